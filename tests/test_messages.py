"""Messages: bad identity files are local configuration, echoes are escaped and never show a
file the user did not mean to show, and Ctrl-C ends a launch with one line and exit 130.

Real parts: real files (a FIFO, a directory, a public key, a password-hash file, the real
/etc/shadow where readable), the real CLI in a subprocess, a real local torchrun launch (fake
engine) and a real two-host SSH launch (tests/sshhosts.py) interrupted with SIGINT.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from llmtrain.cluster.hostfile import parse_hostfile
from llmtrain.launch.sshconfig import identity_problems, resolve_targets
from tests.sshhosts import get_cluster, run_processes
from tests.test_launch_local import _start_and_wait_sleeping
from tests.test_launch_ssh import Background, wait_gone, write_hosts, write_recipe

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "debug.yaml"
CLI = [sys.executable, "-c", "from llmtrain.cli.app import main; main()"]
PRIVATE = "-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjEAAAAA\n-----END OPENSSH PRIVATE KEY-----\n"
HASH = "$y$j9T$Fq2ZsEcReThAsH0123456789abcdef$ZXCVBNMasdfghjklQWERTYuiop0987"


@pytest.fixture(scope="session")
def cluster(request, tmp_path_factory):
    return get_cluster(request.config, tmp_path_factory)


def cli(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("LLMTRAIN_", "SSH_"))}
    base.setdefault("HOME", str(tmp_path))
    return subprocess.run([*CLI, *args], cwd=tmp_path, env={**base, **(env or {})}, capture_output=True, text=True,
                          timeout=120)


def dry_run(tmp_path: Path, hosts: Path) -> subprocess.CompletedProcess:
    return cli(tmp_path, "launch", str(RECIPE), "--set", "cluster.nodes=1", "--set", "cluster.gpus_per_node=2",
               "--hosts", str(hosts), "--dry-run", env={"HOME": str(tmp_path / "home")})


# ----------------------------------------------------------------------------- identity files


def key_files(tmp_path: Path) -> dict[str, Path]:
    good = tmp_path / "id_good"
    good.write_text(PRIVATE)
    pub = tmp_path / "id_good.pub"
    pub.write_text("ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIFakeFakeFake user@host\n")
    notkey = tmp_path / "notes.txt"
    notkey.write_text(f"password={HASH}\n")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    return {"good": good, "pub": pub, "notkey": notkey, "fifo": fifo, "dir": tmp_path, "missing": tmp_path / "nope",
            "big": _big(tmp_path)}


def _big(tmp_path: Path) -> Path:
    path = tmp_path / "huge_key"
    path.write_bytes(b"-----BEGIN OPENSSH PRIVATE KEY-----\n" + b"A" * (70 << 10))
    return path


@pytest.mark.parametrize("kind, fragment", [
    ("missing", "identity file not found: {path}"),
    ("dir", "identity file {path} is a directory"),
    ("fifo", "identity file {path} is a FIFO (named pipe), not a regular file"),
    ("pub", "identity file {path} is a public key; give the private key file (the one without .pub)"),
    ("notkey", "identity file {path} is not a private key"),
    ("big", "identity file {path} is 70.0 KiB, over the 64 KiB limit"),
])
def test_bad_hostfile_identity_file_is_a_local_problem_naming_the_field(tmp_path, kind, fragment):
    path = key_files(tmp_path)[kind]
    hosts = tmp_path / "hosts.yaml"
    hosts.write_text(f"hosts:\n  - {{host: 10.250.0.9, slots: 2, identity_file: {path}}}\n")
    result = dry_run(tmp_path, hosts)
    assert result.returncode == 2, result.stdout + result.stderr
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"error: {hosts}: identity_file of host 10.250.0.9: "), line
    assert fragment.format(path=path) in line and "refused" not in line and HASH not in line


def test_ssh_config_identity_files_follow_openssh(tmp_path):
    keys = key_files(tmp_path)
    config = tmp_path / "ssh_config"
    config.write_text(f"Host lenient\n  IdentityFile {keys['missing']}\n  IdentityFile {keys['good']}\n"
                      f"Host strict\n  IdentityFile {keys['missing']}\n  IdentitiesOnly yes\n"
                      f"Host dirkey\n  IdentityFile {keys['dir']}\n"
                      f"Host *\n  IdentityFile ~/.ssh/id_absent_default\n")
    hf = parse_hostfile(f"ssh_config: {config}\nhosts:\n  - {{host: lenient, slots: 1}}\n  - {{host: strict, slots: 1}}\n"
                        "  - {host: dirkey, slots: 1}\n  - {host: other, slots: 1}\n")
    lenient, strict, dirkey, other = resolve_targets(hf)
    assert identity_problems([lenient]) == []  # a missing IdentityFile is skipped when another one exists
    assert identity_problems([other]) == []  # a Host * default the user lacks: skipped, as OpenSSH does
    (p,) = identity_problems([strict])
    assert p.path == f"{config}: IdentityFile for strict"
    absent = os.path.expanduser("~/.ssh/id_absent_default")  # Host * applies to it too
    assert p.message == f"none of the identity files exists ({keys['missing']}, {absent}) and IdentitiesOnly is yes"
    (p,) = identity_problems([dirkey])
    assert p.path == f"{config}: IdentityFile for dirkey" and p.message == f"identity file {keys['dir']} is a directory, not a regular file"
    assert p.hint == "fix IdentityFile in the ssh config"


def test_hosts_check_reports_a_bad_key_before_connecting(cluster, tmp_path):
    hosts = tmp_path / "hosts.yaml"
    hosts.write_text(f"hosts:\n  - {{host: node0, slots: 2, identity_file: {tmp_path / 'id_typo'}}}\n")
    result = subprocess.run([*CLI, "hosts", "check", "--hosts", str(hosts)], cwd=tmp_path, env=cluster.env(),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr  # a usage error, not a failed host (1)
    assert result.stderr.splitlines() == [f"error: {hosts}: identity_file of host node0: identity file not found: "
                                          f"{tmp_path / 'id_typo'}; fix identity_file for this host in the hostfile"]
    assert "llmtrain hosts check" not in result.stdout  # no table: nothing was connected


def test_a_proxycommand_that_fails_is_one_sentence_with_its_exit_code():
    from llmtrain.launch.backends import ssh
    from llmtrain.launch.sshconfig import SSHTarget

    for command, fragment in (("sh -c 'exit 3'", "exited with code 3"), ("no-such-proxy-xyz %h", "exited with code 127 "
                                                                                          "(command not found)")):
        with pytest.raises(ssh.SSHError) as info:
            ssh.connect(SSHTarget("gate", "10.250.0.1", 22, "u", proxy_command=command),
                        ssh.SSHOptions(connect_timeout=2, banner_timeout=2))
        assert str(info.value) == f"gate (u@10.250.0.1:22): ProxyCommand `{command}` {fragment}"
        assert info.value.kind == "proxy" and "ProxyCommand in the ssh config" in info.value.hint


# ----------------------------------------------------------------------------- echoes


def test_control_characters_in_paths_are_escaped_one_line_per_problem(tmp_path):
    evil = "hosts\x1b[2J\nerror: forged"
    result = cli(tmp_path, "plan", str(RECIPE), "--hosts", str(tmp_path / evil))
    assert result.returncode == 2
    (line,) = result.stderr.splitlines()
    assert "\x1b" not in line and "\\x1b[2J\\nerror: forged" in line
    key = "id\x07\x1b]0;pwned\x07"
    hosts = tmp_path / "hosts.yaml"
    hosts.write_text('hosts:\n  - {host: h1, slots: 2, identity_file: "%s"}\n' % key.encode("unicode_escape").decode())
    result = dry_run(tmp_path, hosts)
    assert result.returncode == 2
    (line,) = result.stderr.splitlines()
    assert "\x1b" not in line and "\x07" not in line and "id\\x07\\x1b]0;pwned\\x07" in line


def shadow_like(tmp_path: Path) -> Path:
    path = tmp_path / "shadow"
    path.write_text(f"root:{HASH}:19000:0:99999:7:::\ndaemon:*:19000:0:99999:7:::\nalice:{HASH[::-1]}:19001:0:99999:7:::\n")
    return path


def test_a_file_that_is_not_a_hostfile_is_never_echoed(tmp_path):
    for hosts in (shadow_like(tmp_path), Path("/etc/shadow")):
        if not os.access(hosts, os.R_OK):
            continue  # the real one needs root; the copy above is always there
        content = hosts.read_text(errors="replace")
        secrets = {f for line in content.splitlines() for f in line.split(":")[1:2] if len(f) > 3}
        for args in (["plan", str(RECIPE), "--hosts", str(hosts)],
                     ["launch", str(RECIPE), "--hosts", str(hosts), "--dry-run"]):
            result = cli(tmp_path, *args)
            out = result.stdout + result.stderr
            assert result.returncode == 2, out
            assert not any(s in out for s in secrets), out
            (line,) = result.stderr.splitlines()
            assert line.startswith(f"error: {hosts}:") and "expected `HOSTNAME slots=N` lines" in line


def test_binary_and_non_utf8_files_and_a_wrong_ssh_config_echo_nothing(tmp_path):
    binary = tmp_path / "id_rsa.bin"
    binary.write_bytes(b"worker-1 slots=8\n" + b"\x00\x01SECRET-BYTES\x00" * 10)
    result = cli(tmp_path, "plan", str(RECIPE), "--hosts", str(binary))
    assert result.returncode == 2 and "SECRET" not in result.stderr
    assert result.stderr.strip() == (f"error: {binary}:2: is a binary file, not a hostfile; "
                                     "pass a text hostfile (`worker-1 slots=8` lines or YAML)")
    latin = tmp_path / "latin"
    latin.write_bytes(b"worker-1 slots=8\nworker-2 slots=8 # caf\xe9 SECRET\n")
    result = cli(tmp_path, "plan", str(RECIPE), "--hosts", str(latin))
    assert result.returncode == 2 and "SECRET" not in result.stderr and f"{latin}:2" in result.stderr
    # a hostfile-looking file echoes only a short escaped token of the bad line
    typo = tmp_path / "typo"
    typo.write_text("worker-1 slots=8\nworker/2 slots=8 \x1b[31m\n")
    result = cli(tmp_path, "plan", str(RECIPE), "--hosts", str(typo))
    assert result.stderr.strip() == f"error: {typo}:2: 'worker/2' is not a valid hostname; write `HOSTNAME slots=N`"
    # an ssh_config: that points at the wrong file: file:line, not its text
    hosts = tmp_path / "hosts.yaml"
    hosts.write_text(f"ssh_config: {shadow_like(tmp_path)}\nhosts:\n  - {{host: h1, slots: 2}}\n")
    result = dry_run(tmp_path, hosts)
    assert result.returncode == 2 and HASH not in result.stderr
    assert result.stderr.strip() == (f"error: {tmp_path / 'shadow'}:1: cannot parse this line (expected `Keyword value`; "
                                     "is it an ssh config?); fix its syntax (man ssh_config)")


# ----------------------------------------------------------------------------- Ctrl-C


def after_interrupt(lines: list[str], n_before: int) -> list[str]:
    return [line.rstrip("\n") for line in lines[n_before:] if line.strip()]


@pytest.mark.parametrize("to_group", [True, False], ids=["terminal-ctrl-c-to-the-group", "sigint-to-the-launcher"])
def test_ctrl_c_on_a_local_launch_ends_with_one_line_and_130(tmp_path, to_group):
    proc, reader, lines, run_id = _start_and_wait_sleeping(tmp_path)
    n_before = len(lines)
    try:
        if to_group:
            os.killpg(os.getpgid(proc.pid), signal.SIGINT)  # what the terminal does on Ctrl-C
        else:
            os.kill(proc.pid, signal.SIGINT)
        rc = proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    reader.join(5)
    out = "".join(lines)
    tail = after_interrupt(lines, n_before)
    assert rc == 130, out
    assert "Traceback" not in out and "SignalException" not in out, out
    assert len(tail) <= 3, tail
    assert tail[0] == "[launcher] SIGINT received: stopping the run (SIGTERM now, SIGKILL after 5 s)", tail
    assert re.fullmatch(r"== run stopped by SIGINT: exit code 130; interrupted: stopped 2 ranks \(\d+ processes\); "
                        r"steps 1/12, last loss [\d.]+, [\d,]+ tokens/s; (\d+ lines of output after the signal are "
                        r"only in|logs:) \S+/logs", tail[-1]), tail
    assert run_processes(run_id) == [], out
    # the logs keep everything the console left out
    run_dir = next(Path(tmp_path / "runs" / "debug").iterdir())
    assert "SignalException" in (run_dir / "logs" / "launcher.log").read_text()


def test_ctrl_c_on_an_ssh_launch_ends_with_one_line_and_130(cluster, tmp_path):
    recipe = write_recipe(tmp_path / "r.yaml", cluster, steps=6, grace_s=2)
    hosts = write_hosts(tmp_path / "hosts", "node0 slots=2", "node1 slots=2")
    bg = Background(cluster, tmp_path, "launch", str(recipe), "--hosts", str(hosts), "--skip-preflight",
                    FAKE_ENGINE_SLEEP="60")
    bg.wait_for(*[f"[node{r // 2}:{r}] rank {r} sleeping" for r in range(4)])
    run_id, n_before = bg.run_id, len(bg.lines)
    try:
        t0 = time.monotonic()
        os.killpg(os.getpgid(bg.proc.pid), signal.SIGINT)
        rc = bg.proc.wait(timeout=30)
        elapsed = time.monotonic() - t0
    finally:
        bg.kill()
    bg.reader.join(5)
    out, tail = bg.text, after_interrupt(bg.lines, n_before)
    assert rc == 130, out
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out
    assert len(tail) <= 3, tail
    assert tail[0] == "[launcher] SIGINT received: stopping all nodes (SIGTERM now, SIGKILL after 2 s)", tail
    assert tail[-1].startswith("== run stopped by SIGINT: exit code 130; interrupted: stopped 4 ranks on 2 nodes; "), tail
    assert elapsed < 8, f"{elapsed:.1f} s"
    assert wait_gone(run_id, 2.0) == [], out
    run_dir = next(Path(tmp_path / "runs").glob("*/*"))
    node_logs = "".join((run_dir / "logs" / f"node-{i}.log").read_text() for i in (0, 1))
    assert "helper: SIGINT received, stopping the node" in node_logs  # shown before; now in the logs only
    logs = node_logs + "".join(p.read_text() for p in (run_dir / "logs").glob("rank-*.log"))
    assert "Traceback" in logs  # what the console was spared is all in the logs
