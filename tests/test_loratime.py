"""Time model v2 under LoRA (plan/loratime.py): the GEMMs it prices are the ones plan/flops.py counts.

Pure and fast. flops.py's LoRA count (checked against FlopCounterMode on the engine's LoRA model,
tests/test_costmodel.py) is per token, GEMMs plus the norms' ``2h`` each way and attention's
scores and values; here the priced GEMM list's ``2 m n k`` must equal it once those non-GEMM
terms are taken out (forward; forward + backward; full recomputation), for every target set,
block 0 and a later block, without and with TP. Exact: integer FLOPs in float64.
"""

from __future__ import annotations

import dataclasses

import pytest

from llmtrain.plan import flops, loratime, ops
from llmtrain.plan.api import plan_recipe
from llmtrain.plan.costmodel import estimate
from llmtrain.recipe.gpus import GPUS
from llmtrain.recipe.load import validate_recipe_dict
from llmtrain.recipe.schema import ModelConfig

TARGETS = [("wq", "wk", "wv", "wo", "w1", "w2", "w3"), ("wq", "wv"), ("w1", "w2", "w3"), ("wo",), ("w2",)]


def _model() -> ModelConfig:
    return ModelConfig(layers=4, hidden=512, heads=8, kv_heads=2, ffn_hidden=1536, vocab_size=1000, max_seq_len=256,
                       rope_theta=10000.0, norm_eps=1e-5, tie_embeddings=False)


def _shape(m: ModelConfig, targets, tp=1, rank=8, recompute="none", first=False, seq=256) -> ops.BlockShape:
    return ops.BlockShape(b=2, s=seq, seq=seq, h=m.hidden, heads=m.heads, kv_heads=m.kv_heads, hd=m.head_dim,
                          ffn=m.ffn_hidden, vocab=m.vocab_size, tp=tp, sp=False, e=2, recompute=recompute,
                          lora=(rank, tuple(t for t in ("wq", "wk", "wv", "wo", "w1", "w2", "w3", "e1", "e2", "e3")
                                            if t in targets), False),
                          lora_first=first)


def _flops(gemms) -> float:
    return sum(2.0 * m * n * k for m, n, k in gemms)


def _needs(targets, first):
    """The requires-grad flags flops.py derives (module docstring there): q, k, v outputs, the residual."""
    x_grad = not first
    q, k, v = (x_grad or t in targets for t in ("wq", "wk", "wv"))
    o = (q or k or v) or "wo" in targets
    return q, k, v, x_grad or o


@pytest.mark.parametrize("first", [False, True])
@pytest.mark.parametrize("targets", TARGETS)
def test_priced_gemms_are_the_counted_gemm_flops(targets, first):
    m = _model()
    x = _shape(m, targets, first=first)
    tok, h, seq, rank = x.b * x.s, m.hidden, x.seq, 8
    layer = 0 if first else 1
    fwd, bwd, attn_grad, again, _ = loratime.block_gemms(x, first)
    q, k, v, r_grad = _needs(targets, first)
    # forward: flops.py's forward less the two norms (2h each) and the scores and values (4 h s)
    f_split, f_rep = flops.forward_flops_per_token(m, layer, seq, (rank, tuple(targets)))
    assert _flops(fwd) == pytest.approx(tok * (f_split + f_rep - 2 * 2 * h - 4 * h * seq), rel=1e-12)
    # forward + backward: less the norms' input gradients (where needed) and the attention backward terms
    split, rep = flops.block_flops_per_token(m, layer, seq, (rank, tuple(targets)))
    norms = 2 * h * (1 + (not first)) + 2 * h * (1 + r_grad)
    attention = 4 * h * seq + 2 * h * seq * (v + (q or k) + q + k)
    assert _flops(fwd) + _flops(bwd) == pytest.approx(tok * (split + rep - norms - attention), rel=1e-12)
    assert attn_grad == (q or k or v)
    # full recomputation: flops.py's recompute count less the forward norms and scores
    r_split, r_rep = flops.recompute_flops_per_token(m, layer, seq, "full", (rank, tuple(targets)))
    assert _flops(again) == pytest.approx(tok * (r_split + r_rep - 2 * 2 * h - 4 * h * seq), rel=1e-12)


@pytest.mark.parametrize("first", [False, True])
@pytest.mark.parametrize("targets", [("wq", "wk", "wv", "wo", "w1", "w2", "w3"), ("wo",), ("w1",),
                                     ("wq", "wk", "wv", "wo", "w1", "w2", "w3", "e1", "e2", "e3"), ("e2",), ("wo", "e1", "e3")])
def test_moe_block_under_lora_prices_the_counted_gemm_flops(targets, first):
    """An MoE block under LoRA (adapters on its attention; router and shared experts frozen: their forward,
    and their input gradients where the MLP input needs one; the routed experts too, unless
    ``train.lora.experts`` adapts them, ``e1 e2 e3`` in the key): the priced GEMMs equal flops.py's count,
    as for a dense block (``("w1",)``: no adapter at all in an MoE block)."""
    m = ModelConfig(layers=4, hidden=512, heads=8, kv_heads=2, ffn_hidden=1536, vocab_size=1000, max_seq_len=256,
                    rope_theta=10000.0, norm_eps=1e-5, tie_embeddings=False,
                    moe={"num_experts": 8, "top_k": 2, "shared_experts": 1, "expert_ffn_hidden": 256})
    x = dataclasses.replace(_shape(m, targets, first=first), experts=8, top_k=2, shared=1, expert_ffn=256)
    tok, h, seq = x.b * x.s, m.hidden, x.seq
    fwd, bwd, attn_grad, again, needs = loratime.block_gemms(x, first, moe=True)
    assert set(needs) == {"wq", "wk", "wv", "wo"}
    attn_t = tuple(t for t in targets if t in needs)
    q, k, v, r_grad = _needs(attn_t, first)
    f_split, f_rep = flops.forward_flops_per_token(m, 0 if first else 1, seq, (8, tuple(targets)))
    assert _flops(fwd) == pytest.approx(tok * (f_split + f_rep - 2 * 2 * h - 4 * h * seq), rel=1e-12)
    split, rep = flops.block_flops_per_token(m, 0 if first else 1, seq, (8, tuple(targets)))
    norms = 2 * h * (1 + (not first)) + 2 * h * (1 + r_grad)
    attention = 4 * h * seq + 2 * h * seq * (v + (q or k) + q + k)
    assert _flops(fwd) + _flops(bwd) == pytest.approx(tok * (split + rep - norms - attention), rel=1e-12)
    assert attn_grad == (q or k or v)
    experts = any(t in ("e1", "e2", "e3") for t in targets)  # block 0 with no adapter runs no backward GEMM
    assert (not bwd) == (first and not attn_t and not experts)
    # full recomputation re-runs the MoE block's forward whole: flops.py's count less the norms and scores
    r_split, r_rep = flops.recompute_flops_per_token(m, 0 if first else 1, seq, "full", (8, tuple(targets)))
    assert _flops(again) == pytest.approx(tok * (r_split + r_rep - 2 * 2 * h - 4 * h * seq), rel=1e-12)


def test_tp_splits_the_base_and_one_adapter_matrix():
    """Under TP 2 a column-wise projection's B and a row-wise one's A are split, the other replicated:
    the per-rank GEMM FLOPs are (split / 2 + replicated) of flops.py's per-token split."""
    m = _model()
    x1, x2 = _shape(m, TARGETS[0]), _shape(m, TARGETS[0], tp=2)
    tok = x1.b * x1.s
    split, rep = flops.forward_flops_per_token(m, 1, x1.seq, (8, TARGETS[0]))
    gemm_split = split - 2 * 2 * m.hidden - 4 * m.hidden * x1.seq
    assert _flops(loratime.block_gemms(x1, False)[0]) == pytest.approx(tok * (gemm_split + rep), rel=1e-12)
    assert _flops(loratime.block_gemms(x2, False)[0]) == pytest.approx(tok * (gemm_split / 2 + rep), rel=1e-12)


def test_adapter_dropout_backward_follows_each_input_gradient():
    """Block 0 with adapters on wo and w1 only: q, k, v need no gradient, so wo's input needs none
    (no dropout backward there), but wo's adapter makes the residual need one, so w1's input does.
    Forward: scale + add (5e per output element) and dropout (2e + 1 per input element) on both."""
    m = _model()
    x = dataclasses.replace(_shape(m, ("wo", "w1"), first=True), lora=(8, ("wo", "w1"), True))
    needs = loratime.block_gemms(x, True).input_grad
    assert needs == {"wq": False, "wk": False, "wv": False, "wo": False, "w1": True, "w3": True, "w2": True}
    tok, e, h, f = x.b * x.s, x.e, m.hidden, m.ffn_hidden
    fwd, bwd = loratime.adapter_bytes(x, needs)
    assert fwd == tok * (5 * e * (h + f) + (2 * e + 1) * (h + h))
    assert bwd == tok * (2 * e * (h + f) + (2 * e + 1) * h)


def test_lora_block_skips_the_weight_gradients_and_block_0_more():
    """At Llama-3-8B's shapes (4,096 tokens) an adapted block's backward is cheaper than the full
    fine-tune's (no base weight gradient; at toy widths the adapters' memory-bound passes can cost
    more), block 0's cheaper still where a branch is frozen (no input gradient), its forward the
    same, and the forward dearer than the full fine-tune's (the adapters)."""
    m = ModelConfig(layers=32, hidden=4096, heads=32, kv_heads=8, ffn_hidden=14336, vocab_size=128256,
                    max_seq_len=8192, rope_theta=500000.0, norm_eps=1e-5, tie_embeddings=False)
    gpu = GPUS["h100-sxm"]
    full = dataclasses.replace(_shape(m, TARGETS[0], seq=4096), lora=None)
    lora, first = _shape(m, ("w1", "w2", "w3"), seq=4096), _shape(m, ("w1", "w2", "w3"), first=True, seq=4096)
    f_full, b_full = ops.block_seconds(full, gpu, False)
    f_lora, b_lora = ops.block_seconds(lora, gpu, False)
    f_first, b_first = ops.block_seconds(first, gpu, False)
    assert b_lora < b_full and b_first < b_lora and f_first == f_lora and f_lora > f_full


def test_v2_prices_lora_recipes_itself_and_fp8_lora_stays_v1():
    """A LoRA recipe's v2 step differs from v1's and from the same recipe without LoRA; under fp8 the
    compute is v1's (the breakdown has no v2 overlap term)."""
    base = dict(model=dict(preset="llama3-8b"), parallel=dict(zero=3, dp_shard=-1),
                train=dict(seq_len=2048, micro_batch_size=1, global_batch_size=8, activation_checkpointing="full",
                           lora=dict(rank=16)),
                cluster=dict(nodes=1, gpus_per_node=8, gpu="h100-sxm"))

    def est(**patch):
        data = {k: dict(v) for k, v in base.items()}
        for key, value in patch.items():
            section, name = key.split("__")
            data[section][name] = value
        recipe = validate_recipe_dict(data)
        plan = plan_recipe(recipe)
        return estimate(recipe, plan.validation.dims, plan.validation.batch, plan.placement, hints=False).time

    v2, v1, no_lora = est(), est(cluster__time_model="v1"), est(train__lora=None)
    assert "overlap" in v2.breakdown and v2.step_s != v1.step_s
    assert v2.breakdown["compute"] < no_lora.breakdown["compute"]  # 70B-class savings hold at 8B with full AC
    fp8 = est(train__precision="fp8")
    assert "overlap" not in fp8.breakdown

