"""``llmtrain eval`` and the periodic eval of ``train.eval_interval`` (docs/eval.md).

What is checked, and the tolerances:

* **Equal to transformers.** A tiny HF model of every family written by ``save_pretrained``
  (tests/hf_tiny.py, sharded) evaluated by ``llmtrain eval DIR`` equals transformers' own ``model(input_ids=w,
  labels=w).loss`` averaged window by window, to 1e-5 relative: both are fp32 forwards of the
  same weights; they differ only in kernel reduction order (measured ~1e-8).
* **A run, its checkpoint and its export agree** (1e-5 relative, same reason: the export permutes
  q/k rows, the math is the same), and the final eval row written during training equals
  ``llmtrain eval RUN`` on the same held-out file (the periodic eval uses micro-batches of 2,
  the CLI 8 windows per forward: reduction order only).
* **Two layouts** ``--set parallel.tp=2 --set parallel.dp_shard=2 --set parallel.zero=3`` (TP 2 x
  FSDP 2) and ``--set parallel.pp=2 --set parallel.cp=2`` (pipeline 2 x ring context 2), each a
  real 4-rank torchrun (the only multi-rank jobs of this file), equal the one-process
  answer to 1e-5 relative: TP splits the vocabulary-parallel cross-entropy and the matmuls over
  ranks (fp32 reduction order, ~1e-7). 53 windows in 5 micro-batches of 11 over 2 data-parallel
  ranks: the last real one is partial and rank 1 runs an uncounted dummy forward in round 3
  (counting it, or weighting by batches instead of windows, moves the loss by >> 1e-5).
* **Eval does not change training**: the same 4 steps with and without eval give bit-identical
  losses, gradient norms and weights (tolerance 0: eval draws no RNG and touches no state).
* Bad inputs are one ``error:`` line and exit 2.
"""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.helpers_cli import cli_in_process as cli

ROOT = Path(__file__).resolve().parent.parent
REL = 1e-5
SEQ = 32
WORDS = ["alpha", "beta", "gamma", "delta", "the", "cat", "sat", "on", "mat", "model", "token", "window"]
TRAIN_SETS = ["parallel.tp=1", "parallel.dp_shard=1", "parallel.zero=0", f"train.seq_len={SEQ}",
              "train.micro_batch_size=2", "train.global_batch_size=4", "train.steps=4", "model.layers=2",
              "train.log_interval=1", "checkpoint.async=false", "cluster.gpus_per_node=1"]


def ok_json(args: list[str]) -> dict:
    code, out, err = cli(args + ["--json"])
    assert code == 0, err
    result = json.loads(out.strip().splitlines()[-1])
    assert set(result) == {"loss", "perplexity", "tokens", "windows"}
    return result


def one_error(args: list[str]) -> str:
    code, out, err = cli(args)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, (code, out, err)
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def close(a: float, b: float) -> bool:
    return abs(a - b) <= REL * abs(b)


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("eval_files")
    rng = random.Random(0)
    text = " ".join(rng.choice(WORDS) for _ in range(330))  # ASCII: byte ids < 128 (the tiny HF vocab)
    (tmp / "text.txt").write_text(text)
    (tmp / "heldout.txt").write_text(text[: 8 * SEQ + 10])  # exactly 8 windows of 32 (tail dropped)
    return {"text": tmp / "text.txt", "heldout": tmp / "heldout.txt", "dir": tmp}


@pytest.fixture(scope="module")
def trained(files, tmp_path_factory):
    """The same 4 steps trained twice in this process (1-rank group): with eval every 2 steps into a
    run directory (metrics, TensorBoard, final checkpoint), and without eval."""
    from llmtrain.engine.eval_main import single_process_group
    from llmtrain.engine.trainer import train
    from llmtrain.recipe.load import load_recipe

    run = tmp_path_factory.mktemp("eval_run") / "run"
    with_eval = TRAIN_SETS + ["train.eval_interval=2", "train.eval_batches=2", f"data.eval_path={files['heldout']}"]
    out = {}
    with single_process_group() as device:
        for name, sets, run_dir in (("eval", with_eval, str(run)), ("plain", TRAIN_SETS, None)):
            res = train(load_recipe(ROOT / "recipes/debug.yaml", sets), device, run_dir=run_dir, verbose=False)
            out[name] = {"losses": res.losses, "norms": res.grad_norms,
                         "state": {k: v.detach().clone() for k, v in res.parts.parts[0].state_dict().items()}}
            del res
    out["run"] = run
    return out


@pytest.mark.parametrize("family", ["llama", "llama3", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe"])
def test_hf_model_equals_transformers(files, tmp_path, family):
    """Windows of 32 byte tokens of a sharded tiny model of every family (tests/hf_tiny.py: every
    switch non-trivial); micro-batches of 7 (a partial last one)."""
    import transformers as tf

    from tests.hf_tiny import save_tiny

    model_dir = save_tiny(family, tmp_path / family)
    got = ok_json(["eval", str(model_dir), "--data", str(files["text"]), "--tokenizer", "byte",
                   "--seq-len", str(SEQ), "--batch", "7"])
    ids = list(files["text"].read_bytes())
    n = len(ids) // SEQ
    windows = torch.tensor(ids[: n * SEQ]).view(n, SEQ)
    model = tf.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        want = sum(model(input_ids=w[None], labels=w[None]).loss.item() for w in windows) / n
    print(f"llmtrain {got['loss']:.9f}  transformers {want:.9f}")
    assert got["windows"] == n and got["tokens"] == n * SEQ
    assert close(got["loss"], want) and close(got["perplexity"], math.exp(want))


def test_training_writes_eval_rows_and_is_unchanged(trained, files):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from llmtrain.analysis.report import load_metrics, summarize, summary_lines

    assert trained["eval"]["losses"] == trained["plain"]["losses"]
    assert trained["eval"]["norms"] == trained["plain"]["norms"]
    for k, v in trained["plain"]["state"].items():
        assert torch.equal(v, trained["eval"]["state"][k]), k
    rows = [json.loads(line) for line in (trained["run"] / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval_loss" in r]
    assert [r["step"] for r in evals] == [2, 4]  # every 2 steps; the end (4) once
    assert all(r["eval_windows"] == 8 and r["eval_tokens"] == 8 * SEQ for r in evals)
    assert all(math.isclose(r["eval_perplexity"], math.exp(r["eval_loss"])) for r in evals)
    assert evals[1]["eval_loss"] < evals[0]["eval_loss"] + 1.0  # finite, sane
    # `llmtrain report` keeps counting steps (eval rows are not steps) and shows the last eval loss
    summary = summarize(load_metrics(trained["run"]))
    assert summary.steps == 4 and summary.extra["eval_loss"] == evals[1]["eval_loss"]
    assert any(line.startswith("eval loss") for line in summary_lines(summary))
    tb = EventAccumulator(str(trained["run"] / "tb"))
    tb.Reload()
    assert [e.step for e in tb.Scalars("eval/loss")] == [2, 4]
    # the CLI on the same held-out file and the final checkpoint gives the step-4 row's number
    got = ok_json(["eval", str(trained["run"]), "--data", str(files["heldout"])])  # default seq-len: the run's 32
    assert got["windows"] == 8 and close(got["loss"], evals[1]["eval_loss"]), (got, evals[1])


def test_run_checkpoint_and_export_agree(trained, files, tmp_path):
    run, args = trained["run"], ["--data", str(files["text"]), "--seq-len", str(SEQ), "--batch", "7"]
    of_run = ok_json(["eval", str(run), *args])
    of_step = ok_json(["eval", str(run / "checkpoints" / "step-4"), *args])
    assert of_step == of_run
    code, _, err = cli(["ckpt", "export", str(run), "--hf", str(tmp_path / "hf")])
    assert code == 0, err
    assert "no tokenizer.json" in one_error(["eval", str(tmp_path / "hf"), *args])
    of_hf = ok_json(["eval", str(tmp_path / "hf"), *args, "--tokenizer", "byte"])
    print(f"run {of_run['loss']:.9f}  export {of_hf['loss']:.9f}")
    assert of_hf["windows"] == of_run["windows"] == len(files["text"].read_bytes()) // SEQ
    assert close(of_hf["loss"], of_run["loss"])


def test_layouts_tp2_fsdp2_and_pp2_cp2_equal_one_process(trained, files):
    """Two real 4-rank torchrun jobs against the one-process answer (fp32, 1e-5 relative; the
    layouts change only the reduction order, ~1e-7): TP 2 x FSDP 2 (see the module docstring),
    and PP 2 x CP 2 (ring): the forward-only 1F1B schedule (``schedule.eval``, 11 windows = 11
    microbatches of one, the 5th call padded with 2 uncounted windows) with each window's 32
    tokens zigzag-sharded over 2 cp ranks, labels shifted on the whole window before sharding,
    per-rank token sums all-reduced over cp and the last stage's total given to rank 0. Shifting
    labels per shard, or dropping a cp rank's tokens, moves the loss by >> 1e-5."""
    args = ["eval", str(trained["run"]), "--data", str(files["text"]), "--seq-len", str(SEQ), "--batch", "11", "--json"]
    single = ok_json(args[:-1])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    for name, sets in (("tp2 x fsdp2", ["parallel.tp=2", "parallel.dp_shard=2", "parallel.zero=3"]),
                       ("pp2 x cp2", ["parallel.pp=2", "parallel.cp=2"])):
        proc = subprocess.run([sys.executable, "-m", "llmtrain.cli.app", *args, *(x for s in sets for x in ("--set", s))],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False)
        assert proc.returncode == 0, (name, proc.stderr[-4000:])
        layout = json.loads(proc.stdout.strip().splitlines()[-1])
        print(f"1 process {single['loss']:.9f}  {name} {layout['loss']:.9f}")
        assert layout["windows"] == single["windows"] and close(layout["loss"], single["loss"]), name


def test_token_stream_matches_prepared_data(files, tmp_path):
    """A .txt equals its prepared directory (byte: no EOS); a .jsonl joins documents as `data
    prepare` does (each followed by the EOS of a trained BPE), so it equals its prepared directory."""
    from llmtrain.engine.data import ByteTokenizer, load_tokenizer, prepare
    from llmtrain.engine.evaluate import read_token_stream

    prepare([files["text"]], tmp_path / "bytes", "byte", progress=False)
    assert np.array_equal(read_token_stream(tmp_path / "bytes", None), read_token_stream(files["text"], ByteTokenizer()))
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": " ".join(WORDS[i:i + 4])}) + "\n" for i in range(6)) + "\n")
    prepare([docs], tmp_path / "bpe", "bpe:300", progress=False)
    tok = load_tokenizer(tmp_path / "bpe")
    stream = read_token_stream(docs, tok)
    assert np.array_equal(stream, read_token_stream(tmp_path / "bpe", None))
    assert int((stream == tok.eos_id).sum()) == 6


def test_bad_inputs_are_one_line(trained, files, tmp_path):
    run = str(trained["run"])
    (tmp_path / "short.txt").write_text("too short")
    assert "fewer than one window of 32" in one_error(["eval", run, "--data", str(tmp_path / "short.txt")])
    (tmp_path / "bad.jsonl").write_text('{"text": "a"}\n{"body": "b"}\n')
    assert "bad.jsonl:2" in one_error(["eval", run, "--data", str(tmp_path / "bad.jsonl")])
    os.mkfifo(tmp_path / "fifo.txt")
    assert "not a regular file" in one_error(["eval", run, "--data", str(tmp_path / "fifo.txt")])
    (tmp_path / "empty").mkdir()
    assert "without meta.json" in one_error(["eval", run, "--data", str(tmp_path / "empty")])
    assert "is V-shaped" in one_error(["eval", run, "--data", str(files["text"]), "--set", "parallel.pp=2",
                                       "--set", "parallel.pp_schedule=zbv", "--set", "parallel.pp_virtual_stages=1"])  # (any --batch runs with pp)
    assert "--seq-len 30: parallel.cp=2 (ring)" in one_error(["eval", run, "--data", str(files["text"]), "--seq-len", "30",
                                                              "--set", "parallel.cp=2"])
    assert "only parallel" in one_error(["eval", run, "--data", str(files["text"]), "--set", "train.steps=3"])
    assert "no such directory" in one_error(["eval", str(tmp_path / "nope"), "--data", str(files["text"])])
