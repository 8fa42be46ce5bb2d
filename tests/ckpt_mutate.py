"""Applying the fuzz mutations of tests/test_ckpt_fuzz.py to a cloned run directory.

Each mutation (the hypothesis strategies in test_ckpt_fuzz.py) replaces a file, a link or a
field of ``metadata.json`` in a hard-linked clone (tests/ckpt_craft.py: never written in
place); :func:`apply` runs a scenario and returns the checkpoints it made hostile (a code
payload, a path out, an unlisted file DCP would read) and what it did, counted.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import shutil
import signal
from collections import Counter
from pathlib import Path

from llmtrain.engine.checkpoint_meta import rel_problem
from tests import ckpt_craft as cc

def set_path(doc, path: tuple, value, delete: bool = False):
    if not isinstance(doc, dict):
        return doc
    node = doc
    for key in path[:-1]:
        if not isinstance(node.get(key), dict):
            node[key] = {}
        node = node[key]
    if delete:
        node.pop(path[-1], None)
    else:
        node[path[-1]] = value
    return doc


def edit_meta(ckpt: Path, fn) -> None:
    if not (ckpt / "metadata.json").is_file():  # a FIFO or a link to a device: reading it would block
        return
    try:
        doc = json.loads((ckpt / "metadata.json").read_bytes())
    except (OSError, ValueError):
        return
    cc.write_meta(ckpt, json.dumps(fn(doc)))


def edit_index(ckpt: Path, how: str, name: str, number: int, marker: str) -> bool:
    """Change the real index; returns whether the change is hostile (must never be used)."""
    if not (ckpt / ".metadata").is_file():
        return False
    try:
        index = cc.real_index(ckpt)
    except Exception:  # noqa: BLE001  (an earlier mutation replaced it)
        return False
    infos = list(index.storage_data.values())
    entries = list(index.state_dict_metadata.values())
    if how == "relpath":
        infos[number % len(infos)].relative_path = name
    elif how == "offset":
        infos[number % len(infos)].offset = number
    elif how == "length":
        infos[number % len(infos)].length = number
    elif how == "bytes_entry":  # resealed only if an earlier mutation left metadata.json readable
        try_reseal(ckpt, extra=(cc.index_with_bytes_entry(ckpt, marker, seal=False),))
        return True
    elif how == "planner":
        key = next(iter(index.planner_data))
        index.planner_data[key] = ("model", number) if number % 2 else (name,)
    elif how == "size":
        entries[number % len(entries)].size = __import__("torch").Size([number % (2**40) + 1, 3])
    elif how == "no_chunks":
        entries[number % len(entries)].chunks = []
    elif how == "transform":
        infos[0].transform_descriptors = ["zstd"]
    elif how == "drop_storage":
        index.storage_data.pop(next(iter(index.storage_data)))
    if how == "not_metadata":
        data = pickle.dumps({"state_dict_metadata": {}, "n": number})
    elif how == "truncate":
        raw = (ckpt / ".metadata").read_bytes()
        data = raw[: number % max(len(raw), 1)]
    else:
        data = pickle.dumps(index)
    cc.replace(ckpt / ".metadata", data)
    return how == "relpath" and name != "__0_0.distcp"


def make_link(ckpt: Path, root: Path, target: str, dest: str, outside: Path) -> bool:
    """Make ``target`` a symlink to ``dest``; returns whether it now leads out of the checkpoint."""
    path = root / "latest" if target == "latest" else ckpt if target == "STEP" else ckpt / target
    if not (path.exists() or path.is_symlink()):
        return False
    copy = outside / f"copy-{len(os.listdir(outside))}"
    if dest == "inside_copy":
        if not path.is_file() or path.is_symlink() or target in ("latest", "STEP"):
            return False
        inside = ckpt / f"inside-{copy.name}"
        shutil.copy2(path, inside)
        cc.relink(path, inside.name if "/" not in target else f"../{inside.name}")
        return False
    if dest == "outside_copy":
        try:
            if path.is_dir():
                shutil.copytree(path, copy, symlinks=True)
            else:
                shutil.copy2(path, copy) if path.is_file() else copy.write_bytes(b"")
        except (OSError, shutil.Error):  # a FIFO from an earlier mutation
            copy.mkdir(exist_ok=True)
        cc.relink(path, copy)
    elif dest == "outside_dir":
        copy.mkdir()
        cc.relink(path, copy)
    elif dest == "dangling":
        cc.relink(path, outside / "nothing-here")
    elif dest == "loop":
        cc.relink(path, path.name)
    else:
        cc.relink(path, dest)
    return True


@contextlib.contextmanager
def time_limit(seconds: int):
    """Fail (instead of hanging the suite) if a command blocks, e.g. on a FIFO."""
    def expired(signum, frame):
        raise AssertionError(f"a command blocked for more than {seconds} s")

    old = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def apply(run: Path, muts, reseal: bool, outside: Path, marker: str) -> tuple[set, Counter]:
    """Apply the mutations; returns (hostile step directories, kinds applied)."""
    root = run / "checkpoints"
    hostile, kinds, touched = set(), Counter(), set()
    for m in muts:
        kind = m[0]
        kinds[kind] += 1
        if kind == "latest":
            cc.replace(root / "latest", m[1].encode("utf-8", "surrogatepass"))
            continue
        ckpt = root / f"step-{m[1]}"
        if not ckpt.is_dir():
            continue
        touched.add(ckpt)
        if kind == "set":
            edit_meta(ckpt, lambda d: set_path(d, m[2], m[3]))
        elif kind == "del":
            edit_meta(ckpt, lambda d: set_path(d, m[2], None, delete=True))
        elif kind == "extra":
            edit_meta(ckpt, lambda d: set_path(d, (m[2],), m[3]) if m[2] not in d else d)
        elif kind == "doc":
            raw = (ckpt / "metadata.json").read_bytes() if (ckpt / "metadata.json").is_file() else b""
            data = {"json": json.dumps(m[3]).encode(), "bytes": m[4], "truncate": raw[: m[5] % max(len(raw), 1)]}[m[2]]
            cc.write_meta(ckpt, data)
        elif kind == "name":
            entry = {"bytes": 6, "sha256": "0" * 64}
            if m[3]:
                (outside / "secret").write_bytes(b"secret")
                entry = {"bytes": 6, "sha256": __import__("hashlib").sha256(b"secret").hexdigest()}
            edit_meta(ckpt, lambda d: set_path(d, ("files", m[2]), entry))
            if rel_problem(m[2]) is not None:
                hostile.add(ckpt)
        elif kind == "link":
            if make_link(ckpt, root, m[2], m[3], outside) and m[2] != "latest":
                hostile.add(ckpt)
        elif kind == "special":
            path = root / "latest" if m[2] == "latest" else ckpt / m[2]
            if path.exists() or path.is_symlink():
                path.unlink() if not path.is_dir() or path.is_symlink() else shutil.rmtree(path)
            path.parent.mkdir(parents=True, exist_ok=True)
            {"fifo": os.mkfifo, "dir": os.mkdir, "empty": lambda p: Path(p).write_bytes(b"")}[m[3]](path)
        elif kind == "payload":
            data = (cc.torch_saved({"torch": cc.MkdirMarker(marker)}) if m[3] == "torch_obj"
                    else cc.payloads(marker)[m[3]])
            cc.replace(ckpt / m[2], data)
            hostile.add(ckpt)
        elif kind == "index":
            if edit_index(ckpt, m[2], m[3], m[4], marker):
                hostile.add(ckpt)
        elif kind == "truncate":
            f = ckpt / m[2]
            if f.is_file():
                raw = f.read_bytes()
                cc.replace(f, raw[: int(len(raw) * m[3])] + m[4])
        elif kind == "unlisted":
            f = ckpt / m[2]
            if not (f.exists() or f.is_symlink()):
                f.parent.mkdir(parents=True, exist_ok=True)
                f.write_bytes(b"unlisted")
                if m[2] not in ("notes.txt", ".hidden", "sub/dir/file"):
                    hostile.add(ckpt)
    if reseal:
        for ckpt in touched:
            try_reseal(ckpt)
    return hostile, kinds


def try_reseal(ckpt: Path, extra: tuple[str, ...] = ()) -> None:
    """Reseal ``ckpt`` where an earlier mutation left a ``metadata.json`` to reseal (a regular file
    holding a document with a files mapping); otherwise leave it as the mutations made it."""
    if not (ckpt / "metadata.json").is_file() or (ckpt / "metadata.json").is_symlink():
        return  # a FIFO would block the read; resealing would replace a link (an attacker would edit its target)
    try:
        cc.reseal(ckpt, extra)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass  # metadata.json is not a document with a files mapping any more (the edit of the bytes_entry
        # case once raised here, after a 'doc' mutation: six harness failures, thirty-fourth session)
