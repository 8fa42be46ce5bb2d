"""``llmtrain hosts check --launcher slurm``: the checks of ``hosts check``, run as one short Slurm job step.

Users cannot SSH into nodes Slurm has not given them, so the probe of
:mod:`llmtrain.launch.preflight` (python, workdir, torch with its CUDA/NCCL builds, llmtrain's
version, GPUs, disk, the rendezvous port, clock skew) travels as one ``srun`` task per node
instead of over SSH, and is judged by the same rules into the same per-node table. Only the
first column differs: ``slurm`` (the node ran its task) instead of ``ssh``.

Decisions:

* **Where it runs.** Inside an allocation (``SLURM_JOB_ID`` set, :mod:`llmtrain.launch.backends.slurm_alloc`):
  one step ``srun --jobid=ID --nodelist=...`` on the first ``--nodes`` of the allocated nodes --
  exactly the nodes a launch there uses. Outside: ``srun`` makes its own small job (``--partition
  --account``, ``--time`` 5 minutes unless given, so the backfill scheduler can start it early)
  and runs the step in it; those are the partition's nodes Slurm picks now, not necessarily
  the ones a later ``launch --launcher slurm`` job gets (say so in the output). ``srun``, not
  ``sbatch`` and a poll: srun waits for the allocation, runs the step and releases the job in
  one blocking call whose output is the probes' lines.
* **Checked before anything is asked of Slurm**, as for a launch: the clients exist, the options
  are Slurm names, the partition exists and ``--nodes`` fits it, and ``sbatch --test-only``
  accepts the request (an account Slurm rejects is one line, no job is made).
* **GPUs.** They are expected unless the recipe's ``cluster.gpu`` is ``cpu`` (the same rule as
  the launch, which asks Slurm for ``--gpus-per-node`` then). When the partition's nodes have
  GPU GRES (``sinfo -o %G``), the step asks for ``--gpus-per-node`` so that ``nvidia-smi`` sees
  the GPUs a job gets (under ``ConstrainDevices`` a step without GRES sees none); when they have
  none, the step asks for none and each node then fails ``gpus`` with its own reason, rather
  than sbatch's one ``Invalid generic resource`` for the whole request. Inside an allocation the
  step asks for nothing: it uses what the allocation holds.
* **One task per node**, a ``/bin/sh`` wrapper that names its node (``SLURMD_NODENAME``) first,
  passes the rendezvous port only on the step's node 0 (the launch's ``MASTER_ADDR``), then runs
  the probe with the launch's python (``launch.python``, else this interpreter) and reports its
  exit code: a python that is missing on one node is that node's ``python`` failure (127), not a
  failed step. ``--label`` attributes every line to its task.
* **Clock skew** is measured against the middle of the srun call, with half its duration as the
  error bar (as over SSH, where it is one round trip): a step that waited for its allocation has
  a wide bar, so only a gross skew fails there (munge refuses skews above its 5-minute TTL anyway).
* **The env file** (``launch.env_file``): a launch's nodes read it themselves at task start
  (:mod:`llmtrain.launch.envexec`: its values never go through Slurm), so each task runs envexec
  on it first, with the names the launcher reads from it, and the check ``env_file`` fails on a
  node that cannot read it at that path or reads another file (a name missing): envexec's own
  line, in the table's "problems and fixes" and in ``--json`` (no column of its own: most
  recipes have no env file, and a tenth column squeezes the fixes column into folds).
* **It always ends**: at most ``CHECK_TIMEOUT_S`` for the allocation and the step; on expiry,
  Ctrl-C or an error the check's job (or, inside an allocation, the step) is cancelled by its
  name, then srun is stopped.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from llmtrain.errors import LLMTrainError
from llmtrain.launch.backends import slurmctl
from llmtrain.launch.preflight import PROBE, HostReport, _cross_check, _judge, local_versions

CHECK_TIMEOUT_S = 300.0
DEFAULT_TIME = "5"  # minutes: the check's job is short, which lets backfill start it early
# the table's columns; ``env_file`` (only with a recipe's launch.env_file) is in the JSON and, failed, in the fixes
SLURM_CHECKS = ("slurm", "python", "workdir", "torch", "llmtrain", "gpus", "disk", "port", "clock")
# $5/$6: the env file and its names, checked on the node exactly as a launch's task start does (envexec)
WRAPPER = ('echo "@@node ${SLURMD_NODENAME:-$(hostname)}"; p=0; [ "${SLURM_NODEID:-0}" = 0 ] && p="$3"; '
           'if [ -n "$5" ]; then e=$("$0" -m llmtrain.launch.envexec --env-file "$5" --only "$6" -- true 2>&1 </dev/null); '
           'rc=$?; echo "@@envfile $rc $(echo "$e" | head -n 1)"; fi; '
           '"$0" -c "$1" "$2" "$p" "$4"; echo "@@exit $?"')


@dataclass(frozen=True)
class NodeTarget:
    """What a report names a Slurm node by (the SSH target's fields that the table and JSON read)."""

    address: str
    label: str
    route: str = ""
    short_route: str = ""


@dataclass(frozen=True)
class ProbeNode:
    """One node of the check step, with what :func:`~llmtrain.launch.preflight._judge` reads."""

    node_rank: int
    host: str
    slots: int
    python: str
    workdir: str
    target: NodeTarget


@dataclass(frozen=True)
class PortSpec:
    port: int


def _job_name() -> str:
    return f"llmtrain-hosts-check-{os.getpid()}-{int(time.time())}"


def srun_argv(name: str, nodes: int, python: str, runs_root: str, port: int, workdir: str,
              job_id: str | None = None, hosts: list[str] | None = None, options: list[str] = (),
              env_file: str = "", env_names: tuple[str, ...] = ()) -> list[str]:
    """The check step: one labelled task per node running the probe through the wrapper (and,
    with ``env_file``, :mod:`llmtrain.launch.envexec` on it first, as the launch's node script does)."""
    argv = ["srun", f"--job-name={name}", f"--nodes={nodes}", f"--ntasks={nodes}", "--ntasks-per-node=1", "--label",
            "--kill-on-bad-exit=0"]
    if job_id:
        argv += [f"--jobid={job_id}", f"--nodelist={','.join(hosts or [])}"]
    return [*argv, *options, "/bin/sh", "-c", WRAPPER, python, PROBE, runs_root, str(port), workdir, env_file,
            ",".join(env_names)]


def parse_output(stdout: str, stderr: str, nodes: int) -> list[dict[str, Any]]:
    """Per task: ``host``, ``probe`` (the dict, or None), ``exit`` (the probe's code, or None), ``err``."""
    tasks: list[dict[str, Any]] = [{"host": None, "probe": None, "exit": None, "err": []} for _ in range(nodes)]
    for stream, text in (("out", stdout), ("err", stderr)):
        for line in text.splitlines():
            label, sep, rest = line.partition(": ")
            if not sep or not label.strip().isdigit() or int(label) >= nodes:
                continue
            task = tasks[int(label)]
            if stream == "err":
                task["err"].append(rest)
            elif rest.startswith("@@node "):
                task["host"] = rest.split()[1] if len(rest.split()) > 1 else None
            elif rest.startswith("@@probe "):
                try:
                    task["probe"] = json.loads(rest[len("@@probe "):])
                except ValueError:
                    task["err"].append("unreadable probe line")
            elif rest.startswith("@@envfile "):
                code, _, words = rest[len("@@envfile "):].partition(" ")
                task["envfile"] = (int(code) if code.isdigit() else -1, words.removeprefix("llmtrain: ").strip())
            elif rest.startswith("@@exit ") and rest.split()[-1].isdigit():
                task["exit"] = int(rest.split()[-1])
    return tasks


def judge_task(index: int, task: dict[str, Any], slots: int, python: str, workdir: str, port: int,
               expect_gpus: bool, gpu_kind: str, t0: float, t1: float, local: dict, env_file: str = "") -> HostReport:
    host = task["host"] or f"node {index}"
    report = HostReport(ProbeNode(index, host, slots, python, workdir, NodeTarget(host, host)))  # type: ignore[arg-type]
    if task["host"] is None:
        detail = (task["err"] or ["no output"])[-1][:160]
        report.add("slurm", "fail", f"task {index} of the check step never ran ({detail})",
                   "see `scontrol show node` for this node's state", "no task")
        return report
    report.add("slurm", "ok", f"task {index} ran on {host}", short="ok")
    probe, code = task["probe"], task["exit"]
    if probe is None:
        detail = (task["err"] or [f"exit code {code}"])[-1][:160]
        what = {127: "not found", 126: "is not executable"}.get(code, "could not run the probe")
        report.add("python", "fail", f"{python} {what} on {host} ({detail})",
                   "install Python >= 3.10 at that path on every node (shared storage), or set launch.python",
                   "not found" if code == 127 else "broken")
        return report
    report.probe = probe
    probe["_skew"] = probe["time"] - (t0 + t1) / 2
    probe["_skew_err"] = (t1 - t0) / 2
    _judge(report, PortSpec(port), report.node, probe, local)  # type: ignore[arg-type]
    if expect_gpus and probe.get("gpus") is None and not probe.get("gpu_error"):
        report.add("gpus", "fail", f"no GPU visible on {host} (no nvidia-smi) for {slots} rank(s); the recipe's "
                                   f"cluster.gpu is {gpu_kind}",
                   "pick a GPU --partition, or a CPU recipe (--set cluster.gpu=cpu)", f"none/{slots}")
    if env_file:
        _judge_env_file(report, task.get("envfile"), env_file, host)
    return report


def _judge_env_file(report: HostReport, result: tuple[int, str] | None, path: str, host: str) -> None:
    """``launch.env_file`` as the node's task start reads it (envexec's own line when it fails)."""
    from llmtrain.launch.envexec import SHARED_HINT

    if result is not None and result[0] == 0:
        report.add("env_file", "ok", f"{path} readable on {host} with every variable the launcher read", short="ok")
        return
    detail = (result[1] if result else "") or "the check did not run"
    report.add("env_file", "fail", detail.split("; put the env file")[0][:300], SHARED_HINT, "unreadable")


def _filtered_env(environ: Mapping[str, str]) -> dict[str, str]:
    """This shell's environment without an enclosing job's Slurm variables (``--jobid`` names the
    allocation; an ``SLURM_NTASKS`` or ``SBATCH_*`` must not reshape the check), ``SLURM_CONF`` kept."""
    return {k: v for k, v in environ.items()
            if not k.startswith(("SLURM_", "SBATCH_", "SALLOC_", "SRUN_")) or k == "SLURM_CONF"}


def _stop(proc: subprocess.Popen, name: str, job_id: str | None, environ: Mapping[str, str]) -> None:
    """Cancel what the check started (its job, or its step inside an allocation), then srun."""
    env = _filtered_env(environ)
    try:
        if job_id:
            from llmtrain.launch.backends.slurm_alloc import Allocation, step_id

            step = step_id(Allocation(job_id, "", 0, None), name, env)
            if step:
                slurmctl.cancel(step, env)
        else:
            found = slurmctl._client(["squeue", "-h", "-n", name, "-o", "%i"], env, timeout=10).stdout.split()
            for jid in found:
                slurmctl.cancel(jid, env)
    except LLMTrainError:
        pass
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                continue


def run_slurm_preflight(recipe, runs_root: str | Path, nodes: int | None = None, gpus_per_node: int | None = None,
                        partition: str | None = None, account: str | None = None, time_limit: str | None = None,
                        say=print, environ: Mapping[str, str] | None = None,
                        timeout: float = CHECK_TIMEOUT_S) -> list[HostReport]:
    """Check the nodes as one srun step; reports in node order (see the module docstring)."""
    from llmtrain.launch.backends.slurm_alloc import allocation_from_env
    from llmtrain.launch.backends.slurm_script import SlurmOptions

    environ = os.environ if environ is None else environ
    alloc = allocation_from_env(environ)
    expect_gpus = recipe.cluster.gpu != "cpu"
    launch = recipe.launch
    python, workdir = launch.python or sys.executable, launch.workdir or os.getcwd()
    runs = str(Path(runs_root).absolute())
    env = _filtered_env(environ)
    if alloc is not None:
        for flag, value in (("--partition", partition), ("--account", account), ("--time", time_limit)):
            if value:
                raise LLMTrainError(f"{flag} does not apply inside Slurm allocation {alloc.job_id}",
                                    "drop it (the allocation fixed it), or run outside the allocation", path=flag)
        n = alloc.node_count(nodes)
        per_node, _ = alloc.ranks_per_node(gpus_per_node, recipe.cluster.gpus_per_node)
        slurmctl.check_clients(("srun", "squeue", "scontrol", "scancel"))
        hosts = slurmctl.hostnames(alloc.nodelist, env)[:n]
        if len(hosts) != n:
            raise LLMTrainError(f"scontrol show hostnames {alloc.nodelist} gave {len(hosts)} host(s), not {n}",
                                "check SLURM_JOB_NODELIST and SLURM_CONF", path="SLURM_JOB_NODELIST")
        options, where = [], f"{n} node(s) of Slurm allocation {alloc.job_id} ({', '.join(hosts)})"
    else:
        n = nodes or recipe.cluster.nodes
        per_node = gpus_per_node or recipe.cluster.gpus_per_node
        hosts = []
        opts = SlurmOptions(n, per_node, partition, account, time_limit or DEFAULT_TIME, expect_gpus)
        opts.check()
        slurmctl.check_clients(("sbatch", "srun", "squeue", "scontrol", "scancel", "sinfo"))
        part = slurmctl.check_partition(partition, n, env)
        gres = slurmctl._client(["sinfo", "-h", "-p", part.name, "-o", "%G"], env, timeout=10).stdout
        ask_gpus = expect_gpus and "gpu" in gres
        options = [f"--{flag}={value}" for flag, value in (("partition", partition), ("account", account),
                                                           ("time", opts.time)) if value is not None]
        options += [f"--gpus-per-node={per_node}"] if ask_gpus else []
        slurmctl.will_run([f"--nodes={n}", "--ntasks-per-node=1", *options], env)
        where = (f"{n} node(s) of partition {part.name} that Slurm picks now (a later launch job may get others)"
                 + ("" if ask_gpus or not expect_gpus else "; its nodes have no GPU GRES, so none were asked for"))
    from llmtrain.launch.envpolicy import env_file_path, policy_env, read_from_file

    names = tuple(v.name for v in read_from_file(policy_env(launch, environ, base_dir=os.getcwd()), launch))
    env_file = str(env_file_path(launch, os.getcwd()).absolute()) if names else ""  # type: ignore[union-attr]
    name = _job_name()
    argv = srun_argv(name, n, python, runs, launch.rdzv_port, workdir, alloc.job_id if alloc else None, hosts, options,
                     env_file, names)
    say(f"checking {where}: one srun task per node (job name {name}; at most {timeout:g} s)")
    t0 = time.time()
    try:
        proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
    except OSError as exc:
        raise LLMTrainError(f"cannot run srun: {exc.strerror or exc}", "check the Slurm client installation",
                            path="--launcher slurm") from None
    finished, received = False, []

    def interrupted(signum, _frame):
        received.append(signum)
        raise KeyboardInterrupt(signal.Signals(signum).name)

    # SIGINT too, as the launchers do (proctree.signals_recorded): a process started in the
    # background of a script inherits SIGINT ignored, and Ctrl-C must still cancel the check's job
    previous = {sig: signal.signal(sig, interrupted) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)} \
        if threading.current_thread() is threading.main_thread() else {}
    try:
        try:
            out, err = proc.communicate(timeout=timeout)
        except KeyboardInterrupt:
            if not received:
                raise  # a KeyboardInterrupt not from a signal handled here (other threads): the CLI's "interrupted"
            _stop(proc, name, alloc.job_id if alloc else None, environ)
            finished = True
            say(f"{signal.Signals(received[0]).name} received: the check's job was cancelled")
            raise SystemExit(128 + received[0]) from None
        except subprocess.TimeoutExpired:
            raise LLMTrainError(f"the check step did not finish within {timeout:g} s (pending for an allocation, or "
                                "a node hangs); it was cancelled", "try again inside `salloc`, or check `squeue`",
                                path="--launcher slurm") from None
        finished = True
    finally:
        if not finished:  # Ctrl-C, SIGTERM, the timeout: the check never leaves a job or a step behind
            _stop(proc, name, alloc.job_id if alloc else None, environ)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    t1 = time.time()
    tasks = parse_output(out, err, n)
    if all(t["host"] is None for t in tasks):
        words = "; ".join(ln.removeprefix("srun: error: ") for ln in err.splitlines()
                          if ln.startswith("srun: error:"))[:400] or slurmctl.one_line(err)
        raise LLMTrainError(f"srun ran no task of the check step (exit {proc.returncode}): {words}",
                            "fix what Slurm names; nothing is left running", path="--launcher slurm")
    local = local_versions()
    reports = [judge_task(i, t, per_node, python, workdir, launch.rdzv_port, expect_gpus, recipe.cluster.gpu,
                          t0, t1, local, env_file) for i, t in enumerate(tasks)]
    _cross_check(reports)
    return reports


__all__ = ["run_slurm_preflight", "srun_argv", "parse_output", "judge_task", "SLURM_CHECKS", "CHECK_TIMEOUT_S"]
