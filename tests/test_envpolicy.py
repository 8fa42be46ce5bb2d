"""The environment policy of the SSH launcher: sources, precedence, quoting, masking, and `plan --hosts`."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from llmtrain.errors import LLMTrainError
from llmtrain.launch.envpolicy import (DEFAULT_PASSTHROUGH, EnvVar, Redactor, launcher_env, merge, policy_env,
                                       read_env_file, shell_assignments)
from llmtrain.recipe.load import load_recipe_text
from llmtrain.recipe.schema import LaunchConfig

REPO = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-c", "from llmtrain.cli.app import main; main()"]
TRICKY = {"SPACES": "a b;echo PWNED", "SUBST": "$(id) `id` ${HOME} $$", "QUOTES": "it's \"q\" \\ \\n",
          "NEWLINES": "one\ntwo\n\nthree", "EMPTY": "", "GLOB": "* ? [a]", "DASH": "-n", "UNICODE": "ünï €"}


def launch(**kw) -> LaunchConfig:
    return LaunchConfig.model_validate(kw)


def test_sources_and_precedence(tmp_path):
    env_file = tmp_path / "env"
    env_file.write_text("# comment\nexport FROM_FILE=file\nNCCL_DEBUG='from file'\nBOTH=file\n\n")
    environ = {"NCCL_DEBUG": "INFO", "CUDA_HOME": "/cuda", "PYTHONPATH": "/p", "HOME": "/root", "PATH": "/bin",
               "MY_X": "1", "MY_Y": "2", "OTHER": "no", "LLMTRAIN_RUN_ID": "stale"}
    env = policy_env(launch(env={"BOTH": "explicit"}, env_passthrough=["MY_*"], env_file=str(env_file)), environ)
    got = {v.name: (v.value, v.source) for v in env}
    assert got == {"CUDA_HOME": ("/cuda", "passthrough"), "PYTHONPATH": ("/p", "passthrough"),
                   "MY_X": ("1", "passthrough"), "MY_Y": ("2", "passthrough"),
                   "NCCL_DEBUG": ("from file", "env_file"), "FROM_FILE": ("file", "env_file"), "BOTH": ("explicit", "env")}
    assert [v.name for v in env] == sorted(got)  # HOME, PATH, OTHER and the stale run id do not travel
    bare = policy_env(launch(env_passthrough_defaults=False), environ)
    assert bare == []
    assert set(DEFAULT_PASSTHROUGH) == {"NCCL_*", "CUDA_*", "TORCH_*", "GLOO_*", "HF_*", "WANDB_*", "PYTHONPATH"}


def test_launcher_variables_win_and_cannot_be_set(tmp_path):
    with pytest.raises(LLMTrainError, match="LLMTRAIN_RUN_ID is set by the launcher"):
        policy_env(launch(env={"LLMTRAIN_RUN_ID": "x"}), {})
    env = merge(policy_env(launch(env={"CUDA_VISIBLE_DEVICES": "7"}), {}),
                launcher_env("r1", "/runs/r1", 2, visible_devices=(0, 2)))
    values = {v.name: v.value for v in env}
    assert values == {"CUDA_VISIBLE_DEVICES": "0,2", "LLMTRAIN_RUN_ID": "r1", "LLMTRAIN_RUN_DIR": "/runs/r1",
                      "LLMTRAIN_NODE_ID": "r1.2", "PYTHONUNBUFFERED": "1"}


def test_env_file_errors_name_file_and_line(tmp_path):
    path = tmp_path / "bad.env"
    path.write_text("GOOD=1\nnot a line\n1BAD=x\nQ='unbalanced\n")
    with pytest.raises(LLMTrainError) as info:
        read_env_file(path)
    where = [p.path for p in info.value.problems]
    assert where == [f"{path}:2", f"{path}:3", f"{path}:4"]
    with pytest.raises(LLMTrainError, match="env file not found"):  # llmtrain.safeio's message
        read_env_file(tmp_path / "missing")
    path.write_text("A=\"x y\"\nB='$(id)'\nC=plain value # not a comment\n")
    assert read_env_file(path) == {"A": "x y", "B": "$(id)", "C": "plain value # not a comment"}


def test_quoted_assignments_arrive_literally_through_a_shell():
    env = [EnvVar(k, v, "env") for k, v in TRICKY.items()]
    words = " ".join(shell_assignments(env))
    code = "import json, os; print(json.dumps({k: os.environ[k] for k in %r}))" % sorted(TRICKY)
    result = subprocess.run(["sh", "-c", f"exec env {words} {sys.executable} -c {shlex.quote(code)}"], capture_output=True,
                            text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == TRICKY
    assert "PWNED" not in result.stdout.replace("a b;echo PWNED", "")


def test_secrets_are_masked_and_redacted():
    env = [EnvVar("HF_TOKEN", "hf_abcdef", "passthrough"), EnvVar("DB_PASSWORD", "multi\nline-secret", "env"),
           EnvVar("api_key", "k3y", "env"), EnvVar("PLAIN", "hf_abcdef-visible", "env")]
    assert [v.secret for v in env] == [True, True, True, False]
    masked = shell_assignments(env, masked=True)
    assert masked == ["HF_TOKEN=****", "DB_PASSWORD=****", "api_key=****", "PLAIN=hf_abcdef-visible"]
    redact = Redactor(env)
    assert redact("token hf_abcdef, pw line-secret and multi") == "token ****, pw **** and ****"  # each line
    assert redact("k3y stays (too short to search for)") == "k3y stays (too short to search for)"
    plain = Redactor([EnvVar("PLAIN", "x", "env")])  # knows no secret value, still masks token shapes
    assert not plain.needles and plain("hf_" + "A" * 30 + " x") == "**** x"


def test_schema_rejects_bad_names_patterns_and_non_strings():
    base = "model: {preset: debug-dense}\n"
    for snippet, path in [("launch: {env: {'1X': a}}", "launch.env"), ("launch: {env: {A: 1}}", "launch.env.A"),
                          ("launch: {env_passthrough: ['A B']}", "launch.env_passthrough"),
                          ("launch: {python: bin/python}", "launch.python"), ("launch: {nope: 1}", "launch.nope"),
                          ("launch: {rendezvous: etcd}", "launch.rendezvous")]:
        with pytest.raises(LLMTrainError) as info:
            load_recipe_text(base + snippet)
        assert any(p.path == path for p in info.value.problems), (snippet, info.value.problems)
    ok = load_recipe_text(base + "launch: {env: {A: 'x y'}, python: /opt/py/bin/python, watchdog: {hang_timeout_s: 5}}")
    assert ok.launch.env == {"A": "x y"} and ok.launch.watchdog.hang_timeout_s == 5


def test_plan_hosts_shows_the_env_policy_masked(tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("worker-1 slots=2\nworker-2 slots=2\n")
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "HF_TOKEN": "hf_visible_nowhere", "NCCL_DEBUG": "INFO"}
    args = [*CLI, "plan", str(REPO / "recipes" / "debug.yaml"), "--hosts", str(hosts), "--set", "launch.env.X=a b"]
    text = subprocess.run(args, capture_output=True, text=True, env=env, timeout=60)
    assert text.returncode == 0, text.stderr
    assert "Environment on every node HF_TOKEN='****' (passthrough); NCCL_DEBUG='INFO' (passthrough); X='a b' (env)" \
        in " ".join(text.stdout.split())
    assert "hf_visible_nowhere" not in text.stdout
    data = json.loads(subprocess.run(args + ["--json"], capture_output=True, text=True, env=env, timeout=60).stdout)
    assert data["launch"]["env"] == [
        {"name": "HF_TOKEN", "value": "****", "source": "passthrough", "secret": True},
        {"name": "NCCL_DEBUG", "value": "INFO", "source": "passthrough", "secret": False},
        {"name": "X", "value": "a b", "source": "env", "secret": False}]
    assert data["launch"]["launcher_env"][0] == "LLMTRAIN_RUN_ID"
    without = json.loads(subprocess.run([*CLI, "plan", str(REPO / "recipes" / "debug.yaml"), "--json"],
                                        capture_output=True, text=True, env=env, timeout=60).stdout)
    assert "launch" not in without  # only with --hosts
