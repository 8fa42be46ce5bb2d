"""Integrity of one checkpoint directory: what ``resume``, ``ckpt inspect`` and ``ckpt export`` check
before they read a byte of tensor data. Pure Python (no torch).

:func:`check` returns the validated ``metadata.json`` and every problem found, each a line
that names the file:

* the step directory (and ``metadata.json``) must resolve inside the checkpoint root / the
  step directory — a symlink out of it is corruption, not a place to read from;
* ``metadata.json`` has the shape of :class:`~llmtrain.engine.checkpoint_meta.CheckpointMeta`
  (relative file names only: no absolute paths, no ``..``);
* DCP's index ``.metadata`` is listed (so it is covered by the sha256 check: it says which
  files and byte ranges DCP reads);
* every listed file resolves inside the step directory (symlinks followed), is a regular
  file (never a FIFO or a device, so nothing blocks), has the listed size and sha256;
* no file that DCP or ``resume`` would read is unlisted: ``.metadata``, ``__R.metadata``
  (DCP's per-rank fallback index), ``*.distcp`` shards, ``rng/*`` and ``*.pt``. Other unlisted
  files are inert (nothing reads them) and are only shown by ``ckpt inspect``.

The DCP index itself (which needs torch to unpickle, through an allow-list) and the RNG states
are checked by :func:`index_problems` (:mod:`llmtrain.engine.dcp_index`,
:func:`llmtrain.engine.safe_reader.load_rng`): every file and byte range the index names must be
a listed shard; an RNG state must load with ``torch.load(weights_only=True)`` and have its shape.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
from pathlib import Path

from llmtrain.engine.checkpoint_meta import META, CheckpointMeta, FileEntry, load_meta
from llmtrain.errors import LLMTrainError
from llmtrain.safeio import inside, open_regular, printable

DCP_INDEX = ".metadata"
MAX_WALK = 1_000_000
_DCP_READS = re.compile(r"^(\.metadata|__\d+\.metadata|[^/]+\.distcp|rng/.*|.*\.pt)$")


def message_of(exc: LLMTrainError, shown: str) -> str:
    """The first problem of ``exc`` as one line that names the file ``shown``."""
    p = exc.problems[0]
    return p.message if shown in p.message else f"{shown}: {p.message}"


def walk_files(path: Path) -> list[str]:
    """Relative names of every non-directory entry under ``path`` (symlinks listed, never
    followed; a symlink to a directory is an entry too), at most :data:`MAX_WALK`."""
    out: list[str] = []
    for dirpath, dirnames, filenames in os.walk(path, followlinks=False):
        base = Path(dirpath)
        links = [d for d in dirnames if (base / d).is_symlink()]
        for name in sorted(filenames + links):
            out.append((base / name).relative_to(path).as_posix())
            if len(out) >= MAX_WALK:
                return out
    return sorted(out)


def dcp_reads(rel: str) -> bool:
    """Whether DCP or ``resume`` would read a file of this name (see the module docstring)."""
    return bool(_DCP_READS.match(rel))


def file_problem(ckpt: Path, rel: str, entry: FileEntry) -> str | None:
    """Why the listed file ``rel`` does not match its entry (None: it does)."""
    f = ckpt / rel
    shown = printable(f)
    if not inside(ckpt, f):
        return f"{shown}: resolves outside the checkpoint directory (symlink or path out of it)"
    if not os.path.lexists(f):
        return f"{shown}: missing"
    try:
        fobj, size = open_regular(f, "checkpoint file")
    except LLMTrainError as exc:
        return message_of(exc, shown)
    with fobj:
        if size != entry.bytes:
            return f"{shown}: {size} bytes, expected {entry.bytes} (truncated or changed)"
        h, seen = hashlib.sha256(), 0
        while seen <= size and (block := fobj.read(1 << 20)):
            h.update(block)
            seen += len(block)
    if seen != size:
        return f"{shown}: changed while being read ({seen} bytes, expected {size})"
    if h.hexdigest() != entry.sha256:
        return f"{shown}: sha256 mismatch (corrupted)"
    return None


def check(path: str | Path, root: str | Path | None = None,
          require: tuple[str, ...] = ()) -> tuple[CheckpointMeta | None, list[str]]:
    """``(metadata or None, problems)`` of the checkpoint directory ``path``; with ``root`` (the
    checkpoint root it was found under), ``path`` must resolve inside it."""
    path = Path(path)
    shown = printable(path)
    if root is not None and not inside(root, path):
        return None, [f"{shown}: resolves outside the checkpoint root {printable(root)} (symlink)"]
    if not path.is_dir():
        return None, [f"{shown}: no such checkpoint directory"]
    if not os.path.lexists(path / META):
        return None, [f"{shown}: no {META} (not committed: written partially or interrupted)"]
    if not inside(path, path / META):
        return None, [f"{printable(path / META)}: resolves outside the checkpoint directory (symlink)"]
    try:
        meta = load_meta(path, require)
    except LLMTrainError as exc:
        return None, [message_of(exc, printable(path / META))]
    problems = []
    if DCP_INDEX not in meta.files:
        problems.append(f"{printable(path / DCP_INDEX)}: not listed in {META} (DCP's index must be covered "
                        "by the integrity check)")
    for rel, entry in sorted(meta.files.items()):
        why = file_problem(path, rel, entry)
        if why is not None:
            problems.append(why)
    for rel in walk_files(path):
        if rel not in meta.files and rel != META and dcp_reads(rel):
            problems.append(f"{printable(path / rel)}: not listed in {META} (a file DCP or resume would read)")
    return meta, problems


def verify(path: str | Path, root: str | Path | None = None) -> list[str]:
    """Problems with a checkpoint directory, each naming the file (empty list: intact)."""
    return check(path, root)[1]


def index_problems(path: str | Path, meta: CheckpointMeta) -> list[str]:
    """Problems of the files that need torch to check: DCP's ``.metadata`` (read through the
    allow-list unpickler, see :mod:`llmtrain.engine.dcp_index`) and every listed ``rng/*.pt``
    (``torch.load(weights_only=True)``, shape checked). Empty when torch is not installed here
    (``resume --hosts`` from a machine without it): every rank checks again before it reads."""
    if importlib.util.find_spec("torch") is None:
        return []
    from llmtrain.engine.dcp_index import load_index
    from llmtrain.engine.safe_reader import load_rng

    path = Path(path)
    problems = []
    try:
        load_index(path, meta.files)
    except LLMTrainError as exc:
        problems.append(message_of(exc, printable(path / DCP_INDEX)))
    for rel in sorted(r for r in meta.files if r.startswith("rng/")):
        try:
            load_rng(path, rel, meta.files)
        except LLMTrainError as exc:
            problems.append(message_of(exc, printable(path / rel)))
    return problems
