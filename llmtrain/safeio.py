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

from llmtrain.errors import LLMTrainError, escape_controls

KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30


def human_bytes(n: int) -> str:
    for unit, size in (("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if n >= size:
            value = n / size
            return f"{value:.0f} {unit}" if value == int(value) else f"{value:.1f} {unit}"
    return f"{n} bytes"


def printable(text: object, limit: int = 200) -> str:
    """``text`` with control characters escaped (``\\n``, ``\\x1b``) and cut to ``limit`` chars."""
    out = escape_controls(str(text))
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
    # The problem's path prefix already names the file when no recipe field is given.
    named = "" if where == shown else f" {shown}"
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise LLMTrainError(f"{what} not found" + (f": {shown}" if named else ""), hint or "check the path", path=where) from None
    except IsADirectoryError:
        raise LLMTrainError(f"{what}{named} is a directory", hint or f"pass the {what} file itself",
                            path=where) from None
    except OSError as exc:
        if exc.errno == errno.ENXIO:  # a FIFO or socket without a writer on the other side
            raise LLMTrainError(f"{what}{named} is not a regular file", hint or f"pass a regular file as the {what}",
                                path=where) from None
        raise LLMTrainError(f"cannot read {what}{named}: {exc.strerror or exc}", hint or "check the path and permissions",
                            path=where) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise LLMTrainError(f"{what}{named} is {_kind(st.st_mode)}, not a regular file",
                                hint or f"pass a regular file as the {what}", path=where)
        if cap is not None and st.st_size > cap:
            raise LLMTrainError(f"{what}{named} is {human_bytes(st.st_size)}, over the {human_bytes(cap)} limit",
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
        raise LLMTrainError(f"{what} is over the {human_bytes(cap)} limit",
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


def read_json_object(path: str | Path, what: str, cap: int, hint: str = "") -> dict:
    """A capped, regular UTF-8 file holding one JSON object; every failure (too big, not regular,
    not JSON, nested too deeply, not an object) is one line naming the file."""
    import json

    text = read_text(path, what, cap, field=printable(path), hint=hint)
    try:
        value = json.loads(text)
    except RecursionError:
        raise LLMTrainError(f"{printable(path)}: JSON nested too deeply", hint) from None
    except ValueError as exc:
        raise LLMTrainError(f"{printable(path)}: not valid JSON ({printable(getattr(exc, 'msg', exc), 80)})", hint) from None
    if not isinstance(value, dict):
        raise LLMTrainError(f"{printable(path)}: not a JSON object", hint)
    return value


def inside(root: str | Path, path: str | Path) -> bool:
    """True when ``path`` (relative paths are taken under ``root``) resolves, symlinks followed,
    to ``root`` itself or something below it. A path that cannot be resolved (a symlink loop) is
    not inside."""
    try:
        root_r = Path(root).resolve()
        p = Path(path)
        target = (p if p.is_absolute() else Path(root) / p).resolve()
    except (OSError, RuntimeError, ValueError):  # a symlink loop (RuntimeError before 3.13), NUL in a name
        return False
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


# -- outputs --------------------------------------------------------------------------------
# An output never destroys an input: an existing file is replaced only when it is an earlier
# output of the same kind (its first bytes say so: a PNG for pictures, our JSON Schema for
# `schema --out`) or with --force; a directory given for a file output means "a file with the
# default name inside it"; FIFOs and devices are never written to. Writes go to a temporary
# file beside the target and are renamed over it, so a failed write leaves the old file whole.

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def output_file(path: str | Path, flag: str, default_name: str, force: bool = False,
                magic: bytes | None = None) -> Path:
    """The file an output option should write, checked: see the comment above. ``magic`` is
    the prefix an earlier output of this kind starts with. Raises :class:`LLMTrainError`."""
    p = Path(path).expanduser()
    if p.is_dir():
        p = p / default_name
    shown = printable(p)
    try:
        st = os.stat(p)
    except FileNotFoundError:
        st = None
    except OSError as exc:
        raise LLMTrainError(f"cannot use {shown}: {exc.strerror or exc}", "choose another path", path=flag) from None
    if st is not None:
        if stat.S_ISDIR(st.st_mode):
            raise LLMTrainError(f"{shown} is a directory", f"give a file path to {flag}", path=flag)
        if not stat.S_ISREG(st.st_mode):
            raise LLMTrainError(f"{shown} is {_kind(st.st_mode)}", f"give a regular file path to {flag}", path=flag)
        if not force and not _starts_with(p, magic):
            what = "a file of another kind" if magic else "an existing file"
            raise LLMTrainError(f"{shown} exists and is {what} (not an earlier output of {flag})",
                                "choose another path, or pass --force to replace it", path=flag)
    parent = p.parent
    if not parent.exists():
        raise LLMTrainError(f"directory {printable(parent)} does not exist", f"create it or give another {flag}",
                            path=flag)
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise LLMTrainError(f"cannot write into {printable(parent)}", f"give {flag} a writable directory", path=flag)
    return p


def _starts_with(path: Path, magic: bytes | None) -> bool:
    if not magic:
        return False
    try:
        with open(path, "rb") as f:
            return f.read(len(magic)) == magic
    except OSError:
        return False


def write_file(path: Path, data: bytes | str, flag: str) -> Path:
    """Write ``data`` to ``path`` through a temporary file and an atomic rename."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
        os.replace(tmp, path)
    except OSError as exc:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise LLMTrainError(f"cannot write {printable(path)}: {exc.strerror or exc}", f"give {flag} a writable path",
                            path=flag) from None
    return path


def output_dir(path: str | Path, flag: str, force: bool = False, ours: frozenset[str] | None = None) -> Path:
    """A directory an output option fills: missing or empty is fine; non-empty needs ``--force``,
    and with ``ours`` (the names this command writes) even ``--force`` refuses a directory that
    holds anything else (it would be deleted along with the previous output)."""
    p = Path(path).expanduser()
    shown = printable(p)
    if p.is_symlink() or (p.exists() and not p.is_dir()):
        raise LLMTrainError(f"{shown} exists and is not a directory", f"give {flag} a directory", path=flag)
    if not p.exists():
        return p
    try:
        names = sorted(os.listdir(p))
    except OSError as exc:
        raise LLMTrainError(f"cannot read {shown}: {exc.strerror or exc}", f"give {flag} a readable directory",
                            path=flag) from None
    if not names:
        return p
    if ours is not None:
        foreign = [n for n in names if n not in ours]
        if foreign:
            listed = ", ".join(printable(n, 40) for n in foreign[:3]) + (", ..." if len(foreign) > 3 else "")
            raise LLMTrainError(f"{shown} is not empty and holds files this command did not write ({listed})",
                                f"choose an empty or new directory for {flag}", path=flag)
    if not force:
        raise LLMTrainError(f"{shown} is not empty ({len(names)} entries)",
                            "choose an empty or new directory, or pass --force to replace its contents", path=flag)
    return p
