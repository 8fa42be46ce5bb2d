"""``llmtrain launch`` / ``plan`` inside a Slurm allocation, on the real test cluster
(tests/slurmcluster.py): one srun step on the allocated nodes, no nested job, and the user's
allocation survives a failure or Ctrl-C (issue 15 item 3; docs/launch.md "Inside an allocation")."""

from __future__ import annotations

import json
import os
import re
import signal
import time

import pytest

from tests.sshhosts import run_processes
from tests.test_launch_slurm import (FILE_PLAIN, SECRET, STOP_S, Background, base_env, cli, cluster, env_file,  # noqa: F401
                                     environ, job_files, write_recipe)


STEP_ONLY = "step-only-9a8b7c6d"  # a launch.env secret of this file only (the batch tests' one IS in slurmctld's state)


def _allocation(cluster) -> tuple[str, dict[str, str]]:
    """``salloc -N2 --no-shell``: a real allocation; its SLURM_* as salloc would give its shell."""
    out = cluster.client("salloc", "-N2", "--no-shell", "-J", "user-alloc", timeout=60)
    job = re.search(r"Granted job allocation (\d+)", out.stderr + out.stdout)
    assert job, out.stderr + out.stdout
    job_id = job.group(1)
    nodelist = re.search(r" NodeList=(\S+)", cluster.client("scontrol", "show", "job", "-o", job_id).stdout).group(1)
    return job_id, {"SLURM_JOB_ID": job_id, "SLURM_JOB_NODELIST": nodelist, "SLURM_JOB_NUM_NODES": "2"}


def test_inside_an_allocation_plan_and_launch_use_it_with_one_srun_step(cluster, tmp_path):
    """salloc --no-shell, then llmtrain with that allocation's SLURM_* on the submit host (as in
    salloc's shell): plan reports 2 nodes; launch trains the debug recipe (dp 2, 3 steps) as one
    step of that job (no new job), both nodes' lines prefixed; after it no step and no process is
    left, and the allocation itself is still there (it is the user's)."""
    recipe = write_recipe(tmp_path / "r.yaml", steps=3, env_file=env_file(tmp_path / "e"))  # torchrun under envexec
    job_id, slurm_env = _allocation(cluster)
    try:
        env = cluster.env(OMP_NUM_THREADS="1", **slurm_env)
        planned = cli({**env, "PATH": "/nonexistent" + os.pathsep + env["PATH"]}, tmp_path, "plan", str(recipe),
                      "--set", "cluster.nodes=1", "--json")
        assert planned.returncode == 0, planned.stderr
        assert f"planning for Slurm allocation {job_id}: 2 node(s) (SLURM_JOB_NUM_NODES) x 1 GPU(s) per node " \
               "(cluster.gpus_per_node)" in planned.stderr
        assert json.loads(planned.stdout)["world_size"] == 2
        before = cluster.known_jobs()
        result = cli(env, tmp_path, "launch", str(recipe), timeout=240)
        out = result.stdout
        assert result.returncode == 0, out[-6000:] + result.stderr
        n0, n1 = cluster.nodes
        assert f"inside Slurm allocation {job_id}: 2 of its 2 node(s) x 1 rank(s) (cluster.gpus_per_node)" in out
        assert re.search(rf"^\[{n0}:0\] ", out, re.M) and re.search(rf"^\[{n1}\] ", out, re.M)
        assert "progress: step 3/3" in out and f"== run finished: exit code 0 (Slurm job {job_id}: step" in out
        assert cluster.new_jobs(before) == []  # no nested job
        run = next((tmp_path / "runs" / "debug").iterdir())
        assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]
        steps = cluster.client("squeue", "-h", "-s", "-j", job_id, "-o", "%i %j").stdout
        assert "llmtrain-" not in steps and run_processes(run.name) == []
        assert cluster.jobs() == [job_id]
    finally:
        cluster.client("scancel", job_id)


@pytest.mark.parametrize("how", ["rank-SIGKILL", "launcher-SIGINT"])
def test_inside_an_allocation_a_failure_or_ctrl_c_stops_the_step_not_the_allocation(cluster, tmp_path, how):
    """Bound: the issue's 10 s (kill -> llmtrain's exit), as for the batch path. The step is
    stopped (scancel JOBID.STEPID), every process of the run is gone, the allocation stays.
    The env file's values reach the ranks (envexec on each node) and no file of Slurm's or the run's;
    nor does a launch.env secret, which travels in the step's environment (srun hands it to slurmd
    in memory: no warning is printed for it here, unlike for a batch job)."""
    recipe = write_recipe(tmp_path / "r.yaml", steps=6, OTHER_TOKEN=STEP_ONLY, env_file=env_file(tmp_path / "e"))
    job_id, slurm_env = _allocation(cluster)
    try:
        bg = Background(cluster.env(LLMTRAIN_ENGINE_MODULE="fake_engine", FAKE_ENGINE_SLEEP="60",
                                    FAKE_ENGINE_ENV_DUMP=str(tmp_path / "env"), **slurm_env),
                        tmp_path, "launch", str(recipe))
        n0, n1 = cluster.nodes
        bg.wait_for(f"[{n0}:0] rank 0 sleeping", f"[{n1}:1] rank 1 sleeping")
        run = next((tmp_path / "runs" / "debug").iterdir())
        for rank in (0, 1):
            got = json.loads((tmp_path / f"env.{rank}.json").read_text())["env"]
            assert got["MY_API_TOKEN"] == SECRET and got["FILE_PLAIN"] == FILE_PLAIN and got["OTHER_TOKEN"] == STEP_ONLY
        for path in [*run.rglob("*"), *job_files(cluster)]:
            if path.is_file():
                assert SECRET.encode() not in path.read_bytes() and STEP_ONLY.encode() not in path.read_bytes(), path
        assert "warning: secrets in the Slurm job's environment" not in bg.text
        try:
            if how == "rank-SIGKILL":
                os.kill(next(pid for pid in run_processes(run.name) if b"\0RANK=1\0" in b"\0" + environ(pid)),
                        signal.SIGKILL)
            else:
                os.kill(bg.proc.pid, signal.SIGINT)
            t0 = time.monotonic()
            rc = bg.proc.wait(timeout=60)
            elapsed = time.monotonic() - t0
        finally:
            bg.kill()
        bg.reader.join(5)
        print(f"{how} -> llmtrain exit: {elapsed:.2f} s (load {open('/proc/loadavg').read().split()[0]})")
        step = f"srun step llmtrain-{run.name} of job {job_id}"
        if how == "rank-SIGKILL":
            assert rc == 1 and elapsed < STOP_S, (rc, elapsed, bg.text)
            assert f"[launcher] a rank failed on {n1} (local rank 0 exited with -9): stopping the {step} now" in bg.text
            assert "== run failed: exit code 1" in bg.text
        else:
            assert rc == 130 and elapsed < STOP_S, (rc, elapsed, bg.text)
            assert f"[launcher] SIGINT received: stopping the {step}" in bg.text and "Traceback" not in bg.text
        deadline = time.monotonic() + 2.0  # the allocation stays listed: wait for the run's processes only
        while run_processes(run.name) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = run_processes(run.name)
        steps = cluster.client("squeue", "-h", "-s", "-j", job_id, "-o", "%i %j").stdout
        assert left == [] and "llmtrain-" not in steps and cluster.jobs() == [job_id]
    finally:
        cluster.client("scancel", job_id)


def test_allocation_from_the_environment_and_its_refusals(tmp_path):
    """Pure: what SLURM_* give, the ranks-per-node rule, and the one-line errors (no cluster)."""
    from llmtrain.errors import LLMTrainError
    from llmtrain.launch.backends.slurm_alloc import allocation_from_env

    assert allocation_from_env({}) is None
    alloc = allocation_from_env({"SLURM_JOBID": "7", "SLURM_NODELIST": "n[0-3]", "SLURM_NNODES": "4",
                                 "SLURM_GPUS_ON_NODE": "8", "SLURM_NTASKS_PER_NODE": "1"})
    assert (alloc.job_id, alloc.nodes, alloc.node_count(None), alloc.node_count(2)) == ("7", 4, 4, 2)
    assert alloc.ranks_per_node(None, 2) == (8, "SLURM_GPUS_ON_NODE") and alloc.ranks_per_node(4, 2)[0] == 4
    for env, words in (({"SLURM_JOB_ID": "7"}, "SLURM_JOB_ID=7 is set but SLURM_JOB_NODELIST is not"),
                       ({"SLURM_JOB_ID": "x"}, "'x' is not a job id")):
        with pytest.raises(LLMTrainError) as err:
            allocation_from_env(env)
        assert words in str(err.value)
    with pytest.raises(LLMTrainError) as err:
        alloc.node_count(5)
    assert "--nodes 5 is more than the 4 node(s) of Slurm allocation 7" in str(err.value)
    recipe = write_recipe(tmp_path / "r.yaml")
    inside = base_env(PATH="/nonexistent", SLURM_JOB_ID="7", SLURM_JOB_NODELIST="n[0-1]", SLURM_JOB_NUM_NODES="2")
    result = cli(inside, tmp_path, "launch", str(recipe), "--partition", "gpu")
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [
        "error: --partition: --partition does not apply inside Slurm allocation 7 (it is already allocated); "
        "drop the flag, or run llmtrain outside the allocation"], result.stderr
    dry = cli(inside, tmp_path, "launch", str(recipe), "--dry-run")  # no Slurm client on PATH: none ran
    assert dry.returncode == 0, dry.stdout + dry.stderr
    assert "inside Slurm allocation 7: 2 of its 2 node(s) x 1 rank(s) (cluster.gpus_per_node)" in dry.stdout
    assert re.search(r"^srun --jobid=7 --job-name=llmtrain-\S+ --kill-on-bad-exit=1 --nodes=2 ", dry.stdout, re.M)
    assert not (tmp_path / "runs").exists()
