"""LoRA end to end: adapters on every layout, merged and PEFT exports (the runs on a Hugging Face base,
adapters-only checkpoints and resume: tests/test_lora_hf.py).

Model: the tiny Llama of tests/hf_tiny.py (hidden 32, 2 layers, 4 heads / 2 KV heads, ffn 64,
vocab 128), fp32, rank 4, alpha 8 (scale 2), all seven projections, AdamW lr 1e-2 (large, so
the adapters move far from B = 0 within 4 steps and a mismapped export cannot hide).

* **Parity** (one 4-rank torchrun job vs one 1-process job, tests/dist_worker.py): DDP, ZeRO-1,
  ZeRO-2, FSDP zero 3, TP 2 (without and with sequence parallelism, under FSDP), PP 2 (ZeRO-1),
  plus a target subset (wq, w2: a column- and a row-wise base) under TP 2 + SP; an MoE model (its
  experts frozen: EP 2, TP 2 + SP + FSDP, PP 2) and with ``train.lora.experts`` (the routed experts'
  stacked adapters: EP 2 + ZeRO-1, EP 2 x TP 2 + SP + FSDP, PP 2, CP 2 x TP 2 with bias balancing, FSDP
  over 2 experts on 4 ranks). Tolerances are
  those of tests/test_engine_parity.py, for the same reason (layouts differ only in summation
  order): losses |diff| <= 2e-5, adapter weights after AdamW |diff| <= 2e-4 (AdamW turns
  rounding-level gradient differences on near-zero gradients into up to ~lr-sized moves; a
  wrong placement or a missing reduction is >= 1e-2 here). Measured: ~5e-7 and ~2e-7. The frozen
  base must be **bitwise** equal to a fresh 1-process initialization in every layout (it is never
  stepped, and init is layout-independent); trainable parameters and the optimizer state in the
  checkpoint are exactly the adapters.
* **Exports**: ``--peft`` loaded with ``peft.PeftModel.from_pretrained`` onto the transformers
  base gives the logits of the ``--hf`` merged export loaded by transformers to <= 1e-5 (fp32,
  logits ~1: merging W + 2 B A in fp64 vs PEFT's separate fp32 path differ by rounding, ~1e-6),
  and differ from the base's by > 1e-2 (the adapters matter). A run without an HF base gets its
  frozen base written as ``--peft OUT/base``; ``--peft`` on a non-LoRA checkpoint is one line.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.distrun import ROOT, run_cases

STEPS = 4
LOSS_TOL, WEIGHT_TOL, LOGIT_TOL = 2e-5, 2e-4, 1e-5
TINY = ["model.layers=2", "model.hidden=32", "model.heads=4", "model.kv_heads=2", "model.ffn_hidden=64",
        "model.vocab_size=128", "model.max_seq_len=128"]
COMMON = TINY + ["train.seq_len=32", "train.micro_batch_size=2", "train.global_batch_size=8", f"train.steps={STEPS}",
                 "train.optimizer.lr=0.01", "train.optimizer.eps=1e-6", "train.schedule.warmup_steps=1",
                 "train.schedule.decay=constant", "parallel.dp_shard=-1", "train.lora={rank: 4, alpha: 8}"]
SUBSET = ["train.lora={rank: 4, alpha: 8, targets: [wq, w2]}"]
# MoE: layer 0 dense (all seven adapters), layer 1 MoE (attention adapters; router, routed and shared experts frozen)
MOE = ["model.moe.num_experts=4", "model.moe.top_k=2", "model.moe.expert_ffn_hidden=32", "model.moe.first_dense_layers=1",
       "model.moe.shared_experts=1"]
# the same with train.lora.experts: layer 1's routed experts get stacked adapters on w1/w2/w3 too
EXPERTS = [*MOE, "train.lora={rank: 4, alpha: 8, experts: true}"]
# CP splits each sequence, and the auxiliary balance loss is per rank by design (tests/test_engine_5d.py): these
# cases balance with the bias instead, layout-independent; 2 experts (top 1), so that over 4 FSDP ranks the stacked
# adapters' dim 0 is split unevenly (FSDP2 pads)
BIAS = [*EXPERTS, "model.moe.balance=bias", "model.moe.router=sigmoid", "model.moe.bias_update_rate=0.01",
        "model.moe.num_experts=2", "model.moe.top_k=1"]
CASES = {
    "ddp": ["parallel.tp=1", "parallel.zero=0"],
    "zero1": ["parallel.tp=1", "parallel.zero=1"],
    "zero2": ["parallel.tp=1", "parallel.zero=2"],
    "zero3": ["parallel.tp=1", "parallel.zero=3"],
    "tp2": ["parallel.tp=2", "parallel.zero=0", "parallel.sequence_parallel=false"],
    "tp2_sp_zero3": ["parallel.tp=2", "parallel.zero=3", "parallel.sequence_parallel=true"],
    "pp2_zero1": ["parallel.tp=1", "parallel.pp=2", "parallel.zero=1"],
    "subset_tp2_sp": ["parallel.tp=2", "parallel.zero=3", "parallel.sequence_parallel=true", *SUBSET],
    "moe_ep2_zero1": ["parallel.tp=1", "parallel.zero=1", "parallel.ep=2", *MOE],
    "moe_tp2_sp_zero3": ["parallel.tp=2", "parallel.zero=3", "parallel.sequence_parallel=true", *MOE],  # expert-TP
    "moe_pp2": ["parallel.tp=1", "parallel.pp=2", "parallel.zero=1", *MOE],
    "experts_ep2_zero1": ["parallel.tp=1", "parallel.zero=1", "parallel.ep=2", *EXPERTS],
    "experts_ep2_tp2_sp_zero3": ["parallel.tp=2", "parallel.zero=3", "parallel.ep=2", "parallel.sequence_parallel=true",
                                 *EXPERTS],  # EP x expert-TP, FSDP on the edp mesh
    "experts_pp2": ["parallel.tp=1", "parallel.pp=2", "parallel.zero=1", *EXPERTS],
    "bias_cp2_tp2": ["parallel.tp=2", "parallel.zero=1", "parallel.cp=2", *BIAS],
    "bias_zero3": ["parallel.tp=1", "parallel.zero=3", *BIAS],  # 2 experts' adapters over 4 FSDP ranks: uneven
}
SAVED = ("zero1", "tp2_sp_zero3", "pp2_zero1", "experts_ep2_zero1")  # checkpoint at the end: which parameters have AdamW state


def env() -> dict:
    e = {**os.environ, "OMP_NUM_THREADS": "1", "LLMTRAIN_TENSORBOARD": "0", "PYTHONPATH": str(ROOT)}
    e.pop("LLMTRAIN_ENGINE_MODULE", None)
    return e


def run_worker(tmp: Path, nproc: int, cases: dict, saved: tuple[str, ...] = ()) -> dict:
    """One torchrun job over ``cases``; the ``saved`` ones write a checkpoint at the end (tmp/N-case)."""
    return run_cases(tmp, nproc, "recipes/debug.yaml",
                     [{"name": k, "set": v, **({"run_dir": str(tmp / f"{nproc}-{k}")} if k in saved else {})}
                      for k, v in cases.items()], STEPS, COMMON)


def cli(args: list[str], timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "llmtrain.cli.app", *args], cwd=ROOT, env=env(), capture_output=True,
                          text=True, timeout=timeout)


def index_keys(ckpt: Path) -> list[str]:
    from torch.distributed.checkpoint import FileSystemReader

    return sorted(FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata)


def fresh_init(sets: list[str]) -> dict[str, torch.Tensor]:
    """The 1-process, unparallelized initialization of the recipe's LoRA model (full tensors)."""
    from llmtrain.engine.finetune.lora import apply_lora
    from llmtrain.engine.models.init import init_weights
    from llmtrain.engine.models.llama import Transformer
    from llmtrain.recipe.load import load_recipe

    recipe = load_recipe(ROOT / "recipes/debug.yaml", COMMON + sets)
    model = Transformer(recipe.model)
    apply_lora(model, recipe.train.lora)
    init_weights(model, recipe.train.seed)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# -- unit checks (one process, no torchrun) ----------------------------------------------------------

def test_adapters_freeze_init_and_merge():
    """Only adapters train; B = 0 at init (the LoRA model is the base); merge_lora of a model with
    random B gives the logits of the adapter forward (fp32, |diff| <= 1e-5 at logits ~0.1-1)."""
    from llmtrain.engine.finetune.lora import LoRALinear, apply_lora, is_adapter_key, merge_lora
    from llmtrain.engine.models.init import init_weights
    from llmtrain.engine.models.llama import Transformer
    from llmtrain.recipe.load import load_recipe

    recipe = load_recipe(ROOT / "recipes/debug.yaml", COMMON)
    torch.manual_seed(0)
    base, lora = Transformer(recipe.model), Transformer(recipe.model)
    adapted = apply_lora(lora, recipe.train.lora)
    assert len(adapted) == 2 * 7 and isinstance(lora.layers["0"].attention.wq, LoRALinear)
    init_weights(base, 0)
    init_weights(lora, 0)
    trainable = sorted(n for n, p in lora.named_parameters() if p.requires_grad)
    assert trainable and all(is_adapter_key(n) for n in trainable) and len(trainable) == 2 * 7 * 2
    assert all(torch.equal(v, base.state_dict()[k]) for k, v in lora.state_dict().items() if not is_adapter_key(k))
    tokens = torch.randint(0, 128, (2, 16))
    assert torch.equal(base(tokens), lora(tokens))  # B = 0: exactly the base
    a = lora.layers["1"].attention.wk.lora_a.weight
    assert 0 < a.abs().max() <= 1 / 32 ** 0.5  # kaiming-uniform(a=sqrt(5)): U(-1/sqrt(in), 1/sqrt(in))
    with torch.no_grad():
        for n, p in lora.named_parameters():
            if n.endswith("lora_b.weight"):
                p.normal_(0, 0.05)
    merged = merge_lora(lora.state_dict(), recipe.train.lora)
    assert not any(is_adapter_key(k) for k in merged)
    with torch.no_grad():
        before = base(tokens)
        base.load_state_dict(merged)
        want, got = lora(tokens), base(tokens)
    assert (want - got).abs().max() <= 1e-5
    assert (want - before).abs().max() > 1e-2  # the random B matter: the check above is not vacuous


def test_expert_adapters_init_and_merge():
    """``train.lora.experts``: the routed experts get stacked adapters ``[E, r, in]`` / ``[E, out, r]``
    (A within PEFT's kaiming bound per expert, B = 0: the base at init); merge_lora folds them into
    the stacked expert weights, giving the adapter forward's logits (fp32, |diff| <= 1e-5)."""
    from llmtrain.engine.finetune.lora import apply_lora, is_adapter_key, merge_lora
    from llmtrain.engine.models.init import init_weights
    from llmtrain.engine.models.llama import Transformer
    from llmtrain.recipe.load import load_recipe

    recipe = load_recipe(ROOT / "recipes/debug.yaml", COMMON + EXPERTS)
    base, lora = Transformer(recipe.model), Transformer(recipe.model)
    adapted = apply_lora(lora, recipe.train.lora)
    assert [a for a in adapted if ".experts." in a] == [f"layers.1.moe.experts.{t}" for t in ("w1", "w2", "w3")]
    init_weights(base, 0)
    init_weights(lora, 0)
    experts = lora.layers["1"].moe.experts
    assert tuple(experts.lora_a["w1"].shape) == (4, 4, 32) and tuple(experts.lora_b["w2"].shape) == (4, 32, 4)
    assert 0 < experts.lora_a["w2"].abs().max() <= 1 / 32 ** 0.5 and not experts.lora_b["w1"].any()
    tokens = torch.randint(0, 128, (2, 16))
    assert torch.equal(base(tokens), lora(tokens))
    with torch.no_grad():
        for n, p in lora.named_parameters():
            if is_adapter_key(n) and ("lora_b" in n):
                p.normal_(0, 0.05)
        merged = merge_lora(lora.state_dict(), recipe.train.lora)
        assert not any(is_adapter_key(k) for k in merged)
        before = base(tokens)
        base.load_state_dict(merged)
        want, got = lora(tokens), base(tokens)
    assert (want - got).abs().max() <= 1e-5
    assert (want - before).abs().max() > 1e-2


# -- parity on every layout ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def parity(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora_parity")
    refs = run_worker(tmp, 1, {"all": ["parallel.tp=1", "parallel.zero=0"],
                               "subset": ["parallel.tp=1", "parallel.zero=0", *SUBSET],
                               "moe": ["parallel.tp=1", "parallel.zero=0", *MOE],
                               "experts": ["parallel.tp=1", "parallel.zero=0", *EXPERTS],
                               "bias": ["parallel.tp=1", "parallel.zero=0", *BIAS]})
    return tmp, refs, run_worker(tmp, 4, CASES, saved=SAVED)


@pytest.mark.parametrize("case", list(CASES))
def test_lora_layout_matches_single_process(parity, case):
    from llmtrain.engine.finetune.lora import is_adapter_key

    tmp, refs, layouts = parity
    kind = case.split("_")[0] if case.startswith(("subset", "moe", "experts", "bias")) else "all"
    ref, got = refs[kind], layouts[case]
    assert got["layout_errors"] == []
    loss_diff = max(abs(a - b) for a, b in zip(got["losses"], ref["losses"]))
    assert loss_diff <= LOSS_TOL, (got["losses"], ref["losses"])
    assert set(got["state"]) == set(ref["state"])
    adapters = [k for k in ref["state"] if is_adapter_key(k)]
    # MoE: layer 1's attention only; with experts also its routed experts' w1/w2/w3
    assert len(adapters) == 2 * {"all": 2 * 7, "subset": 2 * 2, "moe": 7 + 4}.get(kind, 7 + 4 + 3)
    assert got["trainable"] == sorted(adapters)
    worst = max((got["state"][k] - ref["state"][k]).abs().max().item() for k in adapters)
    assert worst <= WEIGHT_TOL, worst
    print(f"{case}: loss diff {loss_diff:.2e}, adapter weight diff {worst:.2e}")
    init = fresh_init({"all": [], "subset": SUBSET, "moe": MOE, "experts": EXPERTS, "bias": BIAS}[kind])
    # the bias balancing's expert_bias is learned state, not a weight: it moves, as in the reference
    moved = [k for k in ref["state"] if not is_adapter_key(k) and not k.endswith("expert_bias")
             and not torch.equal(got["state"][k], init[k])]
    assert not moved, f"frozen base changed: {moved[:3]}"
    for k in (k for k in ref["state"] if k.endswith("expert_bias")):
        assert (got["state"][k] - ref["state"][k]).abs().max() <= WEIGHT_TOL, k
    if case not in SAVED:
        return
    ckpt = tmp / f"4-{case}" / "checkpoints" / f"step-{STEPS}"
    keys = index_keys(ckpt)
    opt = sorted({k.removeprefix("optimizer.state.").rsplit(".", 1)[0] for k in keys if k.startswith("optimizer.")})
    assert opt == sorted(adapters)  # AdamW state for the adapters only
    assert {k.removeprefix("model.") for k in keys if k.startswith("model.")} == set(ref["state"])  # base saved: no HF base


def test_reference_adapters_trained(parity):
    """Guards the parity test: the adapters moved (B far from 0) and the loss fell."""
    _, refs, _ = parity
    for ref in refs.values():
        bs = [v for k, v in ref["state"].items() if k.endswith("lora_b.weight") or ".experts.lora_b." in k]
        assert min(b.abs().max().item() for b in bs) > 1e-2
        assert ref["losses"][-1] < ref["losses"][0]


def test_peft_export_without_hf_base_writes_the_base(parity, tmp_path):
    """A LoRA run without init_from_hf (TP 2 + SP checkpoint): ``--peft`` writes OUT/base too;
    PEFT on that base equals the merged export; ``--peft`` on a non-LoRA checkpoint is one line."""
    tmp, _, _ = parity
    root = tmp / "4-tp2_sp_zero3" / "checkpoints"
    peft_dir, merged = tmp_path / "peft", tmp_path / "merged"
    proc = cli(["ckpt", "export", str(root), "--peft", str(peft_dir), "--hf", str(merged), "--workers", "1"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    conf = json.loads((peft_dir / "adapter_config.json").read_text())
    assert conf["base_model_name_or_path"] == str((peft_dir / "base").resolve())
    assert_peft_equals_merged(peft_dir, merged, Path(conf["base_model_name_or_path"]))
    fake = tmp_path / "ckpts" / "step-4"  # the same checkpoint, its recipe without train.lora
    shutil.copytree(root / f"step-{STEPS}", fake)
    meta = json.loads((fake / "metadata.json").read_text())
    del meta["recipe"]["train"]["lora"]
    (fake / "metadata.json").write_text(json.dumps(meta))
    proc = cli(["ckpt", "export", str(fake), "--peft", str(tmp_path / "p2")])
    assert proc.returncode == 2 and "is not a LoRA run" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def assert_peft_equals_merged(peft_dir: Path, merged: Path, base: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    tokens = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
        base_logits = plain(tokens).logits
        peft_logits = PeftModel.from_pretrained(plain, peft_dir).eval()(tokens).logits
        merged_logits = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()(tokens).logits
    diff = (peft_logits - merged_logits).abs().max().item()
    print(f"PEFT vs merged logits: {diff:.2e}; merged vs base {(merged_logits - base_logits).abs().max().item():.2e}")
    assert diff <= LOGIT_TOL, diff
    assert (merged_logits - base_logits).abs().max().item() > 1e-2
