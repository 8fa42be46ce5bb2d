"""A real Slurm cluster on this machine for the Slurm launcher tests (one per test session).

Layout (facts in ../shared/notes/slurm-test-cluster.md): one ``munged`` and one ``slurmctld`` in
the root network namespace, and one ``slurmd -N NAME`` per node, each inside its own network
namespace on a test-only bridge (``10.A.B.0/24``, addresses ``.21``, ``.22``, ...; bridge
``lslb<pid>``, namespaces ``lsl<pid>n<i>``, node names ``sl<pid>n<i>``: the SSH hosts use
``lltb``/``llt`` and ``.11``+, so both fixtures can run in one session). A node is started
with ``nsenter --net=/run/netns/NS unshare --uts --mount``, not ``ip netns exec`` (that remounts
/sys without the cgroup mounts and slurmd dies); the private mount namespace bind-mounts a
hosts file over ``/etc/hosts`` so nodes resolve each other's names, ``--uts`` gives each its
own hostname. The nodes share this machine's filesystem (the run directory is "shared
storage") and its process table (one /proc scan covers every node).

Everything the cluster writes is under the fixture's tmp dir (config, munge key and socket,
state, spool, logs). slurmctld's port is a free port picked at start, so it never collides
with another cluster or a real Slurm; clients find the cluster through ``SLURM_CONF``
(:meth:`SlurmCluster.env`). Partitions: ``debug`` (both nodes, the default) and ``gated``
(both nodes, ``AllowAccounts=research``). Without slurmdbd no account is known, so sbatch
refuses *every* job to ``gated`` with the message a real cluster gives for an account it
does not know ("Invalid account or account/partition combination specified"); measured:
``DenyAccounts`` instead gives "Requested partition configuration not available now", a
message no user meets for a bad account. Settings that matter (measured): ``EnforcePartLimits=ALL`` (else an impossible
request pends forever), ``ProctrackType=proctrack/cgroup`` (with linuxproc a daemonized task
survives ``scancel``), ``KillWait=5``, fast scheduler intervals.

Start and stop are idempotent: :func:`clean_stale` removes namespaces/bridges of crashed
earlier sessions (their pid is gone) first; teardown kills every daemon by the pid it was
started with (checked against its command line, so a reused pid is never hit), then deletes
the veth links explicitly (a deleted namespace with closing TCP connections keeps its veth
for a minute otherwise), the namespaces and the bridge.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.sshhosts import _alive, _run  # the SSH test hosts' process helpers, shared

SLURM_BINARIES = ("slurmctld", "slurmd", "munged", "sbatch", "srun", "squeue", "scontrol", "scancel", "sinfo")
NS_RE = re.compile(r"^lsl(\d+)n\d+$")
BR_RE = re.compile(r"^lslb(\d+)$")
VETH_RE = re.compile(r"^lsv(\d+)x\d+$")
N_NODES = 2
ACCOUNT = "research"  # partition "gated" allows only it (and, without slurmdbd, refuses even it)


@dataclass
class Daemon:
    name: str
    proc: subprocess.Popen
    marker: str  # a path in its command line: the pid is ours only while /proc/PID/cmdline holds it


@dataclass
class SlurmCluster:
    root: Path
    conf: Path
    nodes: list[str] = field(default_factory=list)  # node names, in job order
    addrs: list[str] = field(default_factory=list)
    netns: list[str] = field(default_factory=list)
    veths: list[str] = field(default_factory=list)
    bridge: str | None = None
    daemons: list[Daemon] = field(default_factory=list)
    ifname: str = "eth0"  # GLOO_SOCKET_IFNAME inside a node
    partition: str = "debug"

    def env(self, **extra: str) -> dict[str, str]:
        """Environment for a CLI subprocess: this cluster's SLURM_CONF, nothing of another Slurm."""
        keep = {k: v for k, v in os.environ.items()
                if not k.startswith(("SLURM_", "SBATCH_", "SALLOC_", "SRUN_", "LLMTRAIN_", "GLOO_", "TORCH_", "NCCL_"))}
        repo = Path(__file__).resolve().parents[1]
        keep.update(SLURM_CONF=str(self.conf), PYTHONPATH=str(repo / "tests"), COLUMNS="250")
        keep.update(extra)
        return keep

    def client(self, *args: str, timeout: float = 30) -> subprocess.CompletedProcess:
        """Run a Slurm client command (squeue, scontrol, ...) against this cluster."""
        return subprocess.run(list(args), env=self.env(), capture_output=True, text=True, timeout=timeout)

    def jobs(self) -> list[str]:
        """Job ids squeue still lists (pending, running or completing)."""
        return self.client("squeue", "-h", "-o", "%i").stdout.split()

    def known_jobs(self) -> list[tuple[int, str]]:
        """(job id, name) of every job slurmctld knows: live, or ended within MinJobAge (600 s), so
        a job can drop out of this list while a test runs; compare ids, not the lists (new_jobs)."""
        out = self.client("scontrol", "show", "job", "-o").stdout
        found = ((re.search(r"\bJobId=(\d+)", line), re.search(r"\bJobName=(\S+)", line)) for line in out.splitlines())
        return [(int(i.group(1)), n.group(1)) for i, n in found if i and n]

    def new_jobs(self, before: list[tuple[int, str]]) -> list[str]:
        """Names of the jobs submitted since ``before`` (a :meth:`known_jobs` list), in id order: ids
        only grow, and a job that aged out since is not new."""
        mark = max((i for i, _ in before), default=0)
        return [name for i, name in sorted(self.known_jobs()) if i > mark]

    def wait_idle(self, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        states: dict[str, str] = {}
        while time.monotonic() < deadline:
            dead = [d.name for d in self.daemons if d.proc.poll() is not None]
            if dead:
                raise RuntimeError(f"{dead[0]} exited at start; see {self.root}/log/{dead[0]}.out")
            out = self.client("sinfo", "-h", "-N", "-p", self.partition, "-o", "%N %t").stdout.split("\n")
            states = dict(line.split() for line in out if line.strip())
            if len(states) == len(self.nodes) and all(s == "idle" for s in states.values()):
                return
            time.sleep(0.1)
        raise RuntimeError(f"slurm nodes not idle after {timeout:g} s: {states}; see {self.root}/log")

    def node_pids(self, index: int) -> list[int]:
        """Every process in node ``index``'s network namespace: its slurmd, slurmstepds, torchrun, ranks."""
        out = subprocess.run(["ip", "netns", "pids", self.netns[index]], capture_output=True, text=True).stdout
        return [int(pid) for pid in out.split()]

    def crash_node(self, index: int, slurmd: bool = True) -> list[int]:
        """kill -9 every process of node ``index`` (a crashed machine); ``slurmd=False``: all but its
        slurmd (the job's slurmstepd, torchrun and ranks die; the node can run the next step).
        Returns the pids killed."""
        daemon = next(d for d in self.daemons if d.name == f"slurmd-{self.nodes[index]}")
        killed = []
        for pid in self.node_pids(index):
            if pid == daemon.proc.pid and not slurmd:
                continue
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except ProcessLookupError:
                pass
        if slurmd:
            daemon.proc.wait(timeout=10)
        return killed

    def restart_node(self, index: int, wait: bool = True) -> None:
        """Start node ``index``'s slurmd again (after :meth:`crash_node`; nothing if it runs) and,
        with ``wait``, wait until every node is idle."""
        name = self.nodes[index]
        self.daemons = [d for d in self.daemons if d.name != f"slurmd-{name}" or d.proc.poll() is None]
        if not any(d.name == f"slurmd-{name}" for d in self.daemons):
            _start_slurmd(self, name, self.netns[index])
        self.client("scontrol", "update", f"NodeName={name}", "State=RESUME")  # if slurmctld marked it down meanwhile
        if wait:
            self.wait_idle(60)

    def stop(self) -> None:
        for daemon in reversed(self.daemons):  # slurmd first, slurmctld, munged last
            _stop(daemon)
        self.daemons.clear()
        for veth in self.veths:
            subprocess.run(["ip", "link", "del", veth], capture_output=True)
        for ns in self.netns:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        if self.bridge:
            subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)
        self.veths, self.netns, self.bridge = [], [], None
        for node in self.nodes:
            _remove_cgroups(node)


def _remove_cgroups(node: str) -> None:
    """slurmd's (empty, once its jobs are gone) cgroup folders ``/sys/fs/cgroup/*/slurm_NODE``:
    removed deepest first with rmdir, which refuses a cgroup that still holds a process."""
    for top in Path("/sys/fs/cgroup").glob(f"*/slurm_{node}"):
        for path in sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)) + [top]:
            try:
                path.rmdir()
            except OSError:
                pass


def _cmdline_has(pid: int, marker: str) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fp:
            cmdline = fp.read()
        with open(f"/proc/{pid}/stat", "rb") as fp:
            state = fp.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != b"Z" and marker.encode() in cmdline


def _stop(daemon: Daemon) -> None:
    """SIGTERM the daemon by its pid (only while that pid is still it), SIGKILL after 5 s."""
    pid = daemon.proc.pid
    if daemon.proc.poll() is None and _cmdline_has(pid, daemon.marker):
        os.kill(pid, signal.SIGTERM)
        try:
            daemon.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            os.kill(pid, signal.SIGKILL)
            daemon.proc.wait(timeout=5)


def clean_stale() -> None:
    """Remove namespaces, veths and bridges of earlier sessions that crashed (their pid is gone)."""
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    for line in listing.splitlines():
        name = line.split()[0] if line.split() else ""
        m = NS_RE.match(name)
        if m and not _alive(int(m.group(1))):
            for pid in subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout.split():
                try:  # only the stale namespace's own processes (its slurmd and job steps)
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    for line in links.splitlines():
        parts = line.split(":")
        name = parts[1].strip().split("@")[0] if len(parts) > 1 else ""
        m = BR_RE.match(name) or VETH_RE.match(name)
        if m and not _alive(int(m.group(1))):
            subprocess.run(["ip", "link", "del", name], capture_output=True)
    for top in Path("/sys/fs/cgroup").glob("*/slurm_sl*n*"):
        m = re.match(r"^slurm_(sl(\d+)n\d+)$", top.name)
        if m and not _alive(int(m.group(2))):
            _remove_cgroups(m.group(1))


def _free_port(addr: str) -> int:
    with socket.socket() as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


def _network(cluster: SlurmCluster, tag: int) -> str:
    """Bridge + one namespace per node; returns the bridge address (slurmctld's)."""
    used = subprocess.run(["ip", "-o", "-4", "addr"], capture_output=True, text=True).stdout
    rng = random.Random(tag * 7 + 1)
    for _ in range(50):
        prefix = f"10.{rng.randint(200, 250)}.{rng.randint(1, 250)}"
        if f" {prefix}." not in used:
            break
    cluster.bridge = f"lslb{tag}"
    _run("ip", "link", "add", cluster.bridge, "type", "bridge")
    _run("ip", "addr", "add", f"{prefix}.1/24", "dev", cluster.bridge)
    _run("ip", "link", "set", cluster.bridge, "up")
    for i in range(N_NODES):
        ns, veth, addr = f"lsl{tag}n{i}", f"lsv{tag}x{i}"[:15], f"{prefix}.{21 + i}"
        _run("ip", "netns", "add", ns)
        cluster.netns.append(ns)
        _run("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
        cluster.veths.append(veth)
        _run("ip", "link", "set", veth, "master", cluster.bridge, "up")
        _run("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0")
        _run("ip", "-n", ns, "link", "set", "eth0", "up")
        _run("ip", "-n", ns, "link", "set", "lo", "up")
        cluster.nodes.append(f"sl{tag}n{i}")
        cluster.addrs.append(addr)
    return f"{prefix}.1"


def _slurm_conf(cluster: SlurmCluster, ctl_addr: str, port: int, sock: Path) -> str:
    r = cluster.root
    nodes = [f"NodeName={n} NodeAddr={a} NodeHostname={n} CPUs=2 Sockets=1 CoresPerSocket=2 ThreadsPerCore=1 "
             "RealMemory=1000 State=UNKNOWN" for n, a in zip(cluster.nodes, cluster.addrs)]
    names = ",".join(cluster.nodes)
    return "\n".join([
        f"ClusterName=llt{os.getpid()}", f"SlurmctldHost={socket.gethostname().split('.')[0]}({ctl_addr})", "MailProg=/bin/true", f"SlurmctldPort={port}", "SlurmdPort=6818",
        "AuthType=auth/munge", "CredType=cred/munge", f"AuthInfo=socket={sock}",
        "SlurmUser=root", "SlurmdUser=root", f"StateSaveLocation={r}/state", f"SlurmdSpoolDir={r}/spool/%n",
        f"SlurmctldPidFile={r}/run/slurmctld.pid", f"SlurmdPidFile={r}/run/slurmd-%n.pid",
        f"SlurmctldLogFile={r}/log/slurmctld.log", f"SlurmdLogFile={r}/log/slurmd-%n.log",
        "SlurmctldDebug=info", "SlurmdDebug=info", "SlurmdParameters=config_overrides",
        "ProctrackType=proctrack/cgroup", "TaskPlugin=task/none", "MpiDefault=none",
        "SelectType=select/cons_tres", "SelectTypeParameters=CR_CPU", "ReturnToService=2", "KillWait=5",
        "MinJobAge=600", "EnforcePartLimits=ALL", "SchedulerParameters=batch_sched_delay=0,bf_interval=1,sched_interval=2",
        "JobCompType=jobcomp/filetxt", f"JobCompLoc={r}/log/jobcomp.txt", "AccountingStorageType=accounting_storage/none",
        "JobAcctGatherType=jobacct_gather/none", "SlurmctldTimeout=30", "SlurmdTimeout=30", "InactiveLimit=0",
        *nodes,
        f"PartitionName=debug Nodes={names} Default=YES MaxTime=INFINITE State=UP",
        f"PartitionName=gated Nodes={names} AllowAccounts={ACCOUNT} MaxTime=INFINITE State=UP",
    ]) + "\n"


def _daemon(cluster: SlurmCluster, name: str, cmd: list[str], marker: str) -> None:
    with open(cluster.root / "log" / f"{name}.out", "ab") as log:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    cluster.daemons.append(Daemon(name, proc, marker))


def _start_slurmd(cluster: SlurmCluster, name: str, ns: str) -> None:
    hosts = cluster.root / "etc" / "hosts"
    script = f"hostname {name} && mount --bind {hosts} /etc/hosts && exec slurmd -D -N {name} -f {cluster.conf}"
    _daemon(cluster, f"slurmd-{name}", ["nsenter", f"--net=/run/netns/{ns}", "unshare", "--uts", "--mount",
                                        "--propagation", "private", "sh", "-c", script], str(cluster.conf))


def missing_binaries() -> list[str]:
    return [b for b in (*SLURM_BINARIES, "ip", "nsenter", "unshare") if shutil.which(b) is None
            and not os.path.exists(f"/usr/sbin/{b}")]


def start_cluster(root: Path) -> SlurmCluster:
    """munged + slurmctld here, one slurmd per node namespace; RuntimeError when that cannot run."""
    if os.geteuid() != 0:
        raise RuntimeError("not root: slurmd and network namespaces need root")
    missing = missing_binaries()
    if missing:
        raise RuntimeError(f"missing {' '.join(missing)}: apt-get install slurmctld slurmd slurm-client munge "
                           "iproute2 util-linux (.ci/run does)")
    clean_stale()
    for sub in ("state", "spool", "log", "run", "munge", "etc"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    os.chmod(root / "munge", 0o755)  # munged wants its socket directory world-executable
    cluster = SlurmCluster(root, root / "etc" / "slurm.conf")
    tag = os.getpid()
    try:
        ctl_addr = _network(cluster, tag)
        key, sock = root / "munge" / "munge.key", root / "munge" / "munge.socket"
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o600)
        _daemon(cluster, "munged", ["munged", "-F", "--force", f"--socket={sock}", f"--key-file={key}",
                                    f"--pid-file={root}/run/munged.pid", f"--log-file={root}/log/munged.log",
                                    f"--seed-file={root}/munge/munge.seed"], str(key))
        port = _free_port(ctl_addr)
        cluster.conf.write_text(_slurm_conf(cluster, ctl_addr, port, sock))
        (root / "etc" / "cgroup.conf").write_text("CgroupPlugin=autodetect\nIgnoreSystemd=yes\n")
        hosts = root / "etc" / "hosts"
        hosts.write_text("127.0.0.1 localhost\n" + "".join(f"{a} {n}\n" for a, n in zip(cluster.addrs, cluster.nodes))
                         + f"{ctl_addr} ctl\n")
        deadline = time.monotonic() + 10
        while not sock.exists():
            if time.monotonic() > deadline or cluster.daemons[0].proc.poll() is not None:
                raise RuntimeError(f"munged did not start; see {root}/log/munged.out")
            time.sleep(0.02)
        _daemon(cluster, "slurmctld", ["slurmctld", "-D", "-c", "-i", "-f", str(cluster.conf)], str(cluster.conf))
        for name, ns in zip(cluster.nodes, cluster.netns):
            _start_slurmd(cluster, name, ns)
        cluster.wait_idle()
    except BaseException:
        cluster.stop()
        raise
    return cluster


_STATE: dict[str, object] = {}


def get_cluster(config, tmp_path_factory) -> SlurmCluster:
    """The session's one Slurm cluster. Skipped, with the reason, where it cannot run (not root,
    packages missing) -- except under CI (``CI=true``), where .ci/run installs everything and a
    cluster that does not come up is a failure, never a silent skip."""
    import pytest

    if "cluster" not in _STATE:
        try:
            cluster = start_cluster(tmp_path_factory.mktemp("slurm"))
        except RuntimeError as exc:
            _STATE["cluster"], _STATE["error"] = None, str(exc)
        else:
            config.add_cleanup(cluster.stop)
            _STATE["cluster"] = cluster
    if _STATE["cluster"] is None:
        message = f"cannot start the Slurm test cluster: {_STATE['error']}"
        if os.environ.get("CI", "").lower() in ("true", "1"):
            pytest.fail(message + " (CI=true: .ci/run installs the packages, so this is a failure)")
        pytest.skip(message)
    return _STATE["cluster"]  # type: ignore[return-value]
