"""``llmtrain launch RECIPE --hosts FILE``: one torchrun per node over SSH, one run, one exit code.

This module holds steps 1-3 (everything before a process starts); :mod:`llmtrain.launch.backends.sshrun` holds
the run itself (steps 4-6).

What happens, in order (:func:`launch_ssh`):

1. The recipe (with ``--set``) is validated for the hostfile's placement (after ``--include`` /
   ``--exclude``), exactly as ``llmtrain plan --hosts`` does; host aliases are resolved through
   ``~/.ssh/config``; every node's command is built (:mod:`llmtrain.launch.commands`).
   ``--dry-run`` prints those commands (secrets masked) and stops here: nothing connects.
2. Preflight (:mod:`llmtrain.launch.preflight`) checks every host in parallel over one strict
   SSH connection each (``--skip-preflight``: only connect). Any failure: one line per problem,
   exit 2, nothing started anywhere.
3. The run directory is created here; ``recipe.lock.yaml`` (without any ``launch.env`` /
   env file value: names and sources only, :mod:`llmtrain.recipe.lock`) is copied to each
   node's run directory unless ``launch.shared_fs``. A locked recipe (``llmtrain resume
   --hosts``, a whole-job retry) gets its values again from the caller's environment or env
   file first (:func:`~llmtrain.launch.envpolicy.restore_env`); a missing one: exit 2.
4. All nodes start at once, each command under a pty on its own channel. Lines are streamed
   live as ``[host:rank] text`` (``[host] text`` for torchrun and the node helper), written to
   ``logs/rank-<R>.log`` and ``logs/node-<i>.log``; rank 0's events drive one progress bar and
   the watchdog (:mod:`llmtrain.launch.watchdog`).
5. The run ends when every node exits 0, or at the first of: a node exiting non-zero, a lost
   connection (or a node silent past ``launch.watchdog.heartbeat_timeout_s``), a hang, or
   SIGINT/SIGTERM/SIGHUP to the launcher. Then every node is stopped in parallel: Ctrl-C typed
   into its pty (SIGINT to the node helper at once, which stops its node), and over a second
   channel ``python -m llmtrain.launch.remote kill`` (SIGTERM to the recorded process group,
   its descendants and the run's marked processes, SIGKILL after ``launch.grace_s``), within
   ~5 s with the default 3 s grace. A launcher killed with SIGKILL cannot do this; the pty
   hang-up then makes each node's helper do it.
6. Exit code: 0; the first failing node's (torchrun's) code; 255 for a lost node; 124 for a
   hang; 130/143/129 for SIGINT/SIGTERM/SIGHUP. With ``launch.max_restarts`` K > 0 a lost node
   makes the launcher retry the whole job up to K times (:mod:`llmtrain.launch.jobretry`:
   optionally without the lost host, re-validated; ranks resume from the latest checkpoint). The summary names the failing host and rank,
   the last lines of that rank's log and torchelastic's error message when there is one.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.text import Text

from llmtrain.errors import LLMTrainError, Problem
from llmtrain.launch import jobretry
from llmtrain.launch.commands import LaunchSpec, NodeSpec, build_spec, describe
from llmtrain.launch.envpolicy import Redactor, lock_recipe, restore_env
from llmtrain.cluster.filters import select_hosts
from llmtrain.cluster.hostfile import Hostfile, load_hostfile
from llmtrain.launch.launchplan import engine_module, resolve_recipe
from llmtrain.launch.rundir import RunDir, create_run_dir, new_run_id, reuse_run_dir
from llmtrain.launch.sshconfig import known_hosts_files, resolve_targets
from llmtrain.launch.backends.sshrun import SSHRun
from llmtrain.plan.api import plan_recipe
from llmtrain.recipe.schema import Recipe

@dataclass
class Prepared:
    recipe: Recipe
    hostfile: Hostfile  # after --include/--exclude
    spec: LaunchSpec
    warnings: list[str]
    visible_devices: dict[str, tuple[int, ...]]
    targets: list[Any]
    runs_root: str | Path
    notes: list[str] = dataclasses.field(default_factory=list)  # dry run: what was not run (sshconfig)

    def with_run_id(self, run_id: str) -> LaunchSpec:
        return build_spec(self.recipe, self.hostfile, self.targets, run_id, self.runs_root, self.spec.module,
                          self.visible_devices)


def prepare(recipe: Recipe | str | Path, hosts: str | Path | Hostfile, overrides: list[str] | None = None,
            include: str | None = None, exclude: str | None = None, runs_root: str | Path = "runs",
            run_id: str | None = None, environ: dict[str, str] | None = None, dry_run: bool = False) -> Prepared:
    """Validate everything that can be validated without touching a host; build every node's command.
    ``dry_run``: execute nothing, not even ssh_config ``Match exec`` (:mod:`llmtrain.launch.sshconfig`)."""
    recipe = restore_env(resolve_recipe(recipe, overrides), environ, base_dir=os.getcwd())
    hostfile = hosts if isinstance(hosts, Hostfile) else load_hostfile(hosts)
    selection = select_hosts(hostfile, include, exclude)
    plan = plan_recipe(recipe, selection.hostfile)
    if not plan.valid:
        raise LLMTrainError(plan.validation.errors)
    notes: list[str] = []
    targets = resolve_targets(selection.hostfile, dry_run=dry_run, notes=notes if dry_run else None,
                              check_identities=True)
    spec = build_spec(recipe, selection.hostfile, targets, run_id or new_run_id(), runs_root, engine_module(),
                      selection.visible_devices, environ)
    return Prepared(recipe, selection.hostfile, spec, [w.line() for w in plan.validation.warnings],
                    selection.visible_devices, targets, runs_root, notes)


def ssh_options(hostfile: Hostfile, recipe: Recipe, accept_new: bool, warn) -> Any:
    from llmtrain.launch.backends.ssh import SSHOptions

    files, extra = known_hosts_files(hostfile)
    return SSHOptions(files, accept_new, extra, recipe.launch.connect_timeout_s, recipe.launch.banner_timeout_s, warn)


def launch_ssh(recipe: Recipe | str | Path, hosts: str | Path | Hostfile, overrides: list[str] | None = None,
               runs_root: str | Path = "runs", include: str | None = None, exclude: str | None = None,
               dry_run: bool = False, skip_preflight: bool = False, accept_new_host_keys: bool = False,
               console: Console | None = None, resume_run: str | Path | None = None,
               extra_env: dict[str, str] | None = None) -> int:
    """Validate, preflight, start every node over SSH, stream, tear down; return the run's exit code.

    ``resume_run``: run again in this existing run directory (``llmtrain resume --hosts``; its
    ``runs_root`` and run id are kept); ``extra_env``: set on every node (``LLMTRAIN_RESUME``)."""
    from llmtrain.launch import preflight
    from llmtrain.launch.backends import ssh

    if resume_run is not None:
        runs_root = Path(resume_run).parent.parent
    prepared = prepare(recipe, hosts, overrides, include, exclude, runs_root,
                       run_id=Path(resume_run).name if resume_run is not None else None, dry_run=dry_run)
    console = console or Console(highlight=False, soft_wrap=True)
    say = lambda text, style=None: console.print(Text(text), style=style)  # noqa: E731
    for warning in prepared.warnings:
        say(f"warning: {warning}", "yellow")
    if dry_run:
        redact = Redactor(prepared.spec.policy)
        for line in describe(prepared.spec, masked=True):
            say(redact(line))
        for note in prepared.notes:
            say(f"dry run: {redact(note)}")
        say("dry run: nothing was started (a real launch draws its own run id)")
        return 0
    opts = ssh_options(prepared.hostfile, prepared.recipe, accept_new_host_keys, lambda m: say(m, "yellow"))
    conns: dict[int, Any] = {}
    try:
        if skip_preflight:
            conns = _connect_all(prepared.spec, opts)
        else:
            reports = preflight.run_preflight(prepared.spec, opts)
            conns = {r.node.node_rank: r.conn for r in reports if r.conn is not None}
            problems = [p for r in reports for p in r.problems()]
            if problems:
                preflight.render(reports, console)
                raise LLMTrainError(problems)
            say(f"preflight: {len(reports)} of {len(reports)} hosts ready")
            for r in reports:
                for c in r.checks.values():
                    if c.status == "warn":
                        say(f"warning: {r.node.host} {c.name}: {c.value}" + (f"; {c.hint}" if c.hint else ""), "yellow")
        locked = lock_recipe(prepared.recipe, prepared.spec.policy, os.getcwd())  # no value reaches disk
        if resume_run is None:
            run = create_run_dir(locked, prepared.hostfile, runs_root)
        else:
            run = reuse_run_dir(resume_run, locked, prepared.hostfile)
        spec = jobretry.with_env(prepared.with_run_id(run.run_id), extra_env or {})
        _copy_recipe(spec, conns, run)
        retries = prepared.recipe.launch.max_restarts
        for attempt in range(retries + 1):
            sshrun = SSHRun(run, spec, conns, console, opts)
            code = sshrun.run()
            lost = jobretry.lost_host(code, sshrun)
            if lost is None or attempt == retries:
                return code
            for conn in conns.values():
                ssh.close(conn)
            conns = {}
            if prepared.recipe.launch.exclude_lost_hosts:
                remaining = jobretry.without_host(prepared.hostfile, lost)
                if not remaining.hosts:
                    raise LLMTrainError(f"{lost} was lost and no other host is left", "fix the host and resume",
                                        path="launch.exclude_lost_hosts")
                visible = {h: v for h, v in prepared.visible_devices.items() if h != lost}
                prepared = dataclasses.replace(prepare(prepared.recipe, remaining, runs_root=runs_root),
                                               visible_devices=visible)
            say(f"[launcher] {lost} was lost: retrying the whole job (retry {attempt + 1} of {retries}) on "
                f"{len(prepared.hostfile.hosts)} host(s), {prepared.hostfile.world_size} ranks; "
                "ranks resume from the latest checkpoint", "yellow")
            run = reuse_run_dir(run.path, hostfile=prepared.hostfile)
            spec = jobretry.with_env(prepared.with_run_id(run.run_id), {**(extra_env or {}), jobretry.AUTO_RESUME_ENV: "1"})
            conns = _connect_all(spec, opts)
            _copy_recipe(spec, conns, run)
        return code
    finally:
        for conn in conns.values():
            ssh.close(conn)


def _connect_all(spec: LaunchSpec, opts: Any) -> dict[int, Any]:
    from concurrent.futures import ThreadPoolExecutor

    from llmtrain.launch.backends import ssh

    def one(node: NodeSpec):
        try:
            return node.node_rank, ssh.connect(node.target, opts), None
        except ssh.SSHError as exc:
            return node.node_rank, None, Problem(f"{exc.target.label}{node.target.route}", exc.message, exc.hint)

    with ThreadPoolExecutor(max_workers=min(64, len(spec.nodes))) as pool:
        results = list(pool.map(one, spec.nodes))
    conns = {rank: conn for rank, conn, _ in results if conn is not None}
    problems = [p for _, _, p in results if p is not None]
    if problems:
        for conn in conns.values():
            ssh.close(conn)
        raise LLMTrainError(problems)
    return conns


def _copy_recipe(spec: LaunchSpec, conns: dict[int, Any], run: RunDir) -> None:
    """Put recipe.lock.yaml into each node's run dir (or, with shared_fs, check it is there)."""
    from concurrent.futures import ThreadPoolExecutor

    from llmtrain.launch.backends import ssh

    data = run.recipe_lock.read_bytes()

    def one(node: NodeSpec) -> Problem | None:
        conn = conns[node.node_rank]
        try:
            if spec.launch.shared_fs:
                code, _, _ = ssh.run_capture(conn, f"test -f {shlex.quote(node.recipe_lock)}", 30)
                if code != 0:
                    return Problem(node.target.label, f"{node.recipe_lock} is not there although launch.shared_fs is set",
                                   "mount the same filesystem at the same path, or set launch.shared_fs: false")
                ssh.run_capture(conn, f"mkdir -p {shlex.quote(node.log_dir)}", 30)
            else:
                ssh.upload(conn, data, node.recipe_lock)
        except Exception as exc:  # noqa: BLE001 - one line per host
            return Problem(node.target.label, f"cannot prepare {node.run_dir}: {exc}", "check the workdir and disk there")
        return None

    with ThreadPoolExecutor(max_workers=min(64, len(spec.nodes))) as pool:
        problems = [p for p in pool.map(one, spec.nodes) if p is not None]
    if problems:
        raise LLMTrainError(problems)


__all__ = ["launch_ssh", "prepare", "ssh_options", "lock_recipe"]
