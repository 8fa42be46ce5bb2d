"""The SSH launch plan: the hostfile's nodes as a :class:`~llmtrain.launch.launchplan.LaunchPlan`.

One exact shell command per node: the torchrun command line, its environment, its paths.

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
ranks ``first_rank(i) .. first_rank(i) + slots - 1`` -- exactly :class:`~llmtrain.cluster.placement.Placement`.
With ``launch.rendezvous: c10d`` (elastic membership, ``--rdzv-conf is_host=1`` on the first
host) the launcher refuses a hostfile whose order differs from the sorted addresses. Either
way the node helper checks each worker's ``RANK`` against the plan at start and stops the run
on a mismatch.

Paths: ``python`` and ``workdir`` come from the hostfile entry, then the hostfile's top level,
then ``launch.python`` / ``launch.workdir``, then the launching machine's own (its
``sys.executable`` and current directory) -- all absolute. The run directory on a node is the
same absolute path as on the launching machine when ``--runs`` is absolute or the workdir is
the launching directory (``WORKDIR/<runs>/<name>/<run id>`` in general).

This module only *builds* the plan (pure: it touches no host); the SSH backend
(:mod:`llmtrain.launch.backends.sshrun`) starts ``node_command`` and, to stop a node, runs
:func:`kill_command` -- both read the plan, neither derives a path or a variable. ``LaunchSpec``
and ``NodeSpec`` are the plan's own classes under the names the SSH code has always used.
"""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path, PurePosixPath
from typing import Mapping

from llmtrain.cluster.hostfile import Hostfile
from llmtrain.errors import LLMTrainError, Problem
from llmtrain.launch import launchplan
from llmtrain.launch.envpolicy import EnvVar, policy_env
from llmtrain.launch.launchplan import LaunchPlan, NodePlan, NodeSite, Rendezvous, assemble
from llmtrain.launch.sshconfig import SSHTarget
from llmtrain.recipe.schema import Recipe

HELPER_MODULE = "llmtrain.launch.remote"
LaunchSpec = LaunchPlan  # the names the SSH code (and its tests) use
NodeSpec = NodePlan


def remote_run_dir(workdir: str, runs_root: str | Path, name: str, run_id: str) -> str:
    root = PurePosixPath(str(runs_root))
    base = root if root.is_absolute() else PurePosixPath(workdir) / root
    return str(base / name / run_id)


def build_spec(recipe: Recipe, hostfile: Hostfile, targets: list[SSHTarget], run_id: str, runs_root: str | Path,
               module: str, visible_devices: Mapping[str, tuple[int, ...]] | None = None,
               environ: Mapping[str, str] | None = None, cwd: str | None = None,
               python: str | None = None, launch_id: str | None = None) -> LaunchPlan:
    """Resolve paths, addresses and environment for every node (pure: touches no host)."""
    launch, name = recipe.launch, recipe.name or "run"
    cwd = cwd or os.getcwd()
    policy = policy_env(launch, environ, base_dir=cwd)
    problems, sites = [], []
    for entry, target in zip(hostfile.hosts, targets):
        node_python = entry.python or hostfile.python or launch.python or python or sys.executable
        node_workdir = entry.workdir or hostfile.workdir or launch.workdir or cwd
        for what, value in (("python", node_python), ("workdir", node_workdir)):
            if not PurePosixPath(value).is_absolute():
                problems.append(Problem(f"{hostfile.source}: {entry.host}", f"{what} {value!r} is not an absolute path",
                                        f"give an absolute {what} (the remote shell has no venv on PATH)"))
        sites.append(NodeSite(entry.host, entry.slots, node_python, node_workdir,
                              remote_run_dir(node_workdir, runs_root, name, run_id), entry.addr or target.hostname,
                              f"{target.label}{target.route}", target, (visible_devices or {}).get(entry.host)))
    if problems:
        raise LLMTrainError(problems)
    extra = []
    if launch.rendezvous == "c10d" and launch.max_restarts > 0 and \
            not any(v.name == launchplan.STALE_STORE_VAR for v in policy):
        # restarted gloo workers otherwise read stale peer addresses from the reused store
        extra.append(EnvVar(launchplan.STALE_STORE_VAR, "1", "launcher"))

    def helper(index: int, site: NodeSite, first: int, lid: str):
        ids = ["--run-id", run_id, "--node-rank", str(index), "--launch-id", lid]
        wrapper = [site.python, "-m", HELPER_MODULE, "run", *ids, "--first-rank", str(first), "--nproc",
                   str(site.nproc), "--log-dir", f"{site.run_dir}/logs/torchrun/node-{index}",
                   "--grace", f"{launch.grace_s:g}", "--"]
        return wrapper, [site.python, "-m", HELPER_MODULE, "kill", *ids]

    spec = assemble("ssh", launch, name, run_id, sites, Rendezvous(launch.rendezvous, sites[0].addr, launch.rdzv_port, run_id),
                    module, policy, launch_id, extra, helper=helper, local_addr=True)
    if launch.rendezvous == "c10d":
        check_c10d_order(spec)
    return spec


def check_c10d_order(spec: LaunchPlan) -> None:
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


def torchrun_argv(spec: LaunchPlan, node: NodePlan) -> list[str]:
    """The node's torchrun line, as the plan holds it."""
    return list(node.argv)


def node_command(spec: LaunchPlan, node: NodePlan, masked: bool | str = False) -> str:
    """The exact shell command for ``node`` (secret values as ``****`` when ``masked``; with
    ``"disk"`` every launch.env / env file value too: :func:`~llmtrain.launch.envpolicy.shell_assignments`)."""
    return launchplan.node_command(node, node.env, masked=masked)


def kill_command(spec: LaunchPlan, node: NodePlan, pgid: int | None = None, pgid_start: int | None = None,
                 grace_s: float | None = None) -> str:
    """Stop everything of this run on ``node``: its recorded process group, descendants, marked processes."""
    grace = spec.retry.grace_s if grace_s is None else grace_s
    argv = [*node.stop_argv, "--grace", f"{grace:g}"]
    if pgid:
        argv += ["--pgid", str(pgid), "--pgid-start", str(pgid_start or 0)]
    return shlex.join(argv)


def describe(spec: LaunchPlan, masked: bool | str = True) -> list[str]:
    """``--dry-run`` lines: the one renderer of every backend (:func:`llmtrain.launch.launchplan.describe`)."""
    return launchplan.describe(spec, masked=masked)
