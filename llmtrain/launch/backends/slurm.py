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
   policy's environment in memory -- without the env file's values, which each node reads itself
   (:mod:`llmtrain.launch.envexec`); a secret that does travel is named in one warning line.
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
from pathlib import Path
from typing import Mapping

from rich.console import Console
from rich.text import Text

from llmtrain.errors import LLMTrainError
from llmtrain.launch.backends import slurmctl
from llmtrain.launch.envpolicy import Redactor, lock_recipe, policy_env, restore_env, shell_assignments
from llmtrain.cluster.hostfile import HostEntry, Hostfile
from llmtrain.launch.launchplan import LaunchPlan, describe
from llmtrain.launch.launchplan import engine_module, resolve_recipe
from llmtrain.launch.rundir import RunDir, create_run_dir, new_run_id, reuse_run_dir
from llmtrain.launch.backends.slurm_retry import node_script_name, shrunk_plans, slurm_plan
from llmtrain.launch.backends.slurm_script import (BASE_ENV, JOB_SCRIPT, NODE_SCRIPT, SlurmOptions, check_run_dir,
                                          job_environment, job_script, node_script, warn_secrets)
from llmtrain.plan.api import plan_recipe

from llmtrain.launch.backends.slurm_watch import SlurmRun


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
        warn_secrets(plan, say)
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
    warn_secrets(plan, say)
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


__all__ = ["launch_slurm", "validated_plan", "slurm_plan", "shrunk_plans", "slurm_hostfile", "write_scripts",
           "write_node_files", "SlurmRun"]
