"""``llmtrain hosts check`` against real sshd hosts, plus the judging rules on synthetic probes.

One hostfile holds a good host and one broken host per failure class: a python path that does
not exist, a python whose llmtrain has another version (a wrapper running the real interpreter
with ``-S`` and a fake ``llmtrain`` package first on ``PYTHONPATH``; it is reached through
ProxyJump, so that path is checked too), an unreachable host (closed port), and -- on the first
host -- a rendezvous port that is taken (sshd's own).
"""

from __future__ import annotations

import json
import socket
import stat
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from llmtrain import __version__
from llmtrain.launch.commands import build_spec
from llmtrain.cluster.hostfile import parse_hostfile
from llmtrain.launch.preflight import HostReport, _cross_check, _judge, local_versions, probe_command
from llmtrain.launch.sshconfig import SSHTarget
from llmtrain.recipe.load import load_recipe_text
from tests.sshhosts import get_cluster

CLI = [sys.executable, "-c", "from llmtrain.cli.app import main; main()"]


@pytest.fixture(scope="session")
def cluster(request, tmp_path_factory):
    return get_cluster(request.config, tmp_path_factory)


def fake_version_python(tmp_path: Path) -> Path:
    pkg = tmp_path / "fakepkg" / "llmtrain"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text('__version__ = "0.0.1-other"\n')
    site = sysconfig.get_paths()["purelib"]
    script = tmp_path / "python-other"
    script.write_text(f"#!/bin/sh\nPYTHONPATH={tmp_path / 'fakepkg'}:{site} exec {sys.executable} -S \"$@\"\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return script


def broken_hostfile(cluster, tmp_path: Path) -> Path:
    other = fake_version_python(tmp_path)
    path = tmp_path / "hosts.yaml"
    path.write_text("hosts:\n"
                    "  - {host: node0, slots: 2}\n"
                    "  - {host: node1, slots: 2, python: /nonexistent/bin/python3}\n"
                    f"  - {{host: jumped, slots: 2, python: {other}}}\n"
                    "  - {host: closed, slots: 2}\n")
    return path


def test_hosts_check_reports_missing_python_version_mismatch_unreachable_and_busy_port(cluster, tmp_path):
    hosts = broken_hostfile(cluster, tmp_path)
    port = cluster.host("node0").port  # sshd listens there: the rendezvous port is taken
    result = subprocess.run([*CLI, "hosts", "check", "--hosts", str(hosts), "--json", "--set",
                             f"launch.rdzv_port={port}", "--set", "launch.connect_timeout_s=3"],
                            cwd=tmp_path, env=cluster.env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, result.stdout + result.stderr
    data = json.loads(result.stdout)
    assert data["ok"] is False and data["local"]["llmtrain"] == __version__
    hosts_by_name = {h["host"]: h for h in data["hosts"]}
    assert list(hosts_by_name) == ["node0", "node1", "jumped", "closed"]

    def check(host: str, name: str) -> dict:
        return hosts_by_name[host]["checks"][name]

    node0 = hosts_by_name["node0"]["checks"]
    for name in ("ssh", "python", "workdir", "torch", "llmtrain", "gpus", "disk", "clock"):
        assert node0[name]["status"] in ("ok", "warn"), (name, node0[name])
    assert node0["llmtrain"]["value"] == __version__
    assert node0["torch"]["value"].startswith(local_versions()["torch"])
    assert node0["port"]["status"] == "fail" and f"rendezvous port {port} is in use" in node0["port"]["value"]
    assert "launch.rdzv_port" in node0["port"]["hint"]

    assert check("node1", "ssh")["status"] == "ok"
    assert check("node1", "python")["status"] == "fail"
    assert check("node1", "python")["value"].startswith("/nonexistent/bin/python3 not found")
    assert "set `python:` for this host" in check("node1", "python")["hint"]

    assert check("jumped", "ssh") == {"name": "ssh", "status": "ok", "hint": "",
                                      "value": f"{check('jumped', 'ssh')['value'].split(' via ')[0]} via node0"}
    assert check("jumped", "python")["status"] == "ok" and check("jumped", "torch")["status"] == "ok"
    assert check("jumped", "llmtrain")["status"] == "fail"
    assert check("jumped", "llmtrain")["value"] == f"version 0.0.1-other, the launching machine has {__version__}"
    assert f"pip install llmtrain=={__version__}" in check("jumped", "llmtrain")["hint"]

    closed = hosts_by_name["closed"]["checks"]
    assert list(closed) == ["ssh"] and closed["ssh"]["status"] == "fail"
    assert "connection refused" in closed["ssh"]["value"] and "check that sshd runs" in closed["ssh"]["hint"]


def test_hosts_check_prints_one_table_with_a_fix_per_failure(cluster, tmp_path):
    hosts = broken_hostfile(cluster, tmp_path)
    result = subprocess.run([*CLI, "hosts", "check", "--hosts", str(hosts), "--set", "launch.connect_timeout_s=3"],
                            cwd=tmp_path, env=cluster.env(), capture_output=True, text=True, timeout=120)
    out = result.stdout
    assert result.returncode == 1, out + result.stderr
    assert out.startswith("llmtrain hosts check\n")
    assert out.count("┏") == 1  # one table
    header = next(line for line in out.splitlines() if "host" in line and "problems and fixes" in line)
    for col in ("ssh", "python", "workdir", "torch", "llmtrain", "gpus", "disk", "port", "clock"):
        assert col in header
    rows: dict[str, str] = {}  # host -> its cells, continuation lines of wrapped cells joined
    for line in out.splitlines():
        if not line.startswith("│"):
            continue
        cells = [c.strip() for c in line.split("│")[1:-1]]
        if cells[0]:
            host, rows[cells[0]] = cells[0], " | ".join(cells)
        else:
            rows[host] += " " + cells[-1]
    assert "✗ not found" in rows["node1"] and "-> fix: install Python >= 3.10 there" in rows["node1"]
    assert "✗ 0.0.1-other != " in rows["jumped"] and "ok via node0" in rows["jumped"]
    assert "✗ refused" in rows["closed"] and "-> fix: check that sshd runs" in rows["closed"]
    assert out.rstrip().endswith("1 of 4 hosts ready; 3 failed")


def test_hosts_check_all_ready_exits_0(cluster, tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("node0 slots=1\nnode1 slots=1\n")
    with socket.socket() as s:  # a port free here is free in node0's namespace too (and on loopback hosts)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    result = subprocess.run([*CLI, "hosts", "check", "--hosts", str(hosts), "--json", "--set",
                             f"launch.rdzv_port={port}"], cwd=tmp_path, env=cluster.env(), capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    data = json.loads(result.stdout)
    assert data["ok"] and [h["ok"] for h in data["hosts"]] == [True, True]
    assert data["hosts"][0]["checks"]["port"]["value"] == f"{port} free"


# ----------------------------------------------------------------------------- judging rules


def _report(probe: dict, slots: int = 8, node_rank: int = 1, local: dict | None = None) -> HostReport:
    recipe = load_recipe_text("model: {preset: debug-dense}\nname: t\n")
    hostfile = parse_hostfile(f"a slots={slots}\nb slots={slots}\n")
    spec = build_spec(recipe, hostfile, [SSHTarget("a", "10.0.0.1"), SSHTarget("b", "10.0.0.2")], "20260101-000000-abcd",
                      "/runs", "llmtrain.engine.main", python="/usr/bin/python3", cwd="/work")
    node = spec.nodes[node_rank]
    base = {"python": "3.11.7", "llmtrain": __version__, "torch": "2.13.0+cu128", "cuda": "12.8", "nccl": "2.27.3",
            "gpus": 8, "disk_free": 500 << 30, "disk_path": "/runs", "workdir_ok": True, "port_free": True,
            "_skew": 0.01, "_skew_err": 0.02}
    report = HostReport(node)
    report.probe = {**base, **probe}
    _judge(report, spec, node, report.probe, local or {"llmtrain": __version__, "torch": "2.13.0+cpu"})
    return report


def test_judge_rules_each_failure_class_with_a_fix():
    ok = _report({})
    assert not ok.failed and ok.checks["torch"].value == "2.13.0+cu128 (CUDA 12.8, NCCL 2.27.3)"
    assert ok.checks["gpus"].value == "8 GPUs, 8 slots" and ok.checks["port"].status == "skip"
    few = _report({"gpus": 4})
    assert few.checks["gpus"].status == "fail" and "at most slots=4" in few.checks["gpus"].hint
    assert _report({"gpus": None}).checks["gpus"].value == "no nvidia-smi (CPU host)"
    assert _report({"gpu_error": "NVIDIA-SMI has failed"}).checks["gpus"].status == "fail"
    assert _report({"disk_free": 1 << 29}).checks["disk"].status == "fail"
    assert _report({"disk_free": 5 << 30}).checks["disk"].status == "warn"
    assert _report({"_skew": 7.5}).checks["clock"].status == "fail"
    assert _report({"_skew": -2.0}).checks["clock"].status == "warn"
    assert _report({"python": "3.8.10"}).checks["python"].status == "fail"
    missing = _report({"torch": None})
    assert missing.checks["torch"].status == "fail" and "pip install torch==2.13.0" in missing.checks["torch"].hint
    assert _report({"llmtrain": None, "llmtrain_error": "ModuleNotFoundError: x"}).checks["llmtrain"].status == "fail"
    assert _report({"workdir_ok": False}).checks["workdir"].status == "fail"
    busy = _report({"port_free": False, "port_error": "Address already in use"}, node_rank=0)
    assert busy.checks["port"].status == "fail" and busy.problems()[0].line().startswith("a (")
    differs = _report({"torch": "2.14.0+cu128"})
    assert differs.checks["torch"].status == "warn"
    _cross_check([ok, differs])
    assert differs.checks["torch"].status == "fail" and "install the same torch version" in differs.checks["torch"].hint


def test_probe_command_runs_here_and_reports_json(tmp_path):
    recipe = load_recipe_text("model: {preset: debug-dense}\nname: t\n")
    spec = build_spec(recipe, parse_hostfile("a slots=1\n"), [SSHTarget("a", "127.0.0.1")], "20260101-000000-abcd",
                      tmp_path / "runs", "llmtrain.engine.main", python=sys.executable, cwd=str(tmp_path))
    result = subprocess.run(probe_command(spec, spec.nodes[0]), shell=True, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    probe = json.loads(result.stdout.split("@@probe ", 1)[1])
    assert probe["llmtrain"] == __version__ and probe["torch"] == local_versions()["torch"]
    assert probe["workdir_ok"] is True and probe["disk_path"] == str(tmp_path) and probe["disk_free"] > 0
    assert probe["port_free"] in (True, False) and "import torch" not in probe_command(spec, spec.nodes[0])
