"""The periodic eval (``train.eval_interval``) under pipeline and context parallelism, and
``llmtrain eval`` of LoRA runs (docs/eval.md).

* **Layouts** (ONE 4-rank torchrun job, tests/dist_worker.py, against one in-process 1-rank
  run): the ``metrics.jsonl`` eval rows (steps 2 and 4) of PP 2 under every placement the
  trainer has (1f1b; interleaved-1f1b with FSDP zero 3; zbv and dualpipev, V-shaped: rank r
  holds stages r and 3 - r; zero-bubble with TP 2 + SP), CP 2 (ring, ulysses, allgather; allgather x TP 2 is the
  fine-tuning case below) and PP 2 x CP 2 equal the 1-process rows to 1e-5 relative. Why 1e-5: fp32 forwards whose
  layouts differ only in reduction order (TP matmuls, the vocabulary-parallel cross-entropy,
  online-softmax merges of ring attention), ~1e-7 per forward; and the weights being evaluated
  differ by the same rounding only, because AdamW runs with ``eps = 1``: its update is then
  ~lr x m (linear in the gradient) instead of ~lr x sign(g), which turns rounding-level
  gradient differences on near-zero gradients into lr-sized moves (tests/test_engine_parity.py
  needs 2e-4 on weights for that). Measured: see the printout. The eval loss moves by > 10x the
  tolerance between step 2 and step 4 (lr 0.5; measured 6e-4 relative: synthetic training data,
  word text held out), so evaluating the weights of the wrong step fails.
  11 held-out windows in rounds of one training step (8 windows in 4 microbatches of 2 per
  data-parallel rank): the last round has a 1-window microbatch and, on dp rank 1, an uncounted
  dummy forward.
* **Fine-tuning rows**: a chat run (the committed example, unpacked) with ``data.eval_path`` read
  like its training data, under PP 2 (1f1b) and CP 2 (allgather) x TP 2, equals the 1-process rows
  to the same 1e-5 (16 held-out samples, loss over the reply tokens only).
* **Training is not disturbed**: two cases run again without eval (interleaved zero 3, whose
  FSDP parameters the eval gathers and re-shards, and zbv); losses, gradient norms and final
  weights are bitwise equal (tolerance 0: eval draws no RNG, builds no autograd graph and
  touches neither the training schedule nor its stages).
* **LoRA**: ``llmtrain eval RUN`` of a LoRA run evaluates the merged model; it equals
  ``llmtrain eval`` of ``ckpt export --hf`` (fp32) to 1e-6 relative (the same fp64 merge gives
  the same fp32 weights: only the q/k row permutation of the export and back, which is exact,
  lies between them) and the final periodic eval row, computed on the adapter model in memory
  (x W + s (x A) B), to 1e-5 (a different fp32 summation than the merged W + s B A). Both for a
  run that saved its base and for an adapters-only run on an HF base (transformers'
  ``save_pretrained``); a changed base is refused in one line by the fingerprint check.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from tests.distrun import run_cases
from tests.helpers_cli import cli_in_process as cli

ROOT = Path(__file__).resolve().parent.parent
REL, EXPORT_REL = 1e-5, 1e-6
SEQ = 32
WORDS = ["alpha", "beta", "gamma", "delta", "the", "cat", "sat", "on", "mat", "model", "token", "window"]
TINY = ["model.layers=4", "model.hidden=32", "model.heads=4", "model.kv_heads=2", "model.ffn_hidden=64",
        "model.vocab_size=128", "model.max_seq_len=128"]
COMMON = TINY + [f"train.seq_len={SEQ}", "train.micro_batch_size=2", "train.global_batch_size=16", "train.steps=4",
                 "train.optimizer.lr=0.5", "train.optimizer.eps=1.0", "train.schedule.warmup_steps=1",
                 "train.schedule.decay=constant", "train.eval_batches=1", "checkpoint.async=false",
                 "parallel.tp=1", "parallel.dp_shard=-1", "parallel.zero=0"]
V2 = "parallel.pp_virtual_stages=2"
CASES = {
    "pp2_1f1b": ["parallel.pp=2", "parallel.pp_schedule=1f1b", "parallel.zero=1"],
    "pp2_interleaved_zero3": ["parallel.pp=2", "parallel.pp_schedule=interleaved-1f1b", V2, "parallel.zero=3"],
    "pp2_zbv": ["parallel.pp=2", "parallel.pp_schedule=zbv", V2],
    "pp2_dualpipev": ["parallel.pp=2", "parallel.pp_schedule=dualpipev", V2, "parallel.zero=1"],
    "pp2_tp2_zero_bubble": ["parallel.pp=2", "parallel.tp=2", "parallel.sequence_parallel=true",
                            "parallel.pp_schedule=zero-bubble", V2],
    "cp2_ring": ["parallel.cp=2", "parallel.cp_method=ring"],
    "cp2_ulysses": ["parallel.cp=2", "parallel.cp_method=ulysses", "parallel.zero=2"],
    "cp2_allgather": ["parallel.cp=2", "parallel.cp_method=allgather"],
    "pp2_cp2": ["parallel.pp=2", "parallel.cp=2", "parallel.pp_schedule=1f1b"],
}
TWINS = ("pp2_interleaved_zero3", "pp2_zbv")  # run again without eval
# A chat fine-tuning run (the committed example's data and tokenizer, unpacked: CP refuses packing) with
# its held-out rows read like the training rows (docs/eval.md): PP 2 and CP 2 x TP 2 against one process.
CHAT, TOKENIZER = ROOT / "examples/sft/chat.jsonl", ROOT / "examples/sft/tokenizer"
SFT = ["data.source=chat", f"data.path={CHAT}", f"data.tokenizer={TOKENIZER}", "data.packing=false", "train.seq_len=128",
       "train.eval_interval=2", f"data.eval_path={CHAT}"]
SFT_CASES = {
    "sft_pp2": ["parallel.pp=2", "parallel.pp_schedule=1f1b", "parallel.zero=1"],
    "sft_cp2_allgather_tp2": ["parallel.cp=2", "parallel.cp_method=allgather", "parallel.tp=2"],
}


def eval_sets(path: Path) -> list[str]:
    return ["train.eval_interval=2", f"data.eval_path={path}"]


def close(a: float, b: float, rel: float = REL) -> bool:
    return abs(a - b) <= rel * abs(b)


@pytest.fixture(scope="module")
def heldout(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("heldout")
    rng = random.Random(1)
    text = " ".join(rng.choice(WORDS) for _ in range(80))
    (tmp / "heldout.txt").write_text(text[: 11 * SEQ + 5])  # 11 windows of 32 bytes (ASCII: ids < 128)
    return tmp / "heldout.txt"


def reference(run: Path, sets: list[str]) -> list[dict]:
    """The eval rows of the recipe trained in this process on one rank."""
    from llmtrain.engine.eval_main import single_process_group
    from llmtrain.engine.trainer import train
    from llmtrain.recipe.load import load_recipe

    with single_process_group() as device:
        res = train(load_recipe(ROOT / "recipes/debug.yaml", sets), device, run_dir=str(run), verbose=False)
        del res
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "eval_loss" in r]


def test_periodic_eval_under_pp_and_cp_equals_one_process(heldout, tmp_path):
    want = reference(tmp_path / "ref", COMMON + eval_sets(heldout) + ["cluster.gpus_per_node=1"])
    assert [r["step"] for r in want] == [2, 4] and all(r["eval_windows"] == 11 for r in want)
    assert abs(want[1]["eval_loss"] - want[0]["eval_loss"]) > 10 * REL * want[0]["eval_loss"]  # weights matter
    cases = [{"name": k, "set": v + eval_sets(heldout), "run_dir": str(tmp_path / k)} for k, v in CASES.items()]
    cases += [{"name": f"{k}_plain", "set": CASES[k]} for k in TWINS]
    cases += [{"name": k, "set": v + SFT, "run_dir": str(tmp_path / k)} for k, v in SFT_CASES.items()]
    want_sft = reference(tmp_path / "ref_sft", COMMON + SFT + ["cluster.gpus_per_node=1"])
    assert [r["step"] for r in want_sft] == [2, 4] and all(r["eval_windows"] == 16 for r in want_sft)
    assert abs(want_sft[1]["eval_loss"] - want_sft[0]["eval_loss"]) > 10 * REL * want_sft[0]["eval_loss"]
    got = run_cases(tmp_path, 4, "recipes/debug.yaml", cases, steps=4, common=COMMON)
    for name in SFT_CASES:
        rows = got[name]["evals"]
        assert not got[name]["layout_errors"], got[name]["layout_errors"]
        worst = max(abs(r["eval_loss"] - w["eval_loss"]) / w["eval_loss"] for r, w in zip(rows, want_sft))
        print(f"{name:24s} eval {[round(r['eval_loss'], 7) for r in rows]}  rel diff {worst:.1e}")
        assert [r["step"] for r in rows] == [2, 4], (name, rows)
        for r, w in zip(rows, want_sft):
            assert r["eval_windows"] == 16 and r["eval_tokens"] == w["eval_tokens"] < 16 * 128
            assert close(r["eval_loss"], w["eval_loss"]), (name, r, w)
    for name in CASES:
        rows = got[name]["evals"]
        assert not got[name]["layout_errors"], got[name]["layout_errors"]
        assert [r["step"] for r in rows] == [2, 4], (name, rows)
        worst = max(abs(r["eval_loss"] - w["eval_loss"]) / w["eval_loss"] for r, w in zip(rows, want))
        print(f"{name:24s} eval {[round(r['eval_loss'], 7) for r in rows]}  rel diff {worst:.1e}")
        for r, w in zip(rows, want):
            assert r["eval_windows"] == 11 and r["eval_tokens"] == 11 * SEQ
            assert close(r["eval_loss"], w["eval_loss"]) and close(r["eval_perplexity"], w["eval_perplexity"]), \
                (name, r, w)
    for name in TWINS:
        plain, with_eval = got[f"{name}_plain"], got[name]
        assert plain["losses"] == with_eval["losses"] and plain["grad_norms"] == with_eval["grad_norms"], name
        assert plain["state"].keys() == with_eval["state"].keys()
        assert all(v.equal(with_eval["state"][k]) for k, v in plain["state"].items()), name


# -- LoRA -------------------------------------------------------------------------------------------

LORA = ["model.layers=2", *TINY[1:],
    f"train.seq_len={SEQ}", "train.micro_batch_size=2", "train.global_batch_size=4", "train.steps=2",
    "train.optimizer.lr=0.01", "train.optimizer.eps=1e-6", "train.schedule.warmup_steps=1",
    "train.schedule.decay=constant", "train.lora={rank: 4, alpha: 8}", "train.eval_interval=1", "train.eval_batches=3",
    "checkpoint.async=false", "parallel.tp=1", "parallel.dp_shard=1", "parallel.zero=0", "cluster.gpus_per_node=1"]


def eval_loss(args: list[str]) -> float:
    code, out, err = cli(["eval", *args, "--json"])
    assert code == 0, err
    return json.loads(out.strip().splitlines()[-1])["loss"]


def check_lora_run(run: Path, rows: list[dict], heldout: Path, tmp: Path, base: Path | None = None) -> None:
    assert [r["step"] for r in rows] == [1, 2] and rows[0]["eval_loss"] != rows[1]["eval_loss"]
    code, out, err = cli(["ckpt", "inspect", str(run)])  # says what the checkpoint needs besides itself
    assert code == 0, err
    line = next(x for x in out.splitlines() if x.strip().startswith("LoRA"))
    assert "LoRA rank 4, alpha 8 on all-linear" in line, line
    assert (f"adapters only: the frozen base is the Hugging Face directory {base.resolve()}" in line if base else
            "the frozen base is in this checkpoint" in line), line
    code, out, err = cli(["ckpt", "inspect", str(run), "--json"])
    lora = json.loads(out)["lora"]
    assert code == 0 and lora["rank"] == 4 and lora["alpha"] == 8
    assert (lora["base"]["path"] == str(base.resolve()) and lora["base"]["files"] >= 3) if base else lora["base"] == "in this checkpoint"
    merged = eval_loss([str(run), "--data", str(heldout)])
    code, _, err = cli(["ckpt", "export", str(run), "--hf", str(tmp / "hf"), "--dtype", "fp32"])
    assert code == 0, err
    exported = eval_loss([str(tmp / "hf"), "--data", str(heldout), "--tokenizer", "byte", "--seq-len", str(SEQ)])
    print(f"LoRA: periodic {rows[1]['eval_loss']:.9f}  eval RUN {merged:.9f}  eval export {exported:.9f}")
    assert close(merged, exported, EXPORT_REL)
    assert close(merged, rows[1]["eval_loss"])  # the adapters in memory at step 2 = the merged checkpoint


def test_lora_run_with_its_base_in_the_checkpoint(heldout, tmp_path):
    run = tmp_path / "run"
    rows = reference(run, LORA + [f"data.eval_path={heldout}"])
    check_lora_run(run, rows, heldout, tmp_path)


def test_lora_adapters_only_on_an_hf_base(heldout, tmp_path):
    from llmtrain.engine.hf import check_hf_dir, model_from_hf_config
    from tests.hf_tiny import save_tiny

    base = save_tiny("llama", tmp_path / "base", shards=2)
    conf, _ = check_hf_dir(base)
    recipe = tmp_path / "lora.yaml"
    recipe.write_text(f"name: lora\nmodel: {json.dumps(model_from_hf_config(conf))}\ntrain: {{precision: fp32}}\n"
                      f"data: {{source: synthetic}}\ncheckpoint: {{init_from_hf: {json.dumps(str(base))}}}\n"
                      "cluster: {nodes: 1, gpus_per_node: 1, gpu: cpu}\n")
    from llmtrain.engine.eval_main import single_process_group
    from llmtrain.engine.trainer import train
    from llmtrain.recipe.load import load_recipe

    run = tmp_path / "run"
    sets = [s for s in LORA if not s.startswith("model.")] + [f"data.eval_path={heldout}"]
    with single_process_group() as device:
        res = train(load_recipe(recipe, sets), device, run_dir=str(run), verbose=False)
        del res
    rows = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "eval_loss" in r]
    meta = json.loads(next((run / "checkpoints").glob("step-*/metadata.json")).read_text())
    assert meta.get("lora_base") is not None  # adapters only: the base is read from init_from_hf
    check_lora_run(run, rows, heldout, tmp_path, base)
    save_tiny("llama", base, shards=2, seed=1)  # the same architecture, other weights, in the recorded place
    code, _, err = cli(["eval", str(run), "--data", str(heldout)])
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and "is not the base model the adapters" in lines[0], err
