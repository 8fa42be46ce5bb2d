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

from llmtrain.errors import LLMTrainError, Problem

FORMAT = 1
STEP_RE = re.compile(r"^step-(\d+)$")
META = "metadata.json"
LATEST = "latest"


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
    for f in sorted(p for p in tmp.rglob("*") if p.is_file()):
        rel = f.relative_to(tmp).as_posix()
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


def read_latest(root: Path) -> str | None:
    try:
        name = (Path(root) / LATEST).read_text().strip()
    except OSError:
        return None
    return name if STEP_RE.match(name) else None


def verify(path: Path) -> list[str]:
    """Problems with a checkpoint directory, each naming the file (empty list: intact)."""
    path = Path(path)
    meta_path = path / META
    if not meta_path.is_file():
        return [f"{path}: no {META} (not committed: written partially or interrupted)"]
    try:
        meta = json.loads(meta_path.read_text())
        files = meta["files"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return [f"{meta_path}: unreadable ({exc})"]
    problems = []
    for rel, info in sorted(files.items()):
        f = path / rel
        if not f.is_file():
            problems.append(f"{f}: missing")
        elif f.stat().st_size != info["bytes"]:
            problems.append(f"{f}: {f.stat().st_size} bytes, expected {info['bytes']} (truncated or changed)")
        elif sha256(f) != info["sha256"]:
            problems.append(f"{f}: sha256 mismatch (corrupted)")
    return problems


def read_meta(path: Path) -> dict:
    return json.loads((Path(path) / META).read_text())


def resolve(root: Path, spec: str) -> tuple[Path, dict, list[str]]:
    """Pick a verified checkpoint: ``latest`` (falls back to older complete ones, with warnings),
    ``step-N`` (under ``root``) or a path. Raises :class:`LLMTrainError` naming bad files."""
    root = Path(root)
    if spec == "latest":
        candidates = list(reversed(committed(root)))
        pointed = read_latest(root)
        if pointed is not None and (root / pointed) in candidates:  # the pointer first, then newest first
            candidates.remove(root / pointed)
            candidates.insert(0, root / pointed)
        if not candidates:
            raise LLMTrainError(f"no complete checkpoint under {root}",
                                "train with checkpoint.interval > 0, or start a new run with `llmtrain launch`")
        warnings = []
        for cand in candidates:
            problems = verify(cand)
            if not problems:
                return cand, read_meta(cand), warnings
            warnings.append(f"checkpoint {cand.name} is damaged, falling back to an older one: " + "; ".join(problems))
        raise LLMTrainError([Problem("--ckpt", w, "") for w in warnings]
                            + [Problem("--ckpt", f"no intact checkpoint under {root}", "start a new run")])
    path = root / spec if STEP_RE.match(spec) else Path(spec)
    problems = verify(path) if path.is_dir() else [f"{path}: no such checkpoint directory"]
    if problems:
        raise LLMTrainError([Problem("--ckpt", p, "pick another checkpoint with --ckpt (or latest)") for p in problems])
    return path, read_meta(path), []
