"""``llmtrain launch --launcher slurm`` against a real Slurm cluster (tests/slurmcluster.py).

The cluster: slurmctld + munged here, two slurmd "nodes" in their own network namespaces,
sharing this machine's filesystem (the run directory is the shared storage) and process table
(one /proc scan for the run's ``LLMTRAIN_RUN_ID`` covers every node). The CLI runs in a
subprocess with the cluster's ``SLURM_CONF``. The ranks are ``tests/fake_engine.py`` except in
the one real training run (the debug recipe, 2 nodes x 1 rank, gloo over the nodes' ``eth0``).

The dry run and the checks that need no cluster (a missing ``sbatch``, bad options) run
everywhere; the rest skip only where the cluster cannot start (not root, packages missing),
and fail under ``CI=true``.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.background import Background
from tests.slurmcluster import get_cluster
from tests.sshhosts import run_processes

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "debug.yaml"
CLI = [sys.executable, "-c", "from llmtrain.cli.app import main; main()"]
STOP_S = 10.0  # the bound: a killed rank or a cancelled launch ends the job within 10 s
SECRET = "tok-5e3c7a9b1d"
OTHER = "other-7f1e2d3c4b"  # a launch.env secret: it does travel in the job's environment (warned)
FILE_PLAIN = "a b;rm -rf ~ $(id)"  # an env file value that must arrive verbatim, nothing run


def env_file(path: Path) -> Path:
    """An env file with a secret-named and a plain variable (launch.env_file)."""
    path.write_text(f"MY_API_TOKEN={SECRET}\nexport FILE_PLAIN='{FILE_PLAIN}'\n")
    return path
TRAINED: dict[str, Path] = {}  # the real training run's directory: the uninterrupted reference of test_launch_slurm_faults


@pytest.fixture(scope="session")
def cluster(request, tmp_path_factory):
    return get_cluster(request.config, tmp_path_factory)


def write_recipe(path: Path, steps: int = 3, *, env_file: Path | None = None, **env: str) -> Path:
    """debug.yaml for 2 nodes x 1 rank (tp 1, dp 2) with gloo on the nodes' interface."""
    launch = {"env": {"GLOO_SOCKET_IFNAME": "eth0", **env}, "env_passthrough": ["FAKE_ENGINE_*"],
              "rdzv_port": 29400 + os.getpid() % 500, "grace_s": 2, **({"env_file": str(env_file)} if env_file else {})}
    text = RECIPE.read_text().replace("steps: 60", f"steps: {steps}").replace("tp: 2", "tp: 1")
    text = text.replace("nodes: 1, gpus_per_node: 4", "nodes: 2, gpus_per_node: 1")
    text = text.replace("warmup_steps: 5", "warmup_steps: 1")
    path.write_text(text + "launch: " + json.dumps(launch) + "\n")
    return path


def base_env(**extra: str) -> dict[str, str]:
    keep = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "LLMTRAIN_", "FAKE_ENGINE_"))}
    keep.update(PYTHONPATH=str(REPO / "tests"), COLUMNS="250", OMP_NUM_THREADS="1")
    keep.update(extra)
    return keep


def cli(env: dict[str, str], cwd: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


# ----------------------------------------------------------------------------- no cluster needed


def test_pure_parts_quote_references_read_exit_codes_and_one_line_messages():
    from llmtrain.launch.launchplan import shell_words
    from llmtrain.launch.backends.slurmctl import exit_code, one_line

    assert shell_words(["--rdzv-endpoint", "$MASTER_ADDR:29500", "a b", "$HOME"]) == \
        """--rdzv-endpoint "$MASTER_ADDR":29500 'a b' '$HOME'"""  # only the plan's own reference expands
    assert [exit_code({"ExitCode": v}) for v in ("0:0", "1:0", "0:9", "143:0", "")] == [0, 1, 137, 143, None]
    assert one_line("sbatch: error: Batch job submission failed: Invalid account\n") == \
        "Batch job submission failed: Invalid account"
    from llmtrain.errors import LLMTrainError
    from llmtrain.launch.backends.slurm_script import SlurmOptions

    SlurmOptions(2, 8, "gpu", "proj-1", "1-00:00:00", extra=("--qos=high", "--exclusive")).check()
    SlurmOptions(2, 8, time="UNLIMITED").check()
    with pytest.raises(LLMTrainError) as err:
        SlurmOptions(2, 8, "gpu;rm", time="soon", extra=("--export=NONE", "--nodes=4", "-x")).check()
    assert err.value.lines() == [
        "--partition: 'gpu;rm' is not a Slurm name; use letters, digits and . _ + - (sinfo -s lists the partitions)",
        "--time: 'soon' is not a Slurm time limit; write HH:MM:SS, MM or D-HH:MM:SS (sbatch --time)",
        "--slurm-arg: --export is set by llmtrain's job script; drop it (docs/launch.md, Slurm)",
        "--slurm-arg: --nodes is set by llmtrain's job script; use llmtrain's --nodes option",
        "--slurm-arg: '-x' is not one sbatch option; pass one long option per --slurm-arg, e.g. --slurm-arg=--qos=high"]


def test_end_code_maps_a_failure_seen_after_the_job_ended():
    """The batch job's final code (slurm_watch.end_code): the env-file failure is 2 even when every
    node failed at once and srun's kill-on-bad-exit ended the job 143 before the watcher stopped it
    (the race CI met); a torchrun failure hidden by 143 is 1; clean and unknown ends as before."""
    from llmtrain.launch.backends.slurm_watch import end_code

    env = "llmtrain: launch.env_file: env file not found: /x/e on node n0; put the env file on storage ..."
    worker = "[default0]: failed (exitcode: 3) local_rank: 0 (pid: 7) of binary: python"
    assert end_code(143, "FAILED", env, stopped=False, step_loop=False) == 2
    assert end_code(2, "FAILED", env, stopped=False, step_loop=False) == 2
    assert end_code(143, "CANCELLED", env, stopped=True, step_loop=False) == 2
    assert end_code(143, "FAILED", worker, stopped=False, step_loop=False) == 1
    assert end_code(3, "FAILED", worker, stopped=True, step_loop=False) == 3
    assert end_code(0, "COMPLETED", None, stopped=False, step_loop=False) == 0
    assert end_code(0, "NODE_FAIL", None, stopped=False, step_loop=False) == 1
    assert end_code(143, "FAILED", None, stopped=False, step_loop=False) == 143  # nothing seen: Slurm's code
    assert end_code(143, "FAILED", None, stopped=False, step_loop=True) == 1
    assert end_code(None, "UNKNOWN", None, stopped=False, step_loop=False) == 1


def test_a_failure_read_after_the_end_is_still_named_once():
    """The watcher's final read can be the first to see the failure (srun's kill-on-bad-exit ended
    the job before the next poll; CI met it on the env-file test): the run still prints the
    launcher's line naming the host and the cause, saying the job had ended; not when the watcher
    already stopped the job for that failure (its line was printed then), nor without a failure."""
    from llmtrain.launch.backends.slurm_watch import SlurmRun

    lines: list[str] = []
    run = SlurmRun.__new__(SlurmRun)  # the state _failure_after_end reads; no job, no files
    run.job_id, run.hosts, run.display = "8", ["n0", "n1"], type("D", (), {"line": staticmethod(lines.append)})()
    run.failed, run.stopped_for_failure = (1, "llmtrain: launch.env_file: env file not found: /x/e on node n1; put"), False
    run._failure_after_end()
    assert lines == ["[launcher] a rank failed on n1 (it cannot read launch.env_file): Slurm job 8 had already ended"]
    run.failed = (0, "[default0]: failed (exitcode: 3) local_rank: 1 (pid: 7) of binary: python")
    run._failure_after_end()
    assert lines[-1] == "[launcher] a rank failed on n0 (local rank 1 exited with 3): Slurm job 8 had already ended"
    run.stopped_for_failure = True
    run._failure_after_end()
    run.failed, run.stopped_for_failure = None, False
    run._failure_after_end()
    assert len(lines) == 2


def test_dry_run_prints_job_script_and_every_node_command_and_creates_nothing(tmp_path):
    """PATH holds no Slurm client: any sbatch/scontrol call would fail the command (exit 2), so
    exit 0 proves the dry run ran none; no runs/ proves it created nothing."""
    (tmp_path / "e").write_text(f"FILE_TOKEN={SECRET}\nFILE_PLAIN=plain-from-file\nX=shadowed\n")
    recipe = write_recipe(tmp_path / "r.yaml", MY_API_TOKEN=OTHER, X="a b;echo PWNED", env_file=tmp_path / "e")
    result = cli(base_env(PATH="/nonexistent", HF_TOKEN=OTHER + "-hf"), tmp_path, "launch", str(recipe), "--launcher",
                 "slurm", "--dry-run", "--partition", "gpu", "--account", "proj1", "--time", "01:30:00",
                 "--slurm-arg=--qos=high")
    out = result.stdout
    assert result.returncode == 0, out + result.stderr  # no Slurm client on PATH: a dry run runs none
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1", "#SBATCH --partition=gpu", "#SBATCH --account=proj1",
                 "#SBATCH --time=01:30:00", "#SBATCH --qos=high", "#SBATCH --export=ALL",
                 'MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"'):
        assert f"\n{line}\n" in out, line
    assert "--gpus-per-node" not in out  # a CPU recipe asks Slurm for no GPUs
    srun = next(line for line in out.splitlines() if line.startswith("exec srun "))
    assert "--kill-on-bad-exit=1" in srun and "--ntasks-per-node=1" in srun and "/logs/slurm/node-%n.out" in srun
    commands = [line for line in out.splitlines() if line.startswith("cd ")]
    assert len(commands) == 2
    for rank, line in enumerate(commands):
        assert f"--node-rank {rank} " in line and '--rdzv-endpoint "$MASTER_ADDR":' in line
        assert "--nnodes 2 --nproc-per-node 1" in line and "MY_API_TOKEN=**** " in line and "X='a b;echo PWNED'" in line
        assert "LLMTRAIN_NODE_ID=" in line and f".{rank} " in line.split("LLMTRAIN_NODE_ID=")[1][:40]
    case_lines = [line for line in out.splitlines() if re.match(r"^[01]\) cd ", line)]
    assert len(case_lines) == 2 and all("MY_API_TOKEN" not in line and "PWNED" not in line for line in case_lines)
    # the env file's values never go through Slurm: each node's torchrun starts under envexec, which reads the file
    envexec = f" -m llmtrain.launch.envexec --env-file {tmp_path / 'e'} --only FILE_PLAIN,FILE_TOKEN -- "
    assert all(envexec in line and "plain-from-file" not in line for line in case_lines), case_lines[0]
    assert "values are not written here): GLOO_SOCKET_IFNAME HF_TOKEN MY_API_TOKEN PYTHONPATH X\n" in out  # X: launch.env
    assert f"# read by each node from launch.env_file {tmp_path / 'e'} (never sent through Slurm): FILE_PLAIN " \
           "FILE_TOKEN\n" in out
    assert out.startswith("warning: secrets in the Slurm job's environment, which slurmctld keeps on the controller's "
                          "disk while it knows the job: HF_TOKEN (passed through from this shell), MY_API_TOKEN "
                          "(launch.env); put them into launch.env_file"), out
    assert SECRET not in out + result.stderr and OTHER not in out + result.stderr
    assert out.rstrip().splitlines()[-1].startswith("dry run: nothing was created or submitted")
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("args, words", [
    ([], ["sbatch squeue scontrol scancel not found on PATH", "--launcher ssh"]),
    (["--time", "tomorrow"], ["--time: 'tomorrow' is not a Slurm time limit", "HH:MM:SS"]),
    (["--slurm-arg", "-N 3"], ["--slurm-arg: '-N 3' is not one sbatch option", "--slurm-arg=--qos=high"]),
    (["--hosts", "hostfile"], ["--hosts does not apply to --launcher slurm"]),
], ids=["no-sbatch", "bad-time", "bad-slurm-arg", "hosts"])
def test_bad_input_without_a_cluster_is_one_line_and_creates_nothing(tmp_path, args, words):
    recipe = write_recipe(tmp_path / "r.yaml")
    result = cli(base_env(PATH="/nonexistent"), tmp_path, "launch", str(recipe), "--launcher", "slurm", *args)
    assert result.returncode == 2, result.stdout + result.stderr
    line = result.stderr.strip()
    assert len(line.splitlines()) == 1 and "Traceback" not in result.stderr, result.stderr
    for word in words:
        assert word in line, line
    assert not (tmp_path / "runs").exists()


# ----------------------------------------------------------------------------- on the cluster


@pytest.mark.parametrize("args, words", [
    (["--partition", "nosuch"], ["--partition: partition 'nosuch' does not exist on this cluster",
                                 "use one of: debug, gated"]),
    (["--nodes", "3"], ["--nodes: 3 nodes do not fit partition 'debug': it has 2 node(s)", "use --nodes 2 or less"]),
    (["--partition", "gated", "--account", "nosuch"], ["--account: sbatch refused the job: Invalid account",
                                                       "pass an account you may use", "nothing was submitted"]),
    (["--set", "cluster.gpu=h100-sxm"], ["--gpus-per-node: sbatch refused the job: Invalid generic resource",
                                         "pick a GPU --partition", "nothing was submitted"]),
], ids=["unknown-partition", "too-many-nodes", "rejected-account", "gpus-the-nodes-lack"])
def test_slurm_refusals_are_one_line_with_the_fix_and_submit_nothing(cluster, tmp_path, args, words):
    recipe = write_recipe(tmp_path / "r.yaml")
    if "--nodes" in args:  # 3 nodes x 1 rank: a valid layout, which only the partition cannot hold
        args = [*args, "--set", "train.global_batch_size=12", "--set", "train.micro_batch_size=4"]
    before = cluster.known_jobs()
    result = cli(cluster.env(), tmp_path, "launch", str(recipe), "--launcher", "slurm", *args)
    assert result.returncode == 2, result.stdout + result.stderr
    line = result.stderr.strip()
    assert len(line.splitlines()) == 1 and "Traceback" not in result.stderr, result.stderr
    for word in words:
        assert word in line, line
    assert cluster.new_jobs(before) == [] and cluster.jobs() == []
    assert not (tmp_path / "runs").exists()  # all checked before the run dir exists (sbatch --test-only for the account)


def test_real_engine_trains_on_two_slurm_nodes(cluster, tmp_path):
    """The one real training run: the debug recipe (dp 2) for 3 steps, one rank on each node
    (torchrun started through envexec: the recipe has an env file)."""
    recipe = write_recipe(tmp_path / "r.yaml", steps=3, env_file=env_file(tmp_path / "e"))
    result = cli(cluster.env(OMP_NUM_THREADS="1"), tmp_path, "launch", str(recipe), "--launcher", "slurm",
                 timeout=240)
    out = result.stdout
    assert result.returncode == 0, out[-6000:] + result.stderr
    assert re.search(r"submitted Slurm job (\d+) \(partition debug\)", out)
    n0, n1 = cluster.nodes
    assert "[slurm] job " in out and f"running on {n0}, {n1}" in out
    assert re.search(rf"^\[{n0}:0\] ", out, re.M) and re.search(rf"^\[{n1}\] ", out, re.M)
    assert "progress: step 3/3" in out and "== run finished: exit code 0 (Slurm job" in out
    run = next((tmp_path / "runs" / "debug").iterdir())
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]
    assert (run / "hostfile").read_text() == f"{n0} slots=1\n{n1} slots=1\n"
    assert (run / "slurm" / "job.sbatch").read_text().startswith("#!/bin/bash\n")
    assert " -m llmtrain.launch.envexec --env-file " in (run / "slurm" / "node.sh").read_text()
    assert cluster.jobs() == [] and run_processes(run.name) == []
    TRAINED["run"] = run


def test_env_file_the_nodes_cannot_read_fails_the_check_and_the_launch_in_one_line(cluster, tmp_path):
    """Each node reads launch.env_file itself (envexec): ``hosts check --launcher slurm`` checks it
    there, and a launch whose nodes cannot read it fails at once with one line, no traceback.
    "Not shared storage" is real here: a tmpfs mounted after the cluster started is invisible
    to the nodes (each slurmd runs in a private mount namespace, tests/slurmcluster.py)."""
    recipe = write_recipe(tmp_path / "r.yaml", env_file=env_file(tmp_path / "e"))
    result = cli(cluster.env(), tmp_path, "hosts", "check", "--launcher", "slurm", "--recipe", str(recipe), "--json")
    assert result.returncode == 0, result.stdout + result.stderr
    assert [h["checks"]["env_file"]["value"] for h in json.loads(result.stdout)["hosts"]] == [
        f"{tmp_path / 'e'} readable on {node} with every variable the launcher read" for node in cluster.nodes]
    private = tmp_path / "private"
    private.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(private)], check=True)
    try:
        recipe = write_recipe(tmp_path / "r.yaml", env_file=env_file(private / "e"))
        check = cli(cluster.env(), tmp_path, "hosts", "check", "--launcher", "slurm", "--recipe", str(recipe), "--json")
        assert check.returncode == 1, check.stdout + check.stderr
        for host, node in zip(json.loads(check.stdout)["hosts"], cluster.nodes):
            assert host["checks"]["env_file"] == {
                "name": "env_file", "status": "fail", "value": f"launch.env_file: env file not found: {private / 'e'} on node {node}",
                "hint": "put the env file on storage every node mounts at the same path (like the run directory), "
                        "or fix launch.env_file"}
        launch = cli(cluster.env(), tmp_path, "launch", str(recipe), "--launcher", "slurm", timeout=120)
    finally:
        subprocess.run(["umount", str(private)], check=True)
    out = launch.stdout
    assert launch.returncode == 2 and "Traceback" not in out + launch.stderr, out + launch.stderr
    # the first node's line cancels the job (the other node's may not come before), or, when srun's
    # --kill-on-bad-exit ended the job before the watcher's next poll, is named after the end (seen in CI)
    assert any(f"[{node}] llmtrain: launch.env_file: env file not found: {private / 'e'} on node {node}; put the env "
               "file on storage every node mounts at the same path" in out for node in cluster.nodes), out
    assert re.search(r"\[launcher\] a rank failed on \S+ \(it cannot read launch.env_file\): "
                     r"(cancelling Slurm job \d+ \(scancel\) now|Slurm job \d+ had already ended)", out), out
    assert "== run failed: exit code 2 (Slurm job" in out and SECRET not in out + launch.stderr
    assert cluster.jobs() == []


def _sleeping_job(cluster, tmp_path: Path, **env: str) -> tuple[Background, Path]:
    """Ranks of fake_engine sleeping on both nodes; MY_API_TOKEN and FILE_PLAIN from an env file."""
    recipe = write_recipe(tmp_path / "r.yaml", steps=6, OTHER_TOKEN=OTHER, T_TRICKY="a b;echo PWNED $(id)",
                          env_file=env_file(tmp_path / "e"))
    bg = Background(cluster.env(LLMTRAIN_ENGINE_MODULE="fake_engine", FAKE_ENGINE_SLEEP="60",
                                UNRELATED_VAR="must-not-travel", **env),
                    tmp_path, "launch", str(recipe), "--launcher", "slurm")
    n0, n1 = cluster.nodes
    bg.wait_for(f"[{n0}:0] rank 0 sleeping", f"[{n1}:1] rank 1 sleeping")
    return bg, next((tmp_path / "runs" / "debug").iterdir())


def environ(pid: int) -> bytes:
    with open(f"/proc/{pid}/environ", "rb") as fp:
        return fp.read()


def _gone(cluster, run_id: str, timeout: float) -> tuple[list[int], list[str]]:
    deadline = time.monotonic() + timeout
    while (run_processes(run_id) or cluster.jobs()) and time.monotonic() < deadline:
        time.sleep(0.1)
    return run_processes(run_id), cluster.jobs()


def job_files(cluster) -> list[Path]:
    """Every file of slurmctld's StateSaveLocation and the slurmds' SlurmdSpoolDir (tests/slurmcluster.py)."""
    return [f for sub in ("state", "spool") for f in (cluster.root / sub).rglob("*") if f.is_file()]


def test_rank_killed_with_sigkill_ends_the_job_and_the_launch_within_10s(cluster, tmp_path):
    """Also the job's environment: exactly the policy, secrets arrive literally. The env file's
    values are on no disk but the env file's: not in the run directory, not in slurmctld's state
    (the job's ``environment`` file, which exists while the job does and holds the launch.env
    secret: so the search looks at the right file), not in the slurmds' spool.

    Bound: the issue's 10 s from the kill to llmtrain's exit. Measured: 1.5 s on a quiet
    machine; 3-11 s with the 2 cores at load 18-36 (torchrun's own exit after the failure, and
    after srun's SIGTERM, slows down there; KillWait=5 s caps the second)."""
    bg, run = _sleeping_job(cluster, tmp_path, FAKE_ENGINE_ENV_DUMP=str(tmp_path / "env"))
    try:
        for rank in (0, 1):
            data = json.loads((tmp_path / f"env.{rank}.json").read_text())
            assert data["env"]["MY_API_TOKEN"] == SECRET and data["env"]["T_TRICKY"] == "a b;echo PWNED $(id)"
            assert data["env"]["FILE_PLAIN"] == FILE_PLAIN and data["env"]["OTHER_TOKEN"] == OTHER
            assert "UNRELATED_VAR" not in data["env"] and data["env"]["LLMTRAIN_NODE_ID"] == f"{run.name}.{rank}"
            assert data["netns"] == f"net:[{os.stat(f'/run/netns/{cluster.netns[rank]}').st_ino}]"  # on its node
        job_id = re.search(r"submitted Slurm job (\d+)", bg.text).group(1)
        stored = list((cluster.root / "state").glob(f"hash.*/job.{job_id}/environment"))
        assert len(stored) == 1 and OTHER.encode() in stored[0].read_bytes()  # what travels through Slurm is stored
        assert "warning: secrets in the Slurm job's environment, which slurmctld keeps on the controller's disk " \
               "while it knows the job: OTHER_TOKEN (launch.env); put them into launch.env_file" in bg.text
        for path in [*run.rglob("*"), *job_files(cluster)]:
            if path.is_file():
                data = path.read_bytes()
                assert SECRET.encode() not in data and FILE_PLAIN.encode() not in data, path
        worker = next(pid for pid in run_processes(run.name) if b"\0RANK=1\0" in b"\0" + environ(pid))
        os.kill(worker, signal.SIGKILL)
        t0 = time.monotonic()
        rc = bg.proc.wait(timeout=60)
        elapsed = time.monotonic() - t0
    finally:
        bg.kill()
    bg.reader.join(5)
    print(f"kill -9 -> llmtrain exit: {elapsed:.2f} s (load {open('/proc/loadavg').read().split()[0]})")
    assert rc != 0 and elapsed < STOP_S, (rc, elapsed, bg.text)
    n1 = cluster.nodes[1]
    assert f"[launcher] a rank failed on {n1} (local rank 0 exited with -9): cancelling Slurm job " in bg.text
    assert "== run failed: exit code 1 (Slurm job" in bg.text and SECRET not in bg.text
    left, jobs = _gone(cluster, run.name, 2.0)
    assert left == [] and jobs == []


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_launcher_signal_cancels_the_job_within_10s(cluster, tmp_path, signum):
    """SIGTERM, and Ctrl-C (SIGINT: the run's own tracebacks then go to the logs only)."""
    bg, run = _sleeping_job(cluster, tmp_path)
    try:
        os.kill(bg.proc.pid, signum)
        t0 = time.monotonic()
        rc = bg.proc.wait(timeout=60)
        elapsed = time.monotonic() - t0
    finally:
        bg.kill()
    bg.reader.join(5)
    name, code = signal.Signals(signum).name, 128 + signum
    assert rc == code and elapsed < STOP_S, (rc, elapsed, bg.text)
    assert f"[launcher] {name} received: cancelling Slurm job" in bg.text
    assert f"== run stopped by {name}: exit code {code}" in bg.text
    if signum == signal.SIGINT:
        assert "Traceback" not in bg.text and "interrupted: stopped 2 ranks on 2 nodes" in bg.text
    left, jobs = _gone(cluster, run.name, 1.0)  # the launcher waited until squeue no longer listed the job
    assert left == [] and jobs == []


# ----------------------------------------------------------------------------- inside an allocation
