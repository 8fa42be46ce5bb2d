"""``llmtrain launch RECIPE --launcher slurm``: the run as one Slurm batch job, streamed, one exit code.

What happens, in order (:func:`launch_slurm`):

1. The recipe (with ``--set``) is validated for ``--nodes`` x ``--gpus-per-node`` ranks
   (defaults: ``cluster.nodes`` / ``cluster.gpus_per_node``), exactly as ``llmtrain plan``
   does; the options are checked (:class:`~llmtrain.launch.backends.slurm_script.SlurmOptions`).
2. ``--dry-run``: the launch plan (:mod:`llmtrain.launch.launchplan`) is built for a run
   directory that is not created, and the job script, the node script and every node's exact
   command (secrets masked) are printed. Nothing is created, no Slurm command runs (so it works
   on a laptop), nothing is submitted.
3. Otherwise, before anything is written: the Slurm clients exist, the partition exists and
   ``--nodes`` fits it, and slurmctld would accept the whole request (``sbatch --test-only``: an
   account it rejects, GPUs the nodes lack; :mod:`llmtrain.launch.backends.slurmctl`). Then the run
   directory is created (on shared storage: every node reads the recipe and writes its logs
   there, as ``resume --hosts`` assumes), ``slurm/job.sbatch`` and ``slurm/node.sh`` are written
   (:mod:`llmtrain.launch.backends.slurm_script`), and ``sbatch --parsable`` submits the job with the
   policy's environment in memory.
4. The job id is printed; every node's output is streamed from the run directory as
   ``[host:rank] text`` (torchrun's per-worker files) and ``[host] text`` (torchrun itself,
   ``logs/slurm/node-<i>.out``), the job's own lines (srun's messages) as ``[slurm] text``; rank
   0's events drive the progress display. ``squeue -h -j ID`` is polled every 0.5 s; once the job
   is no longer live, ``scontrol show job`` gives its ``ExitCode``, which is the exit code.
5. **The first failure ends the job at once**: when a node's torchrun reports a failed worker
   (its ``failed (exitcode: N) local_rank: ...`` line, or its final ``ChildFailedError``), the job
   is cancelled right then (``scancel``), said in one line, instead of waiting until that
   torchrun has printed its report and exited and srun's ``--kill-on-bad-exit`` ends the others
   (seconds on a loaded node). The exit code is then the job's when it is a plain code (1-127),
   else 1 (torchrun's code for a failed worker group; the cancellation's own 143/137 would hide
   it). With ``--max-restarts K`` only the failed *step* is cancelled (``scancel JOBID.STEP``):
   the job script's loop (:mod:`llmtrain.launch.backends.slurm_retry`) starts the next one, and the
   watcher follows it (its ``llmtrain: step N on M node(s): HOSTS`` line names the hosts again
   and re-arms the early stop).
6. SIGINT / SIGTERM / SIGHUP: ``scancel ID``, then wait until squeue no longer lists the job
   (Slurm's cgroup tracking has then ended every process of it on every node), exit 130 / 143 /
   129. An error in the launcher itself also cancels the job: a launch never leaves a job behind.
"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path
from typing import Mapping

from rich.console import Console
from rich.text import Text

from llmtrain.errors import LLMTrainError
from llmtrain.launch.backends import slurmctl
from llmtrain.launch.envpolicy import Redactor, lock_recipe, policy_env, restore_env, shell_assignments
from llmtrain.launch.events import RunStats
from llmtrain.cluster.hostfile import HostEntry, Hostfile
from llmtrain.launch.launchplan import LaunchPlan, describe
from llmtrain.launch.launchplan import engine_module, resolve_recipe
from llmtrain.launch.proctree import signals_recorded
from llmtrain.launch.rundir import RunDir, create_run_dir, hostfile_text, new_run_id, reuse_run_dir
from llmtrain.launch.backends.slurm_retry import STEP_LINE_RE, node_script_name, shrunk_plans, slurm_plan
from llmtrain.launch.backends.slurm_script import (BASE_ENV, JOB_SCRIPT, NODE_SCRIPT, SlurmOptions, check_run_dir,
                                          job_environment, job_script, node_script)
from llmtrain.launch.stream import (Display, FileTail, LineRouter, WorkerLogTailer, error_file_message,
                                   failure_lines, interrupted_line, parse_failures, stats_summary)
from llmtrain.plan.api import plan_recipe

POLL_S = 0.1
QUEUE_POLL_S = 0.5
CANCEL_WAIT_S = 60.0
PENDING_NOTE_S = 3.0  # a job still pending after this long: say why, once
EXIT_FOR_SIGNAL = {signal.SIGINT: 130, signal.SIGTERM: 143, signal.SIGHUP: 129}
# torchrun's first line about a dead worker (torch/distributed/elastic/multiprocessing/api.py), and its final report
WORKER_FAILED_RE = re.compile(r"\bfailed \(exitcode: (-?\d+)\) local_rank: (\d+)")
GAVE_UP_RE = re.compile(r"\bChildFailedError\b")


def failure_code(code: int) -> int:
    """The run's exit code after the launcher stopped it for a failed rank: a plain code (1-127)
    as is, else 1 (a cancellation's 143/137, or 0, would hide the failure)."""
    return code if 0 < code < 128 else 1


def slurm_hostfile(nodes: int, per_node: int) -> Hostfile:
    """The placement ``plan`` validates: ``nodes`` hosts the scheduler has not named yet."""
    return Hostfile(tuple(HostEntry(host=f"slurm-node-{i}", slots=per_node) for i in range(nodes)), source="<slurm>")


def validated_plan(recipe, nodes: int, per_node: int):
    """``(hostfile, plan result)`` for ``nodes`` x ``per_node`` Slurm nodes; the validation's errors
    raised in one :class:`LLMTrainError` (the batch job and the allocation step check the same way)."""
    hostfile = slurm_hostfile(nodes, per_node)
    plan_result = plan_recipe(recipe, hostfile)
    if not plan_result.valid:
        raise LLMTrainError(plan_result.validation.errors)
    return hostfile, plan_result


def launch_slurm(recipe, overrides: list[str] | None = None, runs_root: str | Path = "runs",
                 nodes: int | None = None, gpus_per_node: int | None = None, partition: str | None = None,
                 account: str | None = None, time_limit: str | None = None, slurm_args: tuple[str, ...] = (),
                 dry_run: bool = False, console: Console | None = None,
                 environ: Mapping[str, str] | None = None, requeue: bool = False,
                 resume_run: str | Path | None = None, extra_env: Mapping[str, str] | None = None) -> int:
    """Validate, submit one batch job, stream it, return its exit code (see the module docstring).

    ``resume_run`` (``llmtrain resume --launcher slurm``): run again in that existing run
    directory (its run id kept, old logs kept as ``logs.prev-N``); ``extra_env``
    (``LLMTRAIN_RESUME``) travels in sbatch's environment with the policy's variables."""
    environ = os.environ if environ is None else environ
    if resume_run is not None:
        runs_root = Path(resume_run).parent.parent
    recipe = restore_env(resolve_recipe(recipe, overrides), environ, base_dir=os.getcwd())
    n_nodes = nodes or recipe.cluster.nodes
    per_node = gpus_per_node or recipe.cluster.gpus_per_node
    opts = SlurmOptions(n_nodes, per_node, partition, account, time_limit, recipe.cluster.gpu != "cpu",
                        tuple(slurm_args), requeue)
    opts.check()
    hostfile, plan_result = validated_plan(recipe, n_nodes, per_node)
    console = console or Console(highlight=False, soft_wrap=True)
    say = lambda text, style=None: console.print(Text(text), style=style)  # noqa: E731
    for warning in plan_result.validation.warnings:
        say(f"warning: {warning.line()}", "yellow")
    name = recipe.name or "run"
    labels = [(f"node {i} of the allocation", per_node) for i in range(n_nodes)]
    module = engine_module()
    if dry_run:
        run_id = new_run_id()
        run_dir = str((Path(runs_root) / name / run_id).absolute())
        plan = slurm_plan(recipe, labels, run_id, run_dir, module, environ)
        shrunk, invalid = shrunk_plans(recipe, plan, per_node, module, environ)
        redact = Redactor(plan.policy)
        say(f"# {run_dir}/slurm/{JOB_SCRIPT}")
        for line in job_script(plan, opts, invalid, recipe.launch.watchdog.heartbeat_timeout_s).splitlines():
            say(redact(line))
        for m, p in [(n_nodes, plan), *shrunk.items()]:
            say(f"# {run_dir}/slurm/{node_script_name(m, n_nodes)}")
            for line in node_script(p).splitlines():
                say(redact(line))
        for line in describe(plan):
            say(redact(line))
        say("dry run: nothing was created or submitted, no Slurm command ran (the partition and --nodes are "
            "checked at launch; a real launch draws its own run id)")
        return 0
    check_run_dir(str((Path(runs_root) / name).absolute()))
    slurmctl.check_clients()
    part = slurmctl.check_partition(partition, n_nodes, environ)
    slurmctl.will_run(sbatch_options(opts), base_environment(environ))  # an account sbatch rejects: nothing made
    policy = policy_env(recipe.launch, environ, base_dir=os.getcwd())
    locked = lock_recipe(recipe, policy, os.getcwd())  # no value reaches disk
    run = create_run_dir(locked, hostfile, runs_root) if resume_run is None else \
        reuse_run_dir(resume_run, locked, hostfile)
    run_dir = str(run.path.absolute())
    plan = slurm_plan(recipe, labels, run.run_id, run_dir, module, environ)
    shrunk, invalid = shrunk_plans(recipe, plan, per_node, module, environ)
    script = write_scripts(run, plan, opts, shrunk, invalid, recipe.launch.watchdog.heartbeat_timeout_s)
    job_id = slurmctl.submit(str(script), {**job_environment(plan, environ), **(extra_env or {})})
    say(f"run dir {run_dir}: {plan.world_size} ranks on {n_nodes} node(s); submitted Slurm job {job_id} "
        f"(partition {part.name})")
    return SlurmRun(run, plan, job_id, console, environ, recipe.launch.watchdog.heartbeat_timeout_s).run()


def sbatch_options(opts: SlurmOptions) -> list[str]:
    """The job script's resource lines as sbatch options, for ``sbatch --test-only`` before anything
    is written (:func:`~llmtrain.launch.backends.slurmctl.will_run`): the same request, no run directory."""
    argv = [f"--nodes={opts.nodes}", "--ntasks-per-node=1"]
    argv += [f"--{flag}={value}" for flag, value in (("partition", opts.partition), ("account", opts.account),
                                                      ("time", opts.time)) if value is not None]
    if opts.request_gpus:
        argv.append(f"--gpus-per-node={opts.gpus_per_node}")
    return [*argv, *opts.extra]


def base_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """sbatch's environment without the policy's values (what a pre-submit check needs)."""
    return {k: v for k, v in environ.items() if k in BASE_ENV or k.startswith("LC_") or k == "SLURM_CONF"}


def write_scripts(run: RunDir, plan: LaunchPlan, opts: SlurmOptions, shrunk: Mapping[int, LaunchPlan] | None = None,
                  invalid: Mapping[int, str] | None = None, heartbeat_timeout_s: float = 0) -> Path:
    """``slurm/job.sbatch``, ``slurm/node.sh`` (and ``node-M.sh`` for the node counts a retry
    without lost nodes can reach), ``logs/commands.txt`` (masked); the job script's path."""
    write_node_files(run, plan, shrunk)
    script = run.path / "slurm" / JOB_SCRIPT
    script.write_text(job_script(plan, opts, invalid, heartbeat_timeout_s))
    return script


def write_node_files(run: RunDir, plan: LaunchPlan, shrunk: Mapping[int, LaunchPlan] | None = None) -> None:
    """``slurm/node.sh`` (+ ``node-M.sh``) and ``logs/commands.txt`` (masked): the same for a batch job and a step."""
    folder = run.path / "slurm"
    folder.mkdir(exist_ok=True)  # a resumed run keeps its folder; the scripts are rewritten for this job
    (run.logs / "slurm").mkdir()
    (folder / NODE_SCRIPT).write_text(node_script(plan))
    for m, small in (shrunk or {}).items():
        (folder / node_script_name(m, len(plan.nodes))).write_text(node_script(small))
    lines = [f"# node {n.node_rank} ({n.rank_span}): env {' '.join(shell_assignments(n.env, masked='disk'))}"
             for n in plan.nodes]
    (run.logs / "commands.txt").write_text("\n".join(lines) + "\n")


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
        code = slurmctl.exit_code(fields)
        job_state = fields.get("JobState", "UNKNOWN")
        if code is None:
            self.display.line(f"[launcher] Slurm no longer knows job {self.job_id}: its exit code is lost")
            code = 1
        elif self.stopped_for_failure or (self.step_loop and code >= 128):
            code = failure_code(code)
        elif code == 0 and job_state != "COMPLETED":
            code = 1  # e.g. NODE_FAIL, TIMEOUT with a clean step
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
        return GAVE_UP_RE.search(line) is not None or WORKER_FAILED_RE.search(line) is not None

    def _stop_for_failure(self) -> None:
        """The first failure ends the run now, not when Slurm's ``--kill-on-bad-exit`` gets to it."""
        self.stopped_for_failure = True
        node, line = self.failed
        host = self.hosts[node] if self.hosts else f"node {node}"
        match = WORKER_FAILED_RE.search(line)
        what = f"local rank {match.group(2)} exited with {match.group(1)}" if match else \
            line if line.startswith("no heartbeat") else "torchrun gave up"
        lost = line.startswith("no heartbeat")
        self.display.line(f"[launcher] {'node' if lost else 'a rank failed on'} {host} "
                          f"{'is lost ' if lost else ''}({what}): {self._stop_words()} now")
        problem = self._stop_step() if self.step_loop else self._stop_now()
        if problem:
            self.display.line(f"[launcher] {problem}")

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


__all__ = ["launch_slurm", "validated_plan", "slurm_plan", "shrunk_plans", "slurm_hostfile", "write_scripts", "write_node_files", "SlurmRun", "failure_code"]
