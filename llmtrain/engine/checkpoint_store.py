"""The checkpoint directory on disk: atomic commit, integrity check, ``latest`` and pruning.

No torch.distributed here (rank 0 calls these); see docs/checkpoint.md::

    CKPT_DIR/
      latest                 # "step-6\\n", replaced atomically (latest.tmp + os.replace)
      step-4/                # committed: has metadata.json
        metadata.json        # step, tokens, sampler, layout, recipe, versions, sha256 of every file
        .metadata            # DCP's own index
        __0_0.distcp ...     # DCP shards (one file per writing rank)
        rng/rank-0.pt ...    # per-rank RNG states
      step-6.tmp/            # being written; never picked, removed by the next save
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path

from llmtrain.engine.checkpoint_meta import FORMAT, META
from llmtrain.engine.checkpoint_verify import check, index_problems, message_of, verify, walk_files
from llmtrain.errors import LLMTrainError, Problem
from llmtrain.safeio import inside, printable, read_regular

STEP_RE = re.compile(r"^step-(\d+)$")
LATEST = "latest"
LATEST_CAP = 4096
__all__ = ["FORMAT", "META", "LATEST", "STEP_RE", "check", "commit", "committed", "prune", "read_latest",
           "check_latest", "resolve", "verify", "read_meta"]


def step_dir(root: Path, step: int) -> Path:
    return Path(root) / f"step-{step}"


def tmp_dir(root: Path, step: int) -> Path:
    return Path(root) / f"step-{step}.tmp"


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def commit(root: Path, step: int, meta: dict) -> Path:
    """Checksum every file of ``step-N.tmp/``, write ``metadata.json``, rename to ``step-N/``,
    then point ``latest`` at it. Call only after every rank's writes completed."""
    root, tmp = Path(root), tmp_dir(root, step)
    files = {}
    for rel in walk_files(tmp):  # our own files, just written: no symlinks
        f = tmp / rel
        files[rel] = {"sha256": sha256(f), "bytes": f.stat().st_size}
    meta = {"format": FORMAT, **meta, "step": step, "files": files}
    _write_atomic(tmp / META, json.dumps(meta, indent=1, sort_keys=True) + "\n")
    final = step_dir(root, step)
    if final.exists():  # a re-run of the same step (resume after a crash): replace it
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync_dir(root)
    _write_atomic(root / LATEST, final.name + "\n")
    return final


def committed(root: Path) -> list[Path]:
    """Committed checkpoints (``step-N/`` with ``metadata.json``), oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := STEP_RE.match(p.name)) and (p / META).is_file()]
    return [p for _, p in sorted(found)]


def prune(root: Path, keep: int) -> list[Path]:
    """Delete all but the ``keep`` newest committed checkpoints (never the one ``latest`` names)."""
    latest = read_latest(root)
    removed = []
    for p in committed(root)[:-keep] if keep > 0 else []:
        if latest is not None and p.name == latest:
            continue
        shutil.rmtree(p, ignore_errors=True)
        removed.append(p)
    return removed


def remove_stale_tmp(root: Path) -> None:
    for p in Path(root).glob("step-*.tmp"):
        shutil.rmtree(p, ignore_errors=True)


def check_latest(root: Path) -> tuple[str | None, str | None]:
    """``(name, problem)`` of the ``latest`` pointer: the ``step-N`` it names, or None with why
    (None, None: there is no pointer). It must be a small regular file inside ``root`` whose
    one line is ``step-N``."""
    path = Path(root) / LATEST
    shown = printable(path)
    if not os.path.lexists(path):
        return None, None
    if not inside(root, path):
        return None, f"{shown}: resolves outside the checkpoint root (symlink)"
    try:
        raw = read_regular(path, "latest pointer", LATEST_CAP)
    except LLMTrainError as exc:
        return None, message_of(exc, shown)
    name = raw.decode("utf-8", "replace").strip()
    if not STEP_RE.match(name):
        return None, f"{shown}: does not name a checkpoint (holds {printable(repr(name), 60)}, expected step-N)"
    return name, None


def read_latest(root: Path) -> str | None:
    return check_latest(root)[0]


def read_meta(path: Path) -> dict:
    """The validated ``metadata.json`` of ``path`` as a dict (:class:`LLMTrainError` if it is not)."""
    from llmtrain.engine.checkpoint_meta import load_meta

    return load_meta(path).as_dict()


def _problems(path: Path, root: Path | None, require: tuple[str, ...], check_index: bool) -> tuple[dict | None, list[str]]:
    meta, problems = check(path, root, require)
    if meta is not None and not problems and check_index:
        problems = index_problems(path, meta)
    return (meta.as_dict() if meta is not None else None), problems


def resolve(root: Path, spec: str, require: tuple[str, ...] = (),
            check_index: bool = False) -> tuple[Path, dict, list[str]]:
    """Pick a verified checkpoint: ``latest`` (falls back to older complete ones, with warnings),
    ``step-N`` (under ``root``) or a path. Raises :class:`LLMTrainError` naming bad files.

    ``require``: optional ``metadata.json`` fields the caller needs (a checkpoint without them is
    damaged). ``check_index``: also check DCP's ``.metadata`` through the allow-list unpickler
    (needs torch; every reader of tensors passes it, so a crafted index falls back like a bad
    checksum). Returns ``(path, metadata dict, warnings)``."""
    root = Path(root)
    if spec == "latest":
        candidates = list(reversed(committed(root)))
        pointed, pointer_problem = check_latest(root)
        warnings = [f"{pointer_problem}; ignoring it"] if pointer_problem else []
        if pointed is not None and (root / pointed) in candidates:  # the pointer first, then newest first
            candidates.remove(root / pointed)
            candidates.insert(0, root / pointed)
        if not candidates:
            raise LLMTrainError(f"no complete checkpoint under {printable(root)}",
                                "train with checkpoint.interval > 0, or start a new run with `llmtrain launch`")
        for cand in candidates:
            meta, problems = _problems(cand, root, require, check_index)
            if not problems:
                return cand, meta, warnings
            warnings.append(f"checkpoint {cand.name} is damaged, falling back to an older one: " + "; ".join(problems))
        raise LLMTrainError([Problem("--ckpt", w, "") for w in warnings]
                            + [Problem("--ckpt", f"no intact checkpoint under {printable(root)}", "start a new run")])
    in_root = bool(STEP_RE.match(spec))
    path = root / spec if in_root else Path(spec)
    meta, problems = _problems(path, root if in_root else None, require, check_index)
    if problems:
        raise LLMTrainError([Problem("--ckpt", p, "pick another checkpoint with --ckpt (or latest)") for p in problems])
    return path, meta, []
