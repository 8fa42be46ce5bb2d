"""A dry run executes nothing: no ssh_config ``Match exec``, no ProxyCommand, no connection.

Real ssh_config files whose ``Match exec`` command and ProxyCommand each create a marker file:
after ``launch --dry-run`` and ``plan --hosts`` no marker exists, and the dry run says that a
ProxyCommand would be used and which ``Match exec`` line it did not evaluate. The positive
control runs ``hosts check`` against a real sshd (tests/sshhosts.py) through such a config: both
markers appear there (paramiko runs ``Match exec`` during lookup, and the ProxyCommand is the
connection), which proves the dry run's silence is not an accident of the config.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from llmtrain.cluster.hostfile import parse_hostfile
from llmtrain.launch.sshconfig import resolve_targets
from tests.sshhosts import get_cluster

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "debug.yaml"
CLI = [sys.executable, "-c", "from llmtrain.cli.app import main; main()"]

RELAY = '''\
import os, socket, sys, threading
host, port, marker = sys.argv[1], int(sys.argv[2]), sys.argv[3]
open(marker, "w").close()
sock = socket.create_connection((host, port), timeout=10)
sock.settimeout(None)
def up():
    while True:
        data = os.read(0, 65536)
        if not data:
            break
        sock.sendall(data)
    sock.shutdown(socket.SHUT_WR)
threading.Thread(target=up, daemon=True).start()
while True:
    data = sock.recv(65536)
    if not data:
        break
    os.write(1, data)
'''


@pytest.fixture(scope="session")
def cluster(request, tmp_path_factory):
    return get_cluster(request.config, tmp_path_factory)


def cli_env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LLMTRAIN_", "SSH_"))}
    env["HOME"] = str(home)
    return env


def trap_config(tmp_path: Path) -> tuple[Path, Path, Path]:
    """An ssh_config with a Match exec and a ProxyCommand that would each create a marker."""
    exec_marker, proxy_marker = tmp_path / "match-exec-ran", tmp_path / "proxycommand-ran"
    config = tmp_path / "ssh_config"
    config.write_text(textwrap.dedent(f"""\
        # a comment, then a Match block whose exec condition would leave a marker
        Match host gate* exec "touch {exec_marker}"
          Port 2222
        Host gate1 gate2
          HostName 10.250.0.1
          User trainer
          ProxyCommand sh -c "touch {proxy_marker}; exec nc %h %p"
        """))
    return config, exec_marker, proxy_marker


def test_dry_run_and_plan_run_no_match_exec_and_no_proxycommand(tmp_path):
    config, exec_marker, proxy_marker = trap_config(tmp_path)
    hosts = tmp_path / "hosts.yaml"
    hosts.write_text(f"ssh_config: {config.name}\nhosts:\n  - {{host: gate1, slots: 2}}\n  - {{host: gate2, slots: 2}}\n")
    home = tmp_path / "home"
    home.mkdir()
    result = subprocess.run([*CLI, "launch", str(RECIPE), "--hosts", str(hosts), "--dry-run"], cwd=tmp_path,
                            env=cli_env(home), capture_output=True, text=True, timeout=120)
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    assert not exec_marker.exists() and not proxy_marker.exists()
    # what a real launch would do: each host through its ProxyCommand (expanded), the Match line not evaluated
    for host in ("gate1", "gate2"):
        assert (f"dry run: {host}: a real launch would connect through ProxyCommand "
                f"`sh -c \"touch {proxy_marker}; exec nc 10.250.0.1 22\"`; a dry run does not run it") in out, out
    assert "# node 0: gate1 (trainer@10.250.0.1:22) via ProxyCommand `sh -c" in out
    assert (f"dry run: ssh config {config}:2: `Match host gate* exec \"touch {exec_marker}\"` was not evaluated "
            "(a dry run runs no command)") in out, out
    assert out.rstrip().endswith("dry run: nothing was started (a real launch draws its own run id)")
    assert not (tmp_path / "runs").exists()

    result = subprocess.run([*CLI, "plan", str(RECIPE), "--hosts", str(hosts)], cwd=tmp_path, env=cli_env(home),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert not exec_marker.exists() and not proxy_marker.exists()


def test_real_lookup_evaluates_match_exec_and_dry_lookup_does_not(tmp_path):
    # the same config through the library: the real lookup runs the command (as OpenSSH would)
    config, exec_marker, proxy_marker = trap_config(tmp_path)
    hostfile = parse_hostfile(f"ssh_config: {config}\nhosts:\n  - {{host: gate1, slots: 2}}\n")
    notes: list[str] = []
    (dry,) = resolve_targets(hostfile, dry_run=True, notes=notes)
    assert not exec_marker.exists() and dry.port == 22 and len(notes) == 2
    (real,) = resolve_targets(hostfile)
    assert exec_marker.exists() and real.port == 2222  # the Match block applied
    assert real.proxy_command == f'sh -c "touch {proxy_marker}; exec nc 10.250.0.1 2222"'
    assert not proxy_marker.exists()  # a ProxyCommand runs only when connecting


def test_proxycommand_and_match_exec_run_in_a_real_hosts_check(cluster, tmp_path):
    """Positive control: a real connection goes through the ProxyCommand (a relay to node0's sshd)."""
    node0 = cluster.host("node0")
    exec_marker, proxy_marker = tmp_path / "match-exec-ran", tmp_path / "proxycommand-ran"
    relay = tmp_path / "relay.py"
    relay.write_text(RELAY)
    config = tmp_path / "ssh_config"
    config.write_text(textwrap.dedent(f"""\
        Match exec "touch {exec_marker}"
          ServerAliveInterval 5
        Host viaproxy
          HostName {node0.addr}
          Port {node0.port}
          ProxyCommand {sys.executable} {relay} %h %p {proxy_marker}
        Host *
          User {os.environ.get("USER") or __import__("getpass").getuser()}
        """))
    hosts = tmp_path / "hosts.yaml"
    hosts.write_text(f"ssh_config: {config}\nhosts:\n  - {{host: viaproxy, slots: 2}}\n")
    result = subprocess.run([*CLI, "launch", str(RECIPE), "--set", "cluster.nodes=1", "--set", "cluster.gpus_per_node=2",
                             "--hosts", str(hosts), "--dry-run"], cwd=tmp_path, env=cluster.env(),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "would connect through ProxyCommand" in result.stdout
    assert not exec_marker.exists() and not proxy_marker.exists()

    result = subprocess.run([*CLI, "hosts", "check", "--hosts", str(hosts), "--json"], cwd=tmp_path,
                            env=cluster.env(), capture_output=True, text=True, timeout=120)
    data = json.loads(result.stdout)
    ssh = data["hosts"][0]["checks"]["ssh"]
    assert ssh["status"] == "ok", (ssh, result.stderr)
    assert "via ProxyCommand" in ssh["value"] and str(relay) in ssh["value"]
    assert exec_marker.exists() and proxy_marker.exists()
    # the relay (the ProxyCommand) was stopped with the connection
    relays = [p for p in os.listdir("/proc") if p.isdigit() and _cmdline_has(p, str(relay))]
    assert relays == []


def _cmdline_has(pid: str, text: str) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fp:
            return text.encode() in fp.read()
    except OSError:
        return False
