"""The planner's model of FSDP + gradient accumulation (engine/step.py, ``parallel.fsdp_reduce_each_microbatch``).

Default (reduce once, after the last micro batch): FSDP2 holds an unsharded fp32 gradient of every
trainable parameter of the rank between micro batches, ``4 x trainable`` bytes of grad buffers
(measured on 2 ranks: 12.26 MiB unsharded vs 6.13 MiB sharded, hidden 256, zero 2 and 3), and one
reduce-scatter per step. Reducing after every micro batch: none of that buffer, and ``grad_accum``
reduce-scatters. Under PP torch's schedule always delays, so the flag changes nothing there.
The engine's gradients with the flag are checked against one process in tests/test_engine_5d.py
(``dp2_fsdp_reduce_each``). Exact integers: no tolerance.
"""

from __future__ import annotations

from llmtrain.plan.api import plan_recipe
from llmtrain.plan.costmodel import rank_memory
from llmtrain.plan.report import plan_to_dict
from llmtrain.recipe.load import load_recipe
from tests.helpers_plan import REPO

BASE = ["parallel.tp=1", "parallel.zero=3", "train.global_batch_size=32", "train.micro_batch_size=2"]


def _mem_and_reduces(extra):
    recipe = load_recipe(REPO / "recipes/debug.yaml", BASE + extra)
    plan = plan_recipe(recipe, None, 1, 4)
    v = plan.validation
    reduces = [c["count"] for c in plan_to_dict(plan)["comm"] if c["dim"] == "dp" and c["op"] == "reduce-scatter"]
    return rank_memory(recipe, v.dims, v.batch, 0, 0), v.batch.grad_accum, reduces


def test_reduce_each_microbatch_drops_the_unsharded_gradient():
    once, accum, _ = _mem_and_reduces([])
    each, _, _ = _mem_and_reduces(["parallel.fsdp_reduce_each_microbatch=true"])
    assert accum == 4
    assert once.other_detail["grad_buffers"] - each.other_detail["grad_buffers"] == 4 * once.trainable_params
    assert (once.params, once.grads, once.optimizer) == (each.params, each.grads, each.optimizer)


def test_pipeline_keeps_the_unsharded_gradient_either_way():
    pp = ["parallel.pp=2", "model.layers=4"]
    once, _, _ = _mem_and_reduces(pp)
    each, _, _ = _mem_and_reduces(pp + ["parallel.fsdp_reduce_each_microbatch=true"])
    assert once.other_detail["grad_buffers"] == each.other_detail["grad_buffers"]
    assert once.other_detail["grad_buffers"] >= 4 * once.trainable_params


def test_reduce_scatter_count_follows_the_setting():
    assert _mem_and_reduces([])[2] == [1]
    assert _mem_and_reduces(["parallel.fsdp_reduce_each_microbatch=true"])[2] == [4]
    assert _mem_and_reduces(["parallel.pp=2", "parallel.fsdp_reduce_each_microbatch=true"])[2] == [1]
