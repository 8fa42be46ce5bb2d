"""``plan --search``: only valid layouts that fit, ranked by modeled step time; pruning loses nothing.

Timing is asserted loosely (the real number, measured on an idle machine, is in docs/planner.md);
the search's own clock is reported in its JSON, so the check does not depend on process start-up.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from llmtrain.plan.api import make_plan
from llmtrain.plan.costmodel import estimate
from llmtrain.plan.search import balanced_split, search
from llmtrain.plan.validate import validate
from tests.helpers_plan import CLI, REPO


def _apply(recipe, choice):
    par = {k.split(".", 1)[1]: v for k, v in choice.overrides.items() if k.startswith("parallel.")}
    train = {k.split(".", 1)[1]: v for k, v in choice.overrides.items() if k.startswith("train.")}
    train["global_batch_size"] = choice.batch.global_batch_size
    return recipe.model_copy(update={"parallel": recipe.parallel.model_copy(update=par),
                                     "train": recipe.train.model_copy(update=train)})


def _check_valid_and_fitting(plan, result):
    assert result.top, "nothing found"
    for choice in result.top:
        variant = _apply(plan.recipe, choice)
        v = validate(variant, plan.placement)
        assert v.valid, [e.line() for e in v.errors]
        cost = estimate(variant, v.dims, v.batch, plan.placement, hints=False)  # every pipeline rank, exact
        assert cost.fits and cost.time.step_s == pytest.approx(choice.cost.time.step_s)
        t = plan.recipe.train  # the same global batch (the recipe's own layout need not be valid)
        assert v.batch.tokens_per_step == t.global_batch_size * t.seq_len
    steps = [c.cost.time.step_s for c in result.top]
    assert steps == sorted(steps)


def test_llama3_405b_on_16384_gpus_is_fast_valid_and_fits():
    plan = make_plan(REPO / "recipes/llama3-405b.yaml")
    assert plan.placement.world_size == 16384
    result = search(plan.recipe, plan.placement, top=5)
    # CPU time, not wall clock: on the shared 2-core VM neighbours can slow the wall clock 10x.
    assert result.cpu_seconds < 10, result.cpu_seconds  # ~0.8 s (docs/planner.md)
    assert len(result.top) == 5 and result.rejected_memory > 0
    _check_valid_and_fitting(plan, result)
    # the recipe itself (ZeRO-1, selective recompute) fits since the TP embedding's gradient is kept in its
    # rows (engine/parallel/tensor.py): pp rank 0 planned 75.5 -> 68.3 GiB, below the middle ranks' 73.7
    cost = estimate(plan.recipe, plan.validation.dims, plan.validation.batch, plan.placement, hints=False)
    assert cost.fits and cost.worst.pp_rank != 0


def test_a_windowed_model_searches_ring_context_parallel_layouts():
    """Mistral-7B v0.1 (window 4,096) at 32,768 tokens on 64 GPUs: the recipe's ring CP takes the band (its
    blocks views of the rank's rows, since the forty-first session; before, the search swapped in Ulysses and
    all-gather); its CP layouts are valid and fit. Since the forty-second session the windowed layers run only
    their score boxes without CP too (plan/localwindow.py), about a quarter of the dense band's scores, so TP x
    DP layouts lead (tp 2, 4.10 s/step) and the first ring layout is #58 (4.86 s; it led at 4.89 s when the
    layers without CP ran the dense band)."""
    plan = make_plan(REPO / "recipes/llama3-8b.yaml", overrides=["model.preset=mistral-7b-v0.1", "train.seq_len=32768",
                                                                  "train.global_batch_size=64"])
    result = search(plan.recipe, plan.placement, top=80)
    _check_valid_and_fitting(plan, result)
    assert result.top[0].overrides["parallel.cp"] == 1
    cps = [c.overrides for c in result.top if c.overrides["parallel.cp"] > 1]
    assert cps and all(o.get("parallel.cp_method", "ring") == "ring" for o in cps)


@pytest.mark.parametrize("overrides, top", [
    (["model.preset=gemma2-9b", "train.seq_len=4096"], 100),  # within its window: the cap alone decides
    (["data.source=text", "data.path=t.txt", "data.packing=true", "train.seq_len=32768"], 100),  # packed rows
    # 128K-token packed rows on 128 GPUs: tp 2 x cp 32 and tp 4 x cp 16 exceed Llama 3 8B's 32 heads
    (["data.source=text", "data.path=t.txt", "data.packing=true", "train.seq_len=131072", "cluster.nodes=16"], 30),
])
def test_masked_models_search_ring_context_parallel_layouts(overrides, top):
    """Gemma 2 9B's soft-capped attention and packed rows under the recipe's ring CP: the search returns
    CP layouts, all valid and fitting. At 128K tokens on 128 GPUs they are among the first 30."""
    plan = make_plan(REPO / "recipes/llama3-8b.yaml", overrides=overrides + ["train.global_batch_size=64"])
    result = search(plan.recipe, plan.placement, top=top)
    _check_valid_and_fitting(plan, result)
    cps = [c.overrides for c in result.top if c.overrides["parallel.cp"] > 1]
    assert cps and all(o.get("parallel.cp_method", "ring") == "ring" for o in cps)


# debug-moe on 4 nodes of 2: expert groups that leave the node (search_bounds.ep_floor's NIC term)
@pytest.mark.parametrize("recipe, nodes, gpus", [("recipes/llama3-8b.yaml", 2, 8), ("recipes/debug-moe.yaml", 1, 8),
                                                 ("recipes/debug-moe.yaml", 4, 2)])
def test_pruned_search_finds_the_exhaustive_optimum(recipe, nodes, gpus):
    plan = make_plan(REPO / recipe, None, nodes, gpus)
    fast = search(plan.recipe, plan.placement, top=3)
    full = search(plan.recipe, plan.placement, top=3, exhaustive=True)
    assert full.layouts_evaluated > fast.layouts_evaluated
    assert [round(c.cost.time.step_s, 9) for c in fast.top] == [round(c.cost.time.step_s, 9) for c in full.top]
    _check_valid_and_fitting(plan, fast)


def test_step_floor_stays_below_the_priced_step_of_expert_layouts_inside_and_across_nodes():
    """Branch and bound prunes a split once its floor (search_bounds.StepFloor: compute, TP and EP
    communication, times the bubble) reaches the K-th best step: the floor must stay under the step
    time estimate prices for every layout of the split, or pruning may drop the fastest. DeepSeek-V3's
    shipped cluster (2,048 H100, 8 per node) over TP x EP x pipeline layouts whose expert groups stay in
    a node (tp x ep <= 8) and leave it (the NIC term), at the least and the most micro batches."""
    from llmtrain.plan.bubble import bubble_fraction  # noqa: PLC0415
    from llmtrain.plan.search_bounds import StepFloor, make_variant  # noqa: PLC0415

    plan = make_plan(REPO / "recipes/deepseek-v3.yaml")
    gbs = plan.recipe.train.global_batch_size
    floors = StepFloor.of(plan.recipe, plan.placement, gbs)
    across, tightest = 0, 0.0
    for tp, ep, pp, schedule, v in [(1, 8, 16, "1f1b", 1), (1, 64, 16, "dualpipev", 2), (1, 256, 8, "1f1b", 1),
                                    (2, 2, 16, "1f1b", 1), (2, 32, 16, "interleaved-1f1b", 2),  # 240 / mb micro batches
                                    (8, 2, 16, "1f1b", 1), (8, 8, 32, "1f1b", 1), (4, 8, 16, "dualpipev", 2)]:
        dp = plan.placement.world_size // (tp * pp)
        split = balanced_split(plan.recipe.model.layers, pp * v)
        for mb in (1, 3) if schedule == "interleaved-1f1b" else (1, 2):
            variant = make_variant(plan.recipe, dict(tp=tp, ep=ep, pp=pp, pp_schedule=schedule, pp_virtual_stages=v,
                                                     pp_layers_per_stage=split, zero=1, dp_shard=dp, cp=1),
                                   dict(micro_batch_size=mb, activation_checkpointing="full"))
            val = validate(variant, plan.placement)
            assert val.valid, [e.line() for e in val.errors]
            step = estimate(variant, val.dims, val.batch, plan.placement, fast=True, hints=False).time.step_s
            floor = (floors.compute_and_tp(tp, 1, pp, dp) + floors.ep(tp, 1, pp, dp, ep)) * (
                1 + bubble_fraction(schedule, pp, v, val.batch.microbatches))
            assert floor <= step, (tp, ep, pp, schedule, mb, floor, step)
            across += (ep - 1) * tp >= 8
            tightest = max(tightest, floor / step)
    assert across >= 8 and tightest > 0.5  # layouts across nodes were checked; the floor is not vacuous


def test_deepseek_v3_search_prunes_the_splits_whose_experts_talk_across_nodes():
    """The EP floor's NIC term lets the bound discard DeepSeek-V3's splits that send their tokens
    over the network. Before it the floor priced every all-to-all over NVLink, 10-15x below what a
    group leaving the node costs, and the search priced 984 of its 1,183 splits (26 s); since, 420
    (3.7 s; docs/planning-speed.md). The same five layouts first, before and after."""
    plan = make_plan(REPO / "recipes/deepseek-v3.yaml")
    result = search(plan.recipe, plan.placement, top=5)
    assert result.splits == 1183 and result.splits_evaluated <= 500, result.splits_evaluated
    assert [round(c.cost.time.step_s, 2) for c in result.top] == [24.82, 24.82, 25.3, 25.93, 27.1]
    _check_valid_and_fitting(plan, result)


def test_balanced_split_puts_extra_layers_in_the_middle():
    assert balanced_split(126, 32) == [3] + [4] * 30 + [3]
    assert balanced_split(64, 16) is None
    assert sum(balanced_split(61, 32)) == 61


def test_cli_search_text_and_json():
    out = subprocess.run([*CLI, "plan", "recipes/llama3-70b.yaml", "--search", "--top", "2"], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "llmtrain plan --search llama3-70b: 512 GPUs" in out.stdout
    assert " 1 " in out.stdout and "why: fastest" in out.stdout and "--set parallel.tp=" in out.stdout
    js = subprocess.run([*CLI, "plan", "recipes/llama3-70b.yaml", "--search", "--top", "2", "--json"], cwd=REPO,
                        capture_output=True, text=True, timeout=120)
    d = json.loads(js.stdout)
    assert len(d["top"]) == 2 and d["top"][0]["step_s"] <= d["top"][1]["step_s"]
    assert {"set", "step_s", "tokens_per_s_per_gpu", "tflops_per_gpu", "mfu", "peak_gib", "reason"} <= set(d["top"][0])


def test_cli_search_reports_when_nothing_fits(tmp_path):
    path = tmp_path / "huge.yaml"
    path.write_text("model: {preset: llama3-405b}\ntrain: {seq_len: 8192, global_batch_size: 8}\n"
                    "cluster: {nodes: 1, gpus_per_node: 8, gpu: h100-sxm}\n")
    out = subprocess.run([*CLI, "plan", str(path), "--search"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "no layout fits" in out.stdout


def _layout_of(choice, keys):
    return {k: choice.overrides[k] for k in keys}


def test_keep_searches_only_those_layouts_and_pruning_still_loses_nothing():
    """--keep is the same search over a subset: its top equals the exhaustive search's order filtered
    to the kept values (the bounds stay lower bounds on any subset)."""
    plan = make_plan(REPO / "recipes/llama3-8b.yaml", None, 2, 8)
    keep = {"parallel.zero": 0, "parallel.tp": 2}
    fast = search(plan.recipe, plan.placement, top=3, keep=keep)
    assert fast.top and fast.kept == keep
    assert all(_layout_of(c, keep) == keep for c in fast.top)
    _check_valid_and_fitting(plan, fast)
    everything = search(plan.recipe, plan.placement, top=10_000, exhaustive=True)
    kept = [c for c in everything.top if _layout_of(c, keep) == keep]
    assert len(kept) > 3 and len(kept) < len(everything.top)
    assert [round(c.cost.time.step_s, 9) for c in fast.top] == [round(c.cost.time.step_s, 9) for c in kept[:3]]


def test_keep_a_recomputation_mode_and_micro_batch_the_ladder_does_not_try():
    plan = make_plan(REPO / "recipes/llama3-8b.yaml", None, 2, 8)
    keep = {"train.activation_checkpointing": "selective_mm", "train.micro_batch_size": 1, "parallel.pp": 2,
            "parallel.pp_schedule": "interleaved-1f1b", "parallel.pp_virtual_stages": 2}
    res = search(plan.recipe, plan.placement, top=3, keep=keep)
    assert res.top and all(_layout_of(c, keep) == keep for c in res.top)
    _check_valid_and_fitting(plan, res)
    no_sp = {"parallel.sequence_parallel": False, "parallel.tp": 2}  # a stack without sequence parallelism
    res = search(plan.recipe, plan.placement, top=3, keep=no_sp)
    assert res.top and all(_layout_of(c, no_sp) == no_sp for c in res.top)
    _check_valid_and_fitting(plan, res)


def test_split_backward_schedules_are_searched_without_selective_recomputation():
    """zero-bubble, zbv and dualpipev refuse selective recomputation (plan/validate.py): the search
    prices them with none or full (from a recipe that says selective), and a kept selective finds none."""
    plan = make_plan(REPO / "recipes/llama3-8b.yaml", None, 2, 8)
    assert plan.recipe.train.activation_checkpointing == "selective"
    for schedule in ("zero-bubble", "zbv"):
        keep = {"parallel.pp_schedule": schedule}
        res = search(plan.recipe, plan.placement, top=5, keep=keep)
        assert res.top and {c.overrides["train.activation_checkpointing"] for c in res.top} <= {"none", "full"}
        _check_valid_and_fitting(plan, res)
        keep["train.activation_checkpointing"] = "selective"
        assert not search(plan.recipe, plan.placement, top=5, keep=keep).top


def test_keep_equal_stages_drops_the_uneven_pipelines_and_pruning_still_loses_nothing():
    """A stack that cannot split layers unevenly (Megatron-LM 2021): 30 layers on pp 2 leave 1F1B (15 + 15)
    and drop every interleaved v (30 / 4, / 8, / 16); the kept top is the exhaustive order filtered."""
    plan = make_plan(REPO / "recipes/llama3-8b.yaml", None, 2, 8)
    recipe = plan.recipe.model_copy(update={"model": plan.recipe.model.model_copy(update={"layers": 30})})
    pp2 = {"parallel.pp": 2, "parallel.zero": 1}
    everything = search(recipe, plan.placement, top=10_000, exhaustive=True, keep=pp2)
    uneven = [c for c in everything.top if c.overrides["parallel.pp_layers_per_stage"] is not None]
    assert uneven and all(c.overrides["parallel.pp_schedule"] == "interleaved-1f1b" for c in uneven)
    keep = pp2 | {"parallel.pp_layers_per_stage": None}
    fast = search(recipe, plan.placement, top=3, keep=keep)
    assert fast.top and all(c.overrides["parallel.pp_layers_per_stage"] is None and c.overrides["parallel.pp_virtual_stages"] == 1
                            for c in fast.top)
    even = [c for c in everything.top if c.overrides["parallel.pp_layers_per_stage"] is None]
    assert [round(c.cost.time.step_s, 9) for c in fast.top] == [round(c.cost.time.step_s, 9) for c in even[:3]]


def test_search_offers_chunks_with_only_the_embedding_or_only_the_output():
    """Up to layers + 2 stages (search.max_stages): 14 layers on pp 2 reach interleaved v 8 (16 chunks),
    the first chunk holding only the embedding and the last only the output, as Llama 3 405B's 126
    layers in 16 x 8 chunks; before, v 8 needed 16 layers. Every such layout validates and is priced
    exactly (_check_valid_and_fitting)."""
    assert balanced_split(126, 128) == [0] + [1] * 126 + [0]
    assert balanced_split(126, 64) == [1] + [2] * 62 + [1]  # Megatron-Core's account_for_* split: (126 + 2) / 64
    plan = make_plan(REPO / "recipes/llama3-8b.yaml", None, 2, 8, ["model.layers=14"])
    keep = {"parallel.pp": 2, "parallel.zero": 1, "parallel.pp_virtual_stages": 8}
    res = search(plan.recipe, plan.placement, top=3, keep=keep)
    assert res.top and all(c.overrides["parallel.pp_layers_per_stage"] == [0] + [1] * 14 + [0] for c in res.top)
    _check_valid_and_fitting(plan, res)


def test_parse_keep_takes_the_recipes_value_and_rejects_what_the_search_does_not_choose():
    from llmtrain.errors import LLMTrainError
    from llmtrain.plan.search_keep import parse_keep

    recipe = make_plan(REPO / "recipes/llama3-8b.yaml").recipe
    assert parse_keep(["parallel.zero", "parallel.tp=4", "parallel.pp_schedule=gpipe"], recipe) == {
        "parallel.zero": recipe.parallel.zero, "parallel.tp": 4, "parallel.pp_schedule": "gpipe"}
    for bad, said in (("model.layers=2", "not a key the search chooses"), ("parallel.zero=4", "between 0 and 3"),
                      ("parallel.tp=two", "integer >= 1"), ("parallel.cp=true", "integer >= 1"),
                      ("train.activation_checkpointing=most", "not one of none, selective, selective_mm, full"),
                      ("parallel.sequence_parallel=maybe", "not true or false")):
        with pytest.raises(LLMTrainError) as err:
            parse_keep([bad], recipe)
        assert str(err.value).startswith("--keep: ") and said in str(err.value), str(err.value)
    even = {"parallel.pp_layers_per_stage": None}
    assert parse_keep(["parallel.pp_layers_per_stage"], recipe) == even == parse_keep(["parallel.pp_layers_per_stage=even"], recipe)
    with pytest.raises(LLMTrainError, match=r"^--keep: parallel.pp_layers_per_stage=\[8, 8\] cannot be kept: only equal "
                                            r"stages can; keep those with --keep parallel.pp_layers_per_stage=even$"):
        parse_keep(["parallel.pp_layers_per_stage=[8, 8]"], recipe)
    with pytest.raises(LLMTrainError, match="kept twice"):
        parse_keep(["parallel.tp=2", "parallel.tp=4"], recipe)


def test_cli_keep():
    js = subprocess.run([*CLI, "plan", "recipes/llama3-70b.yaml", "--search", "--top", "3", "--json", "--keep",
                         "parallel.zero=0", "--keep", "parallel.tp=8"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert js.returncode == 0, js.stderr
    d = json.loads(js.stdout)
    assert d["kept"] == {"parallel.zero": 0, "parallel.tp": 8} and len(d["top"]) == 3
    assert all(c["set"]["parallel.zero"] == 0 and c["set"]["parallel.tp"] == 8 for c in d["top"])
    text = subprocess.run([*CLI, "plan", "recipes/llama3-70b.yaml", "--search", "--top", "1", "--keep", "parallel.zero=0"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert text.returncode == 0 and "only layouts with parallel.zero=0 (--keep)" in text.stdout
    assert "did not fit; time model v2; " in text.stdout.splitlines()[0]  # the default step-time model, named
    for args, said in ((["--keep", "parallel.zero=0"], "--keep: only applies to a layout search; add --search"),
                       (["--search", "--keep", "train.seq_len=2"], "--keep: 'train.seq_len' is not a key the search chooses")):
        out = subprocess.run([*CLI, "plan", "recipes/llama3-70b.yaml", *args], cwd=REPO, capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 2 and said in out.stderr and "Traceback" not in out.stderr, out.stderr
        assert len(out.stderr.strip().splitlines()) == 1, out.stderr
