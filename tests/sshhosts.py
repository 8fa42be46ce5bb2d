"""Real sshd daemons as cluster "hosts" for the SSH launcher tests (one set per test session).

Preferred: every host is a **network namespace** with its own address on a test-only bridge
(``10.A.B.0/24``, names carrying this process id so parallel runs never collide), its own sshd
on port 22, and ``eth0`` inside. Distinct addresses catch real multi-node bugs that loopback
hides (gloo resolving the hostname to 127.0.0.1, a master address that only works locally).
Where the machine forbids namespaces (no CAP_NET_ADMIN/CAP_SYS_ADMIN, no ``ip``), every host
is an sshd on 127.0.0.1 with its own port instead, and the reason is printed
(``LLMTRAIN_TEST_LOOPBACK=1`` forces that fallback, to test it).

Besides the good hosts ``node0..nodeN-1``, the cluster has the bad ones the failure tests need:
``stranger`` (an sshd whose host key is in no known_hosts), ``impostor`` (an sshd whose
known_hosts entry holds another key), ``closed`` (a port nobody listens on), ``mute`` (a port
that accepts TCP and never says a word), ``wrongkey`` (a good host, but a client key it does
not accept) and ``jumped`` (node1 reached through node0 with ProxyJump). They are aliases in
the fixture's own ``~/.ssh/config``: tests run the CLI with ``HOME`` pointing at the fixture's
home, which also holds the client key and ``known_hosts``.

Teardown (a finalizer; also run for leftovers of crashed earlier sessions whose pid is gone):
kill each sshd by the pid in its PidFile, then delete the namespaces and the bridge.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

SSHD = shutil.which("sshd") or "/usr/sbin/sshd"
SFTP = next((p for p in ("/usr/lib/openssh/sftp-server", "/usr/libexec/openssh/sftp-server") if os.path.exists(p)),
            "internal-sftp")
NS_RE = re.compile(r"^llt(\d+)n\d+$")
BR_RE = re.compile(r"^lltb(\d+)$")


@dataclass
class Host:
    name: str
    addr: str
    port: int
    netns: str | None
    pidfile: Path
    known_line: str  # "NAME keytype key"


@dataclass
class Cluster:
    mode: str  # "netns" or "loopback"
    reason: str
    root: Path
    home: Path
    hosts: list[Host]
    ifname: str  # GLOO_SOCKET_IFNAME inside a host
    bridge: str | None = None
    netns: list[str] = field(default_factory=list)
    pidfiles: list[Path] = field(default_factory=list)
    sockets: list[socket.socket] = field(default_factory=list)
    mute_port: int = 0
    closed_port: int = 0
    bridge_addr: str = "127.0.0.1"

    def host(self, name: str) -> Host:
        return next(h for h in self.hosts if h.name == name)

    def env(self, **extra: str) -> dict[str, str]:
        """Environment for a CLI subprocess: the fixture's HOME, the fake engine, no agent."""
        repo = Path(__file__).resolve().parents[1]
        keep = {k: v for k, v in os.environ.items()
                if not k.startswith(("FAKE_ENGINE_", "LLMTRAIN_", "SSH_", "NCCL_", "GLOO_", "TORCH_", "HF_", "WANDB_"))}
        keep.update(HOME=str(self.home), PYTHONPATH=str(repo / "tests"), LLMTRAIN_ENGINE_MODULE="fake_engine",
                    COLUMNS="250")
        keep.update(extra)
        return keep

    def netns_inode(self, host: str) -> str | None:
        ns = self.host(host).netns
        if ns is None:
            return None
        return f"net:[{os.stat(f'/run/netns/{ns}').st_ino}]"

    def stop(self) -> None:
        for sock in self.sockets:
            sock.close()
        for pidfile in self.pidfiles:
            _kill_pidfile(pidfile)
        for ns in self.netns:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        if self.bridge:
            subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)


def _kill_pidfile(pidfile: Path) -> None:
    """Stop the sshd whose pid the PidFile holds, but only while that pid still is this sshd.

    If the sshd is already gone, its pid may belong to another process by now: pids wrap around
    quickly here (pid_max 32768; a loaded suite cycles through them in about an hour), and a
    bare ``kill`` would signal whatever process was given the number (found while chasing a
    torchrun that died of a SIGTERM nobody in its own test sent; not proven to be that case).
    The daemon's title keeps its ``-f CONFIG`` argument and the config lies beside the PidFile,
    so the check is that directory in /proc/PID/cmdline. A zombie counts as gone."""
    try:
        pid = int(pidfile.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return
    if not _is_our_sshd(pid, pidfile.parent):
        return
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    for _ in range(100):
        if not _is_our_sshd(pid, pidfile.parent):
            return
        time.sleep(0.02)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _is_our_sshd(pid: int, root: Path) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fp:
            cmdline = fp.read()
    except OSError:
        return False
    return _state(pid) not in (None, b"Z") and b"sshd" in cmdline and f"{root}/".encode() in cmdline


def _state(pid: int | str) -> bytes | None:
    """The state letter of /proc/PID/stat (b"Z" for a zombie), None when the process is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fp:
            return fp.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def _run(*cmd: str) -> None:
    result = subprocess.run(list(cmd), capture_output=True, text=True, timeout=30)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {(result.stderr or result.stdout).strip()}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def clean_stale() -> None:
    """Remove namespaces/bridges left by earlier sessions that crashed (their pid is gone)."""
    if not shutil.which("ip"):
        return
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    for line in listing.splitlines():
        name = line.split()[0] if line.split() else ""
        m = NS_RE.match(name)
        if m and not _alive(int(m.group(1))):
            pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout.split()
            for pid in pids:  # only the stale namespace's own processes (its sshd)
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
    links = subprocess.run(["ip", "-o", "link", "show", "type", "bridge"], capture_output=True, text=True).stdout
    for line in links.splitlines():
        parts = line.split(":")
        name = parts[1].strip().split("@")[0] if len(parts) > 1 else ""
        m = BR_RE.match(name)
        if m and not _alive(int(m.group(1))):
            subprocess.run(["ip", "link", "del", name], capture_output=True)


def _keygen(path: Path) -> str:
    _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "llmtrain-test", "-f", str(path))
    kind, key = (path.with_suffix(".pub") if path.suffix else Path(str(path) + ".pub")).read_text().split()[:2]
    return f"{kind} {key}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sshd_config(root: Path, name: str, listens: list[tuple[str, int]], hostkey: Path) -> Path:
    cfg = root / f"sshd_{name}.conf"
    lines = [f"ListenAddress {addr}:{port}" for addr, port in listens]
    lines += [f"HostKey {hostkey}", f"PidFile {root / f'sshd_{name}.pid'}", f"AuthorizedKeysFile {root / 'authorized_keys'}",
              "PermitRootLogin prohibit-password", "PasswordAuthentication no", "KbdInteractiveAuthentication no",
              "UsePAM no", "StrictModes no", "MaxStartups 100:30:200", "AllowTcpForwarding yes", "PrintMotd no",
              "PrintLastLog no", f"Subsystem sftp {SFTP}", "LogLevel ERROR"]
    cfg.write_text("\n".join(lines) + "\n")
    return cfg


def _start_sshd(cfg: Path, log: Path, netns: str | None) -> None:
    cmd = [SSHD, "-f", str(cfg), "-E", str(log)]
    if netns:
        cmd = ["ip", "netns", "exec", netns] + cmd
    _run(*cmd)


def _wait_listening(addr: str, port: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((addr, port), timeout=1) as s:
                s.settimeout(2)
                if s.recv(4).startswith(b"SSH"):
                    return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"sshd at {addr}:{port} did not come up")


def _setup_netns(cluster: Cluster, n: int) -> list[tuple[str, str | None]]:
    """Bridge + n namespaces; returns (address, namespace) per host."""
    tag = os.getpid()
    used = subprocess.run(["ip", "-o", "-4", "addr"], capture_output=True, text=True).stdout
    rng = random.Random(tag)
    for _ in range(50):
        prefix = f"10.{rng.randint(200, 250)}.{rng.randint(1, 250)}"
        if f" {prefix}." not in used:
            break
    bridge = f"lltb{tag}"
    _run("ip", "link", "add", bridge, "type", "bridge")
    cluster.bridge = bridge
    _run("ip", "addr", "add", f"{prefix}.1/24", "dev", bridge)
    _run("ip", "link", "set", bridge, "up")
    cluster.bridge_addr = f"{prefix}.1"
    out = []
    for i in range(n):
        ns, veth = f"llt{tag}n{i}", f"llv{tag}{i}"[:15]
        _run("ip", "netns", "add", ns)
        cluster.netns.append(ns)
        _run("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
        _run("ip", "link", "set", veth, "master", bridge, "up")
        _run("ip", "-n", ns, "addr", "add", f"{prefix}.{11 + i}/24", "dev", "eth0")
        _run("ip", "-n", ns, "link", "set", "eth0", "up")
        _run("ip", "-n", ns, "link", "set", "lo", "up")
        out.append((f"{prefix}.{11 + i}", ns))
    return out


def start_cluster(root: Path, n: int = 2) -> Cluster:
    """Start ``n`` good hosts plus the bad ones; raise RuntimeError when sshd cannot run at all."""
    if not os.path.exists(SSHD):
        raise RuntimeError("sshd not found: install openssh-server (.ci/run does)")
    os.makedirs("/run/sshd", exist_ok=True)
    home = root / "home"
    (home / ".ssh").mkdir(parents=True)
    client_pub = _keygen(home / ".ssh" / "id_ed25519")
    (root / "authorized_keys").write_text(client_pub + "\n")
    _keygen(root / "wrong_key")  # a key no host accepts
    clean_stale()
    cluster = Cluster("netns", "", root, home, [], "eth0")
    try:
        if os.environ.get("LLMTRAIN_TEST_LOOPBACK") == "1":  # to exercise the fallback on purpose
            raise RuntimeError("LLMTRAIN_TEST_LOOPBACK=1")
        places = _setup_netns(cluster, n) if shutil.which("ip") else None
        if places is None:
            raise RuntimeError("the `ip` command (iproute2) is missing")
    except RuntimeError as exc:
        cluster.stop()
        cluster = Cluster("loopback", f"network namespaces unavailable ({exc}); using sshd on 127.0.0.1 ports",
                          root, home, [], "lo")
        places = [("127.0.0.1", None)] * n
        print(f"\n[sshhosts] {cluster.reason}", file=sys.__stderr__, flush=True)
    try:
        known, config = [], []
        for i, (addr, ns) in enumerate(places):
            port = 22 if ns else _free_port()
            key = root / f"hostkey_node{i}"
            line = _keygen(key)
            cfg = _sshd_config(root, f"node{i}", [(addr, port)], key)
            _start_sshd(cfg, root / f"sshd_node{i}.log", ns)
            cluster.pidfiles.append(root / f"sshd_node{i}.pid")
            name = addr if port == 22 else f"[{addr}]:{port}"
            known.append(f"{name} {line}")
            cluster.hosts.append(Host(f"node{i}", addr, port, ns, root / f"sshd_node{i}.pid", f"{name} {line}"))
            config.append(f"Host node{i}\n  HostName {addr}\n  Port {port}\n  User {_user()}\n")
        # one more sshd in node0's place, on two ports: "stranger" (key unknown) and "impostor" (key changed)
        addr0, ns0 = places[0]
        p1, p2 = (2200, 2201) if ns0 else (_free_port(), _free_port())
        key = root / "hostkey_stranger"
        _keygen(key)
        bogus = _keygen(root / "hostkey_bogus")
        cfg = _sshd_config(root, "stranger", [(addr0, p1), (addr0, p2)], key)
        _start_sshd(cfg, root / "sshd_stranger.log", ns0)
        cluster.pidfiles.append(root / "sshd_stranger.pid")
        known.append(f"[{addr0}]:{p2} {bogus}")
        config.append(f"Host stranger\n  HostName {addr0}\n  Port {p1}\n")
        config.append(f"Host impostor\n  HostName {addr0}\n  Port {p2}\n")
        # a port that accepts TCP and never speaks, and one that is closed (both on this machine)
        mute = socket.socket()
        mute.bind((cluster.bridge_addr, 0))
        mute.listen(64)
        cluster.sockets.append(mute)
        cluster.mute_port = mute.getsockname()[1]
        cluster.closed_port = _free_port()
        config.append(f"Host mute\n  HostName {cluster.bridge_addr}\n  Port {cluster.mute_port}\n")
        config.append(f"Host closed\n  HostName {cluster.bridge_addr}\n  Port {cluster.closed_port}\n")
        config.append(f"Host wrongkey\n  HostName {addr0}\n  Port {cluster.hosts[0].port}\n"
                      f"  IdentityFile {root / 'wrong_key'}\n  IdentitiesOnly yes\n")
        if n > 1:
            h1 = cluster.hosts[1]
            config.append(f"Host jumped\n  HostName {h1.addr}\n  Port {h1.port}\n  ProxyJump node0\n")
        config.append(f"Host *\n  User {_user()}\n")
        (home / ".ssh" / "config").write_text("\n".join(config))
        (home / ".ssh" / "known_hosts").write_text("\n".join(known) + "\n")
        for h in cluster.hosts:
            _wait_listening(h.addr, h.port)
        _wait_listening(addr0, p1)
    except BaseException:
        cluster.stop()
        raise
    return cluster


def _user() -> str:
    import getpass

    return getpass.getuser()


def run_processes(run_id: str) -> list[int]:
    """Every live process whose environment carries this run's id (on every "host": they share /proc)."""
    needle, found = f"LLMTRAIN_RUN_ID={run_id}".encode(), []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as fp:
                if needle in fp.read().split(b"\0") and _state(name) not in (None, b"Z"):
                    found.append(int(name))
        except OSError:
            continue
    return found


def run_processes_with(run_id: str, *entries: str) -> list[int]:
    """The run's processes whose environment also holds every ``NAME=value`` of ``entries``
    (``RANK=3`` for a worker; ``LLMTRAIN_NODE_ID=<run id>.1`` for everything on node 1)."""
    wanted = {e.encode() for e in entries}
    found = []
    for pid in run_processes(run_id):
        try:
            with open(f"/proc/{pid}/environ", "rb") as fp:
                if wanted <= set(fp.read().split(b"\0")):
                    found.append(pid)
        except OSError:
            continue
    return found


_STATE: dict[str, object] = {}


def get_cluster(config, tmp_path_factory) -> Cluster:
    """The session's one cluster, shared by every test module; skipped (with the reason) without sshd."""
    import pytest

    if "cluster" not in _STATE:
        try:
            cluster = start_cluster(tmp_path_factory.mktemp("sshhosts"), 2)
        except RuntimeError as exc:
            _STATE["cluster"], _STATE["error"] = None, str(exc)
        else:
            config.add_cleanup(cluster.stop)
            _STATE["cluster"] = cluster
    if _STATE["cluster"] is None:
        pytest.skip(f"cannot start sshd test hosts: {_STATE['error']}")
    return _STATE["cluster"]  # type: ignore[return-value]
