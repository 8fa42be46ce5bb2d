"""``llmtrain resume --launcher slurm --ckpt latest``: a run continued as one Slurm batch job.

The base run is the session's real tiny run (tests/conftest.py ``crafted_run``: 1 CPU rank, 2
steps, checkpoints step-1 and step-2), cloned with its logs; the resume raises ``train.steps`` to 3 and runs on the Slurm
test cluster (tests/slurmcluster.py, one node), in the run's own directory (shared storage:
the nodes share this machine's filesystem). Checked: it trains exactly step 3 from step-2's
checkpoint, in the same run directory (old logs kept as ``logs.prev-1``), and leaves no job.
"""

from __future__ import annotations

import json
import shutil
import sys

from tests.ckpt_craft import clone_run
from tests.slurmcluster import get_cluster

CLI = [sys.executable, "-c", "from llmtrain.cli.app import main; main()"]


def test_resume_latest_as_a_slurm_job_continues_in_the_same_run_dir(request, tmp_path_factory, tmp_path, crafted_run):
    import subprocess

    cluster = get_cluster(request.config, tmp_path_factory)
    run = clone_run(crafted_run, tmp_path / "runs" / "debug" / crafted_run.name)
    shutil.copytree(crafted_run / "logs", run / "logs")
    result = subprocess.run([*CLI, "resume", "--run", str(run), "--ckpt", "latest", "--launcher", "slurm",
                             "--set", "train.steps=3"], cwd=tmp_path, env=cluster.env(OMP_NUM_THREADS="1"),
                            capture_output=True, text=True, timeout=240)
    out = result.stdout
    assert result.returncode == 0, out[-6000:] + result.stderr
    assert f"resuming {run} from {run}/checkpoints/step-2 (step 2 of 3)" in out
    assert f"run dir {run}: 1 ranks on 1 node(s); submitted Slurm job " in out
    assert "progress: step 3/3" in out and "== run finished: exit code 0 (Slurm job" in out
    assert [p.name for p in (tmp_path / "runs" / "debug").iterdir()] == [run.name]  # no second run directory
    assert (run / "logs.prev-1").is_dir() and (run / "slurm" / "job.sbatch").is_file()
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps[-1] == 3 and steps.count(3) == 1 and (run / "checkpoints" / "step-3").is_dir()
    assert cluster.jobs() == []
