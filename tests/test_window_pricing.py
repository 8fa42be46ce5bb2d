"""How `llmtrain plan` prices attention the engine runs with a mask or its own kernel: a sliding
window shorter than the sequence (the band mask, engine/models/llama.py window_mask), packed rows
(the sample mask) and Gemma 2's soft-capped kernel: time, model FLOPs and the masks' memory. Engine
measurements of the masks' bytes are tests/test_costmodel.py's window_* cases and
tests/test_packing_model.py."""

from __future__ import annotations

import pytest

from llmtrain.plan.api import plan_recipe
from llmtrain.plan.costmodel import estimate
from llmtrain.recipe.load import load_recipe
from tests.helpers_plan import REPO


def _plan(path: str, overrides: list[str]):
    return plan_recipe(load_recipe(REPO / path, overrides), None, None, None)


@pytest.mark.parametrize("time_model", ["v1", "v2"])
def test_a_sliding_window_shorter_than_the_sequence_is_priced_as_a_masked_kernel(time_model):
    """Mistral v0.1 at 8,192 tokens (window 4,096): the engine runs each windowed layer's score boxes, two
    chunks of 4,096 (plan/localwindow.py: both diagonals whole and the 4,095-square box between them, 0.75
    of the square executed instead of the causal kernel's 1/2; the dense band ran all of it before the
    forty-second session), so the step is slower than the same model without a window; the model FLOPs
    (MFU's numerator) count the window's keys, 12 h min(s, window) per layer and token (flops.py
    window_uncounted), and each micro batch holds one more [S, S] bf16 mask; at 4,096 tokens the window
    changes nothing."""
    base = ["model.preset=mistral-7b-v0.1", "train.global_batch_size=64", "parallel.tp=4", "parallel.zero=1",
            f"cluster.time_model={time_model}"]
    costs = {}
    for seq in (4096, 8192):
        for window in ("4096", "null"):
            plan = _plan("recipes/llama3-8b.yaml", base + [f"train.seq_len={seq}", f"model.sliding_window={window}"])
            v = plan.validation
            assert v.errors == []
            costs[seq, window] = estimate(plan.recipe, v.dims, v.batch, plan.placement, hints=False)
    windowed, causal = costs[8192, "4096"], costs[8192, "null"]
    assert 1.02 * causal.time.step_s < windowed.time.step_s < 1.06 * causal.time.step_s  # v1 +2.9 %, v2 +4.3 %
    m = _plan("recipes/llama3-8b.yaml", base + ["train.seq_len=8192"]).recipe.model  # Mistral's own window
    assert m.sliding_window == 4096
    uncounted = 12.0 * m.hidden * (8192 - 4096) * m.layers
    assert windowed.flops["model_flops_per_token"] == causal.flops["model_flops_per_token"] - uncounted
    assert windowed.time.tflops_per_gpu * windowed.time.step_s == pytest.approx(
        causal.time.tflops_per_gpu * causal.time.step_s * windowed.flops["model_flops_per_token"]
        / causal.flops["model_flops_per_token"])
    assert windowed.worst.saved_detail["window_mask"] == 2 * 8192 ** 2
    assert "window_mask" not in causal.worst.saved_detail
    assert costs[4096, "4096"].time.step_s == costs[4096, "null"].time.step_s
    assert "window_mask" not in costs[4096, "4096"].worst.saved_detail


def test_soft_capped_attention_is_priced_as_the_engines_unfused_kernel():
    """Gemma 2 9B (model.attention_softcap 50) at 8,192 tokens on H100, TP 8: the engine's own kernel
    (engine/models/softcap.py) is two GEMMs forward and five backward over every score block plus its
    element-wise passes through HBM (plan/attentiontime.py SOFTCAP_BYTES), far slower than a flash
    kernel; the same activations (it keeps what a flash kernel keeps on K/V repeated to the query
    heads, which is how the capped kernel takes them: plan/gqa.py) and model FLOPs. A stack whose
    flash kernel caps (planner.attention_kernel fa2, as FlashAttention 2 has softcap) prices as
    without the cap. v2 only: v1 has one efficiency constant for every op."""
    from llmtrain.plan.attentiontime import SOFTCAP_BYTES, attention_seconds
    from llmtrain.recipe.gpus import GPUS

    base = ["model.preset=gemma2-9b", "train.seq_len=8192", "train.global_batch_size=8", "parallel.tp=8",
            "parallel.zero=1", "cluster.gpu=h100-sxm", "cluster.time_model=v2"]
    costs = {}
    for cap, kernel in (("50", "engine"), ("null", "engine"), ("50", "fa2"), ("null", "fa2"), ("null", "repeat")):
        gqa = ["planner.gqa=repeat"] if kernel == "repeat" else []
        plan = _plan("recipes/llama3-8b.yaml", base + gqa + [f"model.attention_softcap={cap}",
                                                             f"planner.attention_kernel={'engine' if gqa else kernel}"])
        assert plan.validation.errors == []
        v = plan.validation
        costs[cap, kernel] = estimate(plan.recipe, v.dims, v.batch, plan.placement, hints=False)
    capped, flash = costs["50", "engine"], costs["null", "engine"]
    compute = capped.time.breakdown["compute"], flash.time.breakdown["compute"]
    assert compute[0] > 2 * compute[1]  # 0.600 vs 0.156 s: about 11 ms of attention per layer and micro batch
    assert capped.time.tflops_per_gpu * capped.time.step_s == pytest.approx(flash.time.tflops_per_gpu * flash.time.step_s)
    assert capped.worst.saved_detail == costs["null", "repeat"].worst.saved_detail
    assert costs["50", "fa2"].time.step_s == costs["null", "fa2"].time.step_s
    f, b = attention_seconds(1, 8192, 8192, 2, 256, 0.5, GPUS["h100-sxm"], kernel="softcap", e=2)
    assert SOFTCAP_BYTES[0](2) == 70 and SOFTCAP_BYTES[1](2) == 140 and b > 2 * f


def test_packed_rows_are_priced_as_masked_kernels_and_their_mask_held():
    """Packed rows run every layer's attention as SDPA with the sample mask (models/llama.py
    packed_mask): every score block executes (flops.masked_layers 1), so the step is slower than the
    same rows unpacked at equal model FLOPs, and each micro batch holds one [b, 1, S, S] mask."""
    base = ["train.seq_len=8192", "train.global_batch_size=64", "parallel.tp=4", "parallel.zero=1",
            "data.source=text", "data.path=t.txt", "cluster.time_model=v2"]
    costs, micro = {}, {}
    for packing in ("true", "false"):
        plan = _plan("recipes/llama3-8b.yaml", base + [f"data.packing={packing}"])
        v = plan.validation
        assert v.errors == []
        costs[packing] = estimate(plan.recipe, v.dims, v.batch, plan.placement, hints=False)
        micro[packing] = plan.recipe.train.micro_batch_size
    packed, unpacked = costs["true"], costs["false"]
    assert packed.time.step_s > 1.05 * unpacked.time.step_s
    assert packed.time.tflops_per_gpu * packed.time.step_s == pytest.approx(unpacked.time.tflops_per_gpu * unpacked.time.step_s)
    assert packed.worst.saved_detail["packed_mask"] == 2 * micro["true"] * 8192 ** 2  # bf16, one kind of layer
    assert "packed_mask" not in unpacked.worst.saved_detail


def test_plan_says_the_soft_capped_kernel_is_unfused():
    """`plan` of a soft-capped model priced with the engine's kernel says so in a recommendation naming
    the setting for a fused stack; priced as FA2 (planner.attention_kernel fa2) it does not."""
    from llmtrain.plan.report import cost_dict

    base = ["model.preset=gemma2-9b", "parallel.tp=2"]
    notes = cost_dict(_plan("recipes/llama3-8b.yaml", base))["recommendations"]
    (note,) = [n for n in notes if n["kind"] == "softcap_kernel"]
    assert "unfused" in note["message"] and "planner.attention_kernel fa2" in note["message"]
    fused = cost_dict(_plan("recipes/llama3-8b.yaml", base + ["planner.attention_kernel=fa2"]))["recommendations"]
    assert not [n for n in fused if n["kind"] == "softcap_kernel"]
