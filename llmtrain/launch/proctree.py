"""Finding and stopping every process of a run, without names or patterns (Linux ``/proc``).

Used by the local launcher (:mod:`llmtrain.launch.backends.local`) and by the per-node helper of the
SSH launcher (:mod:`llmtrain.launch.remote`). Pure standard library, cheap to import: the
remote ``kill`` command must start fast because it runs inside the 5 s teardown budget.

What counts as "a process of the run":

* :class:`ProcessTree`: descendants of known roots, read from ``/proc/*/stat`` ppid links and
  remembered as ``(pid, start time)``. Workers that ``setsid()`` into their own sessions (as
  torchrun's do) stay known, so do grandchildren re-parented to init after their parent died;
  the start time guards against pid reuse.
* :func:`pids_with_env`: processes of this user whose ``/proc/PID/environ`` holds exactly
  ``NAME=value`` (the launcher sets ``LLMTRAIN_RUN_ID`` / ``LLMTRAIN_NODE_ID`` for one run only);
  this catches a child that forked and exited between two scans.
* :func:`group_members`: processes whose process group is a recorded pgid.

:func:`terminate` sends SIGTERM, waits a grace period while re-scanning (newcomers get SIGTERM
too), then SIGKILLs what is left and waits until it is really gone.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterable


@dataclass(frozen=True)
class Stat:
    ppid: int
    state: str
    pgid: int
    sid: int
    start: int


def read_stat(pid: int) -> Stat | None:
    """Fields of ``/proc/PID/stat``, or None if the process is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fp:
            raw = fp.read()
    except OSError:
        return None
    fields = raw[raw.rfind(b")") + 2:].split()  # after "pid (comm) "; comm may hold spaces
    try:
        return Stat(int(fields[1]), fields[0].decode(), int(fields[2]), int(fields[3]), int(fields[19]))
    except (IndexError, ValueError):
        return None


def _stat(pid: int) -> tuple[int, str, int] | None:
    """(ppid, state, start time), or None if the process is gone."""
    info = read_stat(pid)
    return None if info is None else (info.ppid, info.state, info.start)


def all_pids() -> list[int]:
    try:
        return [int(name) for name in os.listdir("/proc") if name.isdigit()]
    except OSError:
        return []


def is_alive(pid: int, start: int | None = None) -> bool:
    info = read_stat(pid)
    return info is not None and info.state != "Z" and (start is None or info.start == start)


class ProcessTree:
    """Remembers every descendant of the roots ever seen, as pid -> start time."""

    def __init__(self, root: int | Iterable[int]):
        roots = [root] if isinstance(root, int) else list(root)
        self.root = roots[0] if roots else -1
        self.known: dict[int, int] = {}
        for pid in roots:
            self.add(pid)

    def add(self, pid: int) -> None:
        info = read_stat(pid)
        if info is not None:
            self.known.setdefault(pid, info.start)

    def scan(self) -> None:
        table = {pid: info for pid in all_pids() if (info := read_stat(pid)) is not None}
        children: dict[int, list[int]] = {}
        for pid, info in table.items():
            children.setdefault(info.ppid, []).append(pid)
        # descendants of every process already known (orphans included)
        todo = [pid for pid in self.known if pid in table and table[pid].start == self.known[pid]]
        while todo:
            pid = todo.pop()
            for child in children.get(pid, ()):
                if child not in self.known or self.known[child] != table[child].start:
                    self.known[child] = table[child].start
                    todo.append(child)

    def alive(self) -> set[int]:
        return {pid for pid, start in self.known.items() if is_alive(pid, start)}


def pids_with_env(name: str, value: str, also: Iterable[tuple[str, str]] = ()) -> set[int]:
    """Live processes of this user (not this one) whose environment holds ``name=value`` exactly
    (and every ``(name, value)`` of ``also``)."""
    needles = [f"{k}={v}".encode() for k, v in ((name, value), *also)]
    uid, me, out = os.getuid(), os.getpid(), set()
    for pid in all_pids():
        if pid == me:
            continue
        try:
            if os.stat(f"/proc/{pid}").st_uid != uid:
                continue
            with open(f"/proc/{pid}/environ", "rb") as fp:
                env = fp.read().split(b"\0")
        except OSError:
            continue
        if all(n in env for n in needles) and is_alive(pid):
            out.add(pid)
    return out


def marked_pids(launch_id: str) -> set[int]:
    """Live processes of this user whose environment holds ``LLMTRAIN_LAUNCH_ID=<launch_id>`` exactly
    (one launcher invocation's id, :func:`~llmtrain.launch.envpolicy.new_launch_id`; not the run
    id, which a resumed or copied run shares with other launches)."""
    return pids_with_env("LLMTRAIN_LAUNCH_ID", launch_id)


def group_members(pgids: Iterable[int]) -> set[int]:
    """Live processes whose process group is one of ``pgids``."""
    wanted = {g for g in pgids if g > 1}
    out = set()
    for pid in all_pids():
        info = read_stat(pid)
        if info is not None and info.pgid in wanted and info.state != "Z":
            out.add(pid)
    return out


def signal_all(pids: Iterable[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


_signal_all = signal_all  # the name local.py has always used


def pdeathsig_preexec(sig: int = signal.SIGTERM):
    """preexec_fn giving the child ``sig`` when its parent dies (Linux), else None."""
    if not sys.platform.startswith("linux") or threading.current_thread() is not threading.main_thread():
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):
        return None
    return lambda: prctl(1, int(sig), 0, 0, 0)  # 1 = PR_SET_PDEATHSIG


_pdeathsig_preexec = pdeathsig_preexec


@dataclass
class Stopped:
    signalled: int = 0  # processes sent SIGTERM
    killed: int = 0  # of those, processes that needed SIGKILL


def terminate(alive: Callable[[], set[int]], grace_s: float, tick: Callable[[], None] | None = None,
              interrupted: Callable[[], bool] = lambda: False, poll_s: float = 0.05) -> Stopped:
    """SIGTERM ``alive()``, re-scan during ``grace_s`` (newcomers get SIGTERM), SIGKILL the rest.

    ``alive`` is called repeatedly and must return the live processes to stop (re-scanning
    trees as it likes). ``tick`` runs on every poll (e.g. to keep streaming output).
    ``interrupted`` returning True cuts the grace period short.
    """
    signalled = alive()
    signal_all(signalled, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    result = Stopped(len(signalled))
    while time.monotonic() < deadline and not interrupted():
        if tick:
            tick()
        else:
            time.sleep(poll_s)
        now = alive()
        new = now - signalled
        if new:
            signal_all(new, signal.SIGTERM)
            signalled |= new
        if not now:
            result.signalled = len(signalled)
            return result
    remaining = alive()
    result.signalled = len(signalled | remaining)
    if remaining:
        signal_all(remaining, signal.SIGKILL)
        result.killed = len(remaining)
        gone_by = time.monotonic() + 2.0  # SIGKILL is not instant: wait until they are really gone
        while time.monotonic() < gone_by:
            left = alive()
            if not left:
                break
            signal_all(left, signal.SIGKILL)  # forked meanwhile
            time.sleep(0.02)
    return result


@contextmanager
def signals_to(handler: Callable, signals: Iterable[int] = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)):
    """Route ``signals`` to ``handler`` for the duration (main thread only; restored after),
    so a launcher records Ctrl-C / SIGTERM / SIGHUP and tears its run down itself."""
    previous = {}
    if threading.current_thread() is threading.main_thread():
        previous = {sig: signal.signal(sig, handler) for sig in signals}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


@contextmanager
def signals_recorded(received: list[int], signals: Iterable[int] = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)):
    """:func:`signals_to` a handler that only appends each signal number to ``received``: the
    launchers (local, SSH, Slurm) poll that list from their watch loops and stop the run themselves."""
    with signals_to(lambda signum, _frame: received.append(signum), signals):
        yield
