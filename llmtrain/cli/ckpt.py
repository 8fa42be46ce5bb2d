"""``llmtrain ckpt``: list, inspect and verify a run's checkpoints; export one to Hugging Face.

Examples::

    llmtrain ckpt list runs/debug/<run id>                     # step, state, latest, layout, size, created
    llmtrain ckpt inspect runs/debug/<run id> --ckpt step-20   # metadata, files, sha256 integrity
    llmtrain ckpt inspect runs/debug/<run id>/checkpoints --json
    llmtrain ckpt export runs/debug/<run id> --hf out/hf       # model.safetensors + config.json

``RUN_DIR`` is a run directory (its ``recipe.lock.yaml`` names ``checkpoint.dir``, default
``RUN_DIR/checkpoints``), a checkpoint root (holding ``latest`` / ``step-N/``), or one
``step-N/`` directory. Decisions:

* ``inspect`` verifies every file against ``metadata.json`` (size and sha256, the check
  ``resume`` runs: :func:`llmtrain.engine.checkpoint_store.verify`) and exits 2 when the
  inspected checkpoint is damaged, naming each bad file. ``--ckpt latest`` inspects the one
  ``latest`` points to (not a fallback: the point is to see it), and says which intact one
  ``resume`` would fall back to.
* ``export`` reads the DCP shards of any layout in this one process (no process group) and
  writes a ``LlamaForCausalLM`` directory (:mod:`llmtrain.engine.hf`: names, the per-head
  RoPE row permutation of wq/wk, config.json). It verifies the checkpoint first, like
  ``resume``: ``latest`` falls back to the newest intact one with a warning.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import typer

from llmtrain.cli.app import app, report_errors
from llmtrain.errors import LLMTrainError

ckpt_app = typer.Typer(no_args_is_help=True, help="List, inspect (verify) and export checkpoints (Hugging Face).")
app.add_typer(ckpt_app, name="ckpt")

DIR_RE = re.compile(r"^step-(\d+)(\.tmp)?$")
RUN_HELP = "Run directory, checkpoint root (with latest / step-N/) or one step-N/ directory."
CKPT_HELP = "Checkpoint: latest | step-N | PATH."


def checkpoint_root(run_dir: Path) -> tuple[Path, Path | None]:
    """``(root, the step directory RUN_DIR itself names or None)``."""
    from llmtrain.engine.checkpoint_store import LATEST, META

    d = Path(run_dir)
    if not d.is_dir():
        raise LLMTrainError(f"{d}: no such directory", "pass a run directory or a checkpoint directory", path="RUN_DIR")
    lock = d / "recipe.lock.yaml"
    if lock.is_file():
        import yaml

        try:
            conf = (yaml.safe_load(lock.read_text()) or {}).get("checkpoint") or {}
        except (OSError, yaml.YAMLError, AttributeError):
            conf = {}
        return (Path(conf["dir"]) if conf.get("dir") else d / "checkpoints"), None
    if (d / "checkpoints").is_dir():
        return d / "checkpoints", None
    if (d / META).is_file() or DIR_RE.match(d.name):
        return d.parent, d
    if (d / LATEST).is_file() or any(DIR_RE.match(p.name) for p in d.iterdir()):
        return d, None
    raise LLMTrainError(f"{d}: neither a run directory nor a checkpoint directory (no recipe.lock.yaml, "
                        "checkpoints/, latest or step-N/)", "pass RUN_DIR made by `llmtrain launch`", path="RUN_DIR")


def pick(root: Path, spec: str, named: Path | None) -> Path:
    """The directory ``spec`` names (no verification)."""
    from llmtrain.engine.checkpoint_store import STEP_RE, committed, read_latest

    if spec == "latest":
        if named is not None:
            return named
        pointed = read_latest(root)
        if pointed is not None and (root / pointed).is_dir():
            return root / pointed
        found = committed(root)
        if not found:
            raise LLMTrainError(f"no committed checkpoint under {root}", "train with checkpoint.interval > 0",
                                path="--ckpt")
        return found[-1]
    path = root / spec if STEP_RE.match(spec) else Path(spec)
    if not path.is_dir():
        raise LLMTrainError(f"{path}: no such checkpoint directory", "see `llmtrain ckpt list RUN_DIR`", path="--ckpt")
    return path


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


def layout(dims: dict | None) -> str:
    if not dims:
        return "?"
    return " ".join(f"{k}{v}" for k, v in dims.items() if v != 1) or "1 process"


def disk_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def read_meta_or_none(path: Path) -> dict | None:
    try:
        return json.loads((path / "metadata.json").read_text())
    except (OSError, ValueError):
        return None


def list_rows(root: Path) -> list[dict]:
    from llmtrain.engine.checkpoint_store import read_latest

    latest = read_latest(root)
    rows = []
    for p in root.iterdir() if root.is_dir() else []:
        m = DIR_RE.match(p.name)
        if not m or not p.is_dir():
            continue
        meta = read_meta_or_none(p)
        state = "tmp" if m.group(2) else ("committed" if meta is not None else "incomplete")
        rows.append({"name": p.name, "step": int(m.group(1)), "state": state, "latest": p.name == latest,
                     "dims": (meta or {}).get("dims"), "layout": layout((meta or {}).get("dims")),
                     "world_size": (meta or {}).get("world_size"), "bytes": disk_bytes(p),
                     "created": (meta or {}).get("created"), "path": str(p)})
    return sorted(rows, key=lambda r: (r["step"], r["state"] == "tmp"))


def table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


@ckpt_app.command("list")
@report_errors
def list_cmd(run_dir: Path = typer.Argument(..., help=RUN_HELP),
             as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table.")) -> None:
    """Table of the run's checkpoints: step, committed/tmp, latest, layout, world size, size, created."""
    root, _ = checkpoint_root(run_dir)
    rows = list_rows(root)
    if as_json:
        typer.echo(json.dumps({"root": str(root), "checkpoints": rows}, indent=1))
        return
    if not rows:
        typer.echo(f"no checkpoints under {root}")
        return
    head = ["step", "state", "latest", "layout", "world", "size", "created", "name"]
    body = [[str(r["step"]), r["state"], "*" if r["latest"] else "", r["layout"], str(r["world_size"] or "?"),
             human(r["bytes"]), r["created"] or "?", r["name"]] for r in rows]
    typer.echo(f"{root}\n" + table([head, *body]))


def model_summary(model: dict) -> str:
    moe = model.get("moe") or {}
    experts = moe.get("num_experts", 1) or 1
    text = (f"{model.get('preset') or 'custom'}: layers {model.get('layers')}, hidden {model.get('hidden')}, "
            f"heads {model.get('heads')}/{model.get('kv_heads')} kv, ffn {model.get('ffn_hidden')}, "
            f"vocab {model.get('vocab_size')}")
    try:
        from llmtrain.plan.params import count_params
        from llmtrain.recipe.schema import ModelConfig

        text += f", {count_params(ModelConfig.model_validate(model)).total / 1e6:.2f}M params"
    except Exception:  # noqa: BLE001  (a summary, never a reason to fail inspect)
        pass
    return text + (f", MoE {experts} experts" if experts > 1 else ", dense")


def inspect_report(path: Path, root: Path) -> dict:
    from llmtrain.engine.checkpoint_store import committed, verify

    meta = read_meta_or_none(path)
    problems = verify(path)
    files = []
    listed = (meta or {}).get("files") or {}
    for rel in sorted(set(listed) | {f.relative_to(path).as_posix() for f in path.rglob("*") if f.is_file()}):
        f = path / rel
        files.append({"file": rel, "bytes": f.stat().st_size if f.is_file() else None,
                      "expected_bytes": (listed.get(rel) or {}).get("bytes"), "listed": rel in listed})
    fallback = None
    if problems:
        fallback = next((p.name for p in reversed(committed(root)) if p != path and not verify(p)), None)
    recipe = (meta or {}).get("recipe") or {}
    return {"path": str(path), "step": (meta or {}).get("step"), "tokens_seen": (meta or {}).get("tokens_seen"),
            "consumed_samples": (meta or {}).get("consumed_samples"), "world_size": (meta or {}).get("world_size"),
            "dims": (meta or {}).get("dims"), "layout": layout((meta or {}).get("dims")),
            "zero": (recipe.get("parallel") or {}).get("zero"), "grad_accum": (meta or {}).get("grad_accum"),
            "versions": (meta or {}).get("versions"), "created": (meta or {}).get("created"),
            "model": model_summary(recipe.get("model") or {}) if recipe.get("model") else None,
            "files": files, "bytes": sum(f["bytes"] or 0 for f in files),
            "integrity": "ok" if not problems else "damaged", "problems": problems, "intact_fallback": fallback}


def print_report(r: dict) -> None:
    typer.echo(f"checkpoint {r['path']}")
    if r["step"] is not None:
        typer.echo(f"  step {r['step']}, {r['tokens_seen']} tokens, {r['consumed_samples']} samples consumed")
        typer.echo(f"  layout {r['layout']} zero{r['zero']} on {r['world_size']} ranks (grad_accum {r['grad_accum']})")
        v = r["versions"] or {}
        typer.echo(f"  saved {r['created']} with torch {v.get('torch')}, python {v.get('python')}, "
                   f"llmtrain {v.get('llmtrain')}")
    if r["model"]:
        typer.echo(f"  model {r['model']}")
    typer.echo(f"  files ({human(r['bytes'])}):")
    typer.echo(table([[f"    {f['file']}", human(f["bytes"]) if f["bytes"] is not None else "missing",
                       "" if f["listed"] or f["file"] == "metadata.json" else "(not in metadata.json)"]
                      for f in r["files"]]))
    if r["integrity"] == "ok":
        typer.echo(f"  integrity ok: {sum(f['listed'] for f in r['files'])} files match metadata.json (size, sha256)")
        return
    typer.echo("  integrity DAMAGED:")
    for p in r["problems"]:
        typer.echo(f"    {p}")
    if r["intact_fallback"]:
        typer.echo(f"  `resume --ckpt latest` would fall back to {r['intact_fallback']}")


@ckpt_app.command("inspect")
@report_errors
def inspect_cmd(run_dir: Path = typer.Argument(..., help=RUN_HELP),
                ckpt: str = typer.Option("latest", "--ckpt", help=CKPT_HELP),
                as_json: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """Metadata, per-file sizes and integrity (sha256) of one checkpoint; exit 2 if it is damaged."""
    root, named = checkpoint_root(run_dir)
    path = pick(root, ckpt, named)
    report = inspect_report(path, root)
    if as_json:
        typer.echo(json.dumps(report, indent=1))
    else:
        print_report(report)
    if report["problems"]:
        raise LLMTrainError(f"checkpoint {path} is damaged: " + "; ".join(report["problems"]),
                            "use another checkpoint (--ckpt step-N); `resume --ckpt latest` skips damaged ones",
                            path="--ckpt")


@ckpt_app.command("export")
@report_errors
def export_cmd(run_dir: Path = typer.Argument(..., help=RUN_HELP),
               ckpt: str = typer.Option("latest", "--ckpt", help=CKPT_HELP),
               hf: Path = typer.Option(..., "--hf", help="Output directory for model.safetensors + config.json.")) -> None:
    """Export a (verified) checkpoint's model to a Hugging Face LlamaForCausalLM directory (dense models)."""
    from llmtrain.engine.checkpoint_store import STEP_RE, resolve
    from llmtrain.recipe.schema import ModelConfig

    root, named = checkpoint_root(run_dir)
    spec = str(named) if named is not None and ckpt == "latest" else ckpt
    spec = spec if spec == "latest" or STEP_RE.match(spec) else str(Path(spec).resolve())
    path, meta, warnings = resolve(root, spec)
    for w in warnings:
        typer.echo(f"warning: {w}", err=True)
    if hf.exists() and not hf.is_dir():
        raise LLMTrainError(f"{hf} exists and is not a directory", "pick another --hf directory", path="--hf")
    model = (meta.get("recipe") or {}).get("model")
    if not model:
        raise LLMTrainError(f"{path}/metadata.json has no recipe.model", "re-save the checkpoint", path="--ckpt")
    cfg = ModelConfig.model_validate(model)
    from llmtrain.engine.hf import require_dense, read_checkpoint_model, save_hf

    require_dense(cfg)
    state = read_checkpoint_model(path)
    written = save_hf(hf, state, cfg)
    total = sum(f.stat().st_size for f in written)
    typer.echo(f"exported {path} (step {meta['step']}, saved as {layout(meta.get('dims'))}) -> {hf} "
               f"({', '.join(f.name for f in written)}; {human(total)})")
