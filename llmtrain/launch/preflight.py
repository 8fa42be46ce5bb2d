"""``llmtrain hosts check``: is every host ready to run this job? Checked in parallel, before anything starts.

Per host, over one SSH connection (kept open for the launch that follows):

==========  =================================================================================
ssh         reachable, host key known, key accepted (each failure class is one sentence)
python      the configured absolute python exists; version >= 3.10
workdir     the working directory exists
torch       installed; version (CUDA and NCCL builds when present); same on every host
llmtrain    importable, and the very version of the launching machine
gpus        ``nvidia-smi -L`` count >= the host's slots (no nvidia-smi: a CPU host, fine)
disk        free space at the run directory (fail < 1 GiB, warn < 10 GiB)
port        the rendezvous port is free on the first host
clock       skew against the launching machine (warn > 1 s, fail > 5 s)
==========  =================================================================================

The probe is one small Python program sent with ``python -c`` (it does not import torch: the
versions come from ``torch/version.py`` and package metadata, so a check takes well under a
second). ``llmtrain launch`` runs the same checks first unless ``--skip-preflight``. Under Slurm
the same probe runs as one ``srun`` task per node instead (:mod:`llmtrain.launch.backends.slurm_preflight`)
and is judged by the same rules.
"""

from __future__ import annotations

import json
import shlex
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

from llmtrain import __version__ as LLMTRAIN_VERSION
from llmtrain.errors import Problem
from llmtrain.launch.commands import LaunchSpec, NodeSpec

GIB = 1 << 30
CHECKS = ("ssh", "python", "workdir", "torch", "llmtrain", "gpus", "disk", "port", "clock")
PROBE_TIMEOUT_S = 60.0

PROBE = r'''
import json, os, shutil, socket, subprocess, sys, time
r = {"python": "%d.%d.%d" % tuple(sys.version_info[:3]), "executable": sys.executable}
def meta(name):
    try:
        from importlib import metadata
        return metadata.version(name)
    except Exception:
        return None
try:
    import llmtrain
    r["llmtrain"] = str(getattr(llmtrain, "__version__", "unknown"))
except Exception as e:
    r["llmtrain"] = None
    r["llmtrain_error"] = "%s: %s" % (type(e).__name__, e)
try:
    import importlib.util
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        r["torch"] = None
    else:
        path = os.path.join(list(spec.submodule_search_locations)[0], "version.py")
        ns = {}
        with open(path) as f:
            exec(compile(f.read(), path, "exec"), ns)
        r["torch"], r["cuda"] = ns.get("__version__"), ns.get("cuda")
except Exception as e:
    r["torch"] = meta("torch")
r["nccl"] = None
for entry in sys.path:  # pip's NCCL wheel: nvidia_nccl_cu12-2.21.5.dist-info (a listdir, not a metadata scan)
    try:
        names = os.listdir(entry or ".")
    except OSError:
        continue
    found = [n for n in names if n.startswith("nvidia_nccl_cu") and n.endswith(".dist-info")]
    if found:
        r["nccl"] = found[0][:-len(".dist-info")].split("-", 1)[-1]
        break
smi = shutil.which("nvidia-smi")
r["gpus"] = None
if smi:
    try:
        p = subprocess.run([smi, "-L"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=20)
        r["gpus"] = sum(1 for l in p.stdout.decode(errors="replace").splitlines() if l.startswith("GPU "))
        if p.returncode:
            r["gpu_error"] = p.stderr.decode(errors="replace").strip()[:200] or "exit %d" % p.returncode
    except Exception as e:
        r["gpu_error"] = str(e)[:200]
path = sys.argv[1]
while not os.path.exists(path) and path not in ("", "/"):
    path = os.path.dirname(path)
st = os.statvfs(path or "/")
r["disk_free"], r["disk_path"] = st.f_bavail * st.f_frsize, path or "/"
r["workdir_ok"] = os.path.isdir(sys.argv[3])
port = int(sys.argv[2])
if port:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("", port))
        r["port_free"] = True
    except OSError as e:
        r["port_free"], r["port_error"] = False, e.strerror
    finally:
        s.close()
r["time"] = time.time()
sys.stdout.write("@@probe " + json.dumps(r) + "\n")
'''


@dataclass
class Check:
    name: str
    status: str  # ok, warn, fail, skip
    value: str  # the full sentence
    hint: str = ""
    short: str = ""  # what the table cell shows (default: value)

    def to_dict(self) -> dict[str, str]:
        return {"name": self.name, "status": self.status, "value": self.value, "hint": self.hint}

    def cell(self) -> str:
        mark = {"fail": "✗ ", "warn": "! "}.get(self.status, "")
        return mark + (self.short or self.value)


@dataclass
class HostReport:
    node: NodeSpec
    checks: dict[str, Check] = field(default_factory=dict)
    conn: Any = None  # the open fabric Connection, when ssh passed
    probe: dict[str, Any] = field(default_factory=dict)

    def add(self, name: str, status: str, value: str, hint: str = "", short: str = "") -> None:
        self.checks[name] = Check(name, status, value, hint, short)

    @property
    def failed(self) -> list[Check]:
        return [c for c in self.checks.values() if c.status == "fail"]

    def problems(self) -> list[Problem]:
        label = f"{self.node.target.label}{self.node.target.route}"
        return [Problem(label, c.value if c.name == "ssh" else f"{c.name}: {c.value}", c.hint) for c in self.failed]

    def to_dict(self) -> dict[str, Any]:
        return {"node": self.node.node_rank, "host": self.node.host, "address": self.node.target.address,
                "slots": self.node.slots, "ok": not self.failed,
                "checks": {name: c.to_dict() for name, c in self.checks.items()}}


def local_versions() -> dict[str, str | None]:
    try:
        torch = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch = None
    return {"llmtrain": LLMTRAIN_VERSION, "torch": torch}


def _base(version: str | None) -> str | None:
    return version.split("+", 1)[0] if version else None


def probe_command(spec: LaunchSpec, node: NodeSpec) -> str:
    runs_root = node.run_dir.rsplit("/", 2)[0]  # RUN_ROOT/<name>/<run id> -> RUN_ROOT
    port = spec.port if node.node_rank == 0 else 0
    return shlex.join([node.python, "-c", PROBE, runs_root, str(port), node.workdir])


def check_host(spec: LaunchSpec, node: NodeSpec, opts: Any, local: dict[str, str | None]) -> HostReport:
    from llmtrain.launch.backends import ssh

    report = HostReport(node)
    try:
        report.conn = ssh.connect(node.target, opts)
    except ssh.SSHError as exc:
        report.add("ssh", "fail", exc.message, exc.hint, exc.kind.replace("_", " "))
        return report
    report.add("ssh", "ok", f"{node.target.address}{node.target.route}", short="ok" + node.target.short_route)
    t0 = time.time()
    try:
        code, out, err = ssh.run_capture(report.conn, probe_command(spec, node), PROBE_TIMEOUT_S)
    except (TimeoutError, OSError, EOFError) as exc:
        report.add("python", "fail", f"the probe did not answer ({exc})", "check the host's load and sshd")
        return report
    except Exception as exc:  # noqa: BLE001 - paramiko errors on a dying connection
        report.add("python", "fail", f"the probe failed: {type(exc).__name__}: {exc}", "check the host")
        return report
    t1 = time.time()
    line = next((ln for ln in out.splitlines() if ln.startswith("@@probe ")), None)
    if code in (126, 127) or line is None:
        detail = (err.strip().splitlines() or [f"exit code {code}"])[-1][:160]
        if code == 127:
            message = f"{node.python} not found ({detail})"
        elif code == 126:
            message = f"{node.python} is not executable ({detail})"
        else:
            message = f"{node.python} could not run the probe ({detail})"
        report.add("python", "fail", message,
                   "install Python >= 3.10 there, or set `python:` for this host in the hostfile (or launch.python)",
                   "not found" if code == 127 else "broken")
        return report
    probe = report.probe = json.loads(line[len("@@probe "):])
    probe["_skew"] = probe["time"] - (t0 + t1) / 2
    probe["_skew_err"] = (t1 - t0) / 2
    _judge(report, spec, node, probe, local)
    return report


def _judge(report: HostReport, spec: LaunchSpec, node: NodeSpec, p: dict[str, Any], local: dict[str, str | None]) -> None:
    version = tuple(int(x) for x in p["python"].split(".")[:2])
    if version < (3, 10):
        report.add("python", "fail", f"{node.python} is Python {p['python']}", "use Python >= 3.10")
    else:
        report.add("python", "ok", f"{p['python']} ({node.python})", short=p["python"])
    if p.get("workdir_ok"):
        report.add("workdir", "ok", node.workdir, short="ok")
    else:
        report.add("workdir", "fail", f"{node.workdir} does not exist",
                   "create it, or set `workdir:` in the hostfile (or launch.workdir)", "missing")
    torch = p.get("torch")
    if not torch:
        report.add("torch", "fail", f"torch is not installed for {node.python}",
                   f"{node.python} -m pip install torch=={_base(local.get('torch')) or '2.13.0'}", "missing")
    else:
        builds = ", ".join(x for x in (f"CUDA {p['cuda']}" if p.get("cuda") else "CPU build",
                                       f"NCCL {p['nccl']}" if p.get("nccl") else "") if x)
        differs = local.get("torch") and _base(local["torch"]) != _base(torch)
        report.add("torch", "warn" if differs else "ok", f"{torch} ({builds})",
                   f"the launching machine has torch {local.get('torch')}" if differs else "",
                   torch + (f" cu{p['cuda']}" if p.get("cuda") else "") + (f" nccl{p['nccl']}" if p.get("nccl") else ""))
    mine = local.get("llmtrain")
    theirs = p.get("llmtrain")
    if theirs is None:
        report.add("llmtrain", "fail", f"llmtrain is not importable by {node.python} "
                                       f"({p.get('llmtrain_error', 'not installed')[:120]})",
                   f"install llmtrain {mine} there: {node.python} -m pip install llmtrain=={mine} (or the same checkout)",
                   "missing")
    elif theirs != mine:
        report.add("llmtrain", "fail", f"version {theirs}, the launching machine has {mine}",
                   f"install llmtrain {mine} there: {node.python} -m pip install llmtrain=={mine} (or the same checkout)",
                   f"{theirs} != {mine}")
    else:
        report.add("llmtrain", "ok", theirs)
    if p.get("gpu_error"):
        report.add("gpus", "fail", f"nvidia-smi failed: {p['gpu_error']}", "check the NVIDIA driver on the host",
                   "nvidia-smi failed")
    elif p.get("gpus") is None:
        report.add("gpus", "ok", "no nvidia-smi (CPU host)", short="none (CPU)")
    elif p["gpus"] < node.slots:
        report.add("gpus", "fail", f"{p['gpus']} GPUs for {node.slots} slots",
                   f"give this host at most slots={p['gpus']} in the hostfile", f"{p['gpus']}/{node.slots}")
    else:
        report.add("gpus", "ok", f"{p['gpus']} GPUs, {node.slots} slots", short=f"{p['gpus']}/{node.slots}")
    free = p["disk_free"] / GIB
    where = f"{free:.1f} GiB free at {p['disk_path']}"
    if free < 1:
        report.add("disk", "fail", where, "free space there or point --runs / workdir elsewhere", f"{free:.1f} GiB")
    elif free < 10:
        report.add("disk", "warn", where, "checkpoints may not fit", f"{free:.1f} GiB")
    else:
        report.add("disk", "ok", where, short=f"{free:.0f} GiB")
    if node.node_rank == 0:
        if p.get("port_free"):
            report.add("port", "ok", f"{spec.port} free", short=f"{spec.port} free")
        else:
            report.add("port", "fail", f"rendezvous port {spec.port} is in use ({p.get('port_error')})",
                       "set launch.rdzv_port to a free port, or stop what listens there", f"{spec.port} in use")
    else:
        report.add("port", "skip", "-")
    skew, err = p["_skew"], p["_skew_err"]
    text = f"{skew:+.2f} s (±{err:.2f})"
    if abs(skew) - err > 5:
        report.add("clock", "fail", f"clock off by {text}", "enable NTP on the host (e.g. timedatectl set-ntp true)",
                   f"{skew:+.1f} s")
    elif abs(skew) - err > 1:
        report.add("clock", "warn", f"clock off by {text}", "enable NTP on the host", f"{skew:+.1f} s")
    else:
        report.add("clock", "ok", text, short=f"{skew:+.1f} s")


def _cross_check(reports: list[HostReport]) -> None:
    """Every host must have the same torch as the others."""
    versions = {_base(r.probe.get("torch")) for r in reports if r.probe.get("torch")}
    if len(versions) > 1:
        first = next(r for r in reports if r.probe.get("torch"))
        for r in reports:
            torch = r.probe.get("torch")
            if torch and _base(torch) != _base(first.probe["torch"]):
                r.add("torch", "fail", f"{torch}, but {first.node.host} has {first.probe['torch']}",
                      "install the same torch version on every host", f"{torch} differs")


def run_preflight(spec: LaunchSpec, opts: Any, local: dict[str, str | None] | None = None) -> list[HostReport]:
    """Check every node in parallel; reports in hostfile order (open connections in ``.conn``)."""
    local = local or local_versions()
    with ThreadPoolExecutor(max_workers=min(64, len(spec.nodes))) as pool:
        reports = list(pool.map(lambda n: check_host(spec, n, opts, local), spec.nodes))
    _cross_check(reports)
    return reports


STYLE = {"ok": "green", "warn": "yellow", "fail": "red", "skip": "dim"}


def render(reports: list[HostReport], console: Any, checks: tuple[str, ...] = CHECKS) -> None:
    """One table: a row per host, a column per check (``checks``: the Slurm check has ``slurm``
    where SSH has ``ssh``), and each failure's sentence with its fix."""
    from rich.table import Table
    from rich.text import Text

    table = Table(title="llmtrain hosts check", title_justify="left")
    for col in ("host", *checks, "problems and fixes"):
        table.add_column(col, overflow="fold", no_wrap=col != "problems and fixes")
    for r in reports:
        cells = [Text(r.node.host)]
        for name in checks:
            check = r.checks.get(name)
            cells.append(Text("-", style="dim") if check is None else Text(check.cell(), style=STYLE[check.status]))
        fixes = [f"{c.name}: {c.value}" + (f" -> fix: {c.hint}" if c.hint else "")
                 for c in r.checks.values() if c.status in ("fail", "warn")]
        cells.append(Text("\n".join(fixes)))
        table.add_row(*cells)
    # a CI log is not a terminal (80 columns by default): give the table room instead of folding every cell
    if not console.is_terminal and console.width < 240:
        from rich.console import Console

        console = Console(file=console.file, width=240, highlight=False, soft_wrap=True, no_color=console.no_color)
    console.print(table)
    failed = sum(1 for r in reports if r.failed)
    console.print(f"{len(reports) - failed} of {len(reports)} hosts ready" + (f"; {failed} failed" if failed else ""),
                  highlight=False)


def to_json(reports: list[HostReport]) -> dict[str, Any]:
    return {"ok": not any(r.failed for r in reports), "local": local_versions(), "hosts": [r.to_dict() for r in reports]}
