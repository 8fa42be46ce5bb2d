"""``llmtrain hosts check --launcher slurm`` on the real Slurm test cluster (tests/slurmcluster.py).

The checks of ``hosts check`` run as one srun task per node of the 2-node cluster: they pass
with a CPU recipe, and fail with each node's own reason where a node cannot run the job (GPUs
expected on CPU nodes, a python missing on the nodes). Inside an ``salloc`` allocation the step
runs on the allocation's nodes and no second job is made. What Slurm refuses (an unknown
partition, an account it rejects, more nodes than the partition has) is one line with the fix,
and no job is made (``scontrol show job`` lists every job of the last MinJobAge=600 s, so an
unchanged list proves nothing was submitted). The parts that need no cluster (the launcher
choice, no Slurm client on PATH, a task that never ran) run everywhere.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest

from llmtrain.errors import LLMTrainError
from tests.slurmcluster import get_cluster

REPO = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-c", "from llmtrain.cli.app import main; main()"]


@pytest.fixture(scope="session")
def cluster(request, tmp_path_factory):
    return get_cluster(request.config, tmp_path_factory)


def cpu_recipe(path: Path) -> Path:
    """A CPU recipe (cluster.gpu: cpu, 2 nodes x 1 rank) with its own rendezvous port."""
    text = (REPO / "recipes" / "debug.yaml").read_text().replace("tp: 2", "tp: 1")
    text = text.replace("nodes: 1, gpus_per_node: 4", "nodes: 2, gpus_per_node: 1")
    path.write_text(text + "launch: " + json.dumps({"rdzv_port": 29900 + os.getpid() % 90}) + "\n")
    return path


def run(env: dict[str, str], cwd: Path, *args: str, timeout: float = 120):
    import subprocess

    return subprocess.run(list(args), cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


# ----------------------------------------------------------------------------- no cluster needed


def test_launcher_choice_and_foreign_flags_are_one_line_errors(monkeypatch):
    from llmtrain.cli.hosts import pick_launcher

    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert pick_launcher(None, Path("h"), {}, {}) == "ssh"
    assert pick_launcher("slurm", None, {"--nodes": None}, {"--include": None}) == "slurm"
    cases = [
        (("local", None, {}, {}), "--launcher: unknown launcher 'local' for hosts check; use ssh (with --hosts) or slurm"),
        ((None, None, {}, {}), "--hosts: nothing to check; pass --hosts HOSTFILE (SSH), or --launcher slurm"),
        (("slurm", Path("h"), {}, {}), "--hosts: --hosts does not apply to --launcher slurm (Slurm picks the nodes)"),
        (("slurm", None, {}, {"--include": "a"}), "--include: --include does not apply to --launcher slurm"),
        (("ssh", Path("h"), {"--partition": "p"}, {}), "--partition: --partition needs --launcher slurm; add"),
    ]
    for args, words in cases:
        with pytest.raises(LLMTrainError) as err:
            pick_launcher(*args)
        assert len(err.value.lines()) == 1 and err.value.lines()[0].startswith(words), err.value.lines()
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "n[0-1]")
    monkeypatch.setenv("SLURM_JOB_NUM_NODES", "2")
    assert pick_launcher(None, None, {}, {}) == "slurm"  # inside an allocation --launcher slurm is implied


def test_task_that_never_ran_and_missing_python_are_that_nodes_failure():
    """srun's labelled output, as measured on the cluster (one task per node)."""
    from llmtrain.launch.backends.slurm_preflight import judge_task, parse_output

    out = "1: @@node n1\n1: @@exit 127\n"
    err = "1: /x/py: 1: /x/py: not found\nsrun: error: n0: task 0: Exited with exit code 1\n"
    tasks = parse_output(out, err, 2)
    never, missing = (judge_task(i, t, 1, "/x/py", "/w", 29500, False, "cpu", 0.0, 1.0, {}) for i, t in
                      enumerate(tasks))
    assert never.node.host == "node 0" and [c.name for c in never.failed] == ["slurm"]
    assert "task 0 of the check step never ran" in never.checks["slurm"].value
    assert missing.checks["slurm"].status == "ok" and [c.name for c in missing.failed] == ["python"]
    assert missing.checks["python"].value == "/x/py not found on n1 (/x/py: 1: /x/py: not found)"


def test_no_slurm_client_on_path_is_one_line(tmp_path):
    env = {**os.environ, "PATH": "/nonexistent", "PYTHONPATH": str(REPO)}
    env.pop("SLURM_JOB_ID", None)
    result = run(env, tmp_path, *CLI, "hosts", "check", "--launcher", "slurm")
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "not found on PATH: this machine is not a Slurm client" in result.stderr and "Traceback" not in result.stderr


# ----------------------------------------------------------------------------- on the cluster


def test_checks_pass_on_both_nodes_and_fail_with_each_nodes_reason(cluster, tmp_path):
    recipe = cpu_recipe(tmp_path / "r.yaml")
    ok = run(cluster.env(), tmp_path, *CLI, "hosts", "check", "--launcher", "slurm", "--recipe", str(recipe), "--json")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    data = json.loads(ok.stdout)
    assert data["ok"] and [h["host"] for h in data["hosts"]] == cluster.nodes
    first, second = (h["checks"] for h in data["hosts"])
    assert first["slurm"]["status"] == "ok" and first["python"]["status"] == "ok" and first["torch"]["status"] == "ok"
    assert first["port"]["value"] == f"{29900 + os.getpid() % 90} free" and second["port"]["status"] == "skip"
    assert first["gpus"]["value"] == "no nvidia-smi (CPU host)" and first["llmtrain"]["status"] == "ok"
    assert "checking 2 node(s) of partition debug" in ok.stderr

    gpus = run(cluster.env(), tmp_path, *CLI, "hosts", "check", "--launcher", "slurm", "--nodes", "2",
               "--gpus-per-node", "1")  # the default recipe: cluster.gpu h100-sxm, so GPUs are expected
    assert gpus.returncode == 1, gpus.stdout + gpus.stderr
    for node in cluster.nodes:
        assert re.search(rf"^│ {node} +│ ok +│ [\d.]+ +│ ok +│.*│ ✗ none/1 +│", gpus.stdout, re.M), gpus.stdout
        assert f"gpus: no GPU visible on {node} (no nvidia-smi) for 1 rank(s); the recipe's cluster.gpu is h100-sxm " \
               "-> fix: pick a GPU --partition" in gpus.stdout
    assert "its nodes have no GPU GRES, so none were asked for" in gpus.stdout
    assert gpus.stdout.rstrip().endswith("0 of 2 hosts ready; 2 failed")

    nopy = run(cluster.env(), tmp_path, *CLI, "hosts", "check", "--launcher", "slurm", "--recipe", str(recipe),
               "--set", "launch.python=/nonexistent/bin/python3", "--json")
    assert nopy.returncode == 1, nopy.stdout + nopy.stderr
    for host in json.loads(nopy.stdout)["hosts"]:
        assert host["checks"]["python"]["value"].startswith(f"/nonexistent/bin/python3 not found on {host['host']}")
    assert cluster.jobs() == []


def test_inside_an_allocation_checks_its_nodes_with_one_step_and_no_new_job(cluster, tmp_path):
    recipe = cpu_recipe(tmp_path / "r.yaml")
    before = cluster.known_jobs()
    result = run(cluster.env(), tmp_path, "salloc", "-N", "2", "-Q", "--job-name=outer-alloc", *CLI, "hosts", "check",
                 "--recipe", str(recipe), "--json")
    assert result.returncode == 0, result.stdout + result.stderr
    assert re.search(r"checking 2 node\(s\) of Slurm allocation \d+ \(" + ", ".join(cluster.nodes), result.stderr)
    assert [h["host"] for h in json.loads(result.stdout)["hosts"]] == cluster.nodes
    assert cluster.new_jobs(before) == ["outer-alloc"]  # the step ran in it: no job of its own
    assert cluster.jobs() == []


@pytest.mark.parametrize("args, words", [
    (["--partition", "nosuch"], "--partition: partition 'nosuch' does not exist on this cluster; use one of: debug, gated"),
    (["--partition", "gated", "--account", "nosuch"], "--account: sbatch refused the job: Invalid account or "
                                                      "account/partition combination specified; pass an account"),
    (["--nodes", "3"], "--nodes: 3 nodes do not fit partition 'debug': it has 2 node(s); use --nodes 2 or less"),
], ids=["unknown-partition", "rejected-account", "too-many-nodes"])
def test_slurm_refusals_are_one_line_and_submit_nothing(cluster, tmp_path, args, words):
    before = cluster.known_jobs()
    result = run(cluster.env(), tmp_path, *CLI, "hosts", "check", "--launcher", "slurm", "--recipe",
                 str(cpu_recipe(tmp_path / "r.yaml")), *args)
    assert result.returncode == 2, result.stdout + result.stderr
    line = result.stderr.strip()
    assert len(line.splitlines()) == 1 and line.startswith(f"error: {words}"), line
    assert cluster.new_jobs(before) == [] and cluster.jobs() == []


@pytest.mark.parametrize("signame, code", [("SIGINT", 130), ("SIGTERM", 143)], ids=["ctrl-c", "sigterm"])
def test_ctrl_c_while_the_check_waits_for_nodes_cancels_its_job(cluster, tmp_path, signame, code):
    """Both nodes held by another job: the check's job pends; Ctrl-C (or SIGTERM) must leave no
    job of it. Bound: 10 s from the signal to exit (the issue's bound for a cancelled launch;
    measured 0.9 s)."""
    import signal
    import subprocess
    import time

    held = cluster.client("salloc", "-N", "2", "--exclusive", "--no-shell", "--job-name=holder")
    assert held.returncode == 0, held.stderr
    try:
        proc = subprocess.Popen([*CLI, "hosts", "check", "--launcher", "slurm", "--recipe",
                                 str(cpu_recipe(tmp_path / "r.yaml"))], cwd=tmp_path, env=cluster.env(),
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + 60
        while "llmtrain-hosts-check" not in cluster.client("squeue", "-h", "-t", "PD", "-o", "%j").stdout:
            assert time.monotonic() < deadline and proc.poll() is None, "the check's job never pended"
            time.sleep(0.2)
        t0 = time.monotonic()
        proc.send_signal(getattr(signal, signame))
        out, _ = proc.communicate(timeout=30)
        elapsed = time.monotonic() - t0
        assert proc.returncode == code and elapsed < 10, (proc.returncode, elapsed, out)
        assert cluster.client("squeue", "-h", "-o", "%j").stdout.split() == ["holder"]
    finally:
        cluster.client("scancel", "--name=holder")
    deadline = time.monotonic() + 10
    while cluster.jobs() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert cluster.jobs() == []
