"""Hypothesis fuzz: secret values never reach the run directory or any output, and always reach the ranks.

Generated variables (``variables()``), each value carrying a unique *core* (a per-session salt, its
index and drawn letters/digits) that the checks search for, because the core survives any
quoting or escaping of the value:

* ``named``: a secret word (token, Key, SECRET, password, passwd, credential, auth, private; any
  case) inside an otherwise odd name; any value (spaces, quotes, ``$(...)``, backticks, ``#``,
  newlines, non-ASCII);
* ``url``: an unusual name (no secret word) with ``scheme://user:PASSWORD@host/path`` inside text;
* ``token``: an unusual name with a token shape (``hf_``, ``ghp_``/``gho_``/``github_pat_``, ``sk-``,
  ``AKIA``/``ASIA``, ``xox?-``) inside text;
* ``envfile``: any name and value in ``launch.env_file`` (no newline: one line per variable);
* ``pass_named`` / ``pass_token``: from the caller's environment through ``env_passthrough``
  (``HF_*`` with a secret word, ``FZP_*`` with a token shape);
* ``plain``: an unusual name with a harmless value (shown by ``plan``, but never on disk either).

``test_plan_and_dry_run_never_show_a_secret``: many examples in-process through the real CLI
(``plan --hosts --json``, ``plan --hosts``, ``launch --hosts --dry-run``) plus the launcher's
line masker on the forms a rank could print. ``real`` (module fixture): ONE drawn set of ~20
variables through a real local launch of recipes/debug.yaml (4 ranks, 2 steps, checkpoint and
TensorBoard on) and a real ``llmtrain resume`` (to step 4), with ``tests/secret_probe.py`` in
front of the engine checking every rank's values by SHA-256; then the run directory is grepped
file by file (checkpoint shards, TensorBoard events, metrics, logs, locks). ``resume --hosts``
runs on the real sshd test hosts (tests/sshhosts.py) with the probe alone.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets as pysecrets
import shlex
import string
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from llmtrain.launch.envpolicy import Redactor, policy_env
from llmtrain.launch.secrets import MASK, secret_name
from llmtrain.recipe.load import load_recipe, yaml_dump

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "debug.yaml"
SALT = pysecrets.token_hex(4)  # per session: a core never occurs by chance in output or binary files
EXAMPLES = 250  # 400 until the suite neared its 30-minute budget (derandomized: CI runs the same set)
FUZZ = dict(deadline=None, database=None, derandomize=True,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example,
                                   HealthCheck.function_scoped_fixture])
ALNUM = string.ascii_letters + string.digits
ODD = ALNUM + " !\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~\tüé€"
SPECIAL = ["$(id)", "`id`", "${HOME}", "'", '"', "a b;echo PWNED", "\\n", "#", " ", "\\", "%s", "&&"]
WORDS = ["token", "Key", "SECRET", "password", "PassWd", "credential", "AUTH", "private"]
PAIRS = {"named": "env", "url": "env", "token": "env", "plain": "env", "envfile": "file",
         "pass_named": "caller", "pass_token": "caller"}
SECRET_KINDS = {"named", "url", "token", "envfile", "pass_named", "pass_token"}


@dataclass(frozen=True)
class Var:
    kind: str
    name: str
    value: str
    core: str  # searched for: inside the value, unique, alphanumeric

    @property
    def where(self) -> str:
        return PAIRS[self.kind]

    @property
    def secret(self) -> bool:
        return self.kind in SECRET_KINDS


def odd_text(newlines: bool, max_size: int = 10):
    alphabet = ODD + ("\n" if newlines else "")
    return st.one_of(st.text(alphabet, max_size=max_size), st.sampled_from(SPECIAL + ([" \n ", "\n"] if newlines else [])))


def plain_name(i: int):
    base = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,10}", fullmatch=True).filter(lambda n: not secret_name(n))
    return base.map(lambda n: f"{n}_{i}")


@st.composite
def token_of(draw, core: str) -> str:
    kind = draw(st.sampled_from(["hf_", "ghp_", "gho_", "github_pat_", "sk-", "sk-proj-", "AKIA", "ASIA", "xoxb-",
                                 "xoxp-"]))
    if kind in ("AKIA", "ASIA"):  # exactly 16 of [0-9A-Z]
        return kind + (core.upper() + "0" * 16)[:16]
    return kind + core + draw(st.text(ALNUM, min_size=10, max_size=16))


@st.composite
def variables(draw, min_size: int = 1, max_size: int = 8, fixed: list[str] | None = None):
    """A list of Var with distinct names: ``min_size..max_size`` of any kind, or the kinds ``fixed``
    (in a drawn order)."""
    if fixed is None:
        chosen = draw(st.lists(st.sampled_from(sorted(PAIRS)), min_size=min_size, max_size=max_size))
    else:
        chosen = draw(st.permutations(fixed))
    out = []
    for i, kind in enumerate(chosen):
        core = f"{SALT}{i:02d}" + draw(st.text(ALNUM, min_size=4, max_size=8))
        newlines = kind in ("named", "plain", "pass_named")
        pre, post = draw(odd_text(newlines)), draw(odd_text(newlines))
        if kind in ("named", "pass_named"):
            word = draw(st.sampled_from(WORDS))
            head = draw(st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,5}", fullmatch=True))
            name = f"{head}{word}{i}" if kind == "named" else f"HF_{head}{word}{i}"
            value = pre + core + post
        elif kind == "url":
            name = draw(plain_name(i))
            scheme = draw(st.sampled_from(["postgres", "https", "redis", "mongodb+srv", "amqp", "s3"]))
            user = draw(st.text(string.ascii_letters, min_size=0, max_size=6))
            pw_chars = ALNUM + "-._~!$&'()*+,;=%:"
            pw = draw(st.text(pw_chars, max_size=4)) + core + draw(st.text(pw_chars, max_size=4))
            host = draw(st.sampled_from(["db", "10.0.0.7:5432", "cache.internal", "[::1]:6379"]))
            value = f"{pre}{scheme}://{user}:{pw}@{host}/{draw(st.text(ALNUM, max_size=5))}{post}"
        elif kind in ("token", "pass_token"):
            name = draw(plain_name(i)) if kind == "token" else f"FZP_{i}"
            sep = " " if pre else ""
            end = draw(st.sampled_from([" ", "'", ",", ";", "\t"])) if post else ""
            value = pre + sep + draw(token_of(core)) + end + post
        else:  # envfile, plain
            name = draw(plain_name(i))
            value = pre + core + post
        out.append(Var(kind, name, value, core))
    return out


def recipe_text(env: dict[str, str], env_file: str | None, passthrough: list[str]) -> str:
    launch = {"env": env, "env_passthrough": passthrough}
    if env_file:
        launch["env_file"] = env_file
    return RECIPE.read_text() + yaml_dump({"launch": launch})  # the loader's YAML 1.2 floats quoted ("1e5")


def env_file_text(vs: list[Var]) -> str:
    return "".join(f"{v.name}={shlex.quote(v.value)}\n" for v in vs if v.where == "file")


def leaks(text: str, vs: list[Var]) -> list[str]:
    return [f"{v.kind} {v.name}" for v in vs if v.secret and v.core in text]


def strings_in(node) -> list[str]:
    if isinstance(node, str):
        return [node]
    if isinstance(node, dict):
        return [s for k, v in node.items() for s in (*strings_in(k), *strings_in(v))]
    if isinstance(node, list):
        return [s for item in node for s in strings_in(item)]
    return []


# ----------------------------------------------------------------------------- in process, many cases


@settings(max_examples=EXAMPLES, **FUZZ)
@given(vs=variables())
def test_plan_and_dry_run_never_show_a_secret(vs, tmp_path_factory):
    from typer.testing import CliRunner

    import llmtrain.cli.launch  # noqa: F401 - registers the commands
    import llmtrain.cli.plan  # noqa: F401
    from llmtrain.cli.app import app

    tmp = tmp_path_factory.mktemp("fuzz")
    (tmp / "vars.env").write_text(env_file_text(vs), encoding="utf-8")
    env = {v.name: v.value for v in vs if v.where == "env"}
    recipe = tmp / "r.yaml"
    recipe.write_text(recipe_text(env, str(tmp / "vars.env"), ["FZP_*"]))
    assert load_recipe(recipe).launch.env == env  # the YAML round trip is exact
    hosts = tmp / "hosts"
    hosts.write_text("worker-1 slots=2\nworker-2 slots=2\n")
    caller = {v.name: v.value for v in vs if v.where == "caller"}
    runner = CliRunner()
    outputs = []
    for args in (["plan", str(recipe), "--hosts", str(hosts), "--json"], ["plan", str(recipe), "--hosts", str(hosts)],
                 ["launch", str(recipe), "--hosts", str(hosts), "--dry-run"]):
        result = runner.invoke(app, args, env={**caller, "HOME": str(tmp), "COLUMNS": "250"})
        assert result.exit_code == 0, (args, result.output, result.exception)
        outputs.append(result.stdout + result.stderr)
        assert leaks(outputs[-1], vs) == [], (args, outputs[-1])
    data = json.loads(outputs[0])
    assert leaks("\n".join(strings_in(data)), vs) == []  # JSON escapes cannot hide a leak
    listed = {e["name"]: e for e in data["launch"]["env"]}
    for v in vs:
        assert listed[v.name]["secret"] is v.secret or v.kind == "plain", (v, listed[v.name])
        if v.kind in ("named", "envfile", "pass_named"):
            assert listed[v.name]["value"] == MASK
    assert outputs[2].count("# node ") == 2  # a command spans lines where a value holds a newline
    assert all(outputs[2].count(f" {v.name}=") == 2 for v in vs)
    # what a rank could print: the launcher's line masker (local and SSH) on the forms of each value
    redact = Redactor(policy_env(load_recipe(recipe).launch, caller))
    for v in vs:
        for form in (v.value, f"{v.name}={v.value}", json.dumps({v.name: v.value}), repr(v.value),
                     shlex.quote(v.value), f"[{v.value}]", *v.value.splitlines()):
            if v.secret and v.core in form:
                assert v.core not in redact(form), (v, form, redact(form))


# ----------------------------------------------------------------------------- real runs


def draw_one(strategy, examples: int = 25):
    """One value of ``strategy``: the last of ``examples`` derandomized draws (the first ones are
    hypothesis's simplest)."""
    drawn = []

    @settings(max_examples=examples, phases=[Phase.generate], **FUZZ)
    @given(strategy)
    def collect(value):
        drawn.append(value)

    collect()
    return drawn[-1]


@dataclass
class Real:
    root: Path
    run: Path
    vs: list[Var]
    outputs: dict[str, subprocess.CompletedProcess]
    probe: Path
    seen: Path
    missing: str
    before_missing: tuple[list[str], bytes]
    after_missing: tuple[list[str], bytes]
    caller: dict[str, str]


def cli(args: list[str], env: dict[str, str], cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "llmtrain.cli.app", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def write_probe(path: Path, vs: list[Var], seen: Path, phase: str, engine: bool = True) -> None:
    expect = {v.name: hashlib.sha256(v.value.encode()).hexdigest() for v in vs}
    path.write_text(json.dumps({"expect": expect, "out": str(seen), "phase": phase, "engine": engine}))


def snapshot(run: Path) -> tuple[list[str], bytes]:
    return sorted(str(p.relative_to(run)) for p in run.rglob("*")), (run / "recipe.lock.yaml").read_bytes()


@pytest.fixture(scope="module")
def real(tmp_path_factory) -> Real:
    vs = draw_one(variables(fixed=sorted(PAIRS) * 3))  # 21 variables, 3 of each kind
    # names of the recipe and the env file start with z: no clash with what the processes need (PATH, RANK)
    vs = [Var(v.kind, f"z{v.name}" if v.where in ("env", "file") else v.name, v.value, v.core) for v in vs]
    root = tmp_path_factory.mktemp("secrets-real")
    (root / "vars.env").write_text(env_file_text(vs), encoding="utf-8")
    env_values = {v.name: v.value for v in vs if v.where == "env"}
    recipe = root / "fuzz.yaml"
    recipe.write_text(recipe_text(env_values, "vars.env", ["FZP_*"]))  # a relative env file: the lock makes it absolute
    caller = {v.name: v.value for v in vs if v.where == "caller"}
    seen, probe = root / "seen", root / "probe.json"
    seen.mkdir()
    base = {k: v for k, v in os.environ.items() if not k.startswith(("LLMTRAIN_", "HF_", "FZP_", "WANDB_"))}
    base.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), LLMTRAIN_ENGINE_MODULE="tests.secret_probe",
                SECRET_PROBE=str(probe), COLUMNS="250", **caller)
    sets = ["train.steps=2", "checkpoint.interval=2", "train.seq_len=64", "train.micro_batch_size=2",
            "train.global_batch_size=8", "train.log_interval=1"]
    outputs = {}
    write_probe(probe, vs, seen, "launch")
    outputs["launch"] = cli(["launch", str(recipe), "--runs", str(root / "runs"),
                             *[a for s in sets for a in ("--set", s)]], base, root)
    launched = outputs["launch"]
    assert launched.returncode == 0, launched.stdout[-3000:] + launched.stderr[-3000:]
    run = next((root / "runs" / "debug").iterdir())  # the recipe is named debug
    missing = next(v.name for v in vs if v.where == "env")
    exported = {**base, **env_values}  # resume: the values come from the caller again
    before = snapshot(run)
    write_probe(probe, vs, seen, "resume-missing")
    outputs["missing"] = cli(["resume", "--run", str(run), "--set", "train.steps=4"],
                             {k: v for k, v in exported.items() if k != missing}, root)
    after = snapshot(run)
    write_probe(probe, vs, seen, "resume")
    outputs["resume"] = cli(["resume", "--run", str(run), "--set", "train.steps=4"], exported, root)
    return Real(root, run, vs, outputs, probe, seen, missing, before, after, {**caller, **env_values})


def grep_run_dir(run: Path, vs: list[Var]) -> tuple[list[str], int, int]:
    """(hits, files, bytes): every file under ``run``, read as bytes, searched for every core."""
    hits, files, size = [], 0, 0
    cores = [(v, v.core.encode()) for v in vs]
    for path in sorted(p for p in run.rglob("*") if p.is_file()):
        data = path.read_bytes()
        files, size = files + 1, size + len(data)
        hits += [f"{path.relative_to(run)}: {v.kind} {v.name}" for v, core in cores if core in data]
    return hits, files, size


def test_real_launch_and_resume_keep_secrets_in_memory_only(real):
    out = real.outputs
    for name in ("launch", "resume"):
        assert out[name].returncode == 0, out[name].stdout[-3000:] + out[name].stderr[-3000:]
    assert "== run finished: exit code 0" in out["resume"].stdout and "step 2 of 4" in out["resume"].stdout
    for phase in ("launch", "resume"):  # every rank saw every real value: none missing, wrong or masked
        for rank in range(4):
            seen = json.loads((real.seen / f"{phase}-rank-{rank}.json").read_text())
            assert seen == {v.name: "ok" for v in real.vs}, (phase, rank, {k: s for k, s in seen.items() if s != "ok"})
    # a resume without one of the values: one line naming it, exit 2, nothing started or changed
    miss = out["missing"]
    assert miss.returncode == 2 and miss.stdout == "" and miss.stderr.count("\n") == 1
    assert miss.stderr.startswith(f"error: launch.env.{real.missing}: {real.missing} (from launch.env) is not stored")
    assert real.before_missing == real.after_missing and not list(real.seen.glob("resume-missing-*"))
    # nothing of any value on disk: checkpoint shards, TensorBoard events, metrics, logs, locks
    hits, files, size = grep_run_dir(real.run, real.vs)
    names = {p.name for p in real.run.rglob("*")}
    assert {"recipe.lock.yaml", "recipe.lock.yaml.prev-1", "metadata.json", "metrics.jsonl", "logs.prev-1"} <= names
    assert list(real.run.glob("tb/events.out.tfevents.*")) and list(real.run.glob("checkpoints/step-4/*.distcp"))
    print(f"\nsecrets fuzz (real): {len(real.vs)} variables ({sum(v.secret for v in real.vs)} secret), "
          f"{files} files / {size} bytes under the run dir searched, {len(hits)} found")
    assert hits == []
    for name, proc in out.items():
        assert leaks(proc.stdout + proc.stderr, real.vs) == [], name
    lock = yaml.safe_load((real.run / "recipe.lock.yaml").read_text())["launch"]
    assert lock["env"] == {} and lock["env_file"] == str(real.root / "vars.env")
    assert lock["env_sources"] == {v.name: ("env_file" if v.where == "file" else "recipe")
                                   for v in sorted(real.vs, key=lambda v: v.name) if v.where in ("env", "file")}
    meta = json.loads((real.run / "checkpoints" / "step-4" / "metadata.json").read_text())
    assert meta["recipe"]["launch"]["env"] == {} and meta["recipe"]["launch"]["env_sources"] == lock["env_sources"]


@pytest.fixture(scope="module")
def cluster(request, tmp_path_factory):
    from tests.sshhosts import get_cluster

    return get_cluster(request.config, tmp_path_factory)


def test_resume_hosts_sends_the_callers_values_to_every_node(real, cluster):
    import socket

    assert real.outputs["resume"].returncode == 0
    hosts = real.root / "hosts"
    hosts.write_text("node0 slots=2\nnode1 slots=2\n")
    write_probe(real.probe, real.vs, real.seen, "hosts", engine=False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = cluster.env(PYTHONPATH=str(REPO), LLMTRAIN_ENGINE_MODULE="tests.secret_probe", SECRET_PROBE=str(real.probe),
                      **real.caller)
    args = ["resume", "--run", str(real.run), "--hosts", str(hosts), "--skip-preflight", "--set", "train.steps=6",
            "--set", f"launch.rdzv_port={port}", "--set", 'launch.env_passthrough=["FZP_*", "SECRET_PROBE"]']
    proc = cli(args, env, real.root, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for rank in range(4):  # ranks 2, 3 on node1: over SSH, with the env written into the command line
        seen = json.loads((real.seen / f"hosts-rank-{rank}.json").read_text())
        assert seen == {v.name: "ok" for v in real.vs}, (rank, {k: s for k, s in seen.items() if s != "ok"})
    assert leaks(proc.stdout + proc.stderr, real.vs) == []
    hits, files, _ = grep_run_dir(real.run, real.vs)  # now with logs/commands.txt and node logs
    assert (real.run / "logs" / "commands.txt").is_file() and hits == [], hits
    print(f"\nsecrets fuzz (resume --hosts, {cluster.mode}): 4 ranks on 2 hosts saw all {len(real.vs)} values; "
          f"{files} files searched, {len(hits)} found")
