"""``llmtrain report RUN_DIR``: curves and a summary from a run's ``metrics.jsonl``.

The engine's rank 0 writes one JSON object per logged step (``step, loss, lr, grad_norm,
tokens_per_s, tflops_per_gpu, mfu, memory_gib, elapsed_s``). :func:`load_metrics` reads them,
skipping lines that are not JSON objects with a numeric ``step`` (e.g. the last line of a run
killed mid-write) and counting them; :func:`summarize` gives steps, first/last/min loss and
mean tokens/s and MFU; :func:`plot_metrics` draws loss, lr and tokens/s against the step into
a PNG with matplotlib's Agg canvas (imported lazily, no pyplot, no display needed).

Means of tokens/s and MFU leave out the first logged step when there are at least three:
the first step carries warm-up (allocation, compilation) and would skew a short run's mean.
"""

from __future__ import annotations

import io
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from llmtrain.errors import LLMTrainError
from llmtrain.safeio import PNG_MAGIC, open_regular, output_file, printable, write_file

MAX_LINE_CHARS = 1 << 20
MAX_METRICS_BYTES = 4 << 30  # ~10M logged steps; read line by line, never whole


@dataclass
class Metrics:
    rows: list[dict[str, Any]]
    skipped: int = 0
    source: Path | None = None
    relogged: int = 0


@dataclass
class Summary:
    steps: int
    first_step: int
    last_step: int
    first_loss: float | None
    last_loss: float | None
    min_loss: float | None
    min_loss_step: int | None
    mean_tokens_per_s: float | None
    mean_mfu: float | None
    skipped_lines: int = 0
    relogged: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


def _num(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def load_metrics(run_dir: str | Path) -> Metrics:
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise LLMTrainError(f"run directory not found: {run_dir}", "pass a directory like runs/<name>/<run id>")
    path = run_dir / "metrics.jsonl"
    if not path.exists() and not path.is_symlink():
        raise LLMTrainError(f"no metrics.jsonl in {printable(run_dir)}", "the run logged no steps (see its logs/)")
    f, _ = open_regular(path, "metrics file", MAX_METRICS_BYTES, field=printable(path),
                        hint="metrics.jsonl is written by the engine's rank 0; pass the run directory")
    rows, skipped = [], 0
    with f:
        for line in _lines(f):
            if line is None:  # a line over MAX_LINE_CHARS: not ours
                skipped += 1
                continue
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except (ValueError, RecursionError):
                row = None
            if not isinstance(row, dict) or _num(row.get("step")) is None:
                skipped += 1
                continue
            rows.append(row)
    if not rows:
        raise LLMTrainError(f"{path} holds no metrics" + (f" ({skipped} unreadable lines)" if skipped else ""),
                            "the run logged no steps (see its logs/)")
    rows, relogged = dedupe(rows)
    return Metrics(rows, skipped, path, relogged)


def _lines(f) -> Iterator[bytes | None]:
    """Lines of ``f``, each at most MAX_LINE_CHARS bytes; a longer one yields None (and is skipped
    without being held in memory)."""
    while True:
        line = f.readline(MAX_LINE_CHARS + 1)
        if not line:
            return
        if len(line) > MAX_LINE_CHARS and not line.endswith(b"\n"):
            while (rest := f.readline(MAX_LINE_CHARS)) and not rest.endswith(b"\n"):
                pass
            yield None
            continue
        yield line


def dedupe(rows: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], int]:
    """Rows sorted by step with re-logged steps collapsed, the last one written winning.

    After a resume (or a guard rollback) the engine trains steps again that an earlier attempt
    had already logged; metrics.jsonl is append-only, so a step appears once per attempt. The
    last entry is the one the surviving run took. A rollback marker row is kept apart from the
    step's own row (it is an event, not a step result), and so is an eval row (``eval_loss``,
    written after its step's row). Returns ``(rows, n_dropped)``."""
    last: dict[tuple[float, str], dict[str, Any]] = {}
    for row in rows:
        last[(float(row["step"]), _kind(row))] = row
    kept = sorted(last.values(), key=lambda r: (float(r["step"]), {"rollback": 0, "step": 1}.get(_kind(r), 2)))
    return kept, len(rows) - len(kept)


def _kind(row: dict[str, Any]) -> str:
    return "rollback" if "rollback" in row else "eval" if "eval_loss" in row else "step"


def _series(rows: list[dict[str, Any]], key: str) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for row in rows:
        value = _num(row.get(key))
        if value is not None:
            xs.append(float(row["step"]))
            ys.append(value)
    return xs, ys


def _mean_after_warmup(values: list[float]) -> float | None:
    if not values:
        return None
    values = values[1:] if len(values) >= 3 else values
    return sum(values) / len(values)


def summarize(metrics: Metrics) -> Summary:
    rows = [r for r in metrics.rows if _kind(r) == "step"]  # rollback markers and eval rows are not steps
    rows = rows or metrics.rows
    loss_steps, losses = _series(rows, "loss")
    eval_steps, eval_losses = _series([r for r in metrics.rows if _kind(r) == "eval"], "eval_loss")
    min_loss = min(losses) if losses else None
    return Summary(
        steps=len(rows), first_step=int(rows[0]["step"]), last_step=int(rows[-1]["step"]),
        first_loss=losses[0] if losses else None, last_loss=losses[-1] if losses else None,
        min_loss=min_loss, min_loss_step=int(loss_steps[losses.index(min_loss)]) if losses else None,
        mean_tokens_per_s=_mean_after_warmup(_series(rows, "tokens_per_s")[1]),
        mean_mfu=_mean_after_warmup(_series(rows, "mfu")[1]), skipped_lines=metrics.skipped,
        relogged=metrics.relogged,
        extra={"eval_loss": eval_losses[-1], "eval_step": int(eval_steps[-1]), "evals": len(eval_losses)}
        if eval_losses else {})


def plot_metrics(metrics: Metrics, out: str | Path, title: str = "") -> Path:
    """Draw loss, lr and tokens/s against the step into ``out`` (PNG)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    out = Path(out)
    fig = Figure(figsize=(8, 9), dpi=100)
    FigureCanvasAgg(fig)
    panels = (("loss", "loss", "tab:blue"), ("lr", "learning rate", "tab:orange"),
              ("tokens_per_s", "tokens/s", "tab:green"))
    axes = fig.subplots(len(panels), 1, sharex=True)
    for ax, (key, label, color) in zip(axes, panels):
        xs, ys = _series(metrics.rows, key)
        if xs:
            ax.plot(xs, ys, color=color, linewidth=1.2, marker="." if len(xs) < 50 else None)
        else:
            ax.text(0.5, 0.5, f"no {key} logged", ha="center", va="center", transform=ax.transAxes)
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
    axes[-1].set_xlabel("step")
    axes[-1].xaxis.set_major_locator(MaxNLocator(integer=True))
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return write_file(out, buf.getvalue(), "--out")


def report(run_dir: str | Path, out: str | Path | None = None, force: bool = False) -> tuple[Summary, Path]:
    """Load ``RUN_DIR/metrics.jsonl``, write the curves (default ``RUN_DIR/report.png``), summarize.
    ``out`` may be a directory (``report.png`` inside it); an existing file that is not a PNG
    (``RUN/metrics.jsonl``, the lock file) is replaced only with ``force``."""
    run_dir = Path(run_dir)
    metrics = load_metrics(run_dir)
    target = output_file(out if out is not None else run_dir, "--out", "report.png", force, magic=PNG_MAGIC)
    png = plot_metrics(metrics, target, title=f"{run_dir.parent.name}/{run_dir.name}")
    return summarize(metrics), png


def summary_lines(summary: Summary) -> list[str]:
    def fmt(value: float | None, spec: str) -> str:
        return "n/a" if value is None else format(value, spec)

    warm = " (first step excluded)" if summary.steps >= 3 else ""
    lines = [
        f"steps logged  {summary.steps} (step {summary.first_step} .. {summary.last_step})",
        f"loss          first {fmt(summary.first_loss, '.4f')}, last {fmt(summary.last_loss, '.4f')}, "
        f"min {fmt(summary.min_loss, '.4f')}" + (f" at step {summary.min_loss_step}" if summary.min_loss_step is not None else ""),
        f"tokens/s      mean {fmt(summary.mean_tokens_per_s, ',.0f')}{warm}",
        f"MFU           mean {'n/a' if summary.mean_mfu is None else f'{summary.mean_mfu:.2%}'}{warm}",
    ]
    if summary.extra.get("evals"):
        e = summary.extra
        lines.append(f"eval loss     last {e['eval_loss']:.4f} at step {e['eval_step']} ({e['evals']} evaluations)")
    if summary.skipped_lines:
        lines.append(f"skipped       {summary.skipped_lines} unreadable line(s) in metrics.jsonl")
    if summary.relogged:
        lines.append(f"re-logged     {summary.relogged} step(s) logged again after a resume or rollback (last kept)")
    return lines
