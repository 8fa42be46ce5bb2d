"""The node helper: runs on every node of an SSH launch, between sshd and torchrun.

::

    python -m llmtrain.launch.remote run --run-id ID --node-rank I --first-rank F --nproc S \\
        --log-dir DIR [--grace 3] -- TORCHRUN ARGV...
    python -m llmtrain.launch.remote kill --run-id ID --node-rank I [--pgid G --pgid-start T] [--grace 3]

``run`` (started by the launcher under a pty, see :mod:`llmtrain.launch.commands`):

1. prints ``@@n {"event": "start", "pid", "pgid", "sid", "start"}``: the launcher records the
   node's process group (the helper leads it; torchrun stays in it);
2. starts torchrun (``--redirects 3 --log-dir DIR``) and streams, as whole lines,
   ``@@r<global rank>.<o|e> text`` for every worker line (following torchrun's per-worker
   files like the local launcher does, global rank = F + local rank), ``@@t text`` for
   torchrun's own output, and ``@@hb`` every 2 s (the launcher's lost-node detection);
3. checks once that every worker's ``RANK`` is ``F + LOCAL_RANK`` (the placement ``plan``
   showed) and stops the node with ``@@n {"event": "rank_mismatch"}`` if not;
4. on SIGTERM/SIGINT/SIGHUP -- SIGINT is the launcher's Ctrl-C typed into the pty (echo is
   turned off first, so it leaves no ``^C`` in the stream), SIGHUP what a pty delivers when the
   SSH session dies, e.g. because the launcher was SIGKILLed -- or when its parent (sshd) disappears, stops every
   process of the node: SIGTERM to torchrun, its descendants (torchrun's workers sit in their own
   sessions, so a group kill would miss them) and every process marked
   ``LLMTRAIN_NODE_ID=<id>.<node rank>``, then SIGKILL after ``--grace`` seconds;
5. when torchrun exits, says so at once (``@@n {"event": "torchrun_exit", "code"}``: the launcher
   starts stopping the other nodes while this one drains), sweeps leftovers the same way, reports torchelastic error files
   (``@@n {"event": "error_file", "rank", "message"}``) and ``@@n {"event": "exit", "code"}``,
   and exits with torchrun's code.

``kill`` is the launcher's teardown over a second SSH channel: it does step 4 for the recorded
process group (checked against the leader's start time, so a reused pid is never hit), its
descendants and the marked processes, independent of whether the helper still runs. Nothing
is ever found by process name or command-line pattern.

Imports are kept light (no rich, no pydantic on the ``kill`` path): both commands run inside
the launcher's 5 s teardown budget.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time

from llmtrain.launch.proctree import (ProcessTree, group_members, pdeathsig_preexec, pids_with_env, read_stat,
                                      terminate)

NODE_TAG = "@@n "
TORCHRUN_TAG = "@@t "
HEARTBEAT = "@@hb"
HEARTBEAT_S = 2.0
POLL_S = 0.1
SCAN_S = 0.25


def frame_rank(rank: int, stream: str, text: str) -> str:
    return f"@@r{rank}.{'e' if stream == 'stderr' else 'o'} {text}"


def parse_frame(line: str) -> tuple[str, int | None, str, str]:
    """``(kind, rank, stream, payload)`` with kind in rank, torchrun, node, heartbeat, raw."""
    if line.startswith("@@r"):
        head, _, text = line.partition(" ")
        rank, _, stream = head[3:].partition(".")
        if rank.isdigit() and stream in ("o", "e"):
            return "rank", int(rank), "stderr" if stream == "e" else "stdout", text
    elif line.startswith(TORCHRUN_TAG):
        return "torchrun", None, "", line[len(TORCHRUN_TAG):]
    elif line.startswith(NODE_TAG):
        return "node", None, "", line[len(NODE_TAG):]
    elif line == HEARTBEAT:
        return "heartbeat", None, "", ""
    return "raw", None, "", line


def node_event(kind: str, **fields) -> str:
    return NODE_TAG + json.dumps({"event": kind, **fields}, separators=(",", ":"))


class Output:
    """Whole lines to stdout (the pty), one write each; silently stops when the pty is gone."""

    def __init__(self, fd: int = 1):
        self.fd, self.dead = fd, False

    def __call__(self, line: str) -> None:
        if self.dead:
            return
        data = (line + "\n").encode("utf-8", errors="replace")
        try:
            while data:
                data = data[os.write(self.fd, data):]
        except OSError:  # EIO / EPIPE: the session is gone
            self.dead = True


def _environ(pid: int) -> dict[str, str]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as fp:
            items = fp.read().split(b"\0")
    except OSError:
        return {}
    out = {}
    for item in items:
        key, sep, value = item.partition(b"=")
        if sep:
            out[key.decode(errors="replace")] = value.decode(errors="replace")
    return out


def _quiet_tty(fd: int = 0) -> None:
    """No echo on our pty: the launcher's Ctrl-C (its fast stop signal) must not come back as "^C"
    glued to the next line. ISIG stays on, so Ctrl-C still means SIGINT."""
    try:
        import termios
    except ImportError:
        return
    try:
        attrs = termios.tcgetattr(fd)
        attrs[3] &= ~(termios.ECHO | getattr(termios, "ECHOCTL", 0))
        termios.tcsetattr(fd, termios.TCSANOW, attrs)
    except (termios.error, OSError, ValueError):  # not a tty (tests, other launchers): nothing to do
        pass


class Helper:
    def __init__(self, args: argparse.Namespace, command: list[str]):
        self.args, self.command = args, command
        self.node_id = f"{args.run_id}.{args.node_rank}"
        self.launch = launch_marker(args)
        self.out = Output()
        self.signals: list[int] = []
        self.ranks_checked = False

    def _on_signal(self, signum, _frame) -> None:
        self.signals.append(signum)

    def run(self) -> int:
        from llmtrain.launch.stream import PipeReader, WorkerLogTailer

        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, self._on_signal)
        _quiet_tty()
        me = read_stat(os.getpid())
        parent = os.getppid()
        self.out(node_event("start", pid=os.getpid(), pgid=os.getpgrp(), sid=os.getsid(0),
                            start=me.start if me else 0, host=socket.gethostname()))
        try:
            proc = subprocess.Popen(self.command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, preexec_fn=pdeathsig_preexec(signal.SIGTERM))
        except OSError as exc:
            self.out(TORCHRUN_TAG + f"cannot start {self.command[0]}: {exc.strerror or exc}")
            self.out(node_event("exit", code=127))
            return 127
        self.proc, self.tree = proc, ProcessTree(proc.pid)
        self.pipes = PipeReader({"stdout": proc.stdout, "stderr": proc.stderr})
        self.tailer = WorkerLogTailer(self.args.log_dir, nproc_per_node=self.args.nproc, node_rank=0)
        self.torchrun_lines: list[str] = []
        stopped_by, exited_at, last_scan, last_beat = None, None, 0.0, time.monotonic()
        while True:
            self._pump()
            now = time.monotonic()
            if now - last_scan >= SCAN_S:
                self.tree.scan()
                last_scan = now
                if not self.ranks_checked and proc.poll() is None and self._check_ranks() is False:
                    stopped_by = "rank_mismatch"
            if now - last_beat >= HEARTBEAT_S:
                self.out(HEARTBEAT)
                last_beat = now
            if self.signals or os.getppid() != parent:
                stopped_by = signal.Signals(self.signals[0]).name if self.signals else "SIGHUP"
            if stopped_by:
                self.out(node_event("stopping", reason=stopped_by, grace=self.args.grace))
                result = terminate(self._alive_all, self.args.grace, tick=self._pump)
                self.out(node_event("stopped", signalled=result.signalled, killed=result.killed))
                break
            if proc.poll() is not None:
                if exited_at is None:  # tell the launcher at once: it stops the other nodes while we drain
                    exited_at = now
                    self.out(node_event("torchrun_exit", code=proc.returncode))
                if not self.pipes.open or now - exited_at > 1.0:
                    break
        self.tree.scan()
        leftovers = self._alive_all() - {proc.pid}
        if leftovers:
            result = terminate(lambda: self._alive_all() - {proc.pid}, self.args.grace, tick=self._pump)
            self.out(node_event("leftovers", signalled=result.signalled, killed=result.killed))
        self._pump(final=True)
        for _, line in self.pipes.close():
            self._torchrun_line(line)
        proc.wait()
        if stopped_by == "rank_mismatch":
            code = 1
        elif stopped_by:
            code = 128 + int(getattr(signal, stopped_by, signal.SIGTERM))
        else:
            code = proc.returncode if proc.returncode >= 0 else 128 - proc.returncode
        self._report_error_files()
        self.out(node_event("exit", code=code))
        return code

    def _alive_all(self) -> set[int]:
        self.tree.scan()
        alive = self.tree.alive() | pids_with_env("LLMTRAIN_NODE_ID", self.node_id, self.launch)
        if self.proc.poll() is not None:
            alive.discard(self.proc.pid)
        return alive

    def _torchrun_line(self, line: str) -> None:
        self.torchrun_lines.append(line)
        del self.torchrun_lines[:-2000]
        self.out(TORCHRUN_TAG + line)

    def _pump(self, final: bool = False) -> None:
        lines = self.pipes.poll(0 if final else POLL_S)
        for rank, stream, line in self.tailer.poll(final=final):
            self.out(frame_rank(self.args.first_rank + rank, stream, line))
        for _, line in lines:
            self._torchrun_line(line)

    def _check_ranks(self) -> bool | None:
        """True: every worker has RANK = first + LOCAL_RANK; False: one does not; None: not all started yet."""
        workers = {}
        for pid in self.tree.alive():
            info = read_stat(pid)
            if info is None or info.ppid != self.proc.pid:
                continue
            env = _environ(pid)
            if "LOCAL_RANK" in env and "RANK" in env:
                workers[pid] = env
        if len(workers) < self.args.nproc:
            return None
        self.ranks_checked = True
        for env in workers.values():
            expected = self.args.first_rank + int(env["LOCAL_RANK"])
            if int(env["RANK"]) != expected:
                self.out(node_event("rank_mismatch", local_rank=int(env["LOCAL_RANK"]), rank=int(env["RANK"]),
                                    expected=expected, group_rank=env.get("GROUP_RANK")))
                return False
        return True

    def _report_error_files(self) -> None:
        from llmtrain.launch.stream import error_file_message, parse_failures

        for failure in parse_failures(self.torchrun_lines):
            message = error_file_message(failure.error_file)
            if message:
                self.out(node_event("error_file", rank=failure.rank, message=message))


def launch_marker(args: argparse.Namespace) -> tuple[tuple[str, str], ...]:
    """``LLMTRAIN_LAUNCH_ID`` of this launch, required beside ``LLMTRAIN_NODE_ID`` in a marked
    process: the node id is the run id plus the node rank, which a resumed or copied run shares
    with other launches on the same host (see envpolicy.new_launch_id)."""
    return (("LLMTRAIN_LAUNCH_ID", args.launch_id),) if args.launch_id else ()


def kill(args: argparse.Namespace) -> int:
    node_id = f"{args.run_id}.{args.node_rank}"
    pgids, helper, helper_start = [], None, None
    if args.pgid:
        leader = read_stat(args.pgid)
        # a live leader with another start time is a reused pid: not our group
        if leader is None or not args.pgid_start or leader.start == args.pgid_start:
            pgids.append(args.pgid)
            if leader is not None and leader.state != "Z":
                helper, helper_start = args.pgid, leader.start
    me = os.getpid()
    tree = ProcessTree(group_members(pgids) | pids_with_env("LLMTRAIN_NODE_ID", node_id, launch_marker(args)))

    def alive() -> set[int]:
        for pid in group_members(pgids) | pids_with_env("LLMTRAIN_NODE_ID", node_id, launch_marker(args)):
            tree.add(pid)
        tree.scan()
        return tree.alive() - {me, helper}

    if helper:  # SIGTERM makes the helper stop its node too, and report it before exiting
        os.kill(helper, signal.SIGTERM)
    result = terminate(alive, args.grace)
    if helper:  # SIGKILL the helper only if it did not finish once everything else is gone
        deadline = time.monotonic() + 2.0
        info = read_stat(helper)  # read once per look: the helper may exit (and be reaped) between two reads
        while time.monotonic() < deadline and info is not None and info.state != "Z":
            time.sleep(0.02)
            info = read_stat(helper)
        if info is not None and info.state != "Z" and info.start == helper_start:
            os.kill(helper, signal.SIGKILL)
            result.killed += 1
    print(json.dumps({"signalled": result.signalled, "killed": result.killed}), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m llmtrain.launch.remote", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    run = sub.add_parser("run", help="Run torchrun on this node and stream its lines.")
    stop = sub.add_parser("kill", help="Stop every process of a run on this node.")
    for p in (run, stop):
        p.add_argument("--run-id", required=True)
        p.add_argument("--node-rank", type=int, required=True)
        p.add_argument("--launch-id", default="", help="This launch's LLMTRAIN_LAUNCH_ID: marked processes must carry it too.")
        p.add_argument("--grace", type=float, default=3.0)
    run.add_argument("--first-rank", type=int, required=True)
    run.add_argument("--nproc", type=int, required=True)
    run.add_argument("--log-dir", required=True)
    run.add_argument("command", nargs=argparse.REMAINDER)
    stop.add_argument("--pgid", type=int, default=0)
    stop.add_argument("--pgid-start", type=int, default=0)
    args = parser.parse_args(argv)
    if args.cmd == "kill":
        return kill(args)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("run needs the torchrun command after --")
    return Helper(args, command).run()


if __name__ == "__main__":
    sys.exit(main())
