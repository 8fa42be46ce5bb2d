"""One exact shell command per node: the torchrun command line, its environment, its paths.

Every node runs, in its login shell (POSIX: sh, bash, dash, zsh)::

    cd WORKDIR && exec env NAME='value' ... PYTHON -m llmtrain.launch.remote run \\
        --run-id RUN_ID --node-rank I --first-rank F --nproc S --log-dir RUN_DIR/logs/torchrun/node-I \\
        --grace 3 -- \\
        PYTHON -m torch.distributed.run --nnodes N --nproc-per-node S \\
          --rdzv-backend static --rdzv-endpoint MASTER:PORT --rdzv-id RUN_ID --node-rank I \\
          --local-addr ADDR --max-restarts K --redirects 3 --log-dir RUN_DIR/logs/torchrun/node-I \\
          -m llmtrain.engine.main --recipe RUN_DIR/recipe.lock.yaml --run-dir RUN_DIR

``llmtrain.launch.remote`` is a small helper on the node (see its docstring): it records the
process group, streams every worker's lines tagged with their global rank, and tears the
node's processes down when told to or when the SSH session goes away.

**Node ranks follow the hostfile.** torchrun's c10d rendezvous ignores ``--node-rank``: it
sorts the joined agents by ``(--local-addr or FQDN, pid, ...)``
(``torch.distributed.elastic.rendezvous.dynamic_rendezvous``: ``enumerate(sorted(participants))``)
and global ranks are then handed out in that order (cumulative slots). That is deterministic
only for distinct addresses, and follows the *sorted* addresses, not the hostfile. So the
default is the **static** rendezvous: host *i* of the hostfile gets ``--node-rank i`` and
ranks ``first_rank(i) .. first_rank(i) + slots - 1`` -- exactly :class:`~llmtrain.plan.placement.Placement`.
With ``launch.rendezvous: c10d`` (elastic membership, ``--rdzv-conf is_host=1`` on the first
host) the launcher refuses a hostfile whose order differs from the sorted addresses. Either
way the node helper checks each worker's ``RANK`` against the plan at start and stops the run
on a mismatch.

Paths: ``python`` and ``workdir`` come from the hostfile entry, then the hostfile's top level,
then ``launch.python`` / ``launch.workdir``, then the launching machine's own (its
``sys.executable`` and current directory) -- all absolute. The run directory on a node is the
same absolute path as on the launching machine when ``--runs`` is absolute or the workdir is
the launching directory (``WORKDIR/<runs>/<name>/<run id>`` in general).
"""

from __future__ import annotations

import os
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Mapping

from llmtrain.errors import LLMTrainError, Problem
from llmtrain.launch.envpolicy import EnvVar, launcher_env, merge, new_launch_id, policy_env, shell_assignments
from llmtrain.launch.hostfile import HostEntry, Hostfile
from llmtrain.launch.sshconfig import SSHTarget
from llmtrain.recipe.schema import LaunchConfig, Recipe

HELPER_MODULE = "llmtrain.launch.remote"


@dataclass(frozen=True)
class NodeSpec:
    """Everything about one node of the run."""

    node_rank: int
    entry: HostEntry
    target: SSHTarget
    addr: str  # what the other nodes connect to
    first_rank: int
    python: str
    workdir: str
    run_dir: str  # absolute, on the node
    env: tuple[EnvVar, ...]
    visible_devices: tuple[int, ...] | None = None

    @property
    def host(self) -> str:
        return self.entry.host

    @property
    def slots(self) -> int:
        return self.entry.slots

    @property
    def ranks(self) -> range:
        return range(self.first_rank, self.first_rank + self.slots)

    @property
    def log_dir(self) -> str:
        return f"{self.run_dir}/logs/torchrun/node-{self.node_rank}"

    @property
    def recipe_lock(self) -> str:
        return f"{self.run_dir}/recipe.lock.yaml"

    @property
    def rank_span(self) -> str:
        last = self.first_rank + self.slots - 1
        return f"rank {last}" if last == self.first_rank else f"ranks {self.first_rank}-{last}"


@dataclass(frozen=True)
class LaunchSpec:
    run_id: str
    run_name: str
    nodes: tuple[NodeSpec, ...]
    master: str
    port: int
    module: str
    launch: LaunchConfig
    policy: tuple[EnvVar, ...] = field(default=())
    launch_id: str = ""  # this launch's own id (envpolicy.new_launch_id): the node helpers sweep by it

    @property
    def world_size(self) -> int:
        return sum(n.slots for n in self.nodes)

    @property
    def endpoint(self) -> str:
        return f"[{self.master}]:{self.port}" if ":" in self.master else f"{self.master}:{self.port}"


def remote_run_dir(workdir: str, runs_root: str | Path, name: str, run_id: str) -> str:
    root = PurePosixPath(str(runs_root))
    base = root if root.is_absolute() else PurePosixPath(workdir) / root
    return str(base / name / run_id)


def build_spec(recipe: Recipe, hostfile: Hostfile, targets: list[SSHTarget], run_id: str, runs_root: str | Path,
               module: str, visible_devices: Mapping[str, tuple[int, ...]] | None = None,
               environ: Mapping[str, str] | None = None, cwd: str | None = None,
               python: str | None = None) -> LaunchSpec:
    """Resolve paths, addresses and environment for every node (pure: touches no host)."""
    launch, name = recipe.launch, recipe.name or "run"
    cwd = cwd or os.getcwd()
    policy = policy_env(launch, environ, base_dir=cwd)
    problems, nodes, first = [], [], 0
    launch_id = new_launch_id()
    for index, (entry, target) in enumerate(zip(hostfile.hosts, targets)):
        node_python = entry.python or hostfile.python or launch.python or python or sys.executable
        node_workdir = entry.workdir or hostfile.workdir or launch.workdir or cwd
        for what, value in (("python", node_python), ("workdir", node_workdir)):
            if not PurePosixPath(value).is_absolute():
                problems.append(Problem(f"{hostfile.source}: {entry.host}", f"{what} {value!r} is not an absolute path",
                                        f"give an absolute {what} (the remote shell has no venv on PATH)"))
        run_dir = remote_run_dir(node_workdir, runs_root, name, run_id)
        visible = (visible_devices or {}).get(entry.host)
        env = merge(policy, launcher_env(run_id, run_dir, index, visible, launch_id=launch_id))
        nodes.append(NodeSpec(index, entry, target, entry.addr or target.hostname, first, node_python, node_workdir,
                              run_dir, tuple(env), visible))
        first += entry.slots
    if problems:
        raise LLMTrainError(problems)
    spec = LaunchSpec(run_id, name, tuple(nodes), nodes[0].addr, launch.rdzv_port, module, launch, tuple(policy),
                      launch_id)
    if launch.rendezvous == "c10d":
        check_c10d_order(spec)
    return spec


def check_c10d_order(spec: LaunchSpec) -> None:
    """c10d numbers nodes by sorted address: refuse when that is not the hostfile's order."""
    addrs = [n.addr for n in spec.nodes]
    if len(set(addrs)) != len(addrs):
        dup = next(a for a in addrs if addrs.count(a) > 1)
        raise LLMTrainError(f"two hosts share the address {dup}: c10d would order them by process id (random)",
                            "use launch.rendezvous: static (the default)", path="launch.rendezvous")
    if addrs != sorted(addrs):
        order = ", ".join(n.host for n in sorted(spec.nodes, key=lambda n: n.addr))
        raise LLMTrainError("with c10d, torch numbers nodes by sorted --local-addr, not by hostfile order, so ranks "
                            "would not land where `plan` shows them",
                            f"use launch.rendezvous: static (the default), or list the hosts as {order}",
                            path="launch.rendezvous")


def torchrun_argv(spec: LaunchSpec, node: NodeSpec) -> list[str]:
    launch = spec.launch
    argv = [node.python, "-m", "torch.distributed.run", "--nnodes", str(len(spec.nodes)),
            "--nproc-per-node", str(node.slots), "--rdzv-backend", launch.rendezvous,
            "--rdzv-endpoint", spec.endpoint, "--rdzv-id", spec.run_id]
    if launch.rendezvous == "static":
        argv += ["--node-rank", str(node.node_rank)]
    elif node.node_rank == 0:
        argv += ["--rdzv-conf", "is_host=1"]
    argv += ["--local-addr", node.addr, "--max-restarts", str(launch.max_restarts), "--redirects", "3",
             "--log-dir", node.log_dir, "-m", spec.module, "--recipe", node.recipe_lock, "--run-dir", node.run_dir]
    return argv


def _launch_id_args(spec: LaunchSpec) -> list[str]:
    return ["--launch-id", spec.launch_id] if spec.launch_id else []


def helper_argv(spec: LaunchSpec, node: NodeSpec) -> list[str]:
    return [node.python, "-m", HELPER_MODULE, "run", "--run-id", spec.run_id, "--node-rank", str(node.node_rank),
            *_launch_id_args(spec), "--first-rank", str(node.first_rank), "--nproc", str(node.slots), "--log-dir", node.log_dir,
            "--grace", f"{spec.launch.grace_s:g}", "--"]


def node_env(spec: LaunchSpec, node: NodeSpec) -> list[EnvVar]:
    env = list(node.env)
    if spec.launch.rendezvous == "c10d" and spec.launch.max_restarts > 0 and \
            not any(v.name == "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" for v in env):
        # restarted gloo workers otherwise read stale peer addresses from the reused store
        env.append(EnvVar("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1", "launcher"))
    return env


def node_command(spec: LaunchSpec, node: NodeSpec, masked: bool | str = False) -> str:
    """The exact shell command for ``node`` (secret values as ``****`` when ``masked``; with
    ``"disk"`` every launch.env / env file value too: :func:`~llmtrain.launch.envpolicy.shell_assignments`)."""
    words = ["env", *shell_assignments(node_env(spec, node), masked=masked)]
    words += [shlex.quote(w) for w in helper_argv(spec, node) + torchrun_argv(spec, node)]
    return f"cd {shlex.quote(node.workdir)} && exec " + " ".join(words)


def kill_command(spec: LaunchSpec, node: NodeSpec, pgid: int | None = None, pgid_start: int | None = None,
                 grace_s: float | None = None) -> str:
    """Stop everything of this run on ``node``: its recorded process group, descendants, marked processes."""
    grace = spec.launch.grace_s if grace_s is None else grace_s
    argv = [node.python, "-m", HELPER_MODULE, "kill", "--run-id", spec.run_id, "--node-rank", str(node.node_rank),
            *_launch_id_args(spec), "--grace", f"{grace:g}"]
    if pgid:
        argv += ["--pgid", str(pgid), "--pgid-start", str(pgid_start or 0)]
    return shlex.join(argv)


def describe(spec: LaunchSpec, masked: bool | str = True) -> list[str]:
    """Human-readable lines for ``--dry-run``: per node, where it goes and its exact command."""
    lines = [f"run {spec.run_name}/{spec.run_id}: {len(spec.nodes)} node(s), world size {spec.world_size}, "
             f"rendezvous {spec.launch.rendezvous} at {spec.endpoint}"]
    for node in spec.nodes:
        lines.append(f"# node {node.node_rank}: {node.target.label}{node.target.route}, {node.rank_span}")
        lines.append(node_command(spec, node, masked=masked))
    return lines
