"""Issue 12 items 6, 7, 8 and report de-duplication: files are what they claim to be, YAML as a
person writes it, outputs never destroy inputs.

Real files throughout: FIFOs made with ``os.mkfifo`` (a reader that opened one blockingly
would hang the test: every CLI call has a timeout far below the suite's), ``/dev/zero`` (a
reader without a cap would exhaust memory), directories, symlinks, over-sized files.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from llmtrain.errors import LLMTrainError
from llmtrain.recipe.load import load_recipe, load_recipe_text
from llmtrain.safeio import PNG_MAGIC, inside, read_regular

ROOT = Path(__file__).resolve().parent.parent
CLI = [sys.executable, "-c", "from llmtrain.cli.app import main; main()"]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def cli(*args: str, timeout: int = 60) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=ENV,
                          stdin=subprocess.DEVNULL)


def one_error_line(out: subprocess.CompletedProcess) -> str:
    """The run failed with exit 2, no traceback, and exactly one `error:` line: return it."""
    assert out.returncode == 2, (out.returncode, out.stdout[-2000:], out.stderr[-2000:])
    assert "Traceback" not in out.stderr + out.stdout
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), out.stderr
    return lines[0]


@pytest.fixture
def specials(tmp_path):
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)
    link = tmp_path / "link.yaml"
    link.symlink_to(fifo)
    folder = tmp_path / "folder.yaml"
    folder.mkdir()
    return {"fifo": fifo, "symlink to a fifo": link, "device": Path("/dev/zero"), "directory": folder}


# -- item 6: regular files only, bounded -------------------------------------------------------

SPECIAL_WORDS = {"fifo": "FIFO", "symlink to a fifo": "FIFO", "device": "character device", "directory": "directory"}


@pytest.mark.parametrize("kind", list(SPECIAL_WORDS))
def test_plan_refuses_special_recipe_at_once(specials, kind):
    start = time.monotonic()
    line = one_error_line(cli("plan", str(specials[kind])))
    assert time.monotonic() - start < 30  # no hang: a blocking open() of the FIFO would time out
    assert SPECIAL_WORDS[kind] in line and "regular file" in line, line


@pytest.mark.parametrize("kind", list(SPECIAL_WORDS))
def test_special_files_refused_everywhere(specials, tmp_path, kind):
    """Hostfile, env file, metrics file, tokenizer file, data meta.json: each refused in one line."""
    special = str(specials[kind])
    line = one_error_line(cli("plan", "recipes/debug.yaml", "--hosts", special))
    assert "regular file" in line and "hostfile" in line, line
    line = one_error_line(cli("launch", "recipes/debug.yaml", "--set", "train.steps=1", "--set",
                              f"launch.env_file={special}"))
    assert "regular file" in line and "launch.env_file" in line, line
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").symlink_to(special)
    line = one_error_line(cli("report", str(run)))
    assert "regular file" in line and "metrics" in line, line
    text = tmp_path / "doc.txt"
    text.write_text("hello world\n")
    tok = tmp_path / "tok.json"
    tok.symlink_to(special)
    line = one_error_line(cli("data", "prepare", str(text), "--out", str(tmp_path / "out"), "--tokenizer", str(tok),
                              "--no-progress"))
    assert ("regular file" in line or (kind == "directory" and "holds neither" in line)) and "tokenizer" in line, line
    inp = tmp_path / "in.jsonl"
    inp.symlink_to(special)
    line = one_error_line(cli("data", "prepare", str(inp), "--out", str(tmp_path / "out2"), "--no-progress"))
    assert "regular file" in line or "directory holds no" in line, line


def test_memmap_meta_must_be_a_regular_file(specials, tmp_path):
    from llmtrain.engine.data.memmap import read_meta

    data = tmp_path / "data"
    data.mkdir()
    (data / "meta.json").symlink_to(specials["fifo"])
    with pytest.raises(LLMTrainError, match="FIFO") as info:
        read_meta(data)
    assert info.value.problems[0].path == "data.path"


def test_caps_are_stated(tmp_path):
    big = tmp_path / "big.yaml"
    big.write_bytes(b"# pad\n" * 200_000)
    line = one_error_line(cli("plan", str(big)))
    assert "over the 1 MiB limit" in line, line
    with pytest.raises(LLMTrainError, match="over the 1 KiB limit"):
        read_regular(big, "file", 1024)
    # a cap holds even when the size on disk says nothing (a device reports 0 bytes)
    with pytest.raises(LLMTrainError, match="character device"):
        read_regular("/dev/zero", "file", 1024)


def test_inside_follows_symlinks(tmp_path):
    root = tmp_path / "ckpt"
    root.mkdir()
    (root / "ok").write_text("x")
    (root / "out").symlink_to(tmp_path)
    assert inside(root, "ok") and inside(root, root / "ok")
    assert not inside(root, "../x") and not inside(root, "/etc/passwd") and not inside(root, "out/ckpt2")


# -- item 7: YAML as a person writes it -------------------------------------------------------

BASE = "model: {preset: debug-dense}\ncluster: {nodes: 1, gpus_per_node: 1, gpu: cpu}\n"


@pytest.mark.parametrize("text, value", [("3e-4", 3e-4), ("1e5", 1e5), ("-2.5E-3", -2.5e-3), ("6.02e+23", 6.02e23),
                                         (".5e1", 5.0), ("3.0e-4", 3e-4), ("+1E-2", 1e-2)])
def test_exponent_floats_are_numbers(text, value):
    from llmtrain.recipe.load import parse_yaml_mapping

    data = parse_yaml_mapping(f"x: {text}\ny: [{text}]\n", "t.yaml")
    assert data == {"x": value, "y": [value]} and isinstance(data["x"], float)


@pytest.mark.parametrize("text", ["3e-4", "1E-5", "2.5e-3"])
def test_exponent_lr_in_recipe_and_set(text):
    recipe = load_recipe_text(BASE + f"train: {{optimizer: {{lr: {text}}}}}\n")
    assert recipe.train.optimizer.lr == pytest.approx(float(text))
    recipe = load_recipe_text(BASE, [f"train.optimizer.lr={text}"])
    assert recipe.train.optimizer.lr == pytest.approx(float(text))


def test_exponent_in_int_field_and_strings_stay_right():
    # strict types: a YAML float in an integer field is refused, with a hint that says why
    with pytest.raises(LLMTrainError) as info:
        load_recipe_text(BASE + "train: {steps: 1e3}\n")
    assert info.value.problems[0].path == "train.steps" and "1000" in info.value.problems[0].hint
    # not numbers: words that merely contain an e, versions, hex-ish names
    for name in ("1e5x", "e5", "1.2.3e4"):
        assert load_recipe_text(BASE + f"name: {name}\n").name == name


def test_plan_cli_accepts_exponent_lr(tmp_path):
    path = tmp_path / "lr.yaml"
    path.write_text((ROOT / "recipes" / "debug.yaml").read_text().replace("lr: 0.003", "lr: 3e-4"))
    assert "lr: 3e-4" in path.read_text()
    for args in ([str(path)], ["recipes/debug.yaml", "--set", "train.optimizer.lr=3e-4"]):
        out = cli("plan", *args, "--json")
        assert out.returncode == 0 and json.loads(out.stdout)["valid"] is True, out.stderr


def test_duplicate_keys_name_key_and_both_lines(tmp_path):
    path = tmp_path / "dup.yaml"
    path.write_text("model: {preset: debug-dense}\ntrain:\n  steps: 10\n  seq_len: 64\n  steps: 20\n")
    with pytest.raises(LLMTrainError) as info:
        load_recipe(path)
    problem = info.value.problems[0]
    assert problem.path == f"{path}:5" and "duplicate key 'steps' (lines 3 and 5)" in problem.message, problem
    assert "keep one" in problem.hint
    line = one_error_line(cli("plan", str(path)))
    assert "duplicate key 'steps' (lines 3 and 5)" in line
    with pytest.raises(LLMTrainError, match="duplicate key 'a' \\(lines 1 and 1\\)"):
        load_recipe_text("{a: 1, a: 2}\n")
    # YAML merge keys may be overridden: that is not a duplicate
    recipe = load_recipe_text(BASE + "train:\n  optimizer:\n    <<: {lr: 0.1, weight_decay: 0.0}\n    lr: 0.2\n")
    assert recipe.train.optimizer.lr == 0.2


def test_duplicate_hosts_yaml_key(tmp_path):
    hosts = tmp_path / "hosts.yaml"
    hosts.write_text("hosts:\n  - {host: a, slots: 1}\nhosts:\n  - {host: b, slots: 1}\n")
    line = one_error_line(cli("plan", "recipes/debug.yaml", "--hosts", str(hosts)))
    assert "duplicate key 'hosts' (lines 1 and 3)" in line, line


def test_thousands_of_problems_print_fifty_and_a_count(tmp_path):
    path = tmp_path / "many.yaml"
    path.write_text(BASE + "train:\n" + "".join(f"  unknown_{i}: 1\n" for i in range(3000)))
    out = cli("plan", str(path))
    assert out.returncode == 2 and "Traceback" not in out.stderr
    lines = out.stderr.splitlines()
    assert len(lines) == 51, len(lines)
    assert all(line.startswith("error: train.unknown_") for line in lines[:50])
    assert lines[50] == "error: ... and 2950 more problems (fix these first)"


# -- item 8: outputs never destroy inputs ------------------------------------------------------

def write_metrics(run: Path, rows: list[dict]) -> None:
    run.mkdir(parents=True, exist_ok=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_report_out_refuses_to_overwrite_the_metrics(tmp_path):
    run = tmp_path / "runs" / "x" / "r1"
    write_metrics(run, [{"step": s, "loss": 5.0 - s} for s in range(1, 4)])
    before = (run / "metrics.jsonl").read_bytes()
    line = one_error_line(cli("report", str(run), "--out", str(run / "metrics.jsonl")))
    assert "metrics.jsonl exists" in line and "--force" in line, line
    assert (run / "metrics.jsonl").read_bytes() == before
    (run / "recipe.lock.yaml").write_text("name: x\n")
    one_error_line(cli("report", str(run), "--out", str(run / "recipe.lock.yaml")))
    assert (run / "recipe.lock.yaml").read_text() == "name: x\n"
    # the default report.png may be rewritten (it is the report's own output) ...
    for _ in range(2):
        out = cli("report", str(run))
        assert out.returncode == 0, out.stderr
    assert (run / "report.png").read_bytes().startswith(PNG_MAGIC)
    # ... a directory means report.png inside it; --force replaces a non-PNG file
    pics = tmp_path / "pics"
    pics.mkdir()
    assert cli("report", str(run), "--out", str(pics)).returncode == 0
    assert (pics / "report.png").read_bytes().startswith(PNG_MAGIC)
    other = tmp_path / "notes.txt"
    other.write_text("mine")
    assert cli("report", str(run), "--out", str(other)).returncode == 2 and other.read_text() == "mine"
    assert cli("report", str(run), "--out", str(other), "--force").returncode == 0
    assert other.read_bytes().startswith(PNG_MAGIC)


def test_unwritable_outputs_are_one_line(tmp_path):
    run = tmp_path / "run"
    write_metrics(run, [{"step": 1, "loss": 1.0}])
    afile = tmp_path / "afile"
    afile.write_text("x")
    line = one_error_line(cli("report", str(run), "--out", str(afile / "r.png")))
    assert "afile" in line and "--out" in line, line
    line = one_error_line(cli("report", str(run), "--out", str(tmp_path / "missing" / "r.png")))
    assert "does not exist" in line, line
    fifo = tmp_path / "pipe.png"
    os.mkfifo(fifo)
    line = one_error_line(cli("report", str(run), "--out", str(fifo)))
    assert "FIFO" in line, line


def test_plan_pictures_and_schema_out(tmp_path):
    pics = tmp_path / "pics"
    pics.mkdir()
    out = cli("plan", "recipes/debug.yaml", "--layout-png", str(pics), "--set", "parallel.pp=2",
              "--set", "parallel.tp=1", "--set", "parallel.dp_shard=2", "--set", "parallel.zero=1",
              "--schedule-png", str(pics))
    assert out.returncode == 0, out.stderr
    assert (pics / "layout.png").read_bytes().startswith(PNG_MAGIC)
    assert (pics / "schedule.png").read_bytes().startswith(PNG_MAGIC)
    recipe_copy = tmp_path / "mine.yaml"
    recipe_copy.write_text((ROOT / "recipes" / "debug.yaml").read_text())
    line = one_error_line(cli("plan", str(recipe_copy), "--layout-png", str(recipe_copy)))
    assert "exists" in line and "--layout-png" in line
    assert recipe_copy.read_text() == (ROOT / "recipes" / "debug.yaml").read_text()
    line = one_error_line(cli("plan", "recipes/debug.yaml", "--layout-png", str(tmp_path / "nodir" / "x.png")))
    assert "does not exist" in line and "--layout-png" in line
    # schema --out: a directory gets recipe.schema.json; an earlier schema is replaced; a recipe is not
    assert cli("schema", "--out", str(tmp_path)).returncode == 0
    assert json.loads((tmp_path / "recipe.schema.json").read_text())["title"] == "Recipe"
    assert cli("schema", "--out", str(tmp_path / "recipe.schema.json")).returncode == 0
    one_error_line(cli("schema", "--out", str(recipe_copy)))
    assert recipe_copy.read_text().startswith("# Tiny dense model")


def test_data_prepare_refuses_used_dir_and_replaces_together(tmp_path):
    from llmtrain.engine.data.prepare import prepare
    from llmtrain.engine.data.tokenizer import load_tokenizer

    doc = tmp_path / "doc.txt"
    doc.write_text("the quick brown fox jumps over the lazy dog\n" * 200)
    out = tmp_path / "out"
    prepare([doc], out, "byte", progress=False)
    assert (out / "tokenizer.llmtrain.json").exists()
    line = one_error_line(cli("data", "prepare", str(doc), "--out", str(out), "--tokenizer", "bpe:300", "--no-progress"))
    assert "not empty" in line and "--force" in line, line
    assert type(load_tokenizer(str(out))).__name__ == "ByteTokenizer"  # the earlier output is untouched
    # --force: every file of the old output replaced together, no stale byte tokenizer left
    done = cli("data", "prepare", str(doc), "--out", str(out), "--tokenizer", "bpe:300", "--no-progress", "--force")
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in out.iterdir()) == ["index.npy", "meta.json", "tokenizer.json", "tokens.bin"]
    assert json.loads((out / "meta.json").read_text())["vocab_size"] == load_tokenizer(str(out)).vocab_size > 256
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no build or old directory left
    # a directory with other files is refused even with --force (they would be deleted)
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    (mixed / "thesis.tex").write_text("precious")
    line = one_error_line(cli("data", "prepare", str(doc), "--out", str(mixed), "--force", "--no-progress"))
    assert "thesis.tex" in line and (mixed / "thesis.tex").read_text() == "precious"


# -- item 10: report de-duplicates steps re-logged after a resume --------------------------------

def test_report_dedupes_relogged_steps(tmp_path):
    from llmtrain.analysis.report import load_metrics, summarize, summary_lines

    run = tmp_path / "run"
    first = [{"step": s, "loss": 10.0 - s} for s in range(1, 7)]  # attempt 1 got to step 6, saved step 4
    again = [{"step": s, "loss": 20.0 - s} for s in range(5, 9)]  # the resume re-runs 5, 6 and goes on
    write_metrics(run, first + [{"step": 6, "rollback": 1, "restored_step": 4}] + again)
    metrics = load_metrics(run)
    steps = [r["step"] for r in metrics.rows if "rollback" not in r]
    assert steps == list(range(1, 9)) and metrics.relogged == 2
    assert [r["loss"] for r in metrics.rows if r["step"] in (5, 6) and "loss" in r] == [15.0, 14.0]  # last wins
    assert any("rollback" in r for r in metrics.rows)
    summary = summarize(metrics)
    assert summary.steps == 8 and summary.last_loss == 12.0
    assert any("re-logged     2 step(s)" in line for line in summary_lines(summary))
