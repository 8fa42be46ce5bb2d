"""The launch plan: what every node of a run executes, as pure data, built once.

A :class:`LaunchPlan` holds, per node, the exact ``torchrun`` argv, its environment (secret
values in memory only: :class:`~llmtrain.launch.envpolicy.EnvVar`), working directory and log
paths, plus the rendezvous and the retry policy. It is built from the recipe, the nodes'
places, the run directory and the env policy by :func:`build_plan`, and touches nothing.
Backends only start, watch and stop what it describes; they never re-derive a command, a
variable or a path. ``--dry-run`` prints it (:func:`describe`).

Today the Slurm backend (:mod:`llmtrain.launch.slurm`) runs on it; the local and SSH launchers
still build their commands in :mod:`llmtrain.launch.local` / :mod:`llmtrain.launch.commands`
and move onto this object in the next step of issue 15 (same argv: this module writes the
torchrun line the SSH launcher writes, without its node helper).

**Places not known before the start.** Under Slurm the hosts are chosen by the scheduler, so
the rendezvous host is a *shell reference*, ``$MASTER_ADDR`` (the job sets it to the first host
of ``scontrol show hostnames $SLURM_JOB_NODELIST``), and a node's ``host`` is a label
(``node 1 of the allocation``). :func:`shell_words` quotes every word for a POSIX shell but
leaves exactly those references (names in :data:`SHELL_REFS`) to be expanded there.
"""

from __future__ import annotations

import os
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Iterable, Mapping

from llmtrain.errors import LLMTrainError
from llmtrain.launch.envpolicy import EnvVar, launcher_env, merge, new_launch_id, policy_env, shell_assignments
from llmtrain.recipe.schema import Recipe

SHELL_REFS = ("MASTER_ADDR",)  # the only variables a plan's words may refer to
REF_RE = re.compile(r"\$(" + "|".join(SHELL_REFS) + r")\b")


@dataclass(frozen=True)
class Rendezvous:
    backend: str  # "static": node i of the plan is --node-rank i and holds ranks first..first+nproc-1
    host: str  # the first node's address, or "$MASTER_ADDR" when it is only known at start
    port: int
    run_id: str  # --rdzv-id

    @property
    def endpoint(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


@dataclass(frozen=True)
class RetryPolicy:
    max_restarts: int  # torchrun --max-restarts: the node's worker group restarts, ranks resume from the checkpoint
    exclude_lost_hosts: bool
    grace_s: float  # SIGTERM -> SIGKILL when stopping


@dataclass(frozen=True)
class NodePlan:
    node_rank: int
    host: str  # a host name, or a label such as "node 1 of the allocation"
    first_rank: int
    nproc: int
    workdir: str
    argv: tuple[str, ...]  # the exact torchrun command
    env: tuple[EnvVar, ...]  # policy < launcher variables, values in memory
    log_dir: str  # torchrun --log-dir: the workers' own files
    output_log: str  # where torchrun's own stdout/stderr go on the node

    @property
    def ranks(self) -> range:
        return range(self.first_rank, self.first_rank + self.nproc)

    @property
    def rank_span(self) -> str:
        last = self.first_rank + self.nproc - 1
        return f"rank {last}" if last == self.first_rank else f"ranks {self.first_rank}-{last}"

    def launcher_vars(self) -> list[EnvVar]:
        """The launcher's own variables (run ids, paths): the only ones a file on disk may hold."""
        return [v for v in self.env if v.source == "launcher"]


@dataclass(frozen=True)
class LaunchPlan:
    backend: str  # "local", "ssh", "slurm"
    run_name: str
    run_id: str
    run_dir: str  # absolute, the same path on every node (shared storage under Slurm)
    nodes: tuple[NodePlan, ...]
    rendezvous: Rendezvous
    retry: RetryPolicy
    policy: tuple[EnvVar, ...]  # the env policy's variables (the same on every node)
    launch_id: str

    @property
    def world_size(self) -> int:
        return sum(n.nproc for n in self.nodes)

    @property
    def recipe_lock(self) -> str:
        return f"{self.run_dir}/recipe.lock.yaml"


def torchrun_argv(python: str, nnodes: int, node_rank: int, nproc: int, rdzv: Rendezvous, max_restarts: int,
                  log_dir: str, module: str, run_dir: str) -> list[str]:
    """The torchrun line of one node (static rendezvous; the engine reads the locked recipe)."""
    return [python, "-m", "torch.distributed.run", "--nnodes", str(nnodes), "--nproc-per-node", str(nproc),
            "--rdzv-backend", rdzv.backend, "--rdzv-endpoint", rdzv.endpoint, "--rdzv-id", rdzv.run_id,
            "--node-rank", str(node_rank), "--max-restarts", str(max_restarts), "--redirects", "3",
            "--log-dir", log_dir, "-m", module, "--recipe", f"{run_dir}/recipe.lock.yaml", "--run-dir", run_dir]


def build_plan(backend: str, recipe: Recipe, hosts: list[tuple[str, int]], run_id: str, run_dir: str, module: str,
               master: str, environ: Mapping[str, str] | None = None, cwd: str | None = None) -> LaunchPlan:
    """The plan for ``hosts`` (``(host or label, nproc)`` in node-rank order), with ``master`` as
    the rendezvous host. Pure: reads only the recipe, ``environ`` and the env file."""
    launch = recipe.launch
    cwd = cwd or os.getcwd()
    python, workdir = launch.python or sys.executable, launch.workdir or cwd
    for what, value in (("launch.python", python), ("launch.workdir", workdir), ("run directory", run_dir)):
        if not PurePosixPath(value).is_absolute():
            raise LLMTrainError(f"{what} {value!r} is not an absolute path", "give an absolute path", path=what)
    if launch.rendezvous != "static":
        raise LLMTrainError(f"launch.rendezvous {launch.rendezvous!r} is not supported by the {backend} launcher",
                            "use launch.rendezvous: static (the default)", path="launch.rendezvous")
    policy = policy_env(launch, environ, base_dir=cwd)
    launch_id = new_launch_id()
    rdzv = Rendezvous("static", master, launch.rdzv_port, run_id)
    nodes, first = [], 0
    for index, (host, nproc) in enumerate(hosts):
        log_dir = f"{run_dir}/logs/torchrun/node-{index}"
        argv = torchrun_argv(python, len(hosts), index, nproc, rdzv, launch.max_restarts, log_dir, module, run_dir)
        env = merge(policy, launcher_env(run_id, run_dir, index, launch_id=launch_id))
        nodes.append(NodePlan(index, host, first, nproc, workdir, tuple(argv), tuple(env), log_dir,
                              f"{run_dir}/logs/{backend}/node-{index}.out"))
        first += nproc
    return LaunchPlan(backend, recipe.name or "run", run_id, run_dir, tuple(nodes), rdzv,
                      RetryPolicy(launch.max_restarts, launch.exclude_lost_hosts, launch.grace_s), tuple(policy), launch_id)


def shell_words(words: Iterable[str]) -> str:
    """``words`` quoted for a POSIX shell, except the references of :data:`SHELL_REFS`, which
    stay expandable (``$MASTER_ADDR:29500`` -> ``"$MASTER_ADDR":29500``)."""
    out = []
    for word in words:
        parts, pos = [], 0
        for match in REF_RE.finditer(word):
            if match.start() > pos:
                parts.append(shlex.quote(word[pos:match.start()]))
            parts.append(f'"${match.group(1)}"')
            pos = match.end()
        if pos < len(word) or not parts:
            parts.append(shlex.quote(word[pos:]))
        out.append("".join(parts))
    return " ".join(out)


def node_command(node: NodePlan, env: Iterable[EnvVar], masked: bool | str = False) -> str:
    """``cd WORKDIR && exec env NAME=value ... torchrun ...`` for ``node`` with the variables ``env``
    (masked as :func:`~llmtrain.launch.envpolicy.shell_assignments` masks)."""
    assignments = shell_assignments(env, masked=masked)
    return f"cd {shlex.quote(node.workdir)} && exec env " + " ".join([*assignments, shell_words(node.argv)])


def describe(plan: LaunchPlan) -> list[str]:
    """``--dry-run`` lines: the run, then per node where it goes and its exact command, secrets masked."""
    lines = [f"run {plan.run_name}/{plan.run_id}: {len(plan.nodes)} node(s), world size {plan.world_size}, "
             f"rendezvous {plan.rendezvous.backend} at {plan.rendezvous.endpoint}, "
             f"max restarts {plan.retry.max_restarts}"]
    for node in plan.nodes:
        lines.append(f"# node {node.node_rank}: {node.host}, {node.rank_span}; torchrun output in {node.output_log}")
        lines.append(node_command(node, node.env, masked=True))
    return lines
