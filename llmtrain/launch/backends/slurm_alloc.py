"""Runs inside a Slurm allocation: ``llmtrain launch`` / ``llmtrain plan`` where ``SLURM_JOB_ID`` is set.

Under ``salloc`` or in a user's own batch script the nodes are already allocated, so a launch
must not submit a nested job: it runs **one job step** with ``srun --jobid=ID`` on the
allocated nodes (:func:`launch_in_allocation`), with the same node script, logs and streaming
as the batch path (:class:`~llmtrain.launch.backends.slurm_watch.SlurmRun`); only the end and the stop differ
(:class:`StepRun`).

Decisions:

* **What the allocation is** (:func:`allocation_from_env`): ``SLURM_JOB_ID`` (or the older
  ``SLURM_JOBID``), the nodes ``SLURM_JOB_NODELIST`` (``SLURM_NODELIST``) expanded with
  ``scontrol show hostnames`` (the job's node order: node 0 is the rendezvous host), the count
  ``SLURM_JOB_NUM_NODES`` (``SLURM_NNODES``). A set ``SLURM_JOB_ID`` without a node list is a
  one-line error (a stale variable in the shell): unset it, or pass ``--launcher local``.
* **Nodes**: all of the allocation's, or ``--nodes N`` (the first N, ``--nodelist``); more than
  allocated is an error. **Ranks per node**: ``--gpus-per-node``, else ``SLURM_GPUS_ON_NODE``
  (the GPUs Slurm gave each node), else the recipe's ``cluster.gpus_per_node``.
  ``SLURM_NTASKS_PER_NODE`` is *not* used: torchrun-style allocations ask for one task per node
  (``--ntasks-per-node=1``), which says nothing about how many ranks a node runs.
* **Explicit wins**: ``--launcher local`` runs on this machine as outside Slurm; ``--hosts``
  (SSH) is honoured too (a site with ``pam_slurm_adopt`` lets a user SSH into the nodes of her
  allocation). The sbatch-only options (``--partition --account --time --slurm-arg``) are an
  error inside an allocation: the allocation already fixed them.
* **The step's environment is exactly the policy**, as the batch job's
  (:func:`~llmtrain.launch.backends.slurm_script.job_environment`) plus ``MASTER_ADDR``; the
  allocation's own ``SLURM_*`` do not travel (``--jobid`` names the job), so an enclosing
  ``SLURM_NTASKS`` etc. cannot change the step. The env file's values are not in it either: the
  node script reads them on each node (:mod:`llmtrain.launch.envexec`), as in a batch job. srun
  hands a step's environment to slurmd in memory; measured on the test cluster (Slurm 22.05),
  no file under StateSaveLocation or SlurmdSpoolDir holds it, so passthrough / ``launch.env``
  secrets get no warning here (a batch job's environment is on slurmctld's disk: they do there).
* **The end is srun's exit** (``--kill-on-bad-exit=1``): its code is the step's, except that
  srun returns 143 when kill-on-bad-exit SIGTERMed the siblings of the failing task; once a
  failure was seen in the stream the run's code is then 1 (:func:`~llmtrain.launch.backends.slurm_watch.failure_code`).
* **Stopping** (Ctrl-C, SIGTERM, SIGHUP, a launcher error, the first failed rank):
  ``scancel JOBID.STEPID`` of this run's step (found by its name ``llmtrain-<run id>`` in
  ``squeue -s``), falling back to two SIGINTs to srun within one second (srun's own "abort the
  step"); then wait for srun's exit and until ``squeue -s`` no longer lists the step. The
  allocation itself is never cancelled: it is the user's.
"""

from __future__ import annotations

import os
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from llmtrain.errors import LLMTrainError


@dataclass(frozen=True)
class Allocation:
    job_id: str
    nodelist: str  # Slurm's compressed form, n[0-1]
    nodes: int
    gpus_on_node: int | None  # SLURM_GPUS_ON_NODE

    def ranks_per_node(self, flag: int | None, recipe_gpus: int) -> tuple[int, str]:
        """Ranks per node and where the number came from (see the module docstring)."""
        if flag is not None:
            return flag, "--gpus-per-node"
        if self.gpus_on_node:
            return self.gpus_on_node, "SLURM_GPUS_ON_NODE"
        return recipe_gpus, "cluster.gpus_per_node"

    def node_count(self, flag: int | None) -> int:
        if flag is not None and flag > self.nodes:
            raise LLMTrainError(f"--nodes {flag} is more than the {self.nodes} node(s) of Slurm allocation {self.job_id}",
                                f"use --nodes {self.nodes} or less, or allocate more nodes", path="--nodes")
        return flag or self.nodes


def _int(environ: Mapping[str, str], *names: str) -> int | None:
    for name in names:
        value = environ.get(name, "").strip()
        if value:
            head = value.split("(")[0].split(",")[0]  # SLURM_GPUS_ON_NODE is one number; be lenient anyway
            if not head.isdigit():
                raise LLMTrainError(f"{name}={value[:40]!r} is not a number", "unset it, or run inside a real "
                                    "allocation (salloc / sbatch)", path=name)
            return int(head)
    return None


def allocation_from_env(environ: Mapping[str, str] | None = None) -> Allocation | None:
    """The enclosing allocation, or None when ``SLURM_JOB_ID`` is not set."""
    environ = os.environ if environ is None else environ
    job_id = (environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID") or "").strip()
    if not job_id:
        return None
    if not job_id.isdigit():
        raise LLMTrainError(f"SLURM_JOB_ID={job_id[:40]!r} is not a job id", "unset it, or pass --launcher local",
                            path="SLURM_JOB_ID")
    nodelist = (environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST") or "").strip()
    nodes = _int(environ, "SLURM_JOB_NUM_NODES", "SLURM_NNODES")
    if nodelist == "(null)":
        nodelist = ""
    if not nodelist or not nodes:
        missing = "SLURM_JOB_NODELIST" if not nodelist else "SLURM_JOB_NUM_NODES"
        raise LLMTrainError(f"SLURM_JOB_ID={job_id} is set but {missing} is not, so this is no usable allocation",
                            "run inside salloc or a batch script, or unset SLURM_JOB_ID / pass --launcher local",
                            path="SLURM_JOB_ID")
    return Allocation(job_id, nodelist, nodes, _int(environ, "SLURM_GPUS_ON_NODE"))


def plan_placement(nodes: int | None, gpus_per_node: int | None, recipe_path: Path, overrides: list[str],
                   environ: Mapping[str, str] | None = None) -> tuple[int | None, int | None, str | None]:
    """``llmtrain plan`` inside an allocation: (nodes, GPUs per node, the one line saying so);
    outside one, the arguments unchanged and no line."""
    alloc = allocation_from_env(environ)
    if alloc is None:
        return nodes, gpus_per_node, None
    from llmtrain.recipe.load import load_recipe

    n = alloc.node_count(nodes)
    per_node, source = alloc.ranks_per_node(gpus_per_node, load_recipe(recipe_path, overrides).cluster.gpus_per_node)
    line = (f"planning for Slurm allocation {alloc.job_id}: {n} node(s) "
            f"({'--nodes' if nodes else 'SLURM_JOB_NUM_NODES'}) x {per_node} GPU(s) per node ({source})")
    return n, per_node, line


def srun_argv(alloc: Allocation, hosts: list[str], run_dir: str, run_id: str) -> list[str]:
    """The step: one task per node running the node script, on ``hosts`` of the allocation."""
    n = len(hosts)
    return ["srun", f"--jobid={alloc.job_id}", f"--job-name=llmtrain-{run_id}", "--kill-on-bad-exit=1",
            f"--nodes={n}", f"--ntasks={n}", "--ntasks-per-node=1", f"--nodelist={','.join(hosts)}",
            f"--output={run_dir.replace('%', '%%')}/logs/slurm/node-%n.out", "/bin/sh", f"{run_dir}/slurm/node.sh"]


def step_id(alloc: Allocation, name: str, environ: Mapping[str, str]) -> str | None:
    """``JOBID.STEPID`` of the step called ``name`` in ``squeue -s``, None when not listed."""
    from llmtrain.launch.backends.slurmctl import _client

    try:
        result = _client(["squeue", "-h", "-s", "-j", alloc.job_id, "-o", "%i %j"], environ, timeout=10)
    except LLMTrainError:
        return None
    for line in result.stdout.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1] == name:
            return parts[0]
    return None


def launch_in_allocation(alloc: Allocation, recipe, overrides: list[str] | None = None, runs_root: str | Path = "runs",
                         nodes: int | None = None, gpus_per_node: int | None = None, dry_run: bool = False,
                         console=None, environ: Mapping[str, str] | None = None) -> int:
    """Validate, run one srun step on the allocation, stream it, return its exit code."""
    from rich.console import Console
    from rich.text import Text

    from llmtrain.launch.backends import slurmctl
    from llmtrain.launch.envpolicy import Redactor, lock_recipe, policy_env, restore_env
    from llmtrain.launch.launchplan import describe, shell_words
    from llmtrain.launch.launchplan import engine_module, resolve_recipe
    from llmtrain.launch.rundir import create_run_dir, new_run_id
    from llmtrain.launch.backends.slurm import shrunk_plans, slurm_plan, validated_plan, write_node_files
    from llmtrain.launch.backends.slurm_script import NODE_SCRIPT, check_run_dir, job_environment, node_script
    from llmtrain.launch.backends.slurm_step import StepRun

    environ = os.environ if environ is None else environ
    recipe = restore_env(resolve_recipe(recipe, overrides), environ, base_dir=os.getcwd())
    n_nodes = alloc.node_count(nodes)
    per_node, source = alloc.ranks_per_node(gpus_per_node, recipe.cluster.gpus_per_node)
    _, plan_result = validated_plan(recipe, n_nodes, per_node)
    console = console or Console(highlight=False, soft_wrap=True)
    say = lambda text, style=None: console.print(Text(text), style=style)  # noqa: E731
    say(f"inside Slurm allocation {alloc.job_id}: {n_nodes} of its {alloc.nodes} node(s) x {per_node} rank(s) "
        f"({source}), one srun step, no new job")
    for warning in plan_result.validation.warnings:
        say(f"warning: {warning.line()}", "yellow")
    name = recipe.name or "run"
    module = engine_module()
    if dry_run:
        run_id = new_run_id()
        run_dir = str((Path(runs_root) / name / run_id).absolute())
        labels = [(f"node {i} of allocation {alloc.job_id}", per_node) for i in range(n_nodes)]
        plan = slurm_plan(recipe, labels, run_id, run_dir, module, environ)
        redact = Redactor(plan.policy)
        say(f"# {run_dir}/slurm/{NODE_SCRIPT}")
        for line in node_script(plan).splitlines():
            say(redact(line))
        say("# the step (MASTER_ADDR = the first of its nodes)")
        say(shell_words(srun_argv(alloc, [f"<node {i}>" for i in range(n_nodes)], run_dir, run_id)))
        for line in describe(plan):
            say(redact(line))
        say("dry run: nothing was created or started, no Slurm command ran")
        return 0
    check_run_dir(str((Path(runs_root) / name).absolute()))
    slurmctl.check_clients(("srun", "squeue", "scontrol", "scancel"))
    hosts = slurmctl.hostnames(alloc.nodelist, environ)
    if len(hosts) != alloc.nodes:
        raise LLMTrainError(f"scontrol show hostnames {alloc.nodelist} gave {len(hosts)} host(s), not the "
                            f"{alloc.nodes} of SLURM_JOB_NUM_NODES", "check SLURM_JOB_NODELIST and SLURM_CONF",
                            path="SLURM_JOB_NODELIST")
    hosts = hosts[:n_nodes]
    policy = policy_env(recipe.launch, environ, base_dir=os.getcwd())
    from llmtrain.cluster.hostfile import HostEntry, Hostfile

    placed = Hostfile(tuple(HostEntry(host=h, slots=per_node) for h in hosts), source=f"<slurm {alloc.job_id}>")
    run = create_run_dir(lock_recipe(recipe, policy, os.getcwd()), placed, runs_root)
    run_dir = str(run.path.absolute())
    plan = slurm_plan(recipe, [(h, per_node) for h in hosts], run.run_id, run_dir, module, environ)
    shrunk, invalid = shrunk_plans(recipe, plan, per_node, module, environ)
    write_node_files(run, plan, shrunk)
    env = {**job_environment(plan, environ), "MASTER_ADDR": hosts[0]}
    argv = srun_argv(alloc, hosts, run_dir, run.run_id)
    (run.path / "slurm" / "step.sh").write_text("#!/bin/sh\n# the srun step of this run inside allocation "
                                                f"{alloc.job_id} (MASTER_ADDR={hosts[0]})\n{shell_words(argv)}\n")
    if plan.retry.max_restarts > 0:  # the retry loop over steps (slurm_retry), run here: bash RUN/slurm/steps.sh
        from llmtrain.launch.backends.slurm_retry import steps_loop

        loop = steps_loop(run_dir, len(hosts), plan.retry.max_restarts, plan.retry.exclude_lost_hosts,
                          ["srun", f"--jobid={alloc.job_id}", f"--job-name=llmtrain-{run.run_id}", "--kill-on-bad-exit=1"],
                          "printf '%s\\n' " + " ".join(shlex.quote(h) for h in hosts), invalid,
                          recipe.launch.watchdog.heartbeat_timeout_s, alloc.job_id)
        (run.path / "slurm" / "steps.sh").write_text("#!/bin/bash\n# the srun steps of this run inside allocation "
                                                     f"{alloc.job_id}, restarted up to K times\n" + "\n".join(loop) + "\n")
        argv = ["/bin/bash", f"{run_dir}/slurm/steps.sh"]
    srun_log = open(run.logs / "slurm" / StepRun.job_log, "ab")
    try:
        proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=srun_log, stderr=subprocess.STDOUT,
                                start_new_session=True)  # Ctrl-C reaches llmtrain only; it stops the step itself
    except OSError as exc:
        raise LLMTrainError(f"cannot run srun: {exc.strerror or exc}", "check the Slurm client installation",
                            path="--launcher slurm") from None
    finally:
        srun_log.close()
    say(f"run dir {run_dir}: {plan.world_size} ranks on {', '.join(hosts)}; srun step llmtrain-{run.run_id} "
        f"of job {alloc.job_id}")
    return StepRun(run, plan, alloc, proc, hosts, console, environ, recipe.launch.watchdog.heartbeat_timeout_s).run()


__all__ = ["Allocation", "allocation_from_env", "plan_placement", "launch_in_allocation", "srun_argv", "step_id"]
