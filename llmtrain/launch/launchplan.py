"""The launch plan: what every node of a run executes, as pure data, built once.

A :class:`LaunchPlan` holds, per node, the exact command (``torchrun`` argv, and for SSH the
node helper in front of it), its environment (secret values in memory only:
:class:`~llmtrain.launch.envpolicy.EnvVar`), working directory, run directory and log paths,
plus the rendezvous, the retry policy and the launch settings. It touches nothing. Backends
(:mod:`llmtrain.launch.backends`) only start, watch and stop what it describes; they never
re-derive a command, a variable or a path. ``--dry-run`` prints it with :func:`describe`, the
one renderer of every backend.

Builders, one per way the nodes are known (all end in :func:`assemble`):

* :func:`local_plan` -- one node, this machine, ``torchrun --standalone``;
* :func:`llmtrain.launch.commands.build_spec` -- the hostfile's nodes over SSH (paths per
  host, addresses, the node helper ``llmtrain.launch.remote``);
* :func:`build_plan` -- nodes known only by position (Slurm: the scheduler picks the hosts).

**One torchrun line** (:func:`torchrun_argv`) for all of them: the static rendezvous puts node
*i* at ``--node-rank i`` (ranks follow the hostfile, :mod:`llmtrain.launch.commands` says why);
``standalone`` is torchrun's single-node form; ``c10d`` is the elastic one.

**Places not known before the start.** Under Slurm the rendezvous host is a *shell reference*,
``$MASTER_ADDR`` (the job sets it from ``scontrol show hostnames $SLURM_JOB_NODELIST``), and a
node's ``host`` is a label (``node 1 of the allocation``). :func:`shell_words` quotes every word
for a POSIX shell but leaves exactly those references (:data:`SHELL_REFS`) to be expanded there;
a plan whose rendezvous host is not a reference quotes every word (``NodePlan.shell_refs``).
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Iterable, Mapping

from llmtrain.errors import LLMTrainError
from llmtrain.launch.envpolicy import EnvVar, launcher_env, merge, new_launch_id, policy_env, shell_assignments
from llmtrain.recipe.load import apply_override, load_recipe, validate_recipe_dict
from llmtrain.recipe.schema import LaunchConfig, Recipe

SHELL_REFS = ("MASTER_ADDR",)  # the only variables a plan's words may refer to
REF_RE = re.compile(r"\$(" + "|".join(SHELL_REFS) + r")\b")
ENGINE_MODULE = "llmtrain.engine.main"
MODULE_RE = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")
EXIT_FOR_SIGNAL = {signal.SIGINT: 130, signal.SIGTERM: 143, signal.SIGHUP: 129}
STALE_STORE_VAR = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


@dataclass(frozen=True)
class Rendezvous:
    backend: str  # "static" | "c10d" | "standalone" (one node, torchrun picks a free port)
    host: str  # the first node's address, or "$MASTER_ADDR" when it is only known at start
    port: int
    run_id: str  # --rdzv-id

    @property
    def endpoint(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    @property
    def shown(self) -> str:
        return "standalone (this machine)" if self.backend == "standalone" else f"{self.backend} at {self.endpoint}"


@dataclass(frozen=True)
class RetryPolicy:
    max_restarts: int  # torchrun --max-restarts (and, over SSH, whole-job retries after a lost node)
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
    output_log: str | None  # where torchrun's own stdout/stderr go on the node (None: streamed back)
    python: str = sys.executable
    run_dir: str = ""  # absolute, on the node
    addr: str = ""  # what the other nodes connect to ("" when not known before the start)
    label: str = ""  # how --dry-run and messages name the node (default: host)
    wrapper: tuple[str, ...] = ()  # words run in front of argv on the node (the SSH node helper)
    stop_argv: tuple[str, ...] = ()  # the node's stop command, without --grace (SSH)
    target: Any = None  # how the backend reaches the node (an SSHTarget over SSH)
    visible_devices: tuple[int, ...] | None = None
    shell_refs: bool = False  # argv refers to $MASTER_ADDR, expanded by the node's shell

    @property
    def slots(self) -> int:
        return self.nproc

    @property
    def ranks(self) -> range:
        return range(self.first_rank, self.first_rank + self.nproc)

    @property
    def rank_span(self) -> str:
        last = self.first_rank + self.nproc - 1
        return f"rank {last}" if last == self.first_rank else f"ranks {self.first_rank}-{last}"

    @property
    def recipe_lock(self) -> str:
        return f"{self.run_dir}/recipe.lock.yaml"

    @property
    def command(self) -> tuple[str, ...]:
        """What the node executes: the wrapper (if any), then torchrun."""
        return (*self.wrapper, *self.argv)

    def launcher_vars(self) -> list[EnvVar]:
        """The launcher's own variables (run ids, paths): the only ones a file on disk may hold."""
        return [v for v in self.env if v.source == "launcher"]


@dataclass(frozen=True)
class LaunchPlan:
    backend: str  # "local", "ssh", "slurm"
    run_name: str
    run_id: str
    run_dir: str  # absolute, the first node's (the same on every node under shared storage)
    nodes: tuple[NodePlan, ...]
    rendezvous: Rendezvous
    retry: RetryPolicy
    policy: tuple[EnvVar, ...]  # the env policy's variables (the same on every node)
    launch_id: str  # marks this launch's processes (envpolicy.new_launch_id)
    module: str = ENGINE_MODULE
    launch: LaunchConfig = field(default_factory=LaunchConfig)

    @property
    def world_size(self) -> int:
        return sum(n.nproc for n in self.nodes)

    @property
    def recipe_lock(self) -> str:
        return f"{self.run_dir}/recipe.lock.yaml"

    @property
    def master(self) -> str:
        return self.rendezvous.host

    @property
    def port(self) -> int:
        return self.rendezvous.port

    @property
    def endpoint(self) -> str:
        return self.rendezvous.endpoint


@dataclass(frozen=True)
class NodeSite:
    """One node as a builder knows it, before the plan turns it into a command."""

    host: str
    nproc: int
    python: str
    workdir: str
    run_dir: str
    addr: str = ""
    label: str = ""
    target: Any = None
    visible_devices: tuple[int, ...] | None = None
    log_dir: str = ""  # torchrun --log-dir (default RUN_DIR/logs/torchrun/node-I; locally RUN_DIR/logs/torchrun)


# --------------------------------------------------------------------------- inputs shared by builders


def engine_module() -> str:
    """The module each rank runs (``LLMTRAIN_ENGINE_MODULE``, a test/debug hook, replaces it)."""
    module = os.environ.get("LLMTRAIN_ENGINE_MODULE") or ENGINE_MODULE
    if not MODULE_RE.match(module):
        raise LLMTrainError(f"LLMTRAIN_ENGINE_MODULE={module[:80]!r} is not a Python module name",
                            "unset it, or name a module like llmtrain.engine.main", path="LLMTRAIN_ENGINE_MODULE")
    return module


def resolve_recipe(recipe: Recipe | str | Path, overrides: list[str] | None) -> Recipe:
    """A recipe object from a path or an object, with ``--set`` overrides applied and re-validated."""
    if not isinstance(recipe, Recipe):
        return load_recipe(recipe, overrides)
    if not overrides:
        return recipe
    data = recipe.model_dump(mode="json", by_alias=True, exclude_none=True)
    for item in overrides:
        apply_override(data, item)
    return validate_recipe_dict(data)


# --------------------------------------------------------------------------- the command of a node


def torchrun_argv(python: str, nnodes: int, node_rank: int, nproc: int, rdzv: Rendezvous, max_restarts: int,
                  log_dir: str, module: str, run_dir: str, local_addr: str | None = None) -> list[str]:
    """The torchrun line of one node; the engine reads the locked recipe.

    ``standalone``: torchrun's one-node form (``--max-restarts`` only when > 0, as it always was
    locally). ``static``: node *i* is ``--node-rank i``. ``c10d``: no node rank (torch orders the
    agents itself), the first node hosts the store (``is_host=1``). ``local_addr``: the address
    this node is reached at (``--local-addr``)."""
    if rdzv.backend == "standalone":
        restarts = ["--max-restarts", str(max_restarts)] if max_restarts > 0 else []
        return [python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), *restarts,
                "--redirects", "3", "--log-dir", log_dir, "-m", module, "--recipe", f"{run_dir}/recipe.lock.yaml",
                "--run-dir", run_dir]
    argv = [python, "-m", "torch.distributed.run", "--nnodes", str(nnodes), "--nproc-per-node", str(nproc),
            "--rdzv-backend", rdzv.backend, "--rdzv-endpoint", rdzv.endpoint, "--rdzv-id", rdzv.run_id]
    if rdzv.backend == "static":
        argv += ["--node-rank", str(node_rank)]
    elif node_rank == 0:
        argv += ["--rdzv-conf", "is_host=1"]
    if local_addr:
        argv += ["--local-addr", local_addr]
    return argv + ["--max-restarts", str(max_restarts), "--redirects", "3", "--log-dir", log_dir, "-m", module,
                   "--recipe", f"{run_dir}/recipe.lock.yaml", "--run-dir", run_dir]


def assemble(backend: str, launch: LaunchConfig, run_name: str, run_id: str, sites: list[NodeSite],
             rdzv: Rendezvous, module: str, policy: list[EnvVar], launch_id: str | None = None,
             extra_env: Iterable[EnvVar] = (), helper: Any = None, local_addr: bool = False,
             output_log: bool = False) -> LaunchPlan:
    """The plan for ``sites`` (node-rank order): every node's torchrun line and environment
    (``policy`` < the launcher's own variables < ``extra_env``). ``helper(index, site,
    first_rank, launch_id)``, when given, returns ``(wrapper, stop_argv)`` for a node (SSH)."""
    launch_id = launch_id or new_launch_id()
    extra = list(extra_env)
    nodes, first = [], 0
    for index, site in enumerate(sites):
        log_dir = site.log_dir or f"{site.run_dir}/logs/torchrun/node-{index}"
        argv = torchrun_argv(site.python, len(sites), index, site.nproc, rdzv, launch.max_restarts, log_dir, module,
                             site.run_dir, site.addr if local_addr else None)
        env = merge(policy, launcher_env(run_id, site.run_dir, index, site.visible_devices, launch_id=launch_id), extra)
        wrapper, stop = helper(index, site, first, launch_id) if helper is not None else ((), ())
        nodes.append(NodePlan(index, site.host, first, site.nproc, site.workdir, tuple(argv), tuple(env), log_dir,
                              f"{site.run_dir}/logs/{backend}/node-{index}.out" if output_log else None,
                              python=site.python, run_dir=site.run_dir, addr=site.addr, label=site.label or site.host,
                              wrapper=tuple(wrapper), stop_argv=tuple(stop), target=site.target,
                              visible_devices=site.visible_devices, shell_refs=bool(REF_RE.search(rdzv.host))))
        first += site.nproc
    return LaunchPlan(backend, run_name, run_id, sites[0].run_dir if sites else "", tuple(nodes), rdzv,
                      RetryPolicy(launch.max_restarts, launch.exclude_lost_hosts, launch.grace_s), tuple(policy),
                      launch_id, module, launch)


def build_plan(backend: str, recipe: Recipe, hosts: list[tuple[str, int]], run_id: str, run_dir: str, module: str,
               master: str, environ: Mapping[str, str] | None = None, cwd: str | None = None) -> LaunchPlan:
    """The plan for nodes known by position (``(host or label, nproc)`` in node-rank order), with
    ``master`` as the rendezvous host and one run directory on shared storage (Slurm). Pure:
    reads only the recipe, ``environ`` and the env file."""
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
    sites = [NodeSite(host, nproc, python, workdir, run_dir) for host, nproc in hosts]
    return assemble(backend, launch, recipe.name or "run", run_id, sites,
                    Rendezvous("static", master, launch.rdzv_port, run_id), module, policy, output_log=True)


def local_plan(recipe: Recipe, world: int, run_id: str, run_dir: str, module: str,
               environ: Mapping[str, str] | None = None, extra_env: Mapping[str, str] | None = None,
               cwd: str | None = None) -> LaunchPlan:
    """All ``world`` ranks on this machine under one ``torchrun --standalone``.

    The node's environment is this machine's (the backend starts from ``os.environ``, as a
    node's login environment over SSH) plus, in the plan: the env policy, ``OMP_NUM_THREADS`` =
    ``max(1, cpus // world)`` unless set, ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` with restarts
    unless set (CPU facts note, trap 5: restarted gloo workers otherwise read stale peer
    addresses from the store torchrun shares), the launcher's own variables, then ``extra_env``
    (``LLMTRAIN_RESUME``)."""
    environ = os.environ if environ is None else environ
    cwd = cwd or os.getcwd()
    launch = recipe.launch
    policy = policy_env(launch, environ, base_dir=cwd)
    defaults = local_defaults(world, launch.max_restarts, {**environ, **{v.name: v.value for v in policy}})
    extra = [EnvVar(k, v, "launcher") for k, v in (extra_env or {}).items()]
    site = NodeSite("localhost", world, sys.executable, cwd, run_dir, label="localhost",
                    log_dir=f"{run_dir}/logs/torchrun")
    return assemble("local", launch, recipe.name or "run", run_id, [site], Rendezvous("standalone", "localhost", 0, run_id),
                    module, policy, extra_env=[*defaults, *extra])


def local_defaults(world: int, max_restarts: int, env: Mapping[str, str]) -> list[EnvVar]:
    """The variables the local backend sets when ``env`` (this machine's + the policy) has none."""
    out = []
    if max_restarts > 0 and STALE_STORE_VAR not in env:
        out.append(EnvVar(STALE_STORE_VAR, "1", "launcher"))
    if not env.get("OMP_NUM_THREADS"):
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        out.append(EnvVar("OMP_NUM_THREADS", str(max(1, cpus // world)), "launcher"))
    return out


def with_env(plan: LaunchPlan, values: Mapping[str, str]) -> LaunchPlan:
    """The plan with ``values`` added to (or replacing in) every node's environment."""
    import dataclasses

    extra = tuple(EnvVar(k, v, "launcher") for k, v in values.items())
    nodes = tuple(dataclasses.replace(n, env=(*[e for e in n.env if e.name not in values], *extra))
                  for n in plan.nodes)
    return dataclasses.replace(plan, nodes=nodes)


# --------------------------------------------------------------------------- rendering


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


def node_command(node: NodePlan, env: Iterable[EnvVar] | None = None, masked: bool | str = False) -> str:
    """``cd WORKDIR && exec env NAME=value ... [helper ...] torchrun ...`` for ``node`` with the
    variables ``env`` (default: all of the node's; masked as
    :func:`~llmtrain.launch.envpolicy.shell_assignments` masks)."""
    assignments = shell_assignments(node.env if env is None else env, masked=masked)
    words = shell_words(node.command) if node.shell_refs else shlex.join(node.command)
    return f"cd {shlex.quote(node.workdir)} && exec env " + " ".join([*assignments, words])


def describe(plan: LaunchPlan, masked: bool | str = True) -> list[str]:
    """``--dry-run`` lines (and ``logs/commands.txt`` with ``masked="disk"``) for every backend:
    the run, then per node where it goes and its exact command, secrets masked."""
    lines = [f"run {plan.run_name}/{plan.run_id}: {len(plan.nodes)} node(s), world size {plan.world_size}, "
             f"rendezvous {plan.rendezvous.shown}, max restarts {plan.retry.max_restarts}"]
    for node in plan.nodes:
        where = f"; torchrun output in {node.output_log}" if node.output_log else ""
        lines.append(f"# node {node.node_rank}: {node.label or node.host}, {node.rank_span}{where}")
        lines.append(node_command(node, node.env, masked=masked))
    return lines
