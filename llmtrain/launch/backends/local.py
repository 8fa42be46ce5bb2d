"""``llmtrain launch RECIPE`` without ``--hosts``: run every rank on this machine under torchrun.

The local backend: it builds the run's :class:`~llmtrain.launch.launchplan.LaunchPlan` once
(:func:`~llmtrain.launch.launchplan.local_plan`: one node, its torchrun argv, its environment,
its paths) and then only starts, watches and stops that node's command. ``--dry-run`` prints
the plan with the renderer every backend uses (:func:`~llmtrain.launch.launchplan.describe`) and
creates nothing (the run id shown is drawn for the occasion; a real launch draws its own).

What happens, in order (:func:`launch_local`):

1. The recipe (with ``--set`` overrides) is validated by the same code as ``llmtrain plan``
   for ``cluster.nodes x cluster.gpus_per_node`` ranks on ``localhost``. Any problem raises
   :class:`~llmtrain.errors.LLMTrainError` listing all of them, *before* a directory is
   created or a process started.
2. A run directory is created (:mod:`llmtrain.launch.rundir`): ``recipe.lock.yaml``,
   ``hostfile``, ``logs/``.
3. ONE child is started, in its own session (so a Ctrl-C on the terminal reaches only the
   launcher, which then stops the run in order)::

       python -m torch.distributed.run --standalone --nproc-per-node W --redirects 3 \\
           --log-dir RUN_DIR/logs/torchrun -m llmtrain.engine.main \\
           --recipe RUN_DIR/recipe.lock.yaml --run-dir RUN_DIR

   with the launcher's environment (this machine's, as a node's login environment over SSH)
   plus the recipe's environment policy (:mod:`llmtrain.launch.envpolicy`, the same code as
   the SSH launcher: passthrough < ``launch.env_file`` < ``launch.env``; values restored from
   the caller's environment on resume), ``OMP_NUM_THREADS`` = ``max(1, cpus // W)`` (unless
   set), and the launcher's own ``LLMTRAIN_RUN_ID``, ``LLMTRAIN_RUN_DIR``, ``LLMTRAIN_NODE_ID``, ``LLMTRAIN_LAUNCH_ID``,
   ``PYTHONUNBUFFERED=1``. Secret values are masked in every line shown or written to
   ``logs/`` and never written to disk (``recipe.lock.yaml`` keeps names and sources only).
   ``LLMTRAIN_ENGINE_MODULE`` (a test/debug hook) replaces ``llmtrain.engine.main``. All of it is
   the plan's: this module adds only ``os.environ`` underneath, at the start.
   ``--redirects`` rather than ``--tee``: see :mod:`llmtrain.launch.stream` (whole lines).
4. Output is streamed (:mod:`llmtrain.launch.stream`): ``[localhost:R] line`` per rank,
   ``[localhost] line`` for torchrun, one progress bar from rank 0's step events.
5. The exit code is torchrun's. A summary follows: final loss, tokens/s, run dir, exit code;
   on failure the failing rank(s), from torchrun's failure report, and the last lines of
   that rank's log.

Teardown (SIGINT, SIGTERM or SIGHUP to the launcher): the launcher sends SIGTERM to torchrun
and to every process of the run, waits up to ``grace_s`` (default 5 s) while still showing
their output, then sends SIGKILL to whatever is left, and returns 130 / 143 / 129. A second
signal skips the rest of the grace period. "Every process of the run" is found without any
name or pattern matching:

* the process tree under torchrun, read from ``/proc/*/stat`` (ppid links), re-read every
  0.25 s while the run lives and remembered as ``(pid, start time)``: workers that sit in
  their own sessions, and grandchildren that were orphaned and re-parented to init, stay
  known; the start time guards against pid reuse;
* as a safety net, processes of the same user whose ``/proc/PID/environ`` holds exactly
  ``LLMTRAIN_LAUNCH_ID=<this launch's id>`` (a fresh random id per launcher invocation: the
  run id is shared by a resumed run's launches and by copies of a run directory), which
  catches a child that forked and exited between two scans.

The same sweep runs after a normal exit, so a run never leaves processes behind. torchrun
also gets ``PR_SET_PDEATHSIG=SIGTERM`` (Linux), so even a SIGKILLed launcher stops the run.
Signal handlers are installed only when called from the main thread.
"""

from __future__ import annotations

import importlib.util
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.text import Text

from llmtrain.cluster.hostfile import MAX_SLOTS, Hostfile
from llmtrain.errors import LLMTrainError
from llmtrain.launch.envpolicy import EnvVar, Redactor, lock_recipe, run_env
from llmtrain.launch.events import RunStats
from llmtrain.launch.launchplan import (ENGINE_MODULE, EXIT_FOR_SIGNAL, LaunchPlan, Rendezvous, describe,
                                       engine_module, local_defaults, local_plan, resolve_recipe, torchrun_argv)
from llmtrain.launch.proctree import ProcessTree, _pdeathsig_preexec, _signal_all, marked_pids, signals_recorded
from llmtrain.launch.rundir import RunDir, create_run_dir, new_run_id, reuse_run_dir
from llmtrain.launch.stream import (Display, LineRouter, PipeReader, WorkerLogTailer, error_file_message,
                                   failure_lines, interrupted_line, parse_failures, stats_summary)
from llmtrain.plan.api import plan_recipe
from llmtrain.recipe.schema import Recipe

POLL_S = 0.1
SCAN_S = 0.25


def launch_local(recipe: Recipe | str | Path, overrides: list[str] | None = None, runs_root: str | Path = "runs",
                 console: Console | None = None, grace_s: float = 5.0, dry_run: bool = False) -> int:
    """Validate, create the run dir, run torchrun with all ranks here; return its exit code.
    ``dry_run``: print the plan, create and start nothing."""
    recipe = resolve_recipe(recipe, overrides)
    world, hostfile, module, console = prepare_local(recipe, console)
    recipe, policy = run_env(recipe, base_dir=os.getcwd())
    if dry_run:
        run_id = new_run_id()
        run_dir = str((Path(runs_root) / (recipe.name or "run") / run_id).resolve())
        plan = local_plan(recipe, world, run_id, run_dir, module)
        redact = Redactor(plan.policy)
        for line in describe(plan):
            console.print(Text(redact(line)))
        console.print(Text("dry run: nothing was started (a real launch draws its own run id)"))
        return 0
    run = create_run_dir(lock_recipe(recipe, policy, os.getcwd()), hostfile, runs_root)
    plan = local_plan(recipe, world, run.run_id, str(run.path.resolve()), module)
    return LocalRun(run, plan, console, grace_s).run()


def relaunch_local(run_path: str | Path, recipe: Recipe, extra_env: dict[str, str] | None = None,
                   console: Console | None = None, grace_s: float = 5.0) -> int:
    """Run ``recipe`` again in the existing run directory ``run_path`` (``llmtrain resume``): the
    recipe is validated like :func:`launch_local`, becomes the new ``recipe.lock.yaml`` (the old
    one and the old ``logs/`` are kept as ``recipe.lock.yaml.prev-N`` / ``logs.prev-N/``)."""
    world, hostfile, module, console = prepare_local(recipe, console)
    recipe, policy = run_env(recipe, base_dir=os.getcwd())  # secret values again, from the caller: nothing stored
    run = reuse_run_dir(run_path, lock_recipe(recipe, policy, os.getcwd()), hostfile)
    plan = local_plan(recipe, world, run.run_id, str(run.path.resolve()), module, extra_env=extra_env)
    return LocalRun(run, plan, console, grace_s).run()


def prepare_local(recipe: Recipe, console: Console | None) -> tuple[int, Hostfile, str, Console]:
    """Everything checked before a local run starts (all ranks on this machine, validated like
    ``llmtrain plan``, torch importable); prints the plan's warnings. Returns the world size, the
    localhost hostfile, the engine module and the console."""
    world = recipe.cluster.nodes * recipe.cluster.gpus_per_node
    if world > MAX_SLOTS:
        raise LLMTrainError(f"{world} ranks (cluster.nodes x cluster.gpus_per_node) on one machine",
                            f"use at most {MAX_SLOTS} locally, or --hosts for a cluster", path="cluster")
    hostfile = Hostfile.localhost(world)
    plan = plan_recipe(recipe, hostfile)
    if not plan.valid:
        raise LLMTrainError(plan.validation.errors)
    module = engine_module()
    if importlib.util.find_spec("torch") is None:
        raise LLMTrainError("torch is not installed in this Python environment",
                            f"install it: {sys.executable} -m pip install torch==2.13.0")
    console = console or Console(highlight=False, soft_wrap=True)
    for warning in plan.validation.warnings:
        console.print(Text(f"warning: {warning.line()}"), style="yellow")
    return world, hostfile, module, console


def torchrun_command(run: RunDir, world: int, module: str = ENGINE_MODULE, max_restarts: int = 0) -> list[str]:
    """torchrun for ``world`` local ranks (the plan's line: :func:`~llmtrain.launch.launchplan.torchrun_argv`);
    with ``max_restarts`` torchrun restarts the whole worker group after a failure and the engine
    resumes from the latest checkpoint (docs/checkpoint.md)."""
    run_dir = str(run.path.resolve())
    return torchrun_argv(sys.executable, 1, 0, world, Rendezvous("standalone", "localhost", 0, run.run_id), max_restarts,
                         f"{run_dir}/logs/torchrun", module, run_dir)


def launch_env(run: RunDir, world: int, base: dict[str, str] | None = None, max_restarts: int = 0,
               policy: list[EnvVar] | tuple[EnvVar, ...] = (), launch_id: str | None = None) -> dict[str, str]:
    """``base`` (this machine's environment) < the env policy's ``policy`` < the launcher's own,
    as the local plan's node holds them (:func:`~llmtrain.launch.launchplan.local_plan`)."""
    from llmtrain.launch.envpolicy import launcher_env

    env = dict(os.environ if base is None else base)
    env.update({v.name: v.value for v in policy})
    env.update({v.name: v.value for v in local_defaults(world, max_restarts, env)})
    env.update({v.name: v.value for v in launcher_env(run.run_id, str(run.path.resolve()), 0, launch_id=launch_id)})
    return env


# --------------------------------------------------------------------------- the run


class LocalRun:
    """One torchrun child, its output, its progress bar and its teardown."""

    def __init__(self, run: RunDir, plan: LaunchPlan, console: Console, grace_s: float = 5.0):
        self.run_dir, self.plan, self.grace_s = run, plan, grace_s
        self.node = plan.nodes[0]
        self.world = plan.world_size
        self.redact = Redactor(self.node.env)  # every line shown or written to logs/
        self.stats = RunStats()
        self.display = Display(console, label=run.name)
        self.router = LineRouter(run.logs, self.display, self.stats)
        self.tailer = WorkerLogTailer(Path(self.node.log_dir), nproc_per_node=self.world)
        self.signals: list[int] = []
        self.leftovers = 0
        self.launch_id = plan.launch_id  # marks this launch's processes (not the run id: see new_launch_id)

    def run(self) -> int:
        try:
            with signals_recorded(self.signals):
                return self._run()
        finally:
            self.router.close()

    def _run(self) -> int:
        cmd = list(self.node.command)
        self.display.line(f"run dir {self.run_dir.path}: {self.world} ranks on localhost")
        (self.run_dir.logs / "command.txt").write_text(self.redact(shlex.join(cmd)) + "\n")
        self.router.create_logs(self.world)
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                env={**os.environ, **{v.name: v.value for v in self.node.env}}, cwd=self.node.workdir,
                                start_new_session=True, preexec_fn=_pdeathsig_preexec())
        self.proc, self.tree = proc, ProcessTree(proc.pid)
        self.pipes = PipeReader({"stdout": proc.stdout, "stderr": proc.stderr})
        self.display.start()
        code, stopped_by = None, None
        try:
            last_scan, exited_at = 0.0, None
            while True:
                self._pump()
                if time.monotonic() - last_scan >= SCAN_S:
                    self.tree.scan()
                    last_scan = time.monotonic()
                if self.signals:
                    stopped_by = self.signals[0]
                    self._teardown()
                    break
                if proc.poll() is not None:
                    exited_at = exited_at or time.monotonic()
                    # drain torchrun's pipes; do not wait on them forever (a leftover may hold them)
                    if not self.pipes.open or time.monotonic() - exited_at > 1.0:
                        break
            if stopped_by is None:
                self.tree.scan()
                leftovers = (self.tree.alive() | marked_pids(self.launch_id)) - {proc.pid}
                if leftovers:
                    self.leftovers = self._stop(leftovers, include_torchrun=False)
        except BaseException:  # a bug or KeyboardInterrupt outside the handlers: never leave the run behind
            self.tree.scan()
            self._stop(self.tree.alive() | marked_pids(self.launch_id) | {proc.pid}, include_torchrun=True)
            raise
        finally:
            self._pump(final=True)
            for _, line in self.pipes.close():
                self.router.launcher_line(self.redact(line))
            for pipe in (proc.stdout, proc.stderr):
                pipe.close()
            self.router.flush()
            self.display.stop()
        if stopped_by is not None:
            code = EXIT_FOR_SIGNAL.get(stopped_by, 128 + stopped_by)
        else:
            code = proc.returncode if proc.returncode >= 0 else 128 - proc.returncode
        self._summary(code, stopped_by)
        return code

    def _pump(self, final: bool = False) -> None:
        # wait on torchrun's pipes, then read the workers' files; show worker lines first: what
        # torchrun says (e.g. its failure report) is mostly a reaction to what a worker did
        launcher_lines = self.pipes.poll(0 if final else POLL_S)
        for rank, stream, line in self.tailer.poll(final=final):
            self.router.rank_line(rank, stream, self.redact(line))
        for _, line in launcher_lines:
            self.router.launcher_line(self.redact(line))
        self.router.flush()

    def _teardown(self) -> None:
        name = signal.Signals(self.signals[0]).name
        self.display.line(f"[launcher] {name} received: stopping the run "
                          f"(SIGTERM now, SIGKILL after {self.grace_s:g} s)")
        if self.signals[0] == signal.SIGINT:  # Ctrl-C: torchrun's tracebacks go to the logs only
            self.display.mute()
        self.tree.scan()
        targets = self.tree.alive() | marked_pids(self.launch_id) | {self.proc.pid}
        self.leftovers = self._stop(targets, include_torchrun=True)

    def _stop(self, targets: set[int], include_torchrun: bool) -> int:
        """SIGTERM ``targets`` (and newcomers), wait ``grace_s``, SIGKILL the rest; return how many."""
        signalled = set(targets)
        _signal_all(signalled, signal.SIGTERM)
        deadline = time.monotonic() + self.grace_s
        n_signals = len(self.signals)
        while time.monotonic() < deadline and len(self.signals) <= n_signals:
            self._pump()
            self.proc.poll()  # reap torchrun so it does not linger as a zombie
            self.tree.scan()
            alive = self._alive(include_torchrun)
            new = alive - signalled
            if new:
                _signal_all(new, signal.SIGTERM)
                signalled |= new
            if not alive:
                return len(signalled)
        self.tree.scan()
        remaining = self._alive(include_torchrun)
        if remaining:
            self.display.line(f"[launcher] SIGKILL to {len(remaining)} process(es) still running: "
                              f"{' '.join(map(str, sorted(remaining)))}")
            _signal_all(remaining, signal.SIGKILL)
            signalled |= remaining
            gone_by = time.monotonic() + 2.0  # SIGKILL is not instant: wait until they are really gone
            while self._alive(include_torchrun) and time.monotonic() < gone_by:
                self.proc.poll()
                time.sleep(0.02)
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL is not ignorable
            pass
        return len(signalled)

    def _alive(self, include_torchrun: bool) -> set[int]:
        alive = self.tree.alive() | marked_pids(self.launch_id)
        if self.proc.poll() is not None or not include_torchrun:
            alive.discard(self.proc.pid)
        return alive

    # ----------------------------------------------------------------------- summary

    def _summary(self, code: int, stopped_by: int | None) -> None:
        run, stats, say = self.run_dir, self.stats, self.display.line
        if stopped_by == signal.SIGINT:
            say(interrupted_line("SIGINT", code, self.world, 1, self.leftovers, stats, run.logs, self.display.hidden))
            return
        if stopped_by is not None:
            head = f"run stopped by {signal.Signals(stopped_by).name}"
        else:
            head = "run finished" if code == 0 else "run failed"
        say(f"== {head}: exit code {code}")
        say("   " + stats_summary(stats))
        say(f"   run dir: {run.path}")
        if self.leftovers:
            say(f"   stopped {self.leftovers} process(es) of the run")
        if code == 0 or stopped_by is not None:
            return
        failures = parse_failures(self.router.launcher_lines)
        for line in failure_lines(failures, self.router.rank_tails, run.rank_log,
                                  lambda failure: self.redact(error_file_message(failure.error_file) or "") or None):
            say(line)
        if not failures:
            say(f"   torchrun failed before a rank did; last lines of {run.launcher_log}:")
            for line in list(self.router.launcher_lines)[-10:]:
                say(f"     | {line}")


__all__ = ["launch_local", "relaunch_local", "torchrun_command", "launch_env", "ProcessTree", "marked_pids"]
