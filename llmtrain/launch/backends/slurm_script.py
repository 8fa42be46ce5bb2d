"""The two files a Slurm launch writes into the run directory, rendered from the launch plan.

``RUN_DIR/slurm/job.sbatch`` is what ``sbatch --parsable`` submits, as is (a user can read it,
and resubmit it by hand with the same environment)::

    #!/bin/bash
    #SBATCH --job-name=llmtrain-debug
    #SBATCH --nodes=2
    #SBATCH --ntasks-per-node=1
    #SBATCH --partition=debug                  # --partition, --account, --time, --gpus-per-node when given
    #SBATCH --output=RUN_DIR/logs/slurm/job.out
    #SBATCH --open-mode=append
    #SBATCH --export=ALL
    #SBATCH ...                                # each --slurm-arg, verbatim
    # environment (from llmtrain's policy; values are not written here): GLOO_SOCKET_IFNAME HF_TOKEN
    MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"
    export MASTER_ADDR
    exec srun --kill-on-bad-exit=1 --nodes=2 --ntasks=2 --ntasks-per-node=1 \\
        --output=RUN_DIR/logs/slurm/node-%n.out /bin/sh RUN_DIR/slurm/node.sh

``RUN_DIR/slurm/node.sh`` is the one srun task per node: a ``case`` on ``$SLURM_NODEID`` (0 is
the first host of the allocation, the order of ``scontrol show hostnames``) with each node's
exact command from the plan, ``cd WORKDIR && exec env LLMTRAIN_...=... PYTHON -m
torch.distributed.run ... --rdzv-endpoint "$MASTER_ADDR":PORT --node-rank I ...``.

Decisions:

* **Secret values never reach these files.** Only the launcher's own variables (run ids,
  paths) are written; the env policy's variables reach the job through sbatch's environment
  (``--export=ALL``), which the launcher builds in memory (:func:`job_environment`).
* **The env file's values never go through Slurm either.** slurmctld writes every batch job's
  environment to the controller's disk (``StateSaveLocation/hash.N/job.ID/environment``, kept
  until the job record is purged, ``MinJobAge`` after the job ends; measured on the test
  cluster, Slurm 22.05). So the variables whose value came from ``launch.env_file``
  (:func:`~llmtrain.launch.envpolicy.read_from_file`) are left out of the job's environment, and
  each node's command runs torchrun through :mod:`llmtrain.launch.envexec` (``PYTHON -m
  llmtrain.launch.envexec --env-file PATH --only A,B -- PYTHON -m torch.distributed.run ...``),
  which reads the same file at the same path on the node when the task starts. The file must
  therefore be on shared storage, like the run directory; a node that cannot read it fails its
  task at once with one line naming ``launch.env_file``. Its path, never its content, is in
  ``node.sh``. A step's environment (``srun``, each step of the job and inside an allocation)
  reaches slurmd in memory only: measured, no file under StateSaveLocation or SlurmdSpoolDir
  holds it; the env file goes through envexec there too, for one rule.
* **Secret-named variables of the other sources** (passed through from this shell, e.g.
  ``HF_TOKEN``; ``launch.env``) still travel in sbatch's environment -- that is how a Slurm job
  gets variables, and anything else would write them somewhere (a file the nodes read) or need
  the submitter alive for the job's whole life (a job outlives its submitter, requeues
  included). :func:`secrets_warning` says so at submission and in ``--dry-run``: one line naming
  them (names only) and the fix, ``launch.env_file``.
* **The job's environment is exactly the policy**, as over SSH: sbatch runs with a small base
  (``PATH HOME USER LOGNAME SHELL LANG LC_* TZ TMPDIR``, the login environment an SSH node would
  have), ``SLURM_CONF``, plus the policy. Nothing else of this machine's environment travels:
  not ``SBATCH_*`` either (sbatch ranks its input variables above the script's ``#SBATCH``
  lines, so an ``SBATCH_PARTITION`` in the shell would make the written script lie), nor the
  ``SLURM_*`` of an enclosing allocation.
* ``--kill-on-bad-exit=1``: the first rank that fails ends the step (its siblings get SIGTERM
  within ~0.25 s), so one dead node never leaves the others waiting on a collective.
* ``exec srun``: the job's exit code is srun's, which Slurm records as the job's ``ExitCode``.
  With ``--max-restarts K`` or ``--requeue`` the script ends instead in the retry loop of
  :mod:`llmtrain.launch.backends.slurm_retry` (one srun step per attempt, exit code the last step's),
  ``#SBATCH --requeue`` / ``--no-requeue`` says which, and ``node.sh`` starts with a
  heartbeat loop (``logs/slurm/alive-<node rank>``, every second) that finds a lost node.
* One srun task per node (``--ntasks-per-node=1``) runs torchrun, which starts the node's ranks.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
from dataclasses import dataclass, field
from typing import Mapping

from llmtrain.errors import LLMTrainError
from llmtrain.launch.envpolicy import EnvVar, env_file_path, read_from_file
from llmtrain.launch.launchplan import LaunchPlan, NodePlan, node_command

NAME_RE = re.compile(r"^[A-Za-z0-9_.+-]{1,128}$")
TIME_RE = re.compile(r"^(\d+-)?\d{1,3}(:\d{2}){0,2}$|^\d+-\d{1,2}$|^(UNLIMITED|INFINITE)$")  # MM, MM:SS, HH:MM:SS, D-HH[:MM[:SS]]
# options the script sets itself: a --slurm-arg repeating one would silently change the job
OWN_OPTIONS = {"--nodes": "--nodes", "--ntasks-per-node": None, "--ntasks": None, "--output": None, "--error": None,
               "--export": None, "--open-mode": None, "--job-name": None, "--partition": "--partition",
               "--account": "--account", "--time": "--time", "--gpus-per-node": "--gpus-per-node",
               "--requeue": "--requeue", "--no-requeue": "--requeue", "--no-kill": "launch.exclude_lost_hosts"}
BASE_ENV = ("PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "TZ", "TMPDIR")
JOB_SCRIPT, NODE_SCRIPT = "job.sbatch", "node.sh"
HEARTBEAT_S = 1  # each node touches logs/slurm/alive-<node rank> this often


@dataclass(frozen=True)
class SlurmOptions:
    """What the user asked Slurm for (``llmtrain launch --launcher slurm`` options)."""

    nodes: int
    gpus_per_node: int  # ranks per node (torchrun --nproc-per-node)
    partition: str | None = None
    account: str | None = None
    time: str | None = None
    request_gpus: bool = True  # emit --gpus-per-node (not for a CPU recipe: CPU nodes have no GPU GRES)
    extra: tuple[str, ...] = field(default=())  # --slurm-arg, each one #SBATCH line
    requeue: bool = False  # --requeue: Slurm may requeue the job; it then resumes from the latest checkpoint

    def check(self) -> None:
        """Every option checked at once, before anything is written (each becomes an #SBATCH line)."""
        from llmtrain.errors import Problem

        problems = []
        for flag, value in (("--partition", self.partition), ("--account", self.account)):
            if value is not None and not NAME_RE.match(value):
                problems.append(Problem(flag, f"{value[:60]!r} is not a Slurm name",
                                        "use letters, digits and . _ + - (sinfo -s lists the partitions)"))
        if self.time is not None and not TIME_RE.match(self.time):
            problems.append(Problem("--time", f"{self.time[:60]!r} is not a Slurm time limit",
                                    "write HH:MM:SS, MM or D-HH:MM:SS (sbatch --time)"))
        for arg in self.extra:
            if not arg.startswith("--") or any(ch in arg for ch in "\n\r\0") or len(arg) > 1000:
                problems.append(Problem("--slurm-arg", f"{arg[:60]!r} is not one sbatch option",
                                        "pass one long option per --slurm-arg, e.g. --slurm-arg=--qos=high"))
            elif arg.split("=", 1)[0] in OWN_OPTIONS:
                flag = arg.split("=", 1)[0]
                own = OWN_OPTIONS[flag]
                problems.append(Problem("--slurm-arg", f"{flag} is set by llmtrain's job script",
                                        f"use llmtrain's {own} option" if own else "drop it (docs/launch.md, Slurm)"))
        if problems:
            raise LLMTrainError(problems)


def check_run_dir(run_dir: str) -> None:
    """The run directory goes into #SBATCH lines, which sbatch splits at whitespace."""
    if re.search(r"\s", run_dir):
        raise LLMTrainError(f"the run directory {run_dir!r} contains whitespace, which #SBATCH lines cannot hold",
                            "pass a --runs directory without spaces", path="--runs")


def _pattern(path: str) -> str:
    return path.replace("%", "%%")  # sbatch/srun file names: %j, %n, ... are patterns, %% is a literal %


def job_script(plan: LaunchPlan, opts: SlurmOptions, invalid: Mapping[int, str] | None = None,
               heartbeat_timeout_s: float = 0) -> str:
    """The batch script. With ``plan.retry.max_restarts`` > 0 its last lines are the retry loop of
    :mod:`llmtrain.launch.backends.slurm_retry` (``invalid``: node count -> why the layout does not fit it)."""
    run = plan.run_dir
    check_run_dir(run)
    lines = ["#!/bin/bash",
             f"# llmtrain: the Slurm job of run {plan.run_name}/{plan.run_id} (written by `llmtrain launch --launcher "
             "slurm`, submitted as is with sbatch --parsable)",
             f"#SBATCH --job-name=llmtrain-{plan.run_name}", f"#SBATCH --nodes={len(plan.nodes)}",
             "#SBATCH --ntasks-per-node=1"]
    for flag, value in (("partition", opts.partition), ("account", opts.account), ("time", opts.time)):
        if value is not None:
            lines.append(f"#SBATCH --{flag}={value}")
    if opts.request_gpus:
        lines.append(f"#SBATCH --gpus-per-node={opts.gpus_per_node}")
    lines += [f"#SBATCH --output={_pattern(run)}/logs/slurm/job.out", "#SBATCH --open-mode=append", "#SBATCH --export=ALL"]
    lines.append("#SBATCH --requeue" if opts.requeue else "#SBATCH --no-requeue")
    retry = plan.retry
    if retry.max_restarts > 0 and retry.exclude_lost_hosts:
        lines.append("#SBATCH --no-kill")  # a node Slurm marks down does not end the job: the loop goes on without it
    lines += [f"#SBATCH {arg}" for arg in opts.extra]
    path, from_file = file_env(plan)
    names = " ".join(v.name for v in plan.policy if v.name not in from_file) or "(none)"
    lines.append(f"# environment (from llmtrain's policy; values are not written here): {names}")
    if from_file:
        lines.append(f"# read by each node from launch.env_file {path} (never sent through Slurm): {' '.join(from_file)}")
    if retry.max_restarts > 0 or opts.requeue:
        from llmtrain.launch.backends.slurm_retry import steps_loop

        lines += steps_loop(run, len(plan.nodes), retry.max_restarts, retry.exclude_lost_hosts,
                            ["srun", "--kill-on-bad-exit=1", f"--job-name=llmtrain-{plan.run_id}"],
                            'scontrol show hostnames "$SLURM_JOB_NODELIST"', dict(invalid or {}), heartbeat_timeout_s)
        return "\n".join(lines) + "\n"
    lines += ['MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"',
              "export MASTER_ADDR",
              f"exec srun --kill-on-bad-exit=1 --nodes={len(plan.nodes)} --ntasks={len(plan.nodes)} --ntasks-per-node=1 "
              f"--output={shlex.quote(_pattern(run) + '/logs/slurm/node-%n.out')} /bin/sh {shlex.quote(f'{run}/slurm/{NODE_SCRIPT}')}"]
    return "\n".join(lines) + "\n"


def node_script(plan: LaunchPlan) -> str:
    lines = ["#!/bin/sh",
             f"# llmtrain: what each node of the Slurm job of run {plan.run_name}/{plan.run_id} runs (one srun task per "
             "node; node rank = $SLURM_NODEID, the order of `scontrol show hostnames`)",
             "# heartbeat: this node is alive while the file's mtime is fresh (a node lost mid-run is found by its age,",
             "# not at a collective's or SlurmdTimeout's timeout; the step's cgroup ends the loop with the step)",
             f"(while :; do : > {shlex.quote(plan.run_dir)}/logs/slurm/alive-\"${{SLURM_NODEID:-x}}\"; sleep {HEARTBEAT_S}; "
             "done) </dev/null >/dev/null 2>&1 &",
             'case "${SLURM_NODEID:-}" in']
    path, from_file = file_env(plan)
    for node in plan.nodes:
        lines.append(f"{node.node_rank}) {node_command(through_env_file(node, path, from_file), node.launcher_vars())} ;;")
    lines += [f'*) echo "llmtrain: unexpected SLURM_NODEID=${{SLURM_NODEID:-unset}} (this job has {len(plan.nodes)} '
              'nodes)" >&2; exit 2 ;;', "esac"]
    return "\n".join(lines) + "\n"


def job_environment(plan: LaunchPlan, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """sbatch's environment, hence the job's (``--export=ALL``): the base login variables and
    Slurm's own from ``environ``, then the policy's variables with their values (in memory),
    except those each node reads from the env file itself (:func:`file_env`)."""
    environ = os.environ if environ is None else environ
    env = {k: v for k, v in environ.items()
           if k in BASE_ENV or k.startswith("LC_") or k == "SLURM_CONF"}
    _, from_file = file_env(plan)
    env.update({v.name: v.value for v in plan.policy if v.name not in from_file})
    return env


def file_env(plan: LaunchPlan, base_dir: str | None = None) -> tuple[str, list[str]]:
    """``(absolute env file path, names)``: the variables whose value came from ``launch.env_file``,
    which the nodes read themselves (:mod:`llmtrain.launch.envexec`); ``("", [])`` when none.
    A relative path is taken under ``base_dir`` (default: the current directory, as the policy
    read it, :func:`~llmtrain.launch.launchplan.build_plan`)."""
    names = [v.name for v in read_from_file(plan.policy, plan.launch)]
    path = env_file_path(plan.launch, base_dir or os.getcwd())
    if not names or path is None:
        return "", []
    return str(path.absolute()), names


def through_env_file(node: NodePlan, path: str, names: list[str]) -> NodePlan:
    """``node`` whose command first runs :mod:`llmtrain.launch.envexec` with the node's python,
    which sets ``names`` from the env file and execs the rest (no names: ``node`` as is)."""
    if not names:
        return node
    words = (node.python, "-m", "llmtrain.launch.envexec", "--env-file", path, "--only", ",".join(names), "--")
    return dataclasses.replace(node, wrapper=(*words, *node.wrapper))


def travelling_secrets(plan: LaunchPlan) -> list[EnvVar]:
    """The policy's variables that go through sbatch's environment (so onto slurmctld's disk) and
    are secret: a secret name, an env file's name whose value was restored from this shell, or a
    value with a token shape / URL user-info (:mod:`llmtrain.launch.secrets`)."""
    _, from_file = file_env(plan)
    return [v for v in plan.policy if v.name not in from_file and (v.secret or v.shown() != v.value)]


SOURCE_WORDS = {"passthrough": "passed through from this shell", "env": "launch.env",
                "env_file": "launch.env_file's name, value from this shell"}


def secrets_warning(plan: LaunchPlan) -> str | None:
    """One line naming (never showing) the secrets that reach slurmctld's disk, and the fix; None when none."""
    found = travelling_secrets(plan)
    if not found:
        return None
    names = ", ".join(f"{v.name} ({SOURCE_WORDS.get(v.source, v.source)})" for v in found)
    return (f"secrets in the Slurm job's environment, which slurmctld keeps on the controller's disk while it knows "
            f"the job: {names}; put them into launch.env_file (each node reads it at task start, nothing of it goes "
            "through Slurm), or stop passing them (docs/launch.md, Slurm)")


def warn_secrets(plan: LaunchPlan, say) -> None:
    """``say`` the :func:`secrets_warning` line (yellow), if any: at submission and in ``--dry-run``."""
    line = secrets_warning(plan)
    if line:
        say(f"warning: {line}", "yellow")
