"""``python -m llmtrain.launch.envexec``: a node reads ``launch.env_file`` itself at task start
(``--launcher slurm`` sends none of its values through Slurm; docs/launch.md, Slurm).

What must hold: the values arrive byte for byte as the launcher's parser reads them and nothing
in them runs (a real ``exec``, the ranks' environment read back from the started process);
exactly the ``--only`` names are set; a file the node cannot read, an oversize one, a name the
node's file lacks are one line naming ``launch.env_file`` and the fix, exit 2, no traceback.
The Slurm side of it (node.sh, the job's environment, slurmctld's state) is tested on the real
cluster in tests/test_launch_slurm.py; the hosts-check parsing of its line here (pure).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from llmtrain.launch import envexec

DUMP = [sys.executable, "-c", "import json, os; print(json.dumps(dict(os.environ)))"]


def run_envexec(env_file: Path, only: str, *command: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "KEPT": "from-the-job", "B": "job-value"}
    return subprocess.run([sys.executable, "-m", "llmtrain.launch.envexec", "--env-file", str(env_file),
                           "--only", only, "--", *command], cwd=cwd, env=env, capture_output=True, text=True, timeout=60)


def test_values_arrive_verbatim_only_the_named_ones_and_nothing_runs(tmp_path):
    marker = tmp_path / "PWNED"
    (tmp_path / "e.env").write_text(
        "# cluster secrets\n"
        "A=a;rm -rf ~\n"
        f"export B='$(touch {marker}) `touch {marker}` \"q\"'\n"
        f"C=\"x; touch {marker}\"\n"
        "NOT_LISTED=must-not-be-set\n")
    result = run_envexec(tmp_path / "e.env", "A,B,C", *DUMP, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    env = json.loads(result.stdout)
    assert env["A"] == "a;rm -rf ~" and env["B"] == f"$(touch {marker}) `touch {marker}` \"q\""
    assert env["C"] == f"x; touch {marker}" and env["KEPT"] == "from-the-job"  # B: the file's value replaced the job's
    assert "NOT_LISTED" not in env and not marker.exists() and result.stderr == ""


def one_line_error(capsys, *argv: str) -> str:
    assert envexec.main(list(argv)) == envexec.EXIT_USAGE
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and captured.out == "", captured.err
    return lines[0]


def test_missing_file_is_one_line_naming_the_field_and_the_fix_without_traceback(tmp_path):
    result = run_envexec(tmp_path / "not-shared.env", "HF_TOKEN", "true", cwd=tmp_path)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.strip().splitlines() == [
        f"llmtrain: launch.env_file: env file not found: {tmp_path / 'not-shared.env'} on node {envexec._node()}; put "
        "the env file on storage every node mounts at the same path (like the run directory), or fix launch.env_file"]


def test_oversize_file_other_file_and_bad_names_are_refused_in_one_line(tmp_path, capsys):
    big = tmp_path / "big.env"
    big.write_text("A=" + "x" * (1 << 20) + "\n")
    line = one_line_error(capsys, "--env-file", str(big), "--only", "A", "--", "true")
    assert line.startswith("llmtrain: launch.env_file: env file ") and "over the 1 MiB limit" in line
    assert "xxxx" not in line
    (tmp_path / "e.env").write_text("A=1\n")
    line = one_line_error(capsys, "--env-file", str(tmp_path / "e.env"), "--only", "A,HF_TOKEN", "--", "true")
    assert "has no HF_TOKEN (the launching machine's had): the nodes read another file than the launcher did" in line
    line = one_line_error(capsys, "--env-file", str(tmp_path / "e.env"), "--only", "A,$(id)", "--", "true")
    assert "--only: '$(id)' is not a variable name" in line
    (tmp_path / "bad.env").write_text("A=1\nSECRET_LINE 'hunter2'\n")
    line = one_line_error(capsys, "--env-file", str(tmp_path / "bad.env"), "--only", "A", "--", "true")
    assert f"launch.env_file: {tmp_path / 'bad.env'}:2: not a NAME=VALUE line" in line and "hunter2" not in line
    assert envexec.main(["--env-file", str(tmp_path / "e.env"), "--only", "A", "--", "/nonexistent/cmd"]) == 127
    assert "cannot run /nonexistent/cmd: No such file or directory" in capsys.readouterr().err


def test_hosts_check_reads_envexecs_line_per_node():
    """``hosts check --launcher slurm`` runs envexec on each node first; its line becomes ``env_file``."""
    from llmtrain.launch.backends.slurm_preflight import parse_output, _judge_env_file
    from llmtrain.launch.preflight import HostReport

    out = ("0: @@node n0\n0: @@envfile 0 \n1: @@node n1\n1: @@envfile 2 llmtrain: launch.env_file: env file not "
           "found: /home/u/e.env on node n1; put the env file on storage every node mounts at the same path\n")
    tasks = parse_output(out, "", 2)
    assert tasks[0]["envfile"] == (0, "") and tasks[1]["envfile"][0] == 2
    reports = [HostReport(node=None) for _ in tasks]  # type: ignore[arg-type]
    for report, task in zip(reports, tasks):
        _judge_env_file(report, task["envfile"], "/home/u/e.env", task["host"])
    ok, bad = (r.checks["env_file"] for r in reports)
    assert ok.status == "ok" and bad.status == "fail" and bad.short == "unreadable"
    assert bad.value == "launch.env_file: env file not found: /home/u/e.env on node n1"
    assert bad.hint == envexec.SHARED_HINT
