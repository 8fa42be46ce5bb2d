"""The watcher of one submitted Slurm job (:class:`SlurmRun`): streamed node logs, the early stop at
the first failed rank, heartbeats, step retries, the job's end and its cancellation.

Split from :mod:`llmtrain.launch.backends.slurm` (which validates, writes the scripts and
submits); that module's docstring, items 4-6, says what the watcher does.
"""

from __future__ import annotations

import re
import signal
import time
from pathlib import Path
from typing import Mapping

from rich.console import Console

from llmtrain.cluster.hostfile import HostEntry, Hostfile
from llmtrain.launch.backends import slurmctl
from llmtrain.launch.backends.slurm_retry import STEP_LINE_RE
from llmtrain.launch.envpolicy import Redactor
from llmtrain.launch.events import RunStats
from llmtrain.launch.launchplan import LaunchPlan
from llmtrain.launch.proctree import signals_recorded
from llmtrain.launch.rundir import RunDir, hostfile_text
from llmtrain.launch.stream import (Display, FileTail, LineRouter, WorkerLogTailer, error_file_message,
                                   failure_lines, interrupted_line, parse_failures, stats_summary)

POLL_S = 0.1
QUEUE_POLL_S = 0.5
CANCEL_WAIT_S = 60.0
PENDING_NOTE_S = 3.0  # a job still pending after this long: say why, once
EXIT_FOR_SIGNAL = {signal.SIGINT: 130, signal.SIGTERM: 143, signal.SIGHUP: 129}
# torchrun's first line about a dead worker (torch/distributed/elastic/multiprocessing/api.py), and its final report
WORKER_FAILED_RE = re.compile(r"\bfailed \(exitcode: (-?\d+)\) local_rank: (\d+)")
GAVE_UP_RE = re.compile(r"\bChildFailedError\b")
ENV_FILE_RE = re.compile(r"^llmtrain: launch\.env_file: ")  # envexec on a node: the env file is unreadable there


def failure_code(code: int) -> int:
    """The run's exit code after the launcher stopped it for a failed rank: a plain code (1-127)
    as is, else 1 (a cancellation's 143/137, or 0, would hide the failure)."""
    return code if 0 < code < 128 else 1


def code_after_failure(code: int, failure: str | None) -> int:
    """The code after a failure (``failure``: its line): 2 (bad input) when a node could not read
    the env file, else :func:`failure_code`."""
    return 2 if failure is not None and ENV_FILE_RE.search(failure) else failure_code(code)


def end_code(code: int | None, job_state: str, failure: str | None, stopped: bool, step_loop: bool) -> int:
    """The run's exit code once the batch job has ended: Slurm's ``ExitCode`` (``code``; None: Slurm
    no longer knows the job, 1), mapped when a failure was seen (``failure``: the first failure
    line, also one read only after the job ended) or the launcher stopped the job for one: 2 when
    a node could not read ``launch.env_file`` (bad input), else :func:`failure_code`. The job's
    code alone races: when every node fails at once, srun's ``--kill-on-bad-exit`` may SIGTERM a
    sibling before it exits by itself, and the job ends 143 instead of the nodes' 2 (seen in CI on
    the env-file test). A clean 0 of a job that did not complete (NODE_FAIL, TIMEOUT) is 1."""
    if code is None:
        return 1
    if stopped or (code and failure is not None) or (step_loop and code >= 128):
        return code_after_failure(code, failure)
    if code == 0 and job_state != "COMPLETED":
        return 1
    return code


class SlurmRun:
    """One submitted job: its streamed logs, its end, its cancellation."""

    job_log = "job.out"  # the job's own output (srun's messages)

    def __init__(self, run: RunDir, plan: LaunchPlan, job_id: str, console: Console, environ: Mapping[str, str],
                 heartbeat_timeout_s: float = 0):
        self.run_dir, self.plan, self.job_id, self.environ = run, plan, job_id, environ
        self.heartbeat_timeout_s, self.last_beat_check = heartbeat_timeout_s, 0.0
        self.redact = Redactor(plan.policy)
        self.stats = RunStats()
        self.display = Display(console, label=run.name)
        self.routers = [LineRouter(run.logs, self.display, self.stats, host=f"node-{n.node_rank}",
                                   launcher_log=f"node-{n.node_rank}.log") for n in plan.nodes]
        self.tailers = [WorkerLogTailer(Path(n.log_dir), n.nproc, n.node_rank) for n in plan.nodes]
        self.outputs = [FileTail(Path(n.output_log)) for n in plan.nodes]
        self.job_out = FileTail(run.logs / "slurm" / self.job_log)
        self.hosts: list[str] = []
        self.signals: list[int] = []
        self.failed: tuple[int, str] | None = None  # (node rank, torchrun's line) of the first failure seen
        self.stopped_for_failure = False
        # restarts inside the job (slurm_retry): a failure cancels the step, not the job
        self.step_loop = plan.retry.max_restarts > 0
        self.new_step = False  # the loop announced a new step: re-arm the early stop after this read

    def run(self) -> int:
        for router, node in zip(self.routers, self.plan.nodes):
            router.create_logs(node.ranks)
        finished = False
        try:
            with signals_recorded(self.signals):
                code = self._watch()
                finished = True
                return code
        finally:
            if not finished:  # a launcher error or KeyboardInterrupt: never leave the job behind
                self._stop_now()
            for router in self.routers:
                router.close()
            self.display.stop()

    def _watch(self) -> int:
        self.display.start()
        state, last_poll, started, told_pending, t0 = "PENDING", 0.0, False, False, time.monotonic()
        while True:
            if self.signals:
                return self._cancel(self.signals[0])
            if time.monotonic() - last_poll >= QUEUE_POLL_S:
                last_poll = time.monotonic()
                state = slurmctl.queue_state(self.job_id, self.environ)
                if state is not None and state != "PENDING" and not started:
                    started = self._learn_hosts()
                elif state == "PENDING" and not told_pending and time.monotonic() - t0 > PENDING_NOTE_S:
                    told_pending = True
                    reason = slurmctl.job_fields(self.job_id, self.environ).get("Reason", "?")
                    self.display.line(f"[slurm] job {self.job_id} is pending (Reason={reason}); Ctrl-C cancels it")
                if state is None:
                    break
            self._pump(nodes=started)  # node lines wait until their host is known: never "[node-0:0]"
            self._check_heartbeats()
            if self.failed and not self.stopped_for_failure:
                self._stop_for_failure()
            time.sleep(POLL_S)
        fields = slurmctl.job_fields(self.job_id, self.environ)
        if not started:
            self._learn_hosts(fields)
        time.sleep(0.2)  # the nodes' last writes (shared storage) before the final read
        self._pump(final=True)
        self._failure_after_end()
        code = slurmctl.exit_code(fields)
        job_state = fields.get("JobState", "UNKNOWN")
        if code is None:
            self.display.line(f"[launcher] Slurm no longer knows job {self.job_id}: its exit code is lost")
        code = end_code(code, job_state, self.failed[1] if self.failed else None, self.stopped_for_failure,
                        self.step_loop)
        self._summary(code, job_state)
        return code

    def _learn_hosts(self, fields: Mapping[str, str] | None = None) -> bool:
        """Name each node's lines by its host once Slurm has placed the job."""
        fields = slurmctl.job_fields(self.job_id, self.environ) if fields is None else fields
        hosts = slurmctl.hostnames(fields.get("NodeList", ""), self.environ)
        if len(hosts) != len(self.plan.nodes):
            return False
        self.hosts = hosts
        for router, host in zip(self.routers, hosts):
            router.host = host
        self.run_dir.hostfile.write_text(hostfile_text(Hostfile(tuple(
            HostEntry(host=h, slots=n.nproc) for h, n in zip(hosts, self.plan.nodes)))))
        self.display.line(f"[slurm] job {self.job_id} running on {', '.join(hosts)}")
        return True

    def _pump(self, final: bool = False, nodes: bool = True) -> None:
        for line in self.job_out.read(final):
            self.display.stream_line(f"[slurm] {self.redact(line)}")
            step = STEP_LINE_RE.search(line)
            if step and int(step.group(1)) > 0:
                self._next_step(step.group(3).split())
        if not nodes:
            return
        for router, tailer, output in zip(self.routers, self.tailers, self.outputs):
            for rank, stream, line in tailer.poll(final=final):
                router.rank_line(rank, stream, self.redact(line))
            for line in output.read(final):
                router.launcher_line(self.redact(line))
                if self.failed is None and not self.new_step and self._is_failure(line):
                    self.failed = (self.routers.index(router), line)
            router.flush()
        if self.new_step:  # what was read until now belongs to the failed step (it has ended)
            self.new_step, self.failed, self.stopped_for_failure = False, None, False

    def _check_heartbeats(self) -> None:
        """A node whose heartbeat file (``node.sh`` touches ``logs/slurm/alive-<node rank>`` every
        second) is older than ``launch.watchdog.heartbeat_timeout_s`` is lost: a failure, found in
        seconds rather than at a collective's timeout or Slurm's ``SlurmdTimeout``."""
        now = time.time()
        if self.heartbeat_timeout_s <= 0 or self.failed or now - self.last_beat_check < 1.0:
            return
        self.last_beat_check = now
        for node in range(len(self.hosts) or len(self.plan.nodes)):
            try:
                age = now - (self.run_dir.logs / "slurm" / f"alive-{node}").stat().st_mtime
            except OSError:
                continue  # not started yet, or between two steps
            if age > self.heartbeat_timeout_s:
                self.failed = (node, f"no heartbeat for {age:.0f} s (launch.watchdog.heartbeat_timeout_s="
                                     f"{self.heartbeat_timeout_s:g}): the node is lost")
                return

    def _next_step(self, hosts: list[str]) -> None:
        """The job's loop started its next step on ``hosts`` (fewer after a lost node)."""
        self.new_step = True
        if self.hosts and len(hosts) <= len(self.routers):
            self.hosts = hosts + self.hosts[len(hosts):]
            for router, host in zip(self.routers, hosts):
                router.host = host

    def _is_failure(self, line: str) -> bool:
        """A torchrun line saying the run has failed (torchrun itself never restarts under
        Slurm, :func:`slurm_plan`, so its first dead worker is the step's failure)."""
        return GAVE_UP_RE.search(line) is not None or WORKER_FAILED_RE.search(line) is not None or \
            ENV_FILE_RE.search(line) is not None

    def _failure_code(self, code: int) -> int:
        """:func:`code_after_failure` of the first failure seen."""
        return code_after_failure(code, self.failed[1] if self.failed else None)

    def _failure_line(self, action: str) -> str:
        """``[launcher]`` line naming the first failure's host and cause, then ``action``."""
        node, line = self.failed
        host = self.hosts[node] if self.hosts else f"node {node}"
        match = WORKER_FAILED_RE.search(line)
        what = f"local rank {match.group(2)} exited with {match.group(1)}" if match else \
            line if line.startswith("no heartbeat") else \
            "it cannot read launch.env_file" if ENV_FILE_RE.search(line) else "torchrun gave up"
        lost = line.startswith("no heartbeat")
        return f"[launcher] {'node' if lost else 'a rank failed on'} {host} {'is lost ' if lost else ''}({what}): {action}"

    def _stop_for_failure(self) -> None:
        """The first failure ends the run now, not when Slurm's ``--kill-on-bad-exit`` gets to it."""
        self.stopped_for_failure = True
        self.display.line(self._failure_line(f"{self._stop_words()} now"))
        problem = self._stop_step() if self.step_loop else self._stop_now()
        if problem:
            self.display.line(f"[launcher] {problem}")

    def _failure_after_end(self) -> None:
        """A failure read only in the final read, after the job or step had ended (srun's
        ``--kill-on-bad-exit`` can end it before the watcher's next poll): the same cause line, so
        the run always names which node failed and why, whoever stopped it."""
        if self.failed and not self.stopped_for_failure:
            self.display.line(self._failure_line(f"{self._what()} had already ended"))

    def _stop_words(self) -> str:
        if self.step_loop and self.failed and not self.signals:
            return f"cancelling its srun step of Slurm job {self.job_id} (the job's loop restarts it)"
        return f"cancelling Slurm job {self.job_id} (scancel)"

    def _stop_step(self) -> str:
        """Cancel this run's running step(s) only: the job's loop decides whether to restart."""
        steps = slurmctl.step_ids(self.job_id, f"llmtrain-{self.plan.run_id}", self.environ)
        problems = [p for p in (slurmctl.cancel(step, self.environ) for step in steps) if p]
        return f"scancel of the step failed: {problems[0]}" if problems else ""

    def _what(self) -> str:
        return f"Slurm job {self.job_id}"

    def _live(self) -> bool:
        """Whether Slurm still lists what this run stops (a job that has ended has no process left)."""
        return slurmctl.queue_state(self.job_id, self.environ) is not None

    def _stop_now(self) -> str:
        """Stop the run's processes on every node; a problem as one line, else ''."""
        problem = slurmctl.cancel(self.job_id, self.environ)
        return f"scancel {self.job_id} failed: {problem}" if problem else ""

    def _cancel(self, signum: int) -> int:
        name = signal.Signals(signum).name
        self.display.line(f"[launcher] {name} received: {self._stop_words()}")
        if signum == signal.SIGINT:
            self.display.mute()
        problem = self._stop_now()
        if problem:
            self.display.line(f"[launcher] {problem}")
        deadline = time.monotonic() + CANCEL_WAIT_S
        while self._live() and time.monotonic() < deadline:
            self._pump()
            time.sleep(0.2)
        gone = not self._live()
        self._pump(final=True)
        code = EXIT_FOR_SIGNAL.get(signum, 128 + signum)
        if signum == signal.SIGINT:
            self.display.line(interrupted_line("SIGINT", code, self.plan.world_size, len(self.plan.nodes), None,
                                               self.stats, self.run_dir.logs, self.display.hidden))
        else:
            self.display.line(f"== run stopped by {name}: exit code {code}; {self._what()} cancelled")
        if not gone:
            self.display.line(f"[launcher] {self._what()} still listed by squeue after {CANCEL_WAIT_S:g} s")
        return code

    def _summary(self, code: int, job_state: str) -> None:
        say = self.display.line
        say(f"== run {'finished' if code == 0 else 'failed'}: exit code {code} (Slurm job {self.job_id}: {job_state})")
        say("   " + stats_summary(self.stats))
        say(f"   run dir: {self.run_dir.path}")
        if code == 0:
            return
        for node, router in zip(self.plan.nodes, self.routers):
            failures = parse_failures(router.launcher_lines)
            host = self.hosts[node.node_rank] if self.hosts else router.host
            for line in failure_lines(failures, router.rank_tails, self.run_dir.rank_log,
                                      lambda f: self.redact(error_file_message(f.error_file) or "") or None, host=host):
                say(line)


__all__ = ["SlurmRun", "failure_code"]
