"""The run of an SSH launch: every node's stream, the live output, the watchdog, the teardown, the summary.

:class:`SSHRun` gets open connections and a :class:`~llmtrain.launch.commands.LaunchSpec` from
:func:`llmtrain.launch.backends.sshlaunch.launch_ssh` (which documents the whole sequence) and:

* starts every node's command at once, each under a pty on its own channel (:class:`llmtrain.launch.backends.ssh.Stream`);
* splits what arrives into whole lines and routes the node helper's frames
  (:mod:`llmtrain.launch.remote`): ``[host:rank] text`` per rank line (``logs/rank-<R>.log``),
  ``[host] text`` for torchrun and the helper (``logs/node-<i>.log``), rank 0's events to the
  progress bar and the watchdog; secret values are redacted first;
* ends when every node exits 0, or at the first of: torchrun exiting non-zero on a node (the
  helper says so before it drains), a lost connection, a node silent past the heartbeat limit,
  a hang, SIGINT/SIGTERM/SIGHUP; then stops every node in parallel -- Ctrl-C into its pty (the
  helper gets SIGINT at once) and the stop command over a second channel -- and waits for their
  sessions to end (a second signal stops the waiting);
* exits with the first failure's code (torchrun's; 255 lost node; 124 hang; 130/143/129 signals)
  and prints the summary: each node's outcome, the failing host and rank with the last lines of
  its log and torchelastic's error message, or the silent ranks of a hang; after Ctrl-C, one line.
"""

from __future__ import annotations

import queue
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console

from llmtrain.launch.commands import LaunchSpec, NodeSpec, describe, kill_command, node_command
from llmtrain.launch.envpolicy import Redactor
from llmtrain.launch.events import RunStats, parse_event
from llmtrain.launch.launchplan import EXIT_FOR_SIGNAL
from llmtrain.launch.remote import parse_frame
from llmtrain.launch.rundir import RunDir
from llmtrain.launch.stream import (Display, LineRouter, LineSplitter, failure_lines, interrupted_line, parse_failures,
                                   stats_summary)
from llmtrain.launch.watchdog import Hang, Watchdog
from llmtrain.launch.proctree import signals_recorded

EXIT_HANG = 124
EXIT_LOST = 255
POLL_S = 0.1


# --------------------------------------------------------------------------- the run


@dataclass
class NodeRun:
    node: NodeSpec
    conn: Any
    router: LineRouter
    splitter: LineSplitter = field(default_factory=LineSplitter)
    stream: Any = None
    pid: int | None = None
    pgid: int | None = None
    pgid_start: int | None = None
    code: int | None = None  # set when the node's session ended
    error: str | None = None
    ended_at: float | None = None
    last_data: float = field(default_factory=time.monotonic)
    error_files: dict[int, str] = field(default_factory=dict)
    note: str | None = None  # what teardown found, for the summary
    mismatch: str | None = None
    torchrun_code: int | None = None  # torchrun's exit code, as soon as the helper saw it

    @property
    def ended(self) -> bool:
        return self.code is not None

    @property
    def failed(self) -> bool:
        return self.ended and (self.code != 0 or self.error is not None)


class SSHRun:
    """All nodes of one run: their streams, the display, the watchdog, the teardown and the summary."""

    def __init__(self, run: RunDir, spec: LaunchSpec, conns: dict[int, Any], console: Console, opts: Any):
        self.run_dir, self.spec, self.opts = run, spec, opts
        self.stats = RunStats()
        self.display = Display(console, label=run.name)
        self.redact = Redactor(env for n in spec.nodes for env in n.env)
        self.nodes = [NodeRun(n, conns[n.node_rank],
                              LineRouter(run.logs, self.display, self.stats, host=n.host, launcher_log=f"node-{n.node_rank}.log"))
                      for n in spec.nodes]
        self.by_rank = {rank: nr for nr in self.nodes for rank in nr.node.ranks}
        wd = spec.launch.watchdog
        self.watchdog = Watchdog(range(spec.world_size), wd.hang_timeout_s, wd.startup_timeout_s)
        self.events: queue.Queue = queue.Queue()
        self.signals: list[int] = []
        self.first_failure: NodeRun | None = None
        self.hang: Hang | None = None
        self.reason: str | None = None

    def run(self) -> int:
        try:
            with signals_recorded(self.signals):
                return self._run()
        finally:
            for nr in self.nodes:
                nr.router.close()

    def _run(self) -> int:
        spec, say = self.spec, self.display.line
        say(f"run dir {self.run_dir.path}: {spec.world_size} ranks on {len(spec.nodes)} nodes: "
            + ", ".join(f"{n.host} ({n.rank_span})" for n in spec.nodes))
        (self.run_dir.logs / "commands.txt").write_text("".join(line + "\n" for line in describe(spec, masked="disk")))
        for nr in self.nodes:
            nr.router.create_logs(nr.node.ranks)
        self.display.start()
        try:
            self._start_all()
            heartbeat_s = spec.launch.watchdog.heartbeat_timeout_s
            while self.reason is None:
                self._pump(POLL_S)
                now = time.monotonic()
                if self.signals:
                    self.reason = signal.Signals(self.signals[0]).name
                elif self.first_failure is not None:
                    self.reason = "failure"
                elif all(nr.ended for nr in self.nodes):
                    break
                elif (hang := self.watchdog.check()) is not None:
                    self.hang, self.reason = hang, "hang"
                elif heartbeat_s:
                    for nr in self.nodes:
                        if not nr.ended and now - nr.last_data > heartbeat_s:
                            self._ended(nr, -1, f"nothing received for {now - nr.last_data:.0f} s "
                                                f"(limit launch.watchdog.heartbeat_timeout_s = {heartbeat_s:g})")
                            break
            if self.reason is not None:
                self._stop_all()
        except BaseException:  # a bug or a KeyboardInterrupt outside the handlers: never leave the run behind
            self.reason = self.reason or "error"
            self._stop_all()
            raise
        finally:
            self._flush_partial()
            for nr in self.nodes:
                nr.router.flush()
            self.display.stop()
        code = self._exit_code()
        self._summary(code)
        return code

    # ---------------------------------------------------------------- streams and lines

    def _start_all(self) -> None:
        from llmtrain.launch.backends import ssh

        for nr in self.nodes:
            i = nr.node.node_rank
            try:
                nr.stream = ssh.Stream(nr.conn, node_command(self.spec, nr.node),
                                       on_data=lambda data, i=i: self.events.put((i, "data", data)),
                                       on_end=lambda code, err, i=i: self.events.put((i, "end", code, err)))
                nr.stream.start()
            except Exception as exc:  # noqa: BLE001 - a connection that broke since preflight
                self._ended(nr, -1, f"could not start the command: {type(exc).__name__}: {exc}")

    def _pump(self, timeout: float) -> None:
        """Wait up to ``timeout`` for the first event, then handle every event already queued."""
        handled = 0
        while handled < 10000:  # bounded, so signals and the watchdog are looked at under a flood
            try:
                item = self.events.get(timeout=timeout) if handled == 0 and timeout > 0 else self.events.get_nowait()
            except queue.Empty:
                break
            handled += 1
            nr = self.nodes[item[0]]
            if item[1] == "data":
                nr.last_data = time.monotonic()
                for line in nr.splitter.feed(item[2]):
                    self._line(nr, line)
            elif item[1] == "end":
                for line in nr.splitter.flush():
                    self._line(nr, line)
                self._ended(nr, item[2], item[3])
            elif item[1] == "note":
                nr.note = item[2]
            elif item[1] == "stopped":
                self._stopped(nr, item[2])
        for nr in self.nodes:
            nr.router.flush()

    def _flush_partial(self) -> None:
        self._pump(0)
        for nr in self.nodes:
            for line in nr.splitter.flush():
                self._line(nr, line)

    def _line(self, nr: NodeRun, line: str) -> None:
        if line.startswith("^C@@"):  # the pty echoed our Ctrl-C before the helper turned echo off
            line = line[2:]
        kind, rank, stream, text = parse_frame(line)
        if kind == "heartbeat":
            return
        if kind == "node":
            self._node_event(nr, text)
            return
        text = self.redact(text) if self.redact else text
        if kind == "rank" and rank in nr.node.ranks:
            self.watchdog.output(rank, text)
            if rank == 0 and stream == "stdout":
                event = parse_event(text)
                if event is not None and event.get("event") in ("step", "end"):
                    step = event.get("step")
                    self.watchdog.progress(step if isinstance(step, int) else None)
            nr.router.rank_line(rank, stream, text)
        elif kind == "rank":  # a rank this node should not have (the helper reports the mismatch)
            nr.router.launcher_line(f"(rank {rank}) {text}")
        else:
            nr.router.launcher_line(text)

    def _node_event(self, nr: NodeRun, payload: str) -> None:
        import json

        try:
            event = json.loads(payload)
        except ValueError:
            nr.router.launcher_line(payload)
            return
        kind = event.get("event")
        if kind == "start":
            nr.pid, nr.pgid = event.get("pid"), event.get("pgid")
            nr.pgid_start = event.get("start") if nr.pgid == nr.pid else None
            nr.router.launcher_line(f"helper started: pid {nr.pid}, process group {nr.pgid}")
        elif kind == "error_file" and isinstance(event.get("rank"), int):
            nr.error_files[event["rank"]] = self.redact(str(event.get("message", "")))
        elif kind == "rank_mismatch":
            nr.mismatch = (f"local rank {event.get('local_rank')} got RANK {event.get('rank')}, the plan puts rank "
                           f"{event.get('expected')} there")
            nr.router.launcher_line(f"rank placement differs from the plan: {nr.mismatch}")
        elif kind == "stopping":
            nr.router.launcher_line(f"helper: {event.get('reason')} received, stopping the node "
                                    f"(SIGKILL after {event.get('grace')} s)")
        elif kind in ("stopped", "leftovers"):
            what = "stopped" if kind == "stopped" else "swept leftovers:"
            nr.router.launcher_line(f"helper {what} {event.get('signalled')} process(es), "
                                    f"{event.get('killed')} needed SIGKILL")
        elif kind == "torchrun_exit":
            code = event.get("code")
            nr.torchrun_code = code if isinstance(code, int) else None
            if nr.torchrun_code and self.first_failure is None and self.reason is None:
                self.first_failure = nr  # do not wait for the node's drain and sweep
        elif kind == "exit":
            nr.router.launcher_line(f"helper exit code {event.get('code')}")

    def _stopped(self, nr: NodeRun, payload: str) -> None:
        import json

        try:
            result = json.loads(payload)
            text = f"{result['signalled']} process(es) signalled, {result['killed']} needed SIGKILL"
        except (ValueError, KeyError, TypeError):
            text = payload[:200]
        nr.router.launcher_line(f"[launcher] stop command on {nr.node.host}: {text}")

    def _ended(self, nr: NodeRun, code: int, error: str | None) -> None:
        if nr.ended:
            return
        nr.code, nr.error, nr.ended_at = code, error, time.monotonic()
        if error:
            nr.router.launcher_line(f"[launcher] connection to {nr.node.target.label} lost: {error}")
        if nr.failed and self.first_failure is None and self.reason is None:
            self.first_failure = nr

    # ---------------------------------------------------------------- teardown

    def _stop_all(self) -> None:
        from llmtrain.launch.backends import ssh

        grace = self.spec.launch.grace_s
        why = {"failure": f"{self.first_failure.node.host} failed" if self.first_failure else "a node failed",
               "hang": "hang detected", "error": "launcher error"}.get(self.reason, f"{self.reason} received")
        self.display.line(f"[launcher] {why}: stopping all nodes (SIGTERM now, SIGKILL after {grace:g} s)")
        if self.reason == "SIGINT":  # Ctrl-C: the nodes' stop chatter and tracebacks go to the logs only
            self.display.mute()
        # 1. Ctrl-C into every live pty: each helper starts stopping its node within a round trip
        #    (not where torchrun already exited: that helper is draining and sweeping on its own)
        for nr in self.nodes:
            if not nr.ended and nr.stream is not None and nr.torchrun_code is None:
                nr.stream.interrupt()
        # 2. and, independently of the helpers, the stop command on every node over a second channel
        threads = []
        for nr in self.nodes:
            if nr.ended and (nr.pgid is None or (nr.code == 0 and nr.error is None)):
                continue  # its helper never started, or finished cleanly (it swept its node itself)
            t = threading.Thread(target=self._kill_node, args=(nr,), daemon=True)
            t.start()
            threads.append(t)
        deadline = time.monotonic() + grace + 6
        n_signals, all_ended_at = len(self.signals), None
        while time.monotonic() < deadline:
            self._pump(POLL_S)
            if all(nr.ended for nr in self.nodes):
                # every helper has finished; the stop commands run to their end on the nodes anyway
                # (no pty: closing the connection does not stop them), so wait only briefly for their report
                all_ended_at = all_ended_at or time.monotonic()
                if not any(t.is_alive() for t in threads) or time.monotonic() - all_ended_at > 0.5:
                    break
            if len(self.signals) > n_signals:  # another signal: stop waiting (each node's helper still
                break                             # finishes the stop on its own once the session drops)
        for nr in self.nodes:
            if not nr.ended:
                nr.note = nr.note or "did not confirm the stop (unreachable?); its helper stops the run when the session drops"
                if nr.stream is not None:
                    nr.stream.close()
                ssh.close(nr.conn)
                self._ended(nr, -1, None)

    def _kill_node(self, nr: NodeRun) -> None:
        from llmtrain.launch.backends import ssh

        i = nr.node.node_rank
        cmd = kill_command(self.spec, nr.node, nr.pgid, nr.pgid_start)
        conn = nr.conn
        try:
            if not ssh.alive(conn):
                fast = ssh.SSHOptions(**{**self.opts.__dict__, "connect_timeout": min(self.opts.connect_timeout, 3.0),
                                         "banner_timeout": min(self.opts.banner_timeout, 3.0), "accept_new": False})
                conn = ssh.connect(nr.node.target, fast)
            code, out, err = ssh.run_capture(conn, cmd, timeout=self.spec.launch.grace_s + 8)
            if conn is not nr.conn:
                ssh.close(conn)
            if code != 0:
                self.events.put((i, "note", f"stop command failed (exit {code}): {err.strip()[-200:]}"))
            else:
                self.events.put((i, "stopped", out.strip().splitlines()[-1] if out.strip() else "{}"))
        except Exception as exc:  # noqa: BLE001 - report, never raise from the teardown thread
            self.events.put((i, "note", f"could not run the stop command: {exc}"))

    # ---------------------------------------------------------------- result

    def _exit_code(self) -> int:
        if self.reason in ("SIGINT", "SIGTERM", "SIGHUP"):
            return EXIT_FOR_SIGNAL[getattr(signal, self.reason)]
        if self.reason == "hang":
            return EXIT_HANG
        failure = self.first_failure
        if failure is not None:
            if failure.torchrun_code is not None and failure.torchrun_code != 0:
                return failure.torchrun_code if failure.torchrun_code > 0 else 128 - failure.torchrun_code
            return EXIT_LOST if failure.code is None or failure.code < 0 else failure.code
        if any(nr.failed for nr in self.nodes):
            return next(nr.code if nr.code and nr.code > 0 else EXIT_LOST for nr in self.nodes if nr.failed)
        return 0

    def _summary(self, code: int) -> None:
        say, run = self.display.line, self.run_dir
        if self.reason == "SIGINT":  # one line, plus the nodes that need attention (no confirmed stop)
            say(interrupted_line("SIGINT", code, self.spec.world_size, len(self.nodes), None, self.stats, run.logs,
                                 self.display.hidden))
            for nr in (nr for nr in self.nodes if nr.note or nr.error):
                say(f"   node {nr.node.node_rank} {nr.node.host}: {nr.note or nr.error}")
            return
        if self.reason in ("SIGINT", "SIGTERM", "SIGHUP"):
            head = f"run stopped by {self.reason}"
        elif self.reason == "hang":
            head = "run hung"
        else:
            head = "run finished" if code == 0 else "run failed"
        say(f"== {head}: exit code {code}")
        say("   " + stats_summary(self.stats))
        say(f"   run dir: {run.path}")
        for nr in self.nodes:
            state = ("connection lost" if nr.error else f"exit code {nr.code}") if nr.ended else "unknown"
            note = f"; {nr.note}" if nr.note else ""
            say(f"   node {nr.node.node_rank} {nr.node.host} ({nr.node.rank_span}): {state}{note}")
        if self.hang is not None:
            say(f"   {self.hang.summary()}")
            for rank, (ago, line) in sorted(self.hang.last_output.items()):
                host = self.by_rank[rank].node.host
                say(f"     rank {rank} on {host}: last output {ago:.0f} s ago: {line[:200] or '(none)'}")
        failure = self.first_failure
        if failure is None or self.reason not in ("failure", None):
            return
        host = failure.node.host
        if failure.error:
            say(f"   host {host} (node {failure.node.node_rank}): connection lost: {failure.error}")
            return
        if failure.mismatch:
            say(f"   host {host}: {failure.mismatch}")
        failures = parse_failures(failure.router.launcher_lines)
        lines = failure_lines(failures, failure.router.rank_tails, run.rank_log,
                              lambda f: failure.error_files.get(f.rank), host=host)
        for line in lines:
            say(line)
        if not failures:
            say(f"   host {host} (node {failure.node.node_rank}) failed before a rank did; "
                f"last lines of {run.logs / f'node-{failure.node.node_rank}.log'}:")
            for line in list(failure.router.launcher_lines)[-10:]:
                say(f"     | {line}")


__all__ = ["SSHRun", "NodeRun", "EXIT_HANG", "EXIT_LOST"]
