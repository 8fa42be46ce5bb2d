"""Launch and teardown over SSH and Slurm: time to all ranks running, and to a clean machine after a stop.

    python benchmarks/launch_teardown.py           # 1, 2, 4 and 8 SSH hosts, 3 repetitions, medians
    python benchmarks/launch_teardown.py --tiny    # 1 host, 1 repetition (CI smoke test)
    python benchmarks/launch_teardown.py --backend slurm --reps 1   # Slurm beside SSH, 1 and 2 nodes

``--backend slurm`` (section ``launch_teardown_slurm``, its own JSON) runs the same recipe on the
2-node Slurm test cluster (tests/slurmcluster.py: slurmctld + one slurmd per network namespace)
with ``llmtrain launch RECIPE --launcher slurm --nodes N``, and in the same session, interleaved,
over SSH on N sshd hosts, so both backends are measured under the same machine load. Each size
and backend is launched twice: once stopped by SIGKILL of the last rank, once by SIGINT of the
launcher (Ctrl-C). Measured per launch, besides the numbers below: *job submitted* (the launcher
printed ``submitted Slurm job``; over SSH: preflight done), *launcher exited* after the stop,
and with Slurm *squeue empty* (``squeue`` no longer lists the job: Slurm's own teardown,
slurmstepd and the job's cgroups included).

The hosts are real sshd daemons, each in its own network namespace with its own address
(tests/sshhosts.py; where namespaces are not allowed, sshd on loopback ports — the mode is in
the JSON). Needs root for namespaces and openssh-server (.ci/run installs it). One rank per host,
the real engine (``llmtrain.engine.main``) training recipes/debug.yaml shrunk to a toy (tp 1,
FSDP over all ranks, seq 32, micro batch 1, global batch 8), so training is not what is measured.

What is measured, per run (the clock starts just before ``llmtrain launch RECIPE --hosts
HOSTFILE`` is spawned; every line of the launcher's stdout is time-stamped on arrival):

* **preflight done** — the launcher printed ``preflight: N of N hosts ready`` (CLI start-up,
  recipe validation, one SSH connection and the checks per host, in parallel).
* **all ranks running** — the launcher printed ``progress: step 1/...``, i.e. rank 0's first
  ``@@llmtrain`` step event reached the launcher. Step 1 ends with an all-reduce of the loss
  over the data-parallel group, which here is every rank (and FSDP's all-gathers before it), so
  at that moment every rank has started, joined the process group, built its model and finished
  one training step. The event carries the step's tokens/s, from which the step's own duration
  is computed and reported (it is part of the number, and small).
* **teardown** — 1 s after "all ranks running", the worker process with ``RANK = N-1`` (on the
  last host) gets SIGKILL. Measured from the kill until no process of the run is left on any host
  (``tests.sshhosts.run_processes``: a /proc scan for the run's ``LLMTRAIN_RUN_ID``; the
  namespaces share this machine's process table, so one scan sees every host), polled every
  20 ms; also until the launcher itself exited.

Runs are interleaved (1, 2, 4, 8 hosts, then again), medians of the repetitions. The machine is
a shared 2-core VM: N hosts means N torchrun agents and N engine processes starting at once on
2 cores, so the start-up time grows with N here for CPU reasons that a real cluster does not have.
Every sshd, namespace and leftover process is removed at the end, also on error.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).parent))
import common  # noqa: E402

sys.path.insert(0, str(common.ROOT))
from tests.sshhosts import run_processes, run_processes_with, start_cluster  # noqa: E402
from tests import slurmcluster  # noqa: E402

CLI = [sys.executable, "-c", "from llmtrain.cli.app import main; main()"]
SEQ, GBS = 32, 8
START_TIMEOUT_S = 300.0
GONE_TIMEOUT_S = 60.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_recipe(path: Path, cluster) -> Path:
    data = yaml.safe_load((common.ROOT / "recipes" / "debug.yaml").read_text())
    data["parallel"] = {"tp": 1, "dp_shard": -1, "zero": 3}
    data["train"].update(seq_len=SEQ, micro_batch_size=1, global_batch_size=GBS, steps=1_000_000)
    data["launch"] = {"env": {"GLOO_SOCKET_IFNAME": cluster.ifname, "OMP_NUM_THREADS": "1"},
                      "rdzv_port": free_port()}
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


class Launcher:
    """``llmtrain launch`` in the background; every stdout line kept with its arrival time."""

    def __init__(self, cluster, cwd: Path, args: list[str]):
        env = cluster.env()
        env.pop("LLMTRAIN_ENGINE_MODULE", None)  # the real engine, not tests/fake_engine.py
        env.pop("PYTHONPATH", None)
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen([*CLI, "launch", *args], cwd=cwd, env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
        self.lines: list[tuple[float, str]] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line))

    def wait_for(self, pattern: str, timeout: float) -> tuple[float, re.Match]:
        rx, seen, deadline = re.compile(pattern), 0, time.monotonic() + timeout
        while True:
            for t, line in self.lines[seen:]:
                if m := rx.search(line):
                    return t, m
            seen = len(self.lines)
            if self.proc.poll() is not None:
                self.reader.join(2)
                if any(rx.search(line) for _, line in self.lines[seen:]):
                    continue
                raise RuntimeError(f"launcher exited {self.proc.returncode} before {pattern!r}:\n{self.text[-4000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"no {pattern!r} after {timeout:.0f} s:\n{self.text[-4000:]}")
            time.sleep(0.01)

    @property
    def text(self) -> str:
        return "".join(line for _, line in self.lines)

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def worker_pid(run_id: str, rank: int) -> int:
    """The engine process with this RANK (torchrun and the node helper carry no RANK)."""
    found = run_processes_with(run_id, f"RANK={rank}")
    if not found:
        raise RuntimeError(f"no worker with RANK={rank} in run {run_id}")
    return found[0]


def kill_leftovers(run_id: str | None) -> None:
    for pid in run_processes(run_id) if run_id else []:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def one_run(cluster, work: Path, n: int, backend: str = "ssh", stop: str = "kill-rank") -> dict:
    """One launch on ``n`` nodes (1 rank each), stopped by SIGKILL of the last rank (``kill-rank``)
    or SIGINT of the launcher (``ctrl-c``) 1 s after all ranks run; the timings of both ends."""
    cwd = Path(tempfile.mkdtemp(prefix=f"{backend}{n}-", dir=work))
    recipe = write_recipe(cwd / "r.yaml", cluster)
    if backend == "slurm":
        args, ready = [str(recipe), "--launcher", "slurm", "--nodes", str(n), "--gpus-per-node", "1"], \
            r"submitted Slurm job \d+"
    else:
        hosts = cwd / "hosts"
        hosts.write_text("".join(f"node{i} slots=1\n" for i in range(n)))
        args, ready = [str(recipe), "--hosts", str(hosts)], rf"^preflight: {n} of {n} hosts ready"
    load1 = os.getloadavg()[0]
    bg = Launcher(cluster, cwd, args)
    run_id = None
    try:
        t_pre, _ = bg.wait_for(ready, START_TIMEOUT_S)
        _, m = bg.wait_for(r"^run dir \S+/(\S+): \d+ ranks", START_TIMEOUT_S)
        run_id = m.group(1)
        t_run, m = bg.wait_for(r"^progress: step 1/\d+.*?([\d,.]+) tok/s", START_TIMEOUT_S)
        step1 = SEQ * GBS / float(m.group(1).replace(",", ""))
        time.sleep(1.0)
        if stop == "ctrl-c":
            os.kill(bg.proc.pid, signal.SIGINT)
        else:
            os.kill(worker_pid(run_id, n - 1), signal.SIGKILL)
        t_kill = time.monotonic()
        t_gone = t_exit = t_queue = None
        if backend != "slurm":
            t_queue = t_kill
        while time.monotonic() - t_kill < GONE_TIMEOUT_S:
            if t_exit is None and bg.proc.poll() is not None:
                t_exit = time.monotonic()
            if t_gone is None and not run_processes(run_id):
                t_gone = time.monotonic()
            if t_queue is None and not cluster.jobs():
                t_queue = time.monotonic()
            if t_gone is not None and t_exit is not None and t_queue is not None:
                break
            time.sleep(0.02)
        bg.proc.wait(timeout=30)
        bg.reader.join(5)
        if t_gone is None:
            raise RuntimeError(f"{n} hosts: processes of run {run_id} still alive {GONE_TIMEOUT_S:.0f} s after the kill")
        return {"backend": backend, "stop": stop, "hosts": n, "preflight_s": t_pre - bg.t0,
                "all_ranks_running_s": t_run - bg.t0, "step1_s": step1, "teardown_s": t_gone - t_kill,
                "launcher_exit_s": (t_exit - t_kill) if t_exit else None,
                "queue_empty_s": (t_queue - t_kill) if backend == "slurm" and t_queue else None,
                "exit_code": bg.proc.returncode, "run_id": run_id, "load1": load1}
    finally:
        bg.kill()
        kill_leftovers(run_id)


def summarize(runs: list[dict], sizes: list[int], groups: list[tuple[str, str]] = (("ssh", "kill-rank"),)) -> list[dict]:
    rows = []
    for (backend, stop), n in [(g, n) for g in groups for n in sizes]:
        mine = [r for r in runs if r["hosts"] == n and r.get("backend", "ssh") == backend and r.get("stop", "kill-rank") == stop]
        row = {"hosts": n, "runs": len(mine)} if len(groups) == 1 else \
            {"backend": backend, "stop": "rank SIGKILL" if stop == "kill-rank" else "Ctrl-C", "hosts": n, "runs": len(mine)}
        for key in ("preflight_s", "all_ranks_running_s", "step1_s", "teardown_s", "launcher_exit_s", "queue_empty_s"):
            vals = [r[key] for r in mine if r[key] is not None]
            row[key] = common.median(vals) if vals else None
            row[key[:-2] + "_max_s"] = max(vals) if vals else None
        row["load1"] = common.median([r["load1"] for r in mine])
        rows.append(row)
    return rows


def main() -> None:
    parser = common.parser(__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=("ssh", "slurm"), default="ssh",
                        help="ssh: 1-8 SSH hosts; slurm: the Slurm test cluster beside SSH, 1 and 2 nodes")
    parser.add_argument("--reps", type=int, default=None, help="repetitions (default 3; --tiny 1)")
    args = parser.parse_args()
    if args.backend == "slurm":
        return main_slurm(args)
    sizes, reps = ([1], 1) if args.tiny else ([1, 2, 4, 8], args.reps or 3)
    work = Path(tempfile.mkdtemp(prefix="llmtrain-launch-bench-"))
    cluster = None
    runs: list[dict] = []
    try:
        cluster = start_cluster(work / "cluster", max(sizes))
        for rep in range(reps):
            for n in sizes:
                r = one_run(cluster, work, n)
                r["rep"] = rep
                runs.append(r)
                print(json.dumps(r), flush=True)
    finally:
        if cluster is not None:
            cluster.stop()
        shutil.rmtree(work, ignore_errors=True)
    rows = summarize(runs, sizes)
    table = common.md_table(rows, [("hosts", "SSH hosts (1 rank each)"), ("preflight_s", "preflight done s"),
                                   ("all_ranks_running_s", "all ranks running s"), ("step1_s", "of which step 1 s"),
                                   ("teardown_s", "rank SIGKILL → no process left s"),
                                   ("teardown_max_s", "(max) s"), ("launcher_exit_s", "launcher exited s"),
                                   ("load1", "machine load avg"), ("runs", "runs")])
    notes = ("Medians over the runs (interleaved 1, 2, 4, 8 hosts per repetition). *All ranks running* = from spawning "
             "`llmtrain launch RECIPE --hosts HOSTFILE` until the launcher printed rank 0's first step event (step 1 "
             "ends with an all-reduce over every rank, so every rank has joined and trained one step); it includes "
             "preflight and the one training step shown. *Teardown* = from SIGKILL of the rank on the last host until "
             "a /proc scan finds no process carrying the run's `LLMTRAIN_RUN_ID` on any host. "
             f"Hosts: sshd in network namespaces on one 2-core VM ({cluster.mode if cluster else '?'} mode), so N hosts "
             "start N torchrun agents and N engines on the same 2 cores: the growth with N is mostly CPU contention "
             "here, not SSH. *Machine load avg* = the 1-minute load average when each launch started (median): other "
             "users' jobs shared the 2 cores, and every number grows with it. The issue's bound for teardown is 5 s.")
    common.publish(args, "launch_teardown", "Launch to all ranks running, and teardown after a killed rank (SSH)",
                   {"mode": cluster.mode if cluster else None, "sizes": sizes, "reps": reps, "seq_len": SEQ,
                    "global_batch_size": GBS, "rows": rows, "runs": runs}, table, notes)


def main_slurm(args) -> None:
    """Slurm and SSH interleaved on 1 and 2 nodes, each stopped by a killed rank and by Ctrl-C."""
    sizes, reps = ([2], 1) if args.tiny else ([1, 2], args.reps or 3)
    groups = [(b, s) for b in ("slurm", "ssh") for s in ("kill-rank", "ctrl-c")]
    work = Path(tempfile.mkdtemp(prefix="llmtrain-launch-bench-"))
    clusters: dict = {}
    runs: list[dict] = []
    try:
        clusters["slurm"] = slurmcluster.start_cluster(work / "slurm")
        clusters["ssh"] = start_cluster(work / "ssh", max(sizes))
        for rep in range(reps):
            for n in sizes:
                for backend, stop in groups:
                    r = one_run(clusters[backend], work, n, backend, stop)
                    r["rep"] = rep
                    runs.append(r)
                    print(json.dumps(r), flush=True)
    finally:
        for cluster in clusters.values():
            cluster.stop()
        shutil.rmtree(work, ignore_errors=True)
    rows = summarize(runs, sizes, groups)
    table = common.md_table(rows, [("backend", "backend"), ("hosts", "nodes (1 rank each)"), ("stop", "stopped by"),
                                   ("preflight_s", "submitted / preflight done s"),
                                   ("all_ranks_running_s", "all ranks running s"), ("step1_s", "of which step 1 s"),
                                   ("teardown_s", "stop → no process left s"), ("launcher_exit_s", "launcher exited s"),
                                   ("launcher_exit_max_s", "(max) s"), ("queue_empty_s", "squeue empty s"),
                                   ("load1", "machine load avg"), ("runs", "runs")])
    notes = ("Medians over the runs; per repetition the sizes and then the four (backend, stop) pairs are interleaved, "
             "so Slurm and SSH share the machine's load. Same recipe as the SSH section (debug model, tp 1, FSDP over "
             "all ranks, seq 32, global batch 8), real engine. *Submitted / preflight done* = from spawning `llmtrain "
             "launch RECIPE --launcher slurm --nodes N` until it printed `submitted Slurm job ID` (recipe validation, "
             "the partition check, `sbatch --test-only`, the run directory, `sbatch --parsable`); over SSH until "
             "`preflight: N of N hosts ready`. *All ranks running* = until rank 0's first step event was printed "
             "(step 1 ends with an all-reduce over every rank); with Slurm it includes scheduling, srun and reading the "
             "logs from the shared run directory (polled every 0.1 s). *Stop* = 1 s after that, SIGKILL of the rank on "
             "the last node, or SIGINT of the launcher (Ctrl-C); *no process left* = a /proc scan finds no process "
             "with the run's `LLMTRAIN_RUN_ID` on any node; *squeue empty* = `squeue` lists no job (Slurm's own "
             "teardown: slurmstepd, cgroups, epilog). Test cluster: slurmctld + 2 slurmd in network namespaces on one "
             "2-core VM (tests/slurmcluster.py), `KillWait=5`, `proctrack/cgroup`. The issue's bound: the job ends "
             "and llmtrain exits within 10 s of a killed rank or a Ctrl-C. Compare rows within this table only "
             "(one session, one load); *machine load avg* is the 1-minute load when each launch started.")
    common.publish(args, "launch_teardown_slurm", "Launch and teardown: Slurm beside SSH (same recipe, same session)",
                   {"sizes": sizes, "reps": reps, "seq_len": SEQ, "global_batch_size": GBS, "rows": rows, "runs": runs},
                   table, notes)


if __name__ == "__main__":
    main()
