"""Run directories: ``<runs root>/<recipe name>/<run id>/``, one per launch.

Layout (see DESIGN.md section 3)::

    runs/debug/20260129-081640-3fa2/
      recipe.lock.yaml      the resolved recipe the engine runs (presets expanded, overrides applied;
                            launch.env / env_file values never: names and sources only, recipe/lock.py)
      hostfile              the hosts used, DeepSpeed form (``localhost slots=4``)
      logs/rank-<R>.log     every line of rank R (stdout and stderr), as the launcher saw it
      logs/launcher.log     torchrun's own output
      logs/command.txt      the exact torchrun command line
      logs/torchrun/        torchrun's raw per-worker stdout/stderr files (--log-dir)
      metrics.jsonl, tb/    written by the engine's rank 0
      checkpoints/          written by the engine

The run id is the UTC start time ``YYYYmmdd-HHMMSS`` plus ``-`` and 4 random hex digits, so
ids sort by start time and two launches in the same second do not collide (creation is
exclusive; on a clash a new suffix is drawn).
"""

from __future__ import annotations

import re
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

from llmtrain.errors import LLMTrainError
from llmtrain.cluster.hostfile import Hostfile
from llmtrain.recipe.lock import lock_text
from llmtrain.recipe.schema import Recipe

RUN_ID_RE = re.compile(r"^\d{8}-\d{6}-[0-9a-f]{4}$")
DEFAULT_NAME = "run"


@dataclass(frozen=True)
class RunDir:
    """A created run directory and the files in it."""

    path: Path
    name: str
    run_id: str

    @property
    def recipe_lock(self) -> Path:
        return self.path / "recipe.lock.yaml"

    @property
    def hostfile(self) -> Path:
        return self.path / "hostfile"

    @property
    def logs(self) -> Path:
        return self.path / "logs"

    @property
    def torchrun_logs(self) -> Path:
        return self.logs / "torchrun"

    @property
    def launcher_log(self) -> Path:
        return self.logs / "launcher.log"

    @property
    def metrics(self) -> Path:
        return self.path / "metrics.jsonl"

    def rank_log(self, rank: int) -> Path:
        return self.logs / f"rank-{rank}.log"


def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + "-" + secrets.token_hex(2)


def hostfile_text(hostfile: Hostfile) -> str:
    return "".join(f"{h.host} slots={h.slots}\n" for h in hostfile.hosts)


def create_run_dir(recipe: Recipe, hostfile: Hostfile, root: str | Path = "runs") -> RunDir:
    """Create ``root/<name>/<run id>/`` with ``recipe.lock.yaml``, ``hostfile`` and ``logs/``."""
    name = recipe.name or DEFAULT_NAME
    parent = Path(root) / name
    try:
        parent.mkdir(parents=True, exist_ok=True)
        for _ in range(20):
            run_id = new_run_id()
            path = parent / run_id
            try:
                path.mkdir()
            except FileExistsError:
                continue
            break
        else:  # pragma: no cover - 20 clashes of 16 random bits within one second
            raise LLMTrainError(f"cannot pick a fresh run id under {parent}", "try again")
        run = RunDir(path, name, run_id)
        run.logs.mkdir()
        run.recipe_lock.write_text(lock_text(recipe))
        run.hostfile.write_text(hostfile_text(hostfile))
    except OSError as exc:
        raise LLMTrainError(f"cannot create run directory under {parent}: {exc.strerror or exc}",
                            "pass a writable --runs directory", path="--runs") from None
    return run


def next_prev_index(path: Path) -> int:
    """The smallest N with neither ``logs.prev-N`` nor ``recipe.lock.yaml.prev-N`` in ``path``."""
    n = 1
    while (path / f"logs.prev-{n}").exists() or (path / f"recipe.lock.yaml.prev-{n}").exists():
        n += 1
    return n


def reuse_run_dir(path: str | Path, recipe: Recipe | None = None, hostfile: Hostfile | None = None) -> RunDir:
    """Prepare an existing run directory for another attempt (``llmtrain resume``, a retried job):
    the old ``logs/`` (and, when a new ``recipe`` is given, the old ``recipe.lock.yaml``) are kept
    as ``logs.prev-N/`` / ``recipe.lock.yaml.prev-N``; ``hostfile`` is rewritten when given."""
    path = Path(path)
    run = RunDir(path, path.parent.name, path.name)
    n = next_prev_index(path)
    if run.logs.exists():
        run.logs.rename(path / f"logs.prev-{n}")
    run.logs.mkdir()
    if recipe is not None:
        if run.recipe_lock.exists():
            run.recipe_lock.rename(path / f"recipe.lock.yaml.prev-{n}")
        run.recipe_lock.write_text(lock_text(recipe))
    if hostfile is not None:
        run.hostfile.write_text(hostfile_text(hostfile))
    return run


def list_runs(root: str | Path = "runs", name: str | None = None) -> list[Path]:
    """Run directories under ``root`` (of recipe ``name`` if given), oldest first."""
    root = Path(root)
    parents = [root / name] if name else sorted(p for p in root.glob("*") if p.is_dir())
    runs = [p for parent in parents if parent.is_dir() for p in parent.iterdir()
            if p.is_dir() and RUN_ID_RE.match(p.name)]
    return sorted(runs, key=lambda p: (p.name, _mtime(p)))


def latest_run(root: str | Path = "runs", name: str | None = None) -> Path | None:
    """The newest run directory (by run id, i.e. start time), or ``None`` if there is none."""
    runs = list_runs(root, name)
    return runs[-1] if runs else None


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0
