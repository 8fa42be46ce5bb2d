"""A lost node over SSH: the launcher retries the whole job without it, then ``llmtrain resume
--hosts`` continues the run on the repaired cluster. Real engine, real sshd hosts
(tests/sshhosts.py), real SIGKILLs; helpers shared with tests/test_launch_ssh.py."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess

import pytest

from tests.sshhosts import get_cluster, run_processes_with
from tests.test_launch_ssh import CLI, Background, wait_gone, write_hosts, write_recipe


@pytest.fixture(scope="session")
def cluster(request, tmp_path_factory):
    return get_cluster(request.config, tmp_path_factory)  # the one cluster of the session (cached)



def test_lost_node_retries_the_whole_job_without_it_and_resumes(cluster, tmp_path):
    """Real engine, 2 hosts x 2 ranks, checkpoints every 2 steps, ``--max-restarts 1`` with
    ``launch.exclude_lost_hosts``. After step-2 is committed every process of the run on node1
    is SIGKILLed (the node "crashes": its SSH session ends without an exit status). The launcher
    stops node0, drops node1, re-validates the recipe for 2 ranks (tp 2, dp 1) and retries the
    job in the same run directory; the ranks resume from the latest checkpoint (resharded) and
    finish all 8 steps; nothing of the run is left anywhere."""
    recipe = write_recipe(tmp_path / "r.yaml", cluster, steps=8, exclude_lost_hosts=True,
                          watchdog={"heartbeat_timeout_s": 10})
    recipe.write_text(recipe.read_text() + "checkpoint: {interval: 2}\n")
    hosts = write_hosts(tmp_path / "hosts", "node0 slots=2", "node1 slots=2")
    bg = Background(cluster, tmp_path, "launch", str(recipe), "--hosts", str(hosts), "--skip-preflight",
                    "--max-restarts", "1", LLMTRAIN_ENGINE_MODULE="llmtrain.engine.main")
    try:
        bg.wait_for("checkpoint: committed", timeout=180)
        run_id = bg.run_id
        victims = run_processes_with(run_id, f"LLMTRAIN_NODE_ID={run_id}.1")  # all of node1
        assert victims, "no process of node1 found"
        for pid in victims:
            os.kill(pid, signal.SIGKILL)
        rc = bg.proc.wait(timeout=240)
    finally:
        bg.kill()
    bg.reader.join(5)
    out = bg.text
    assert rc == 0, out[-6000:]
    assert "node1 was lost: retrying the whole job (retry 1 of 1) on 1 host(s), 2 ranks" in out
    assert re.search(r"checkpoint: resumed from \S+/step-\d+ at step \d+ .*on 4 ranks.* / now tp2 zero3 on 2 ranks", out), out[-4000:]
    assert "== run finished: exit code 0" in out
    run = next((tmp_path / "runs" / "debug").iterdir())
    assert (run / "logs.prev-1").is_dir() and (run / "hostfile").read_text().split() == ["node0", "slots=2"]
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps[-1] == 8 and set(steps) == set(range(1, 9))
    assert wait_gone(run_id, 5.0) == []
    # node1 is back: `llmtrain resume --hosts` continues the run on both hosts (2 -> 4 ranks)
    # launch.env values are not stored with the run: the caller gives them again (tests/test_secrets.py)
    env = cluster.env(LLMTRAIN_ENGINE_MODULE="llmtrain.engine.main", GLOO_SOCKET_IFNAME=cluster.ifname)
    resumed = subprocess.run([*CLI, "resume", "--run", str(run), "--hosts", str(hosts), "--skip-preflight",
                              "--set", "train.steps=10"], cwd=tmp_path, env=env, capture_output=True, text=True,
                             timeout=300)
    out = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, out[-6000:]
    assert "run dir " in out and ": 4 ranks on 2 nodes" in out
    assert re.search(r"resumed from \S+/step-8 at step 8 .*on 2 ranks.* / now dp_shard2 tp2 zero3 on 4 ranks", out), out[-3000:]
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps[-2:] == [9, 10] and (run / "logs.prev-2").is_dir() and (run / "recipe.lock.yaml.prev-2").is_file()
    assert wait_gone(run_id, 5.0) == []
