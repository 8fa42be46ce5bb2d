"""``llmtrain launch --hosts`` against real sshd hosts (tests/sshhosts.py): real SSH, real torchrun.

The hosts are network namespaces with their own addresses (or, where the machine forbids
namespaces, sshd on loopback ports: see the fixture's printed reason). The CLI runs in a
subprocess with ``HOME`` set to the fixture's home (its ``~/.ssh/config`` holds the host
aliases, ``~/.ssh/known_hosts`` their keys). The ranks are ``tests/fake_engine.py`` except in
the one real training run. "No process left" is checked by scanning ``/proc`` for the run's
``LLMTRAIN_RUN_ID``: the namespaces share this machine's process table, so one scan covers
every host.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import background
from tests.sshhosts import get_cluster, run_processes, run_processes_with

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "debug.yaml"
CLI = [sys.executable, "-c", "from llmtrain.cli.app import main; main()"]
TEARDOWN_S = 5.0  # the bound for stopping every node


@pytest.fixture(scope="session")
def cluster(request, tmp_path_factory):
    return get_cluster(request.config, tmp_path_factory)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_recipe(path: Path, cluster, steps: int = 6, env: dict[str, str] | None = None, **launch) -> Path:
    """debug.yaml for 2 hosts x 2 ranks, with a launch: section for the test hosts."""
    launch_section = {"env": {"GLOO_SOCKET_IFNAME": cluster.ifname, **(env or {})},
                      "env_passthrough": ["FAKE_ENGINE_*"], "rdzv_port": free_port(), **launch}
    text = RECIPE.read_text().replace("steps: 60", f"steps: {steps}")
    path.write_text(text + "launch: " + json.dumps(launch_section) + "\n")
    return path


def write_hosts(path: Path, *lines: str) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


def run_cli(cluster, cwd: Path, *args: str, timeout: float = 120, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], cwd=cwd, env=cluster.env(**env), capture_output=True, text=True,
                          timeout=timeout)


class Background(background.Background):
    """The launcher in the background, in the SSH test cluster's environment."""

    def __init__(self, cluster, cwd: Path, *args: str, **env: str):
        super().__init__(cluster.env(**env), cwd, *args)


def wait_gone(run_id: str, timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while (left := run_processes(run_id)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def worker_pid(run_id: str, rank: int) -> int:
    """The pid of the worker with this RANK (torchrun and the helper carry no RANK)."""
    found = run_processes_with(run_id, f"RANK={rank}")
    if not found:
        raise AssertionError(f"no worker with RANK={rank} in run {run_id}")
    return found[0]


# ----------------------------------------------------------------------------- dry run


def test_dry_run_prints_each_node_command_with_secrets_masked_and_starts_nothing(cluster, tmp_path):
    recipe = write_recipe(tmp_path / "r.yaml", cluster, env={"HF_TOKEN": "hf_s3cr3t_value", "X": "a b;echo PWNED"})
    hosts = write_hosts(tmp_path / "hosts", "node0 slots=2", "node1 slots=2")
    marker = tmp_path / "marker"
    result = run_cli(cluster, tmp_path, "launch", str(recipe), "--hosts", str(hosts), "--dry-run",
                     FAKE_ENGINE_MARKER=str(marker))
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    assert "hf_s3cr3t_value" not in out + result.stderr
    commands = [line for line in out.splitlines() if line.startswith("cd ")]
    assert len(commands) == 2
    h0, h1 = cluster.host("node0"), cluster.host("node1")
    for rank, (line, host) in enumerate(zip(commands, (h0, h1))):
        assert "HF_TOKEN=**** " in line and "X='a b;echo PWNED'" in line
        assert f"--node-rank {rank} " in line and "--rdzv-backend static" in line
        assert f"--rdzv-endpoint {h0.addr}:" in line and f"--local-addr {host.addr} " in line
        assert f"--first-rank {2 * rank} --nproc 2" in line and "--nnodes 2 --nproc-per-node 2" in line
        assert f" GLOO_SOCKET_IFNAME={cluster.ifname} " in line and f"FAKE_ENGINE_MARKER={marker} " in line
        assert line.startswith(f"cd {tmp_path} && exec env ")
    assert "# node 1: node1 (" in out and "ranks 2-3" in out
    assert out.rstrip().endswith("dry run: nothing was started (a real launch draws its own run id)")
    assert not (tmp_path / "runs").exists() and not list(tmp_path.glob("marker*"))


# ----------------------------------------------------------------------------- success


def test_two_hosts_run_with_literal_env_masked_secret_and_hostfile_rank_order(cluster, tmp_path):
    tricky = {"T_SPACES": "a b;echo PWNED", "T_SUBST": "$(id) `id` ${HOME}", "T_QUOTES": "it's \"quoted\" \\ back",
              "T_NEWLINE": "line1\nline2\n", "T_EMPTY": "", "MY_API_TOKEN": "tok-9f8e7d6c5b"}
    recipe = write_recipe(tmp_path / "r.yaml", cluster, steps=6, env=tricky)
    hosts = write_hosts(tmp_path / "hosts", "node0 slots=2", "node1 slots=2")
    dump = tmp_path / "env"
    result = run_cli(cluster, tmp_path, "launch", str(recipe), "--hosts", str(hosts), "--skip-preflight",
                     FAKE_ENGINE_ENV_DUMP=str(dump), FAKE_ENGINE_PRINT_ENV="MY_API_TOKEN", NCCL_DEBUG="WARN",
                     UNRELATED_VAR="must-not-travel")
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    run = next((tmp_path / "runs" / "debug").iterdir())
    for rank, host in ((0, "node0"), (1, "node0"), (2, "node1"), (3, "node1")):
        assert f"[{host}:{rank}] fake engine rank {rank}/4 starting, run id {run.name}\n" in out
        data = json.loads((tmp_path / f"env.{rank}.json").read_text())
        env = data["env"]
        for name, value in tricky.items():
            assert env[name] == value, name  # arrived literally: nothing expanded, split or run
        # ranks land where `plan` puts them: hostfile order, node i holds ranks 2i, 2i+1
        assert (env["RANK"], env["GROUP_RANK"], env["LOCAL_RANK"]) == (str(rank), str(rank // 2), str(rank % 2))
        assert env["NCCL_DEBUG"] == "WARN" and "UNRELATED_VAR" not in env  # exactly the policy
        assert env["LLMTRAIN_RUN_ID"] == run.name and env["LLMTRAIN_NODE_ID"] == f"{run.name}.{rank // 2}"
        assert data["cwd"] == str(tmp_path)
        if cluster.mode == "netns":  # each rank really ran inside its host's network namespace
            assert data["netns"] == cluster.netns_inode(host)
    assert "PWNED\n" not in out
    assert "env MY_API_TOKEN=****" in out and "tok-9f8e7d6c5b" not in out + result.stderr
    # masked in every file the launcher writes (logs/torchrun/ holds the workers' own raw output on the nodes)
    launcher_files = [p for p in [*run.glob("*"), *(run / "logs").glob("*")] if p.is_file()]
    assert {"recipe.lock.yaml", "rank-0.log", "node-0.log", "commands.txt"} <= {p.name for p in launcher_files}
    for path in launcher_files:
        assert b"tok-9f8e7d6c5b" not in path.read_bytes(), path
    lock = (run / "recipe.lock.yaml").read_text()  # names and sources, never a value (tests/test_secrets.py)
    assert "MY_API_TOKEN: recipe" in lock and "a b;echo PWNED" not in lock and "'****'" not in lock
    assert "env MY_API_TOKEN=****" in (run / "logs" / "rank-0.log").read_text()
    assert "MY_API_TOKEN=****" in (run / "logs" / "commands.txt").read_text()
    assert "progress: step 6/6" in out and "== run finished: exit code 0" in out
    assert (run / "logs" / "rank-3.log").read_text().count("fake engine rank 3/4 starting") == 1
    assert "helper exit code 0" in (run / "logs" / "node-1.log").read_text()
    assert run_processes(run.name) == []


def test_real_engine_trains_on_two_hosts_after_preflight(cluster, tmp_path):
    """The one real training run: the debug recipe (tp 2 x dp 2) for 5 steps on 2 hosts x 2 ranks."""
    recipe = write_recipe(tmp_path / "r.yaml", cluster, steps=5)
    hosts = write_hosts(tmp_path / "hosts", "node0 slots=2", "node1 slots=2")
    env = cluster.env()
    env.pop("LLMTRAIN_ENGINE_MODULE")
    result = subprocess.run([*CLI, "launch", str(recipe), "--hosts", str(hosts)], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=300)
    out = result.stdout
    assert result.returncode == 0, out[-6000:] + result.stderr
    assert out.startswith("preflight: 2 of 2 hosts ready\n")  # preflight ran first
    assert re.search(r"^\[node0:[01]\] ", out, re.M) and re.search(r"^\[node1:[23]\] ", out, re.M)
    assert "progress: step 5/5" in out and "== run finished: exit code 0" in out
    run = next((tmp_path / "runs" / "debug").iterdir())
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3, 4, 5]
    assert run_processes(run.name) == []


# ----------------------------------------------------------------------------- SSH failures


SSH_FAILURES = {  # alias in the fixture's ~/.ssh/config -> words its one error line must hold
    "stranger": ["host key is not in known_hosts", "SHA256:", "ssh-keyscan", "--accept-new-host-keys"],
    "impostor": ["host key CHANGED", "ssh-keygen -R"],
    "closed": ["connection refused", "check that sshd runs"],
    "wrongkey": ["refused our key", "authorized_keys"],
    "mute": ["accepted TCP but sent no SSH banner within 2 s", "this port is the SSH server"],
}


@pytest.mark.parametrize("aliases, skip_preflight", [(list(SSH_FAILURES), False), (["impostor", "mute"], True)],
                         ids=["preflight", "skip-preflight"])
def test_ssh_failures_are_one_line_per_host_with_the_fix_and_start_nothing(cluster, tmp_path, aliases, skip_preflight):
    """Unknown key, changed key, closed port, wrong key, a port that never speaks SSH: all at once."""
    recipe = write_recipe(tmp_path / "r.yaml", cluster, banner_timeout_s=2, connect_timeout_s=2)
    hosts = write_hosts(tmp_path / "hosts", "node0 slots=2", *[f"{alias} slots=2" for alias in aliases])
    marker = tmp_path / "marker"
    args = ["launch", str(recipe), "--hosts", str(hosts), "--set", f"train.global_batch_size={8 * (1 + len(aliases))}"]
    t0 = time.monotonic()
    result = run_cli(cluster, tmp_path, *args, *(["--skip-preflight"] if skip_preflight else []), timeout=60,
                     FAKE_ENGINE_MARKER=str(marker))
    elapsed = time.monotonic() - t0
    assert result.returncode == 2, result.stdout + result.stderr
    errors = result.stderr.strip().splitlines()
    assert len(errors) == len(aliases), result.stderr  # node0 is fine: one line per broken host
    for alias, line in zip(aliases, errors):
        assert line.startswith(f"error: {alias} ("), line
        for word in SSH_FAILURES[alias]:
            assert word in line, line
    assert "Traceback" not in result.stderr + result.stdout
    assert elapsed < 2 + 15, elapsed  # hosts are checked in parallel: the 2 s timeout plus CLI start-up
    assert not (tmp_path / "runs").exists() and not list(tmp_path.glob("marker*"))


def test_accept_new_host_keys_trusts_on_first_use_with_a_warning(cluster, tmp_path):
    known = tmp_path / "known_hosts"
    known.write_text("")
    hosts = tmp_path / "hosts.yaml"
    hosts.write_text(f"known_hosts: {known}\nhosts:\n  - {{host: stranger, slots: 1}}\n")
    result = run_cli(cluster, tmp_path, "hosts", "check", "--hosts", str(hosts), "--accept-new-host-keys", "--json")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "warning: trusting the host key of" in result.stderr and "SHA256:" in result.stderr
    assert "ssh-ed25519" in known.read_text()
    again = run_cli(cluster, tmp_path, "hosts", "check", "--hosts", str(hosts), "--json")  # now known, no flag
    assert again.returncode == 0 and "trusting" not in again.stderr


# ----------------------------------------------------------------------------- lifecycle


def _start_sleeping(cluster, tmp_path: Path, *extra: str, **env: str) -> Background:
    recipe = write_recipe(tmp_path / "r.yaml", cluster, steps=6, **{k: v for k, v in env.items() if k == "grace_s"})
    env.pop("grace_s", None)
    hosts = write_hosts(tmp_path / "hosts", "node0 slots=2", "node1 slots=2")
    bg = Background(cluster, tmp_path, "launch", str(recipe), "--hosts", str(hosts), "--skip-preflight", *extra,
                    FAKE_ENGINE_SLEEP="60", **env)
    wanted = [f"[node{r // 2}:{r}] rank {r} sleeping" for r in range(4)]
    if env.get("FAKE_ENGINE_GRANDCHILD"):
        wanted += [f"[node{r // 2}:{r}] rank {r} started grandchild" for r in range(4)]
    bg.wait_for(*wanted)
    return bg


def test_rank_killed_with_sigkill_stops_every_node_within_5s(cluster, tmp_path):
    # orphaned grandchildren in their own sessions must be found too (they stop on SIGTERM here:
    # the stubborn kind, which forces the whole grace period, is in the SIGTERM test below)
    bg = _start_sleeping(cluster, tmp_path, FAKE_ENGINE_GRANDCHILD="polite")
    run_id = bg.run_id
    try:
        os.kill(worker_pid(run_id, 3), signal.SIGKILL)
        t0 = time.monotonic()
        rc = bg.proc.wait(timeout=30)
        elapsed = time.monotonic() - t0
    finally:
        bg.kill()
    bg.reader.join(5)
    out = bg.text
    assert rc == 1, out  # torchrun's exit code on the failing node
    assert elapsed < TEARDOWN_S, f"launcher took {elapsed:.1f} s"
    assert "[launcher] node1 failed: stopping all nodes" in out
    assert "rank 3 on node1 failed (exit code -9, SIGKILL); last lines of" in out
    assert "| rank 3 sleeping" in out
    assert wait_gone(run_id, 1.0) == []


def test_launcher_sigterm_stops_every_node_even_ranks_that_ignore_it(cluster, tmp_path):
    # ranks and their orphaned grandchildren ignore SIGTERM: the grace period (2 s here) passes, then SIGKILL
    bg = _start_sleeping(cluster, tmp_path, FAKE_ENGINE_IGNORE_TERM="1", FAKE_ENGINE_GRANDCHILD="1", grace_s=2)
    run_id = bg.run_id
    assert len(run_processes(run_id)) >= 8  # per node: helper, torchrun, 2 ranks
    try:
        os.kill(bg.proc.pid, signal.SIGTERM)
        t0 = time.monotonic()
        rc = bg.proc.wait(timeout=30)
        elapsed = time.monotonic() - t0
    finally:
        bg.kill()
    bg.reader.join(5)
    out = bg.text
    assert rc == 143, out
    assert elapsed < TEARDOWN_S, f"launcher took {elapsed:.1f} s"
    assert "[launcher] SIGTERM received: stopping all nodes" in out and "== run stopped by SIGTERM: exit code 143" in out
    assert "helper: SIGINT received, stopping the node" in out  # the Ctrl-C typed into each pty
    assert "^C" not in out and "@@" not in out  # no echo, no broken frame
    # the stubborn ranks and grandchildren needed SIGKILL: from the node's helper or the launcher's stop command
    assert re.search(r"^\[node0\] .*[1-9]\d* needed SIGKILL$", out, re.M), out
    assert re.search(r"^\[node1\] .*[1-9]\d* needed SIGKILL$", out, re.M), out
    assert wait_gone(run_id, 1.0) == []


def test_launcher_killed_with_sigkill_leaves_nothing_behind(cluster, tmp_path):
    # orphaned grandchildren that ignore SIGTERM: each helper waits out its 2 s grace, then SIGKILLs them
    bg = _start_sleeping(cluster, tmp_path, FAKE_ENGINE_GRANDCHILD="1", grace_s=2)
    run_id = bg.run_id
    os.kill(bg.proc.pid, signal.SIGKILL)  # no handler runs: the pty hang-up must stop every node
    t0 = time.monotonic()
    bg.proc.wait(timeout=10)
    left = wait_gone(run_id, TEARDOWN_S)
    assert left == [], f"still running {time.monotonic() - t0:.1f} s after the launcher died: {left}"


def test_failing_rank_names_host_rank_log_tail_and_error_file(cluster, tmp_path):
    recipe = write_recipe(tmp_path / "r.yaml", cluster, steps=20)
    hosts = write_hosts(tmp_path / "hosts", "node0 slots=2", "node1 slots=2")
    result = run_cli(cluster, tmp_path, "launch", str(recipe), "--hosts", str(hosts), "--skip-preflight",
                     FAKE_ENGINE_FAIL_RANK="2", FAKE_ENGINE_STEP_S="0.3")
    out = result.stdout
    assert result.returncode == 1, out + result.stderr  # torchrun's exit code on the failing node
    summary = out[out.index("== run failed: exit code 1"):]
    assert "node 1 node1 (ranks 2-3): exit code 1" in summary
    named = summary[summary.index("rank 2 on node1 failed (exit code 3); last lines of "):]
    assert "rank-2.log:" in named.splitlines()[0] and "| rank 2 fails on purpose at step 2" in named
    # torchelastic's error file lives on the node: its helper read it and sent the message
    assert "error: FakeEngineError: rank 2 fails on purpose at step 2" in named
    run = next((tmp_path / "runs" / "debug").iterdir())
    assert "ChildFailedError" in (run / "logs" / "node-1.log").read_text()
    assert run_processes(run.name) == []


def test_hung_rank_is_detected_by_the_watchdog_and_torn_down(cluster, tmp_path):
    recipe = write_recipe(tmp_path / "r.yaml", cluster, steps=50, watchdog={"hang_timeout_s": 3})
    hosts = write_hosts(tmp_path / "hosts", "node0 slots=2", "node1 slots=2")
    t0 = time.monotonic()
    result = run_cli(cluster, tmp_path, "launch", str(recipe), "--hosts", str(hosts), "--skip-preflight",
                     FAKE_ENGINE_HANG_RANK="1", FAKE_ENGINE_STEP_S="0.05")
    elapsed = time.monotonic() - t0
    out = result.stdout
    assert result.returncode == 124, out + result.stderr
    assert "[launcher] hang detected: stopping all nodes" in out and "== run hung: exit code 124" in out
    assert "no step progress for 3 s after step 1 (limit 3 s); silent ranks: 1\n" in out
    assert "rank 1 on node0: last output" in out and "rank 1 hangs at step 2" in out
    assert elapsed < 60
    run = next((tmp_path / "runs" / "debug").iterdir())
    assert run_processes(run.name) == []
