"""Talking to Slurm: its client commands, their answers reduced to data or one-line errors.

Only Slurm's own clients are used (``sbatch``, ``squeue``, ``scontrol``, ``scancel``), never its
libraries or REST API: they are on every login node, speak to every Slurm version the user's
site runs, and honour ``SLURM_CONF``. Every call has a timeout (a controller that does not
answer must not hang the launcher) and every failure is a :class:`~llmtrain.errors.LLMTrainError`
whose one line is Slurm's own message plus the fix.

Checked before submitting (so that nothing is submitted that Slurm would refuse or that could
never start): the clients exist, the partition exists (``scontrol show partition -o``; without
``--partition``, Slurm's default partition), and ``--nodes`` fits it (``TotalNodes`` and
``MaxNodes``). Then the whole request is asked of slurmctld without submitting anything
(:func:`will_run`, ``sbatch --test-only`` with the job's options): it refuses what only the
controller knows (an account it rejects, a GPU request the nodes have no GRES for, a ``--qos``)
with the message sbatch would give, and it creates no job record, so a refusal leaves neither a
job nor a run directory behind. (Without slurmdbd no client can list the accounts: asking the
controller is the one check that works on every site.) Measured on the test cluster: ~50 ms.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass
from typing import Mapping

from llmtrain.errors import LLMTrainError

CLIENTS = ("sbatch", "squeue", "scontrol", "scancel")
TIMEOUT_S = 30.0
FIELD_RE = re.compile(r"(\w+)=(\S*)")
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL",
         "DEADLINE", "REVOKED", "SPECIAL_EXIT"}


@dataclass(frozen=True)
class Partition:
    name: str
    total_nodes: int
    max_nodes: int | None  # None: UNLIMITED
    state: str


def check_clients(clients: tuple[str, ...] = CLIENTS) -> None:
    missing = [c for c in clients if shutil.which(c) is None]
    if missing:
        raise LLMTrainError(f"{' '.join(missing)} not found on PATH: this machine is not a Slurm client",
                            "run on a login node of the cluster (or install slurm-client), or use --launcher ssh",
                            path="--launcher slurm")


def _client(argv: list[str], env: Mapping[str, str] | None, timeout: float = TIMEOUT_S) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=dict(env) if env else None,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise LLMTrainError(f"`{' '.join(argv[:3])}` did not answer within {timeout:g} s",
                            "check that slurmctld is up (scontrol ping)", path="--launcher slurm") from None
    except OSError as exc:
        raise LLMTrainError(f"cannot run {argv[0]}: {exc.strerror or exc}", "check the Slurm client installation",
                            path="--launcher slurm") from None


def one_line(text: str) -> str:
    """Slurm's message as one line: its ``sbatch: error:`` prefixes dropped, lines joined."""
    lines = [re.sub(r"^\w+: (error|fatal): ", "", line.strip()) for line in text.strip().splitlines() if line.strip()]
    return "; ".join(lines)[:500] or "no message"


def partitions(env: Mapping[str, str] | None = None) -> tuple[list[Partition], str | None]:
    """Every partition and the name of the default one (``Default=YES``), if any."""
    result = _client(["scontrol", "show", "partition", "-o"], env)
    if result.returncode != 0:
        raise LLMTrainError(f"scontrol show partition failed: {one_line(result.stderr or result.stdout)}",
                            "check SLURM_CONF and that slurmctld is up (scontrol ping)", path="--launcher slurm")
    parts, default = [], None
    for line in result.stdout.splitlines():
        fields = dict(FIELD_RE.findall(line))
        if "PartitionName" not in fields:
            continue
        max_nodes = fields.get("MaxNodes", "UNLIMITED")
        parts.append(Partition(fields["PartitionName"], int(fields.get("TotalNodes", "0") or 0),
                               None if not max_nodes.isdigit() else int(max_nodes), fields.get("State", "UP")))
        if fields.get("Default") == "YES":
            default = fields["PartitionName"]
    return parts, default


def check_partition(name: str | None, nodes: int, env: Mapping[str, str] | None = None) -> Partition:
    """The partition the job goes to, checked: it exists and ``nodes`` fit into it."""
    parts, default = partitions(env)
    names = ", ".join(p.name for p in parts) or "none"
    if name is None:
        if default is None:
            raise LLMTrainError("this cluster has no default partition", f"pass --partition (one of: {names})",
                                path="--partition")
        name = default
    part = next((p for p in parts if p.name == name), None)
    if part is None:
        raise LLMTrainError(f"partition {name!r} does not exist on this cluster", f"use one of: {names} (sinfo -s)",
                            path="--partition")
    limit = min(part.total_nodes, part.max_nodes) if part.max_nodes is not None else part.total_nodes
    if nodes > limit:
        why = f"it has {part.total_nodes} node(s)" + (f", at most {part.max_nodes} per job" if part.max_nodes else "")
        raise LLMTrainError(f"{nodes} nodes do not fit partition {name!r}: {why}",
                            f"use --nodes {limit} or less, or another --partition", path="--nodes")
    return part


def submit(script: str, env: Mapping[str, str]) -> str:
    """``sbatch --parsable SCRIPT`` with ``env`` as sbatch's (hence the job's) environment; the job id."""
    result = _client(["sbatch", "--parsable", script], env)
    if result.returncode != 0:
        message = one_line(result.stderr or result.stdout)
        hint = "check --account and --partition (sacctmgr show assoc where user=$USER)" \
            if "account" in message.lower() else "fix the option Slurm names, or see the script"
        raise LLMTrainError(f"sbatch refused the job: {message}", f"{hint}; nothing was submitted ({script})",
                            path="--launcher slurm")
    job_id = result.stdout.strip().split(";")[0]
    if not job_id.isdigit():
        raise LLMTrainError(f"sbatch --parsable answered {result.stdout.strip()[:80]!r}, not a job id",
                            "check the Slurm client version", path="--launcher slurm")
    return job_id


def will_run(options: list[str], env: Mapping[str, str]) -> None:
    """``sbatch --test-only OPTIONS --wrap=true``: would slurmctld accept this job? Nothing is
    submitted (no job id is used, squeue and ``scontrol show job`` stay as they were); a refusal
    is one line naming the option to fix."""
    result = _client(["sbatch", "--test-only", *options, "--wrap=true"], env)
    if result.returncode != 0:
        message = re.sub(r"(^|; )allocation failure: ", r"\1", one_line(result.stderr or result.stdout))
        low = message.lower()
        flag = "--account" if "account" in low else "--gpus-per-node" if "gres" in low else \
            "--partition" if "partition" in low else "--nodes" if "node count" in low else "--slurm-arg"
        hint = {"--account": "pass an account you may use (sshare -U or sacctmgr show assoc where user=$USER), "
                             "or another --partition",
                "--gpus-per-node": "this partition's nodes have no such GPUs (sinfo -o '%P %G'): pick a GPU "
                                   "--partition, or a CPU recipe (cluster.gpu: cpu)"}.get(
            flag, "fix the option Slurm names (sbatch --test-only accepts it once it is right)")
        raise LLMTrainError(f"sbatch refused the job: {message}", f"{hint}; nothing was submitted", path=flag)


def queue_state(job_id: str, env: Mapping[str, str] | None = None) -> str | None:
    """The job's state in ``squeue -h -j ID`` (``PENDING``, ``RUNNING``, ``COMPLETING``, ...), None once
    squeue no longer lists it as live. A controller that does not answer counts as "still there"."""
    try:
        result = _client(["squeue", "-h", "-j", job_id, "-o", "%T"], env, timeout=10)
    except LLMTrainError:
        return "UNKNOWN"
    state = result.stdout.strip().split("\n")[0].strip()
    if result.returncode != 0:
        return None if "invalid job id" in (result.stderr or "").lower() else "UNKNOWN"
    return None if not state or state in ENDED else state


def job_fields(job_id: str, env: Mapping[str, str] | None = None) -> dict[str, str]:
    """``scontrol show job -o ID`` as a dict (``JobState``, ``ExitCode=N:S``, ``NodeList``, ...); {} if gone."""
    try:
        result = _client(["scontrol", "show", "job", "-o", job_id], env, timeout=10)
    except LLMTrainError:
        return {}
    return dict(FIELD_RE.findall(result.stdout)) if result.returncode == 0 else {}


def hostnames(nodelist: str, env: Mapping[str, str] | None = None) -> list[str]:
    """``scontrol show hostnames NODELIST``: ``n[0-1]`` -> ``["n0", "n1"]`` (the job's node order)."""
    if not nodelist or nodelist == "(null)":
        return []
    result = _client(["scontrol", "show", "hostnames", nodelist], env, timeout=10)
    return result.stdout.split() if result.returncode == 0 else []


def exit_code(fields: Mapping[str, str]) -> int | None:
    """The job's exit code from ``ExitCode=N:S``: N, or 128+S when a signal ended it."""
    code, _, sig = fields.get("ExitCode", "").partition(":")
    if not code.isdigit():
        return None
    return 128 + int(sig) if sig.isdigit() and int(sig) > 0 and int(code) == 0 else int(code)


def step_ids(job_id: str, name: str, env: Mapping[str, str] | None = None) -> list[str]:
    """``JOBID.STEPID`` of every live step of ``job_id`` called ``name`` (``squeue -s``); [] if none."""
    try:
        result = _client(["squeue", "-h", "-s", "-j", job_id, "-o", "%i %j"], env, timeout=10)
    except LLMTrainError:
        return []
    return [parts[0] for parts in (line.split() for line in result.stdout.splitlines())
            if len(parts) == 2 and parts[1] == name]


def cancel(job_id: str, env: Mapping[str, str] | None = None) -> str:
    """``scancel ID``; Slurm's message when it failed, else ''."""
    try:
        result = _client(["scancel", job_id], env, timeout=15)
    except LLMTrainError as exc:
        return str(exc)
    return "" if result.returncode == 0 else one_line(result.stderr or result.stdout)
