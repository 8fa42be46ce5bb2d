"""How `llmtrain plan` prices a sliding window shorter than the sequence (the engine's band mask:
engine/models/llama.py window_mask): time, model FLOPs and the mask's memory. Engine measurements of
the mask's bytes are tests/test_costmodel.py's window_* cases."""

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
    """Mistral v0.1 at 8,192 tokens (window 4,096): the engine's band mask makes SDPA execute every
    score block (flops.attention_executed 1 instead of the causal kernel's 1/2), so the step is
    slower than the same model without a window, the model FLOPs (MFU's numerator) are the same,
    and each micro batch holds one more [S, S] bf16 mask; at 4,096 tokens the window changes nothing."""
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
    assert windowed.time.step_s > 1.05 * causal.time.step_s
    assert windowed.time.tflops_per_gpu * windowed.time.step_s == pytest.approx(causal.time.tflops_per_gpu * causal.time.step_s)
    assert windowed.worst.saved_detail["window_mask"] == 2 * 8192 ** 2
    assert "window_mask" not in causal.worst.saved_detail
    assert costs[4096, "4096"].time.step_s == costs[4096, "null"].time.step_s
    assert "window_mask" not in costs[4096, "4096"].worst.saved_detail
