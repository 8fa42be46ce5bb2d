"""Secrets live in memory only (docs/security.md, issue 12 item 4): masking by name, origin, value
and shape; the env file read safely; the lock (names and sources, never a value); restoring the
values on resume (local and ``--hosts``) from the caller; a local launch applying the policy and
masking what the ranks print. The hypothesis fuzz with real runs: tests/test_secrets_fuzz.py."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from llmtrain.errors import LLMTrainError
from llmtrain.launch.envpolicy import (EnvVar, Redactor, lock_recipe, policy_env, read_env_file, restore_env,
                                       shell_assignments)
from llmtrain.cluster.hostfile import Hostfile
from llmtrain.launch.rundir import create_run_dir
from llmtrain.launch.secrets import MASK, Masker, mask_seen, mask_text, remember
from llmtrain.recipe.load import load_recipe, load_recipe_text
from llmtrain.recipe.lock import secret_free_dict

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "debug.yaml"
CLI = [sys.executable, "-c", "from llmtrain.cli.app import main; main()"]
HF = "hf_" + "Q7pZ" * 8
GHP = "ghp_" + "a1B2" * 9
PAT = "github_pat_" + "11ABCDE_" * 4
SK = "sk-proj-" + "x9Y8" * 6
AKIA = "AKIA" + "Z3K9" * 4
XOX = "xoxb-1234567890-" + "q" * 12


def recipe(launch: str):
    return load_recipe_text(f"model: {{preset: debug-dense}}\nname: t\nlaunch: {launch}\n")


def test_token_shapes_and_url_user_info_are_masked_anywhere_in_text():
    for token in (HF, GHP, PAT, SK, AKIA, XOX, "ASIA" + "0" * 16):
        assert mask_text(f"a {token}, b") == "a ****, b", token
        assert mask_text(f"x={token}") == "x=****" and mask_text(f"'{token}'") == "'****'"
    assert mask_text("postgres://alice:s3cr3t@db:5432/x?y=1") == "postgres://****@db:5432/x?y=1"
    assert mask_text("git+https://tok@github.com/o/r and http://u:p@ss@h/") == \
        "git+https://****@github.com/o/r and http://****@h/"  # an '@' in the password is user-info too
    for plain in ("task-abcdefghijklmnopqrstuvwxyz", "hf_transfer", "AKIAshort", "https://example.com/@user",
                  "sk-short", "checkpoint step-20 at /runs/x", "xhf_" + "A" * 30):
        assert mask_text(plain) == plain, plain


def test_masker_finds_values_their_lines_quoted_forms_and_url_user_info():
    value = "line one!\nit's $(id) `x`\nab"
    masker = Masker([value, "postgres://bob:pa55word@h/db"])
    assert masker(f"got {value} end") == "got **** end"
    assert masker("it's $(id) `x` / line one!") == "**** / ****"
    assert masker("cmd A='it'\"'\"'s $(id) `x`'") == "cmd A=****"  # the shell-quoted form of a line
    assert masker("ab stays: shorter than 4 characters") == "ab stays: shorter than 4 characters"
    assert masker("user-info bob:pa55word alone") == "user-info **** alone"
    assert Masker()(f"shape {HF}") == "shape ****"  # shapes without any known value


def test_variables_from_the_env_file_or_with_secret_names_are_masked_whole():
    env = [EnvVar("DB", "postgres://u:pw123@h/x", "env"), EnvVar("ANY", "plain-from-file", "env_file"),
           EnvVar("MyApiKey", "k-abcdef", "env"), EnvVar("X", f"see {SK} here", "passthrough"),
           EnvVar("PLAIN", "a b", "env"), EnvVar("Git_Auth_Header", "Bearer zzz", "env")]
    assert [v.secret for v in env] == [False, True, True, False, False, True]
    assert [v.shown() for v in env] == ["postgres://****@h/x", MASK, MASK, "see **** here", "a b", MASK]
    assert shell_assignments(env, masked=True) == ["DB='postgres://****@h/x'", "ANY=****", "MyApiKey=****",
                                                   "X='see **** here'", "PLAIN='a b'", "Git_Auth_Header=****"]
    redact = Redactor(env)
    line = "postgres://u:pw123@h/x plain-from-file k-abcdef a b Bearer zzz"
    assert redact(line) == "**** **** **** a b ****"  # a value with user-info is searched for whole


def test_env_file_is_a_regular_capped_file_and_errors_never_echo_a_line(tmp_path):
    path = tmp_path / "env"
    path.write_text(f"GOOD=1\n{HF}\n1BAD=topsecret-value\nQ='unbalanced secret-in-quote\nexport OK2='a b'\n")
    with pytest.raises(LLMTrainError) as info:
        read_env_file(path)
    text = str(info.value)
    assert [p.path for p in info.value.problems] == [f"{path}:2", f"{path}:3", f"{path}:4"]
    assert "Q: unbalanced" in text
    for leaked in (HF, "hf_", "topsecret", "1BAD", "secret-in-quote"):
        assert leaked not in text, leaked
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(LLMTrainError, match="FIFO"):  # would block a plain open() forever
        read_env_file(fifo)
    big = tmp_path / "big"
    big.write_bytes(b"A=" + b"x" * (1 << 20) + b"\n")
    with pytest.raises(LLMTrainError, match="over the 1 MiB limit"):
        read_env_file(big)
    (tmp_path / "latin").write_bytes(b"A=1\nB=caf\xe9-secret\n")
    with pytest.raises(LLMTrainError) as info:
        read_env_file(tmp_path / "latin")
    assert info.value.problems[0].path.endswith("latin:2") and "secret" not in str(info.value)
    with pytest.raises(LLMTrainError, match="is a directory"):
        policy_env(recipe(json.dumps({"env_file": str(tmp_path)})).launch, {})


def test_lock_keeps_names_and_sources_and_reloads_for_engine_and_resume(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "cluster.env").write_text(f"FILE_ONLY=file-secret-1\nBOTH=from-file\nTOK={HF}\n")
    r = recipe(json.dumps({"env": {"HF_TOKEN": "hf-env-secret", "BOTH": "explicit-wins", "DB": "postgres://a:b@c/d"},
                           "env_file": "cluster.env"}))
    policy = policy_env(r.launch, {}, base_dir=tmp_path)
    run = create_run_dir(lock_recipe(r, policy, tmp_path), Hostfile.localhost(4), tmp_path / "runs")
    text = run.recipe_lock.read_text()
    for value in ("hf-env-secret", "explicit-wins", "postgres://", "file-secret-1", "from-file", HF, MASK):
        assert value not in text, value
    assert "  env: {}\n" in text and f"  env_file: {tmp_path / 'cluster.env'}\n" in text
    assert "  env_sources:\n    BOTH: recipe\n    DB: recipe\n    FILE_ONLY: env_file\n    HF_TOKEN: recipe\n" \
           "    TOK: env_file\n" in text
    locked = load_recipe(run.recipe_lock)  # what the engine ranks and `llmtrain resume` load
    assert locked.launch.env == {} and locked.launch.env_sources["TOK"] == "env_file"
    meta = json.dumps(secret_free_dict(r))  # checkpoint metadata.json's "recipe"
    assert "hf-env-secret" not in meta and '"env": {}' in meta and '"HF_TOKEN": "recipe"' in meta
    assert r.launch.env["HF_TOKEN"] == "hf-env-secret"  # the recipe in memory keeps its values


def test_restore_takes_values_from_the_caller_and_names_every_missing_one(tmp_path):
    env_file = tmp_path / "e.env"
    env_file.write_text("F1=file-one\nF2=file-two\n")
    locked = recipe(json.dumps({"env": {}, "env_file": str(env_file),
                                "env_sources": {"A": "recipe", "B": "recipe", "F1": "env_file", "F2": "env_file"}}))
    with pytest.raises(LLMTrainError) as info:
        restore_env(locked, {"A": "a-val"})
    assert [p.path for p in info.value.problems] == ["launch.env.B"]
    line = info.value.problems[0].line()
    assert "\n" not in line and "B (from launch.env) is not stored with the run" in line and "export B=" in line
    back = restore_env(locked, {"A": "a-val", "B": "b-val", "F1": "ignored: the file wins"})
    assert back.launch.env == {"A": "a-val", "B": "b-val"} and back.launch.env_file == str(env_file)
    values = {v.name: (v.value, v.source) for v in policy_env(back.launch, {})}
    assert values == {"A": ("a-val", "env"), "B": ("b-val", "env"), "F1": ("file-one", "env_file"),
                      "F2": ("file-two", "env_file")}
    env_file.unlink()  # the env file is gone: its names come from the environment, still secret
    with pytest.raises(LLMTrainError) as info:
        restore_env(locked, {"A": "1", "B": "2", "F1": "x"})
    assert [p.path for p in info.value.problems] == ["launch.env.F2"] and f"launch.env_file {env_file}" in str(info.value)
    back = restore_env(locked, {"A": "1", "B": "2", "F1": "env-f1", "F2": "env-f2"})
    assert back.launch.env_file is None
    policy = {v.name: v for v in policy_env(back.launch, {})}
    assert policy["F1"].value == "env-f1" and policy["F1"].secret and policy["F1"].shown() == MASK
    over = load_recipe_text(f"model: {{preset: debug-dense}}\nlaunch: {json.dumps(locked.launch.model_dump())}\n",
                            ["launch.env.B=from-set", "launch.env_file=null"])
    assert restore_env(over, {"A": "1", "F1": "x", "F2": "y"}).launch.env["B"] == "from-set"  # --set wins


def test_a_mask_is_never_sent_as_a_value():
    old = recipe('{env: {HF_TOKEN: "****", PLAIN: visible}}')  # a recipe.lock.yaml of an older llmtrain
    with pytest.raises(LLMTrainError, match="HF_TOKEN .*is not stored"):
        restore_env(old, {})
    assert restore_env(old, {"HF_TOKEN": "hf-real"}).launch.env == {"HF_TOKEN": "hf-real", "PLAIN": "visible"}
    with pytest.raises(LLMTrainError, match=r"value of HF_TOKEN is the mask \*\*\*\*"):
        policy_env(old.launch, {})


def test_resume_hosts_spec_carries_the_callers_values_never_the_mask(tmp_path, monkeypatch):
    from llmtrain.launch.commands import describe
    from llmtrain.launch.backends.sshlaunch import prepare

    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.ssh/config of this machine
    monkeypatch.chdir(tmp_path)
    values = {"HF_TOKEN": "hf-resume-secret", "Db_Url": "postgres://u:pw-resume@h/x", "ODD_name": "odd value 1"}
    r = load_recipe(RECIPE, [f"launch.env.{k}={json.dumps(v)}" for k, v in values.items()])
    run = create_run_dir(lock_recipe(r, policy_env(r.launch, {})), Hostfile.localhost(4), tmp_path / "runs")
    hosts = tmp_path / "hosts"
    hosts.write_text("node0 slots=2\nnode1 slots=2\n")
    locked = load_recipe(run.recipe_lock)
    with pytest.raises(LLMTrainError) as info:  # what `resume --hosts` runs before it connects anywhere
        prepare(locked, hosts, runs_root=run.path.parent.parent, run_id=run.run_id, environ={"HF_TOKEN": "x"})
    assert [p.path for p in info.value.problems] == ["launch.env.Db_Url", "launch.env.ODD_name"]
    prepared = prepare(locked, hosts, runs_root=run.path.parent.parent, run_id=run.run_id, environ=dict(values))
    for node in prepared.spec.nodes:
        env = {v.name: v.value for v in node.env}
        assert {k: env[k] for k in values} == values and MASK not in env.values()
    shown = "\n".join(describe(prepared.spec, masked=True))
    assert "hf-resume-secret" not in shown and "pw-resume" not in shown and "postgres://****@h/x" in shown


def test_cli_errors_are_masked_by_value_and_shape(tmp_path):
    remember(["caller-secret-value"])
    assert mask_seen("path /x/caller-secret-value/y") == "path /x/****/y"
    hosts = tmp_path / f"{HF}.hosts"  # a hostfile whose name is a token
    result = subprocess.run([*CLI, "plan", str(RECIPE), "--hosts", str(hosts)], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 2 and "not found" in result.stderr and HF not in result.stderr + result.stdout
    assert "****" in result.stderr


def test_resume_without_a_secret_is_one_line_exit_2_and_changes_nothing(tmp_path):
    r = load_recipe(RECIPE, ["launch.env.WANDB_API_KEY=wandb-secret-value", "launch.env.Odd=odd-secret"])
    run = create_run_dir(lock_recipe(r, policy_env(r.launch, {})), Hostfile.localhost(4), tmp_path / "runs")
    before = sorted(p.name for p in run.path.iterdir())
    env = {k: v for k, v in os.environ.items() if k not in ("WANDB_API_KEY", "Odd")}
    for extra in ([], ["--hosts", str(tmp_path / "no-such-hostfile")]):
        result = subprocess.run([*CLI, "resume", "--run", str(run.path), *extra], capture_output=True, text=True,
                                env={**env, "Odd": "given"}, timeout=60, cwd=tmp_path)
        assert result.returncode == 2 and result.stdout == ""
        assert result.stderr == ("error: launch.env.WANDB_API_KEY: WANDB_API_KEY (from launch.env) is not stored with "
                                 "the run (secrets never are) and is not set in this environment; export "
                                 "WANDB_API_KEY=... (or --set launch.env.WANDB_API_KEY=...) and run again\n")
    assert sorted(p.name for p in run.path.iterdir()) == before  # no logs.prev-1, no new lock


def test_local_launch_applies_the_policy_and_masks_what_ranks_print(tmp_path):
    """A real local launch (torchrun, 2 ranks of the probe, no training): every rank gets launch.env,
    the env file and the launcher's variables; what rank 0 prints of them is masked on the terminal
    and in every log file the launcher writes (logs/torchrun/ holds the ranks' own raw output)."""
    env_file = tmp_path / "vars.env"
    env_file.write_text("FromFile=file-secret-42\nFileUrl='https://x:file-url-pw@h/p'\n")
    values = {"MY_SERVICE_TOKEN": "tok en 'quoted' $(id)", "Plain_Url": "redis://:redis-pw-77@cache:6379/0",
              "Shape": f"bearer {GHP}"}
    secrets = ["tok en 'quoted' $(id)", "redis-pw-77", GHP, "file-secret-42", "file-url-pw"]
    expect = {**values, "FromFile": "file-secret-42", "FileUrl": "https://x:file-url-pw@h/p"}
    probe = tmp_path / "probe.json"
    out = tmp_path / "seen"
    out.mkdir()
    probe.write_text(json.dumps({"expect": {k: hashlib.sha256(v.encode()).hexdigest() for k, v in expect.items()},
                                 "out": str(out), "phase": "launch", "print": True, "engine": False}))
    sets = ["cluster.gpus_per_node=2", "parallel.zero=0", f"launch.env_file={env_file}"]
    sets += [f"launch.env.{k}={json.dumps(v)}" for k, v in values.items()]
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMTRAIN_")}
    env.update(PYTHONPATH=str(REPO), LLMTRAIN_ENGINE_MODULE="tests.secret_probe", SECRET_PROBE=str(probe))
    result = subprocess.run([*CLI, "launch", str(RECIPE), "--runs", str(tmp_path / "runs"),
                             *[a for s in sets for a in ("--set", s)]], capture_output=True, text=True, env=env,
                            cwd=tmp_path, timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    for rank in (0, 1):
        seen = json.loads((out / f"launch-rank-{rank}.json").read_text())
        assert seen == {name: "ok" for name in expect}, seen
    shown = result.stdout + result.stderr
    assert shown.count("probe ") >= 2 * len(expect) and "[localhost:0] probe Plain_Url=****\n" in shown
    run = next((tmp_path / "runs" / "debug").iterdir())
    launcher_files = [p for p in run.rglob("*") if p.is_file() and "torchrun" not in p.relative_to(run).parts]
    assert {"recipe.lock.yaml", "rank-0.log", "launcher.log", "command.txt"} <= {p.name for p in launcher_files}
    for secret in secrets:
        assert secret not in shown, secret
        for path in launcher_files:
            assert secret.encode() not in path.read_bytes(), (secret, path)
    assert "probe MY_SERVICE_TOKEN=****" in (run / "logs" / "rank-0.log").read_text()


def test_forget_seen_ends_one_commands_secret_memory():
    """Values remembered by one command mask only that command's messages (tests/conftest.py
    forgets them between tests: a fuzzed secret 'file' once masked another test's error)."""
    from llmtrain.launch.secrets import forget_seen, mask_seen, remember

    remember(["file"])
    assert mask_seen("not a safetensors file") == "not a safetensors ****"
    forget_seen()
    assert mask_seen("not a safetensors file") == "not a safetensors file"
