"""The planner's communication model (plan/comm.py, plan/recompute_comm.py) against what the
engine sends, plan-level: each rule here was read from the engine and measured by
benchmarks/planner_fidelity.py (every collective of one step, per dimension; its tiny run is in
tests/test_benchmarks.py). Split out of tests/test_costmodel.py by concept."""

from __future__ import annotations

import pytest

from llmtrain.plan.api import plan_recipe
from llmtrain.plan.costmodel import estimate
from llmtrain.recipe.load import load_recipe
from tests.helpers_plan import REPO
from tests.test_costmodel import COMMON, MOE, _plan


def test_lora_adapters_replicated_over_tp_are_all_reduced_once_per_step():
    """LoRA under TP: a column-wise base's A [r, in] and a row-wise base's B [out, r] are replicated
    over TP; their gradients come out Partial and are all-reduced once per step. debug-dense (h 128,
    4 layers), r 4, all-linear, tp 2: per layer 5 x 4 x 128 (A of wq wk wv w1 w3) + 2 x 128 x 4 (B
    of wo w2) = 3,584 elements, 14,336 in all, 57,344 fp32 bytes: what planner_fidelity measured
    (20 all-reduces of [4, 128] and 8 of [128, 4] fp32 per step). None without TP."""
    from llmtrain.plan.shards import lora_key, lora_replicated_numel
    from llmtrain.recipe.load import validate_recipe_dict
    base = {"model": {"preset": "debug-dense"}, "parallel": {"tp": 2, "zero": 0},
            "train": {"seq_len": 64, "micro_batch_size": 2, "global_batch_size": 16, "precision": "fp32",
                      "lora": {"rank": 4}}, "cluster": {"nodes": 1, "gpus_per_node": 4, "gpu": "cpu"}}
    rc = validate_recipe_dict(base)
    assert lora_replicated_numel(rc.model, range(4), 2, lora_key(rc.train.lora)) == 14336
    assert lora_replicated_numel(rc.model, range(4), 1, lora_key(rc.train.lora)) == 0
    p = plan_recipe(rc)
    cost = estimate(rc, p.validation.dims, p.validation.batch, p.placement, hints=False)
    step = [c for c in cost.comms if c.dim == "tp" and c.phase == "step"]
    assert len(step) == 1 and step[0].op == "all-reduce" and step[0].message_bytes * step[0].count == 57344


@pytest.mark.parametrize("sp", [True, False])
def test_recomputation_re_runs_only_the_tp_collectives_the_engine_re_runs(sp):
    """Per layer and micro batch, forward + backward send 4 all-gathers and 4 reduce-scatters (SP)
    or 4 all-reduces; recomputation adds (recompute_comm.recomputed_tp_sites): selective and selective_mm the
    2 SP gathers (nothing without SP), full also wo's reduction, Megatron-LM's whole-block
    checkpoint (planner.full_recompute whole_block) all 4. The engine's counts are measured by
    benchmarks/planner_fidelity.py (and its tiny run in tests/test_benchmarks.py)."""
    def tp_counts(mode: str, whole: bool = False) -> dict[str, float]:
        extra = [f"parallel.sequence_parallel={str(sp).lower()}", f"train.activation_checkpointing={mode}"]
        p = _plan("recipes/llama3-8b.yaml", ["parallel.tp=8", "parallel.zero=1"] + extra
                  + (["planner.full_recompute=whole_block"] if whole else []))
        cost = estimate(p.recipe, p.validation.dims, p.validation.batch, p.placement, hints=False)
        out: dict[str, float] = {}
        for c in cost.comms:
            if c.dim == "tp":
                out[c.op] = out.get(c.op, 0) + c.count
        return out, p.validation.batch.grad_accum * p.recipe.model.layers

    base, lm = tp_counts("none")
    added = [{op: n - base[op] for op, n in tp_counts(mode, whole)[0].items()}
             for mode, whole in (("selective", False), ("selective_mm", False), ("full", False), ("full", True))]
    if sp:
        assert base["all-gather"] == base["reduce-scatter"]
        assert [(a["all-gather"] / lm, a["reduce-scatter"] / lm) for a in added] == [(2, 0), (2, 0), (2, 1), (2, 2)]
    else:
        assert set(base) == {"all-reduce"}
        assert [a["all-reduce"] / lm for a in added] == [0, 0, 1, 2]


@pytest.mark.parametrize("tp, edp", [(2, 1), (1, 2)])
def test_expert_gradients_and_zero1_owners_stay_in_expert_dp(tp, edp):
    """Expert gradients are all-reduced, and under ZeRO-1 their owners broadcast, over the
    expert-DP group (engine/dp_optimizer.py: a second ZeRO1Optimizer on the edp group); with an
    expert-DP group of one neither happens (measured: benchmarks/planner_fidelity.py, MoE ep 2 x
    tp 2). Before, the planner listed a 1-rank all-reduce and broadcast the experts over dense DP."""
    recipe = load_recipe(REPO / "recipes/debug.yaml", COMMON + MOE + ["parallel.zero=1", "parallel.ep=2", f"parallel.tp={tp}"])
    plan = plan_recipe(recipe, None, 1, 4)
    cost = estimate(recipe, plan.validation.dims, plan.validation.batch, plan.placement, hints=False)
    dp = [c for c in cost.comms if c.dim == "dp"]
    assert plan.validation.dims.edp == edp and all(c.group > 1 for c in dp)
    expert = [c for c in dp if "expert" in c.note]
    assert [(c.op, c.group) for c in expert] == ([] if edp == 1 else [("all-reduce", 2), ("broadcast", 2)])


@pytest.mark.parametrize("method, tp", [("ring", 8), ("allgather", 8), ("ulysses", 4), ("ulysses", 8)])
def test_cp_kv_bytes_scale_with_kv_heads_unless_priced_repeated(method, tp):
    """Ring and all-gather CP move K/V (and dK/dV) with the rank's kv_heads (the engine repeats them
    after the exchange, engine/parallel/context.py): Llama 3 405B under TP 8 has 128 / 8 = 16 query
    heads and 8 / 8 = 1 KV head per rank, so ``planner.cp_kv repeated`` (torchtitan's
    context_parallel, K/V repeated before SDPA) prices 16x the CP bytes, said on the assumptions
    line. Memory stays the engine's either way. Ulysses exchanges q and the output with the rank's
    query heads and K/V with its kv_heads when those split over cp (TP 4: 2 per rank over cp 2,
    since the thirty-eighth session), else repeated (TP 8: 1 per rank): (2 x 32 + 2 x 2) / (4 x 32)
    of the repeated bytes at TP 4, no change and no assumption at TP 8."""
    base = ["parallel.cp=2", f"parallel.cp_method={method}", f"parallel.tp={tp}", "train.seq_len=16384"]
    plans = [_plan("recipes/llama3-405b.yaml", base + extra, nodes=256, gpus=8)
             for extra in ([], ["planner.cp_kv=repeated"])]
    engine, repeated = (estimate(p.recipe, p.validation.dims, p.validation.batch, p.placement, hints=False)
                        for p in plans)
    m = plans[0].recipe.model
    assert plans[0].valid and (m.heads, m.kv_heads) == (128, 8)

    def cp_bytes(cost):
        return sum(c.message_bytes * c.count for c in cost.comms if c.dim == "cp")

    assert cp_bytes(engine) > 0
    split = method != "ulysses" or tp == 4
    ratio = (m.heads // m.kv_heads if method != "ulysses" else 128 / 68) if split else 1
    assert cp_bytes(repeated) == pytest.approx(ratio * cp_bytes(engine), rel=1e-12)
    assert ("planner.cp_kv repeated" in repeated.assumptions) == split
    assert "planner.cp_kv repeated" not in engine.assumptions
    assert repeated.worst.peak == engine.worst.peak
