"""Pieces of the SSH launcher without SSH: filters, ssh config, commands, framing, watchdog, the node
helper and its kill command on real local processes, error sentences, import hygiene."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import paramiko
import pytest

from llmtrain.errors import LLMTrainError
from llmtrain.launch.commands import build_spec, describe, kill_command, node_command, torchrun_argv
from llmtrain.cluster.filters import parse_filter, select_hosts
from llmtrain.cluster.hostfile import parse_hostfile
from llmtrain.launch.remote import frame_rank, node_event, parse_frame
from llmtrain.launch.sshconfig import SSHTarget, load_ssh_config, resolve_targets
from llmtrain.launch.watchdog import Watchdog
from llmtrain.recipe.load import load_recipe_text

REPO = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-c", "from llmtrain.cli.app import main; main()"]
RUN_ID = "20260101-000000-abcd"


def recipe(launch: str = "{}"):
    return load_recipe_text(f"model: {{preset: debug-dense}}\nname: t\nlaunch: {launch}\n")


def spec_for(hostfile_text: str, launch: str = "{}", addrs: list[str] | None = None, **kw):
    hostfile = parse_hostfile(hostfile_text)
    addrs = addrs or [f"10.0.0.{i + 1}" for i in range(len(hostfile.hosts))]
    targets = [SSHTarget(h.host, a) for h, a in zip(hostfile.hosts, addrs)]
    kw.setdefault("python", "/venv/bin/python")
    kw.setdefault("cwd", "/work")
    return build_spec(recipe(launch), hostfile, targets, RUN_ID, "runs", "llmtrain.engine.main", environ={}, **kw)


# ----------------------------------------------------------------------------- --include / --exclude


def test_filters_follow_deepspeed_syntax_and_keep_hostfile_order():
    hostfile = parse_hostfile("a slots=4\nb slots=4\nc slots=4\n")
    assert parse_filter("a@b:0,2", "--include") == {"a": None, "b": (0, 2)}
    sel = select_hosts(hostfile, include="c@a:3,1")
    assert [(h.host, h.slots) for h in sel.hostfile.hosts] == [("a", 2), ("c", 4)]
    assert sel.visible_devices == {"a": (1, 3)}
    sel = select_hosts(hostfile, exclude="b@c:0")
    assert [(h.host, h.slots) for h in sel.hostfile.hosts] == [("a", 4), ("c", 3)]
    assert sel.visible_devices == {"c": (1, 2, 3)}
    assert select_hosts(hostfile).hostfile is hostfile
    for include, exclude, message in [("a", "b", "both given"), ("zz", None, "host zz is not in"),
                                      ("a:4", None, "a has slots 0..3, not 4"), ("a:x", None, "no valid slot list"),
                                      (None, "a@b@c", "leaves no hosts"), ("", None, "--include: no host named"),
                                      (None, " ", "--exclude: no host named")]:  # repeats merge: test_hostfile_forms.py
        with pytest.raises(LLMTrainError, match=message):
            select_hosts(hostfile, include=include, exclude=exclude)


def test_include_slots_become_cuda_visible_devices_on_that_node_only():
    hostfile = parse_hostfile("a slots=4\nb slots=4\n")
    sel = select_hosts(hostfile, include="a:0,2@b")
    targets = [SSHTarget("a", "10.0.0.1"), SSHTarget("b", "10.0.0.2")]
    spec = build_spec(recipe(), sel.hostfile, targets, RUN_ID, "runs", "m", sel.visible_devices, environ={},
                      python="/p", cwd="/w")
    envs = [{v.name: v.value for v in n.env} for n in spec.nodes]
    assert envs[0]["CUDA_VISIBLE_DEVICES"] == "0,2" and "CUDA_VISIBLE_DEVICES" not in envs[1]
    assert [n.first_rank for n in spec.nodes] == [0, 2] and spec.world_size == 6


# ----------------------------------------------------------------------------- ~/.ssh/config


def test_ssh_config_aliases_hostname_port_user_identity_and_proxyjump(tmp_path):
    config = tmp_path / "config"
    config.write_text(textwrap.dedent(f"""\
        Host gpu*
          User trainer
          IdentityFile {tmp_path}/id_cluster
        Host gpu1
          HostName 10.1.0.11
          Port 2222
          ProxyJump bastion,jump2:2200
        Host bastion
          HostName bastion.example.com
          User ops
        Host jump2
          HostName 10.1.0.2
          IdentitiesOnly yes
        """))
    hostfile = parse_hostfile(f"ssh_config: {config}\nhosts:\n  - {{host: gpu1, slots: 8}}\n"
                              "  - {host: gpu2, slots: 8, user: root, port: 22, identity_file: /k/id}\n"
                              "  - {host: plain, slots: 8}\n")
    gpu1, gpu2, plain = resolve_targets(hostfile)
    assert (gpu1.hostname, gpu1.port, gpu1.user, gpu1.identity_files) == ("10.1.0.11", 2222, "trainer",
                                                                         (f"{tmp_path}/id_cluster",))
    jump = gpu1.proxy_jump
    assert (jump.alias, jump.hostname, jump.port, jump.identities_only) == ("jump2", "10.1.0.2", 2200, True)
    assert (jump.proxy_jump.alias, jump.proxy_jump.hostname, jump.proxy_jump.user) == ("bastion", "bastion.example.com",
                                                                                       "ops")
    assert gpu1.route == " via bastion -> jump2" and gpu1.known_hosts_name == "[10.1.0.11]:2222"
    assert gpu1.label == "gpu1 (trainer@10.1.0.11:2222)"
    # what the hostfile says wins over the config
    assert (gpu2.hostname, gpu2.user, gpu2.port, gpu2.identity_files) == ("gpu2", "root", 22, ("/k/id",))
    assert plain.hostname == "plain" and plain.proxy_jump is None and plain.known_hosts_name == "plain"
    with pytest.raises(LLMTrainError, match="not found"):
        load_ssh_config(str(tmp_path / "missing"))


# ----------------------------------------------------------------------------- commands


def test_commands_place_ranks_in_hostfile_order_with_static_rendezvous():
    spec = spec_for("a slots=4\nb slots=2\nc slots=4\n", "{env: {A: 'x y'}, rdzv_port: 29600, max_restarts: 2}")
    assert [(n.node_rank, n.first_rank, n.slots) for n in spec.nodes] == [(0, 0, 4), (1, 4, 2), (2, 6, 4)]
    argv = torchrun_argv(spec, spec.nodes[1])
    assert argv[:3] == ["/venv/bin/python", "-m", "torch.distributed.run"]
    joined = " ".join(argv)
    assert ("--nnodes 3 --nproc-per-node 2 --rdzv-backend static --rdzv-endpoint 10.0.0.1:29600 "
            f"--rdzv-id {RUN_ID} --node-rank 1 --local-addr 10.0.0.2 --max-restarts 2") in joined
    assert joined.endswith(f"-m llmtrain.engine.main --recipe /work/runs/t/{RUN_ID}/recipe.lock.yaml "
                           f"--run-dir /work/runs/t/{RUN_ID}")
    cmd = node_command(spec, spec.nodes[1])
    assert cmd.startswith("cd /work && exec env A='x y' LLMTRAIN_RUN_ID=")
    assert f"LLMTRAIN_NODE_ID={RUN_ID}.1 " in cmd and "-m llmtrain.launch.remote run" in cmd
    assert re.fullmatch(r"[0-9a-f]{16}", spec.launch_id) and f"LLMTRAIN_LAUNCH_ID={spec.launch_id} " in cmd
    assert f"remote run --run-id {RUN_ID} --node-rank 1 --launch-id {spec.launch_id} " in cmd
    assert "--first-rank 4 --nproc 2" in cmd and "is_host" not in cmd
    assert kill_command(spec, spec.nodes[1], 4242, 777) == (
        f"/venv/bin/python -m llmtrain.launch.remote kill --run-id {RUN_ID} --node-rank 1 --launch-id {spec.launch_id} --grace 3 "
        "--pgid 4242 --pgid-start 777")
    lines = describe(spec)
    assert lines[0].startswith(f"run t/{RUN_ID}: 3 node(s), world size 10, rendezvous static at 10.0.0.1:29600")
    assert lines[3] == "# node 1: b (10.0.0.2:22), ranks 4-5"


def test_paths_come_from_host_then_hostfile_then_recipe_then_this_machine():
    hostfile = ("python: /hf/python\nhosts:\n  - {host: a, slots: 1, python: /a/python, workdir: /a}\n"
                "  - {host: b, slots: 1, addr: 192.168.0.2}\n")
    spec = spec_for(hostfile, "{python: /recipe/python, workdir: /recipe}")
    assert [(n.python, n.workdir, n.addr) for n in spec.nodes] == [("/a/python", "/a", "10.0.0.1"),
                                                                   ("/hf/python", "/recipe", "192.168.0.2")]
    assert spec.nodes[0].run_dir == f"/a/runs/t/{RUN_ID}" and spec.nodes[1].run_dir == f"/recipe/runs/t/{RUN_ID}"
    spec = spec_for("a slots=1\n", python=None, cwd="/here")
    assert spec.nodes[0].python == sys.executable and spec.nodes[0].workdir == "/here"
    hostfile = parse_hostfile("a slots=1\n")
    absolute = build_spec(recipe(), hostfile, [SSHTarget("a", "h")], RUN_ID, "/abs/runs", "m", environ={}, cwd="/w")
    assert absolute.nodes[0].run_dir == f"/abs/runs/t/{RUN_ID}"
    with pytest.raises(LLMTrainError, match="not an absolute path"):
        spec_for("a slots=1\n", python="venv/bin/python")


def test_c10d_is_refused_unless_sorted_addresses_match_the_hostfile():
    spec = spec_for("a slots=2\nb slots=2\n", "{rendezvous: c10d, max_restarts: 1}", addrs=["10.0.0.1", "10.0.0.2"])
    argv0, argv1 = (" ".join(torchrun_argv(spec, n)) for n in spec.nodes)
    assert "--rdzv-backend c10d" in argv0 and "--rdzv-conf is_host=1" in argv0 and "--node-rank" not in argv0
    assert "is_host" not in argv1
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in node_command(spec, spec.nodes[0])  # trap 5: restarts on gloo
    # torch sorts by --local-addr: "10.0.0.10" < "10.0.0.9" as strings, so this order would be rank-swapped
    with pytest.raises(LLMTrainError, match="sorted --local-addr") as info:
        spec_for("a slots=2\nb slots=2\n", "{rendezvous: c10d}", addrs=["10.0.0.9", "10.0.0.10"])
    assert "list the hosts as b, a" in info.value.problems[0].hint
    with pytest.raises(LLMTrainError, match="share the address"):
        spec_for("a slots=2\nb slots=2\n", "{rendezvous: c10d}", addrs=["127.0.0.1", "127.0.0.1"])
    # the static default does not care
    assert spec_for("a slots=2\nb slots=2\n", addrs=["10.0.0.9", "10.0.0.10"]).nodes[1].first_rank == 2


# ----------------------------------------------------------------------------- framing, watchdog


def test_helper_line_framing_round_trips():
    assert parse_frame(frame_rank(12, "stderr", "boom @@r1.o x")) == ("rank", 12, "stderr", "boom @@r1.o x")
    assert parse_frame(frame_rank(0, "stdout", "")) == ("rank", 0, "stdout", "")
    assert parse_frame("@@t torchrun says") == ("torchrun", None, "", "torchrun says")
    kind, _, _, payload = parse_frame(node_event("exit", code=3))
    assert kind == "node" and json.loads(payload) == {"event": "exit", "code": 3}
    assert parse_frame("@@hb")[0] == "heartbeat"
    for raw in ["sh: 1: /x/python: not found", "@@rX.o nope", "@@r1.z nope", "@@hb2"]:
        assert parse_frame(raw) == ("raw", None, "", raw)


def test_watchdog_startup_then_step_limits_and_silent_ranks():
    now = [0.0]
    wd = Watchdog(range(4), hang_timeout_s=10, startup_timeout_s=60, clock=lambda: now[0])
    now[0] = 59
    assert wd.check() is None
    now[0] = 61
    hang = wd.check()
    assert hang is not None and hang.last_step is None and hang.silent == (0, 1, 2, 3)
    assert "before the first step (limit 60 s); silent ranks: 0-3" in hang.summary()
    wd.progress(1)
    for rank in range(4):
        wd.output(rank, f"rank {rank} hi")
    now[0] = 67
    for rank in (0, 2, 3):
        wd.output(rank, "still waiting")
    now[0] = 71.5
    hang = wd.check()  # rank 1 quiet for 10.5 s, the others for 4.5 s (< half the limit)
    assert hang.silent == (1,) and hang.last_output[1] == (pytest.approx(10.5), "rank 1 hi")
    assert hang.summary() == "no step progress for 10 s after step 1 (limit 10 s); silent ranks: 1"
    off = Watchdog(range(2), 0, 0, clock=lambda: now[0])
    now[0] = 1e9
    assert off.check() is None


# ----------------------------------------------------------------------------- the node helper, for real


FAKE_TORCHRUN = textwrap.dedent("""\
    import os, subprocess, sys, time
    log_dir, nproc, rank_base, mode = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    kids = []
    for local in range(nproc):
        d = os.path.join(log_dir, "rid_x", "attempt_0", str(local))
        os.makedirs(d, exist_ok=True)
        env = dict(os.environ, LOCAL_RANK=str(local), RANK=str(rank_base + local))
        code = ("import sys, time; sys.stdout.write('hello from %d\\\\n'); sys.stdout.flush(); time.sleep(60)" % local)
        kids.append(subprocess.Popen([sys.executable, "-c", code], env=env, start_new_session=True,
                                     stdout=open(os.path.join(d, "stdout.log"), "w"), stderr=subprocess.DEVNULL))
    if mode == "orphan":  # a grandchild in its own session that ignores SIGTERM
        subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                          "time.sleep(60)"], start_new_session=True)
    print("fake torchrun up", flush=True)
    if mode == "exit3":
        time.sleep(0.5)
        sys.exit(3)
    for k in kids:
        k.wait()
""")


def _helper(tmp_path: Path, first_rank: int, rank_base: int, mode: str, node_id: str) -> subprocess.Popen:
    script = tmp_path / "fake_torchrun.py"
    script.write_text(FAKE_TORCHRUN)
    env = dict(os.environ, LLMTRAIN_RUN_ID=node_id.rsplit(".", 1)[0], LLMTRAIN_NODE_ID=node_id,
               PYTHONPATH=str(REPO))
    cmd = [sys.executable, "-m", "llmtrain.launch.remote", "run", "--run-id", node_id.rsplit(".", 1)[0],
           "--node-rank", "1", "--first-rank", str(first_rank), "--nproc", "2", "--log-dir", str(tmp_path / "logs"),
           "--grace", "1", "--", sys.executable, str(script), str(tmp_path / "logs"), "2", str(rank_base), mode]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def _marked(node_id: str) -> list[int]:
    from llmtrain.launch.proctree import pids_with_env

    return sorted(pids_with_env("LLMTRAIN_NODE_ID", node_id))


def test_helper_streams_ranks_and_stops_a_node_whose_ranks_differ_from_the_plan(tmp_path):
    node_id = "20260101-000001-aaaa.1"
    proc = _helper(tmp_path, first_rank=2, rank_base=5, mode="wait", node_id=node_id)  # RANK 5, 6 instead of 2, 3
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 1, out
    lines = out.splitlines()
    events = [json.loads(ln[4:]) for ln in lines if ln.startswith("@@n ")]
    assert events[0]["event"] == "start" and events[0]["pgid"] == events[0]["pid"] == proc.pid
    mismatch = next(e for e in events if e["event"] == "rank_mismatch")
    assert mismatch["expected"] == mismatch["local_rank"] + 2 and mismatch["rank"] == mismatch["local_rank"] + 5
    assert events[-1] == {"event": "exit", "code": 1}
    assert "@@t fake torchrun up" in lines
    assert _marked(node_id) == []


def test_helper_on_sighup_stops_everything_including_stubborn_orphans(tmp_path):
    node_id = "20260101-000002-bbbb.1"
    proc = _helper(tmp_path, first_rank=2, rank_base=2, mode="orphan", node_id=node_id)
    lines: list[str] = []
    deadline = time.monotonic() + 60
    while not all(any(ln.startswith(f"@@r{r}.o hello from {r - 2}") for ln in lines) for r in (2, 3)):
        assert time.monotonic() < deadline and proc.poll() is None, lines
        lines.append(proc.stdout.readline().rstrip("\n"))
    time.sleep(0.3)
    assert len(_marked(node_id)) >= 4  # fake torchrun, 2 workers, the orphan
    os.kill(proc.pid, signal.SIGHUP)  # what a pty delivers when the SSH session dies
    rest, _ = proc.communicate(timeout=30)
    assert proc.returncode == 129, rest
    assert '"event":"stopping","reason":"SIGHUP"' in rest and '"killed":1' in rest  # the orphan needed SIGKILL
    assert _marked(node_id) == []


def test_kill_command_stops_group_descendants_and_marked_processes(tmp_path):
    node_id = "20260101-000003-cccc.0"
    code = textwrap.dedent("""\
        import os, subprocess, sys, time
        subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                          "time.sleep(60)"], start_new_session=True)
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        print("up", flush=True)
        time.sleep(60)
        """)
    env = dict(os.environ, LLMTRAIN_NODE_ID=node_id)
    leader = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    unrelated = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert leader.stdout.readline() == "up\n"
        time.sleep(0.2)
        assert len(_marked(node_id)) == 3
        from llmtrain.launch.proctree import read_stat

        start = read_stat(leader.pid).start
        result = subprocess.run([sys.executable, "-m", "llmtrain.launch.remote", "kill", "--run-id", node_id[:-2],
                                 "--node-rank", "0", "--pgid", str(leader.pid), "--pgid-start", str(start),
                                 "--grace", "0.5"], capture_output=True, text=True, timeout=30)
        assert result.returncode == 0, result.stderr
        assert json.loads(result.stdout) == {"signalled": 2, "killed": 1}  # + the leader (helper) itself
        leader.wait(timeout=5)
        assert _marked(node_id) == [] and unrelated.poll() is None  # nothing outside the run was touched
        # a stale pgid (the leader's start time differs) is never used
        stale = subprocess.run([sys.executable, "-m", "llmtrain.launch.remote", "kill", "--run-id", "x", "--node-rank",
                                "0", "--pgid", str(unrelated.pid), "--pgid-start", "1", "--grace", "0.2"],
                               capture_output=True, text=True, timeout=30)
        assert json.loads(stale.stdout) == {"signalled": 0, "killed": 0} and unrelated.poll() is None
    finally:
        for p in (leader, unrelated):
            if p.poll() is None:
                p.kill()
                p.wait()


# ----------------------------------------------------------------------------- errors, CLI, imports


def test_ssh_errors_are_one_sentence_with_a_fix():
    from llmtrain.launch.backends.ssh import SSHOptions, UnknownHostKey, describe, fingerprint

    target = SSHTarget("gpu1", "10.1.0.11", 2222, "trainer")
    opts = SSHOptions(connect_timeout=4, banner_timeout=6)
    key, other = paramiko.ECDSAKey.generate(), paramiko.ECDSAKey.generate()
    assert fingerprint(key).startswith("ECDSA SHA256:") and "=" not in fingerprint(key)
    cases = [
        (UnknownHostKey("[10.1.0.11]:2222", key), "unknown_host_key", "ssh-keyscan -p 2222 -t ecdsa-sha2-nistp256"),
        (paramiko.BadHostKeyException("[10.1.0.11]:2222", key, other), "changed_host_key", "ssh-keygen -R"),
        (paramiko.ssh_exception.NoValidConnectionsError({("10.1.0.11", 2222): OSError(111, "refused")}), "refused",
         "sshd runs"),
        (paramiko.AuthenticationException("no"), "auth", "authorized_keys"),
        (TimeoutError("timed out"), "timeout", "connect_timeout_s"),
        (OSError(113, "No route to host"), "unreachable", "network"),
        (paramiko.SSHException("Error reading SSH protocol banner"), "handshake", "sshd"),
    ]
    for exc, kind, fix in cases:
        err = describe(target, exc, opts, elapsed=0.1)
        assert err.kind == kind and fix in err.hint and "\n" not in str(err) + err.hint, (kind, str(err), err.hint)
        assert str(err).startswith("gpu1 (trainer@10.1.0.11:2222): ")
    slow = describe(target, paramiko.SSHException("No existing session"), opts, elapsed=6.0)
    assert slow.kind == "banner" and "sent no SSH banner within 6 s" in slow.message


def test_lock_recipe_keeps_env_names_and_sources_never_values():
    from llmtrain.launch.backends.sshlaunch import lock_recipe
    from llmtrain.recipe.load import dump_recipe

    r = recipe("{env: {HF_TOKEN: hf_real, PLAIN: visible}}")
    text = dump_recipe(lock_recipe(r))
    assert "hf_real" not in text and "visible" not in text and "'****'" not in text
    assert "env_sources:\n    HF_TOKEN: recipe\n    PLAIN: recipe\n" in text and "env: {}" in text
    assert r.launch.env["HF_TOKEN"] == "hf_real"  # the recipe in memory keeps them


def test_hosts_only_flags_need_hosts(tmp_path):
    # (--dry-run no longer needs --hosts: every backend prints its launch plan; issue 15 item 1)
    result = subprocess.run([*CLI, "launch", str(REPO / "recipes" / "debug.yaml"), "--skip-preflight"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and result.stderr == ("error: --skip-preflight: --skip-preflight needs --hosts; pass a "
                                                        "hostfile, or drop the flag\n")


def test_launch_layer_never_imports_torch():
    code = ("import sys, llmtrain.launch.backends.sshlaunch, llmtrain.launch.backends.sshrun, llmtrain.launch.backends.ssh, llmtrain.launch.preflight, "
            "llmtrain.launch.remote, llmtrain.launch.commands, llmtrain.cli.hosts, llmtrain.cli.launch; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
    fabric_users = [p.name for p in (REPO / "llmtrain").rglob("*.py")
                    if "import fabric" in p.read_text() or "from fabric" in p.read_text()]
    assert fabric_users == ["ssh.py"]
