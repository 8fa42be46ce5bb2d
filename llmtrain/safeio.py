"""Reading files the way the trust model (docs/security.md) asks: regular files only, bounded.

Every reader of a recipe, hostfile, env file, checkpoint metadata, metrics file, tokenizer or
data file goes through :func:`read_regular` (or :func:`open_regular` for streaming):

* the path must name a **regular file** — a FIFO would block ``open()`` forever, a character
  device such as ``/dev/zero`` never ends, a directory is a user slip. The check is made on
  the opened descriptor (``fstat``), not only on the name, so a path swapped between check and
  read is caught too; FIFOs are opened with ``O_NONBLOCK`` so the open itself cannot hang.
* the read is **capped**: at most ``cap`` bytes are read; a larger file is refused with the cap
  in the message (nothing is read beyond ``cap + 1`` bytes, whatever ``st_size`` claims).
* :func:`inside` tells whether a path resolves (symlinks followed) inside a directory: the
  check for paths named by untrusted files (``metadata.json``'s file list, ``latest``).
* :func:`printable` escapes control characters in anything echoed back (paths, names), so a
  file name cannot rewrite the user's terminal.

Pure Python (no torch): ``plan`` and ``launch`` use it.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import BinaryIO

from llmtrain.errors import LLMTrainError

KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30


def human_bytes(n: int) -> str:
    for unit, size in (("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if n >= size:
            value = n / size
            return f"{value:.0f} {unit}" if value == int(value) else f"{value:.1f} {unit}"
    return f"{n} bytes"


def printable(text: object, limit: int = 200) -> str:
    """``text`` with control characters escaped (``\\n``, ``\\x1b``) and cut to ``limit`` chars."""
    s = str(text)
    if s.isprintable() and len(s) <= limit:
        return s
    out = "".join(ch if ch.isprintable() else ch.encode("unicode_escape").decode("ascii") for ch in s)
    return out if len(out) <= limit else out[: limit - 3] + "..."


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISCHR(mode):
        return "a character device"
    if stat.S_ISBLK(mode):
        return "a block device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def open_regular(path: str | Path, what: str, cap: int | None = None, field: str = "",
                 hint: str = "") -> tuple[BinaryIO, int]:
    """Open ``path`` for reading in binary mode; refuse anything but a regular file (and, when
    ``cap`` is given, one larger than ``cap`` bytes). Returns ``(file, size)``. ``what`` names
    the file in messages ("recipe", "hostfile"); ``field`` is the recipe path or flag it came
    from. Raises :class:`LLMTrainError` (one line, with the fix)."""
    p = Path(path)
    shown = printable(p)
    where = field or shown
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise LLMTrainError(f"{what} not found: {shown}", hint or "check the path", path=where) from None
    except IsADirectoryError:
        raise LLMTrainError(f"{what} {shown} is a directory", hint or f"pass the {what} file itself",
                            path=where) from None
    except OSError as exc:
        if exc.errno == errno.ENXIO:  # a FIFO or socket without a writer on the other side
            raise LLMTrainError(f"{what} {shown} is not a regular file", hint or f"pass a regular {what} file",
                                path=where) from None
        raise LLMTrainError(f"cannot read {what} {shown}: {exc.strerror or exc}", hint or "check the path and permissions",
                            path=where) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise LLMTrainError(f"{what} {shown} is {_kind(st.st_mode)}, not a regular file",
                                hint or f"pass a regular {what} file", path=where)
        if cap is not None and st.st_size > cap:
            raise LLMTrainError(f"{what} {shown} is {human_bytes(st.st_size)}, over the {human_bytes(cap)} limit",
                                hint or f"a {what} is at most {human_bytes(cap)}", path=where)
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb"), st.st_size
    except BaseException:
        os.close(fd)
        raise


def read_regular(path: str | Path, what: str, cap: int, field: str = "", hint: str = "") -> bytes:
    """All bytes of the regular file ``path``, at most ``cap`` (see :func:`open_regular`).
    A file that grows past ``cap`` while being read is refused as well."""
    f, _ = open_regular(path, what, cap, field, hint)
    with f:
        data = f.read(cap + 1)
    if len(data) > cap:
        raise LLMTrainError(f"{what} {printable(path)} is over the {human_bytes(cap)} limit",
                            hint or f"a {what} is at most {human_bytes(cap)}", path=field or printable(path))
    return data


def read_text(path: str | Path, what: str, cap: int, field: str = "", hint: str = "") -> str:
    """:func:`read_regular` decoded as UTF-8; a decoding error names ``file:line``."""
    raw = read_regular(path, what, cap, field, hint)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise LLMTrainError(f"{what} is not UTF-8 text (byte {exc.start})", f"save the {what} as UTF-8",
                            path=f"{printable(path)}:{line}") from None


def inside(root: str | Path, path: str | Path) -> bool:
    """True when ``path`` (relative paths are taken under ``root``) resolves, symlinks followed,
    to ``root`` itself or something below it."""
    root_r = Path(root).resolve()
    p = Path(path)
    target = (p if p.is_absolute() else Path(root) / p).resolve()
    return target == root_r or root_r in target.parents


def check_regular_or_absent(path: str | Path, what: str, field: str = "") -> None:
    """Refuse an existing non-regular file at ``path`` (for outputs that must be files)."""
    try:
        st = os.stat(path)
    except OSError:
        return
    if not stat.S_ISREG(st.st_mode):
        raise LLMTrainError(f"{what} {printable(path)} is {_kind(st.st_mode)}", f"give a file path for the {what}",
                            path=field or printable(path))
