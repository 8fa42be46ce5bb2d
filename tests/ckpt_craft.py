"""Crafting hostile checkpoint directories for tests/test_ckpt_trust.py and tests/test_ckpt_fuzz.py.

* :func:`make_run`: one real tiny run (``llmtrain launch recipes/debug.yaml`` on 1 CPU rank,
  a 1-layer 32-wide model, 2 steps, ``checkpoint.interval=1``: checkpoints step-1 and step-2
  of ~270 KB each), made once per test module.
* :func:`clone_run`: a copy of a run directory whose checkpoint files are hard links (cheap).
  Every mutation below replaces a file (unlink + write), never writes into one, so the shared
  inodes of the original run are never changed.
* Payloads whose unpickling would run code: each creates ``marker`` (a file or a directory) —
  through ``os.mkdir``, ``pathlib.Path.touch``, ``builtins.exec``, a hand-written pickle naming
  ``pathlib.PosixPath.touch`` (a method of an allowed class), and a torch-saved object. A test
  asserts the marker never appears (and, as a control, that a plain ``pickle.loads`` of each
  payload does create it: the payloads are live).
* :func:`reseal`: rewrite ``metadata.json``'s sizes and sha256 to match the files, as an
  attacker who controls the whole directory would, so a crafted file passes the checksum
  check and reaches the deeper checks.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TINY = ["train.steps=2", "checkpoint.interval=1", "train.seq_len=16", "train.micro_batch_size=2",
        "train.global_batch_size=2", "cluster.gpus_per_node=1", "parallel.tp=1", "model.layers=1", "model.hidden=32",
        "model.heads=2", "model.kv_heads=1", "model.ffn_hidden=64", "model.vocab_size=64", "train.log_interval=1"]


def cli(args: list[str], timeout: int = 300, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LLMTRAIN_TENSORBOARD": "0"}
    for key in ("LLMTRAIN_ENGINE_MODULE", "LLMTRAIN_DEBUG"):
        env.pop(key, None)
    return subprocess.run([sys.executable, "-m", "llmtrain.cli.app", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def make_run(tmp: Path) -> Path:
    """A real committed run (see the module docstring); returns its run directory."""
    args = ["launch", "recipes/debug.yaml", "--runs", str(tmp / "runs")]
    for s in TINY:
        args += ["--set", s]
    proc = cli(args)
    if proc.returncode != 0:
        raise RuntimeError(f"the base run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return next((tmp / "runs" / "debug").iterdir())


def clone_run(src: Path, dst: Path) -> Path:
    """``src`` copied to ``dst``: small files copied, checkpoint files hard-linked."""
    def link_or_copy(a: str, b: str) -> None:
        if "checkpoints" in Path(a).parts and not a.endswith("metadata.json"):
            os.link(a, b)
        else:
            shutil.copy2(a, b)

    shutil.copytree(src, dst, symlinks=True, copy_function=link_or_copy, ignore=shutil.ignore_patterns("logs"))
    return dst


def replace(path: Path, data: bytes | str) -> None:
    """Give ``path`` new contents without touching the inode it had (it may be a hard link)."""
    path = Path(path)
    if path.is_symlink() or path.exists():
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data.encode() if isinstance(data, str) else data)


def relink(path: Path, target: str | Path) -> None:
    """Make ``path`` a symlink to ``target``."""
    path = Path(path)
    if path.is_symlink() or path.exists():
        shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
    path.parent.mkdir(parents=True, exist_ok=True)
    os.symlink(target, path)


def read_meta(ckpt: Path) -> dict:
    return json.loads((ckpt / "metadata.json").read_text())


def write_meta(ckpt: Path, meta) -> None:
    replace(ckpt / "metadata.json", json.dumps(meta, indent=1) if not isinstance(meta, (bytes, str)) else meta)


def reseal(ckpt: Path, extra: tuple[str, ...] = ()) -> None:
    """Make ``metadata.json`` list every listed file (plus ``extra``) with its current size and
    sha256 (files that cannot be read as regular files keep their entry)."""
    meta = read_meta(ckpt)
    for rel in [*meta["files"], *extra]:
        f = ckpt / rel
        try:
            data = f.read_bytes() if f.is_file() else None
        except OSError:
            data = None
        if data is not None:
            meta["files"][rel] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    write_meta(ckpt, meta)


# -- payloads that run code when unpickled ------------------------------------------------------

class MkdirMarker:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


class TouchMarker:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


class ExecMarker:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').close()",))


def posixpath_touch_pickle(marker: str) -> bytes:
    """``PosixPath(marker).touch()`` spelled with STACK_GLOBAL ``pathlib`` / ``PosixPath.touch``:
    a method of a class that the index allow-list does admit (``PosixPath``)."""
    def s(text: str) -> bytes:
        raw = text.encode()
        return b"\x8c" + bytes([len(raw)]) + raw  # SHORT_BINUNICODE

    return (b"\x80\x04" + s("pathlib") + s("PosixPath.touch") + b"\x93"  # STACK_GLOBAL
            + s("pathlib") + s("PosixPath") + b"\x93" + s(marker) + b"\x85R"  # PosixPath(marker)
            + b"\x85R.")  # touch(path)


def payloads(marker: str) -> dict[str, bytes]:
    """Name -> pickle bytes that create ``marker`` when plainly unpickled."""
    return {"os.mkdir": pickle.dumps(MkdirMarker(marker)), "Path.touch": pickle.dumps(TouchMarker(marker)),
            "exec": pickle.dumps(ExecMarker(marker)), "PosixPath.touch": posixpath_touch_pickle(marker)}


def torch_saved(obj) -> bytes:
    import torch

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def real_index(ckpt: Path):
    """The checkpoint's own DCP index, read through llmtrain's allow-list unpickler
    (engine/dcp_index.py): a fuzz case may already have replaced ``.metadata`` with a code-running
    pickle, and plain ``pickle.loads`` then ran it in the test itself, leaving the marker that the
    fuzz reads as "a payload ran" (seen unseeded, thirty-fourth session). A replaced index raises."""
    import io

    from llmtrain.engine.dcp_index import IndexUnpickler

    return IndexUnpickler(io.BytesIO((ckpt / ".metadata").read_bytes())).load()


def index_with_bytes_entry(ckpt: Path, marker: str, shard: str = "__9_0.distcp", seal: bool = True) -> str:
    """Add a non-tensor (bytes) entry to the index whose data is a torch-saved code-running object
    in a new shard, and reseal (``seal``) listing it: DCP would load it with
    ``torch.load(weights_only=False)``. Returns the shard's name."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    index = real_index(ckpt)
    data = torch_saved(MkdirMarker(marker))
    index.state_dict_metadata["model.extra"] = BytesStorageMetadata()
    index.storage_data[MetadataIndex("model.extra")] = _StorageInfo(shard, 0, len(data))
    if index.planner_data is not None:
        index.planner_data["model.extra"] = ("model", "extra")
    replace(ckpt / shard, data)
    replace(ckpt / ".metadata", pickle.dumps(index))
    if seal:
        reseal(ckpt, extra=(shard,))
    return shard


def index_pointing_at(ckpt: Path, relative_path: str) -> None:
    """Point every storage entry of the index at ``relative_path`` and reseal."""
    index = real_index(ckpt)
    for info in index.storage_data.values():
        info.relative_path = relative_path
    replace(ckpt / ".metadata", pickle.dumps(index))
    reseal(ckpt)


def marker_made(marker: str | Path) -> bool:
    return os.path.lexists(marker)
