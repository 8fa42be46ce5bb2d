"""One test per rule of llmtrain.plan.validate: the path, the numbers in the message, the fix.

Recipes are small dicts on the debug presets (``debug-dense``: 4 layers, hidden 128, 8 heads /
4 kv, ffn 352, vocab 512, max_seq_len 512), validated for ``nodes x gpus`` in memory.
"""

from __future__ import annotations

import pytest

from tests.helpers_plan import debug, find, nodes_of, paths, plan_of


def errors(data, **kw):
    return plan_of(data, **kw).validation.errors


def warnings(data, **kw):
    return plan_of(data, **kw).validation.warnings


def test_base_recipe_is_valid_and_clean():
    plan = plan_of(debug())
    assert plan.valid and not plan.validation.warnings
    assert plan.validation.dims.dp_shard == 8
    assert plan.validation.batch.global_batch_size == 8


# -- world size ------------------------------------------------------------------------------

def test_world_size_inferred_dp_shard_does_not_divide():
    plan = plan_of(debug({"parallel": {"dp_replicate": 3}}), nodes=1, gpus=8)
    p = find(plan.validation.errors, "parallel", "1x3x1x1 = 3", "does not divide the world size 8")
    assert "divides 8" in p.hint
    assert plan.validation.dims is None and plan.validation.batch is None


def test_world_size_explicit_dp_shard_mismatch():
    p = find(errors(debug({"parallel": {"tp": 2, "dp_shard": 2}})), "parallel", "= 4 but the world size is 8")
    assert "dp_shard: -1" in p.hint and "cluster.nodes x cluster.gpus_per_node" in p.hint
    assert plan_of(debug({"parallel": {"tp": 2, "dp_shard": 4}})).valid


# -- expert parallelism ------------------------------------------------------------------------

def test_ep_must_divide_dp_shard_times_cp():
    data = debug({"model": {"moe": {"num_experts": 8}}, "parallel": {"ep": 8}}, preset="debug-moe")
    p = find(errors(data, gpus=4), "parallel.ep", "ep (8) does not divide dp_shard x cp = 4x1 = 4")
    assert p.hint == "use ep in {1, 2, 4}"
    # ep may span dp_shard x cp: 2 x 2 ranks hold 4 experts
    plan = plan_of(debug({"parallel": {"ep": 4, "cp": 2}}, preset="debug-moe"), gpus=4)
    assert plan.valid, plan.validation.errors
    assert (plan.validation.dims.dp_shard, plan.validation.dims.edp) == (2, 1)


def test_ep_on_dense_model():
    p = find(errors(debug({"parallel": {"ep": 2}})), "parallel.ep", "ep is 2 but the model is dense",
             "num_experts = 1")
    assert "parallel.ep: 1" in p.hint


def test_num_experts_divisible_by_ep():
    p = find(errors(debug({"parallel": {"ep": 8}}, preset="debug-moe")), "model.moe.num_experts",
             "num_experts (4) not divisible by ep (8)")
    assert p.hint == "use parallel.ep in {1, 2, 4}"


def test_moe_fields_on_dense_model():
    errs = errors(debug({"model": {"moe": {"top_k": 2, "router": "sigmoid"}}}))
    for path in ("model.moe.router", "model.moe.top_k"):
        p = find(errs, path, "set, but the model is dense (num_experts <= 1)")
        assert "num_experts > 1" in p.hint
    assert plan_of(debug({"model": {"moe": {"num_experts": 1}}})).valid


def test_top_k_exceeds_experts():
    p = find(errors(debug({"model": {"moe": {"top_k": 8}}}, preset="debug-moe")), "model.moe.top_k",
             "top_k (8) exceeds num_experts (4)")
    assert p.hint == "use top_k <= 4"


def test_first_dense_layers_leaves_no_moe_layer():
    p = find(errors(debug({"model": {"moe": {"first_dense_layers": 4}}}, preset="debug-moe")),
             "model.moe.first_dense_layers", "first_dense_layers (4) leaves no MoE layer of 4")
    assert p.hint == "use first_dense_layers < 4"


# -- tensor parallelism ---------------------------------------------------------------------------

@pytest.mark.parametrize("preset, model, fragment", [
    ("debug-dense", {"hidden": 96, "heads": 6, "kv_heads": 2}, "heads (6) not divisible by tp (4)"),
    ("debug-dense", {"kv_heads": 2}, "kv_heads (2) not divisible by tp (4)"),
    ("debug-dense", {"ffn_hidden": 350}, "ffn_hidden (350) not divisible by tp (4)"),
    ("debug-dense", {"vocab_size": 510}, "vocab_size (510) not divisible by tp (4)"),
    ("debug-moe", {"moe": {"expert_ffn_hidden": 130}}, "expert_ffn_hidden (130) not divisible by tp (4)"),
])
def test_tp_divisibility_lists_valid_tp(preset, model, fragment):
    errs = errors(debug({"model": model, "parallel": {"tp": 4}}, preset=preset))
    p = find(errs, "parallel.tp", fragment)
    assert p.hint == "use tp in {1, 2}"  # divisors of gcd(heads, kv_heads, ffn, vocab[, expert ffn])


def test_tp_hint_is_capped_by_gpus_per_node():
    data = {"model": {"preset": "llama3-8b"}, "parallel": {"tp": 3}}
    assert find(errors(data, gpus=8), "parallel.tp", "heads (32) not divisible by tp (3)").hint == "use tp in {1, 2, 4, 8}"
    assert find(errors(data, gpus=4), "parallel.tp", "heads (32)").hint == "use tp in {1, 2, 4}"


def test_tp_exceeds_gpus_per_node():
    data = {"model": {"preset": "llama3-8b"}, "parallel": {"tp": 16}}
    plan = plan_of(data, nodes=2, gpus=8)
    p = find(plan.validation.errors, "parallel.tp", "tp (16) exceeds the GPUs per node (8)", "NVLink")
    assert p.hint == "use tp <= 8 and move the rest to pp or dp"
    assert not [w for w in plan.validation.warnings if w.path == "parallel.tp"]


def test_tp_crossing_nodes_is_a_warning():
    placement = nodes_of(6, 6, 12)
    plan = plan_of(debug({"parallel": {"tp": 4}}), placement=placement)
    assert plan.valid, plan.validation.errors
    p = find(plan.validation.warnings, "parallel.tp", "tp (4) does not divide every node's slots ([6, 12])",
             "some TP groups cross nodes")
    assert p.hint == "use a tp that divides the slots of every node"
    dims = plan.validation.dims
    assert placement.spans_nodes(dims.group(4, "tp"))  # ranks 4,5 on node 0; 6,7 on node 1
    assert not placement.spans_nodes(dims.group(0, "tp"))


# -- model shape ---------------------------------------------------------------------------------

def test_hidden_divisible_by_heads():
    p = find(errors(debug({"model": {"hidden": 100}})), "model.hidden", "hidden (100) not divisible by heads (8)")
    assert p.hint == "use heads in {1, 2, 4, 5, 10, 20, 25, 50, 100}, or set model.head_dim"
    # an explicit head_dim (Qwen3's form) lifts the requirement: q/k/v widths are heads x head_dim
    assert not [e for e in errors(debug({"model": {"hidden": 100, "head_dim": 16}})) if e.path == "model.hidden"]


def test_heads_divisible_by_kv_heads():
    p = find(errors(debug({"model": {"kv_heads": 3}})), "model.kv_heads", "heads (8) not divisible by kv_heads (3)")
    assert p.hint == "use kv_heads in {1, 2, 4, 8}"


def test_odd_head_dim():
    p = find(errors(debug({"model": {"hidden": 120}})), "model.head_dim", "head_dim (15) is odd", "RoPE")
    assert "even quotient" in p.hint
    find(errors(debug({"model": {"head_dim": 15}})), "model.head_dim", "head_dim (15) is odd")


def _runs_under_every_cp_method(model: dict) -> None:
    """``model`` valid without CP and at cp 2 under Ulysses, all-gather and ring CP (the ring refused
    masks and the soft-cap until the forty-first session)."""
    assert plan_of(debug({"model": model})).valid
    for method in ("ulysses", "allgather", "ring"):
        assert plan_of(debug({"model": model, "parallel": {"cp": 2, "cp_method": method}}), gpus=2).valid, method


def test_sliding_window_shorter_than_seq_len_runs_under_every_cp_method():
    """A sliding window shorter than the sequence is a band mask: without CP, in Ulysses' own attention
    (whole sequences), in all-gather's (its rows of it) and in the ring's blocks (views of those rows)."""
    _runs_under_every_cp_method({"sliding_window": 64})


def test_qk_norms_over_all_heads_need_qk_norm_and_no_offset():
    """OLMo 2's q/k norms span every head (model.qk_norm_width all): they need qk_norm, run under TP
    (engine/models/norm.py SplitRMSNorm), and refuse Gemma's offset norms, which no family combines."""
    find(errors(debug({"model": {"qk_norm_width": "all"}})), "model.qk_norm_width", "model.qk_norm is false")
    olmo = {"model": {"qk_norm": True, "qk_norm_width": "all", "pre_norms": False, "post_norms": True}}
    for sp in (True, False):  # SP refused until the thirty-eighth session found the post norms' missing TP sum
        assert plan_of(debug({**olmo, "parallel": {"tp": 2, "sequence_parallel": sp}})).valid
    offset = {"model": {**olmo["model"], "norm_offset": True}}
    p = find(errors(debug(offset)), "model.qk_norm_width", "offset norms")
    assert p.hint == "set model.qk_norm_width: head, or model.norm_offset: false"


def test_nope_layers_must_exist():
    p = find(errors(debug({"model": {"nope_layers": [1, 4, 9]}})), "model.nope_layers", "layers [4, 9] do not exist")
    assert p.hint == "use layer indices 0..3"
    assert plan_of(debug({"model": {"nope_layers": [3]}})).valid


def test_soft_capped_attention_runs_under_every_cp_method():
    """model.attention_softcap (Gemma 2) is the engine's own kernel: alone, in Ulysses' and all-gather's
    attention, and as the ring's blocks."""
    _runs_under_every_cp_method({"attention_softcap": 50.0})


def test_longrope_factor_counts_and_any_length():
    """longrope needs head_dim / 2 short and long factors (debug-dense: head_dim 16, 8 pairs); a
    train.seq_len past original_max_seq_len is the long factors' regime, not a refusal."""
    rope = {"type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8, "original_max_seq_len": 128}
    for original in (128, 64):
        assert not [e for e in errors(debug({"model": {"rope_scaling": {**rope, "original_max_seq_len": original}}}))
                    if e.path.startswith("model.rope")]
    find(errors(debug({"model": {"rope_scaling": {**rope, "short_factor": [1.0] * 3}}})),
         "model.rope_scaling.short_factor", "3 factors; RoPE has head_dim / 2 = 8")
    find(errors(debug({"model": {"rope_scaling": {**rope, "long_factor": [1.0] * 9}}})),
         "model.rope_scaling.long_factor", "9 factors; RoPE has head_dim / 2 = 8")


def test_rotary_dim_even_and_within_the_head():
    """Partial rotary turns pairs of a head's first rotary_dim features (debug-dense: head_dim 16)."""
    assert not [e for e in errors(debug({"model": {"rotary_dim": 12}})) if e.path == "model.rotary_dim"]
    for bad in (11, 18):
        find(errors(debug({"model": {"rotary_dim": bad}})), "model.rotary_dim", f"rotary_dim ({bad}) must be even")


def test_seq_len_exceeds_max_seq_len():
    p = find(errors(debug({"train": {"seq_len": 1024}})), "train.seq_len", "seq_len (1024) exceeds model.max_seq_len (512)")
    assert p.hint == "use seq_len <= 512 or raise model.max_seq_len"


# -- context parallelism and sequence splits -----------------------------------------------------

def test_ring_seq_len_divisible_by_2cp():
    p = find(errors(debug({"parallel": {"cp": 4}, "train": {"seq_len": 100}})), "train.seq_len",
             "seq_len (100) not divisible by 2 x cp for load-balanced ring attention = 8")
    assert p.hint == "use a seq_len that is a multiple of 8"
    assert plan_of(debug({"parallel": {"cp": 4}, "train": {"seq_len": 104}})).valid


def test_allgather_seq_len_divisible_by_2cp():
    # all-gather CP shards zigzag like the ring (Llama 3's 2 x cp chunks, engine/parallel/context.py):
    # 105 is a multiple of cp = 3 (enough for the old contiguous shards) but not of 6
    data = debug({"parallel": {"cp": 3, "cp_method": "allgather"}, "train": {"seq_len": 105}})
    p = find(errors(data, gpus=6), "train.seq_len",
             "seq_len (105) not divisible by 2 x cp for load-balanced allgather attention = 6")
    assert p.hint == "use a seq_len that is a multiple of 6" and "\n" not in p.message
    assert plan_of(debug({"parallel": {"cp": 3, "cp_method": "allgather"}, "train": {"seq_len": 108}}), gpus=6).valid


@pytest.mark.parametrize("method, need, bad", [("ring", 4, 6), ("allgather", 4, 6), ("ulysses", 2, 7)])
def test_eval_seq_len_divisible_like_training(method, need, bad):
    # llmtrain eval's own copy of the rule (engine/eval_main.py names --seq-len): 6 is a multiple
    # of cp = 2 but not of the zigzag methods' 2 x cp = 4
    from llmtrain.engine.eval_main import eval_recipe
    from llmtrain.errors import LLMTrainError
    from llmtrain.recipe.load import validate_recipe_dict

    model = validate_recipe_dict(debug()).model
    sets = ["parallel.cp=2", f"parallel.cp_method={method}"]
    assert eval_recipe(model, 8 * need, 1, sets).parallel.cp_method == method
    with pytest.raises(LLMTrainError) as info:
        eval_recipe(model, bad, 1, sets)
    (problem,) = info.value.problems
    assert problem.path == "--seq-len" and problem.hint == f"use a --seq-len that is a multiple of {need}"
    assert problem.message == f"--seq-len {bad}: parallel.cp=2 ({method}) shards each window in {need} equal chunks"


@pytest.mark.parametrize("method, cp, seq_len, gpus", [("ulysses", 2, 101, 8)])
def test_other_cp_methods_need_seq_len_divisible_by_cp(method, cp, seq_len, gpus):
    data = debug({"parallel": {"cp": cp, "cp_method": method}, "train": {"seq_len": seq_len}})
    p = find(errors(data, gpus=gpus), "train.seq_len", f"seq_len ({seq_len}) not divisible by cp = {cp}")
    assert p.hint == f"use a seq_len that is a multiple of {cp}"


def test_ulysses_heads_divisible_by_tp_times_cp():
    """Ulysses splits the query heads over tp x cp; K/V arrive repeated to the query heads, so kv_heads
    (4 of debug-dense's 8 heads) need not divide tp x cp (tests/test_engine_5d.py cp4_ulysses_kv2 runs it)."""
    errs = errors(debug({"model": {"heads": 4, "kv_heads": 2, "hidden": 128}, "parallel": {"tp": 2, "cp": 4,
                                                                                        "cp_method": "ulysses"}}))
    p = find(errs, "parallel.cp", "ulysses needs heads (4) divisible by tp x cp = 8")
    assert "cp_method ring or allgather" in p.hint
    assert plan_of(debug({"parallel": {"tp": 2, "cp": 4, "cp_method": "ulysses"}})).valid  # kv_heads 4 < 8: fine
    assert plan_of(debug({"parallel": {"tp": 2, "cp": 4}})).valid  # ring has no such rule


def test_sequence_parallel_split():
    data = debug({"parallel": {"tp": 2}, "train": {"seq_len": 129}})
    p = find(errors(data), "train.seq_len", "sequence parallel splits the per-CP-rank sequence (129) over tp (2)")
    assert p.hint == "use a seq_len that is a multiple of cp x tp = 2, or sequence_parallel: false"
    data["parallel"]["sequence_parallel"] = False
    assert plan_of(data).valid


# -- batch math ---------------------------------------------------------------------------------

def test_global_batch_not_a_multiple_of_micro_times_dp():
    data = debug({"train": {"global_batch_size": 20, "micro_batch_size": 2}})
    p = find(errors(data), "train.global_batch_size",
             "global_batch_size (20) is not micro_batch_size x grad_accum x dp",
             "micro_batch_size 2 x dp 8 = 16 does not divide it")
    assert p.hint == "use a global_batch_size that is a multiple of micro_batch_size x dp = 16"


def test_global_batch_hint_lists_micro_batch_sizes():
    data = debug({"train": {"global_batch_size": 24, "micro_batch_size": 2}})
    p = find(errors(data), "train.global_batch_size", "global_batch_size (24)", "= 16 does not divide it")
    assert p.hint == "use micro_batch_size in {1, 3}"
    data["train"]["micro_batch_size"] = 3
    batch = plan_of(data).validation.batch
    assert (batch.dp, batch.micro_batch_size, batch.grad_accum, batch.tokens_per_step) == (8, 3, 1, 24 * 128)


def test_microbatches_at_least_pp():
    data = debug({"parallel": {"pp": 4}, "train": {"global_batch_size": 4}})
    p = find(errors(data), "train.global_batch_size", "2 microbatches per step but 1f1b with pp 4 needs >= 4")
    assert p.hint == "raise global_batch_size to >= 8 or lower micro_batch_size"


def test_dualpipev_needs_twice_pp_microbatches():
    data = debug({"parallel": {"pp": 2, "pp_schedule": "dualpipev", "pp_virtual_stages": 2},
                  "train": {"global_batch_size": 12}})
    p = find(errors(data), "train.global_batch_size", "3 microbatches per step but dualpipev with pp 2 needs >= 4")
    assert p.hint == "raise global_batch_size to >= 16 or lower micro_batch_size"


@pytest.mark.parametrize("schedule", ["interleaved-1f1b", "zero-bubble"])
def test_interleaved_microbatches_divisible_by_pp(schedule):
    data = debug({"parallel": {"pp": 2, "pp_schedule": schedule, "pp_virtual_stages": 2},
                  "train": {"global_batch_size": 12}})
    p = find(errors(data), "train.global_batch_size", f"{schedule} needs microbatches (3) divisible by pp (2)")
    assert p.hint == "use global_batch_size = k x 8"


def test_large_bubble_warns():
    data = debug({"parallel": {"pp": 4}, "train": {"global_batch_size": 8}})
    plan = plan_of(data)
    assert plan.valid
    p = find(plan.validation.warnings, "parallel.pp", "pipeline bubble is 75% of the step (4 microbatches for pp 4, 1f1b)")
    assert "raise global_batch_size" in p.hint and p.hint.endswith("or use an interleaved schedule")
    # already interleaved: the way out is more virtual stages, not "use an interleaved schedule"
    inter = debug({"parallel": {"pp": 2, "pp_schedule": "interleaved-1f1b", "pp_virtual_stages": 2},
                   "train": {"global_batch_size": 16, "micro_batch_size": 2}})
    p = find(warnings(inter), "parallel.pp", "pipeline bubble is 25% of the step (2 microbatches for pp 2, interleaved-1f1b)")
    assert p.hint.endswith("or raise parallel.pp_virtual_stages (now 2)") and "interleaved schedule" not in p.hint
    data["train"]["global_batch_size"] = 64  # 32 microbatches: bubble 3/32 < 20%
    assert not [w for w in warnings(data) if w.path == "parallel.pp"]


def test_zero_with_dp_1_warns():
    data = debug({"parallel": {"tp": 2, "zero": 3}})
    p = find(warnings(data, gpus=2), "parallel.zero", "zero 3 shards over data parallelism, but dp is 1")
    assert p.hint == "set zero: 0"
    data["parallel"]["zero"] = 0
    assert not warnings(data, gpus=2)


def test_zero3_with_pp_warns():
    data = debug({"parallel": {"pp": 2, "zero": 3}, "train": {"global_batch_size": 32}})
    plan = plan_of(data)
    assert plan.valid
    p = find(plan.validation.warnings, "parallel.zero", "with pp > 1 parameters are not resharded after forward")
    assert "zero: 2" in p.hint


# -- data and schedule -------------------------------------------------------------------------------

def test_memmap_needs_path():
    p = find(errors(debug({"data": {"source": "memmap"}})), "data.path", "source memmap needs a path")
    assert "llmtrain data prepare" in p.hint
    assert plan_of(debug({"data": {"source": "memmap", "path": "/data/x"}})).valid


def test_warmup_longer_than_run_warns():
    plan = plan_of(debug({"train": {"steps": 10, "schedule": {"warmup_steps": 20}}}))
    assert plan.valid
    p = find(plan.validation.warnings, "train.schedule.warmup_steps", "warmup (20) is longer than the run (10 steps)")
    assert p.hint == "shorten the warmup"


# -- all at once -----------------------------------------------------------------------------------

def test_all_problems_reported_together():
    data = debug({
        "model": {"kv_heads": 3},
        "parallel": {"ep": 2, "pp": 2, "pp_schedule": "gpipe", "pp_virtual_stages": 2},
        "train": {"seq_len": 1024},
        "data": {"source": "memmap"},
    })
    plan = plan_of(data)
    got = paths(plan.validation.errors)
    for expected in ("model.kv_heads", "parallel.ep", "parallel.pp_virtual_stages", "train.seq_len", "data.path"):
        assert expected in got, got
    assert not plan.valid and plan.validation.dims is None
    assert all(e.path and e.message and e.hint for e in plan.validation.errors)


def test_eval_interval_needs_eval_path_and_runs_with_pp_and_cp():
    """Periodic held-out eval is checked by plan (before anything starts), not first in the engine;
    it runs with pipeline and context parallelism (tests/test_eval_layouts.py), so plan accepts both."""
    find(errors(debug({"train": {"eval_interval": 2}})), "data.eval_path", "data.eval_path is not set")
    for layout in ({"pp": 2}, {"cp": 2}):
        got = errors(debug({"train": {"eval_interval": 2}, "data": {"eval_path": "x.txt"}, "parallel": layout,
                            "cluster": {"gpus_per_node": 2}}))
        assert not [e for e in got if e.path in ("train.eval_interval", "data.eval_path")], (layout, got)
    assert not [e for e in errors(debug({"train": {"eval_interval": 2}, "data": {"eval_path": "x.txt"}}))
                if e.path in ("train.eval_interval", "data.eval_path")]
