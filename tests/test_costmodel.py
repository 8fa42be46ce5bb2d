"""The planner's cost model in the plan and against the real engine (the published worked examples
and formulas: tests/test_costmodel_formulas.py).

- The engine on CPU/gloo, in ONE 4-rank torchrun job (tests/costmodel_worker.py): predicted
  parameter, gradient and AdamW bytes per rank must EQUAL the local shard bytes of every rank
  (DDP, ZeRO-1/2/3, HSDP, TP2 +- SP, TP2 x FSDP2, MoE + EP, CP, PP, and LoRA on DDP, ZeRO-1/2/3,
  TP2 and PP2: frozen base, adapters sharded like the engine shards them); predicted activation bytes
  must be within 2% of what is held for backward (the issue asks for 10%; the model is exact up
  to a few scalars, so 2% still catches a missing term such as a norm input, ~4%); with EP,
  whose bytes depend on how the untrained router happens to balance tokens, 10%. LoRA cases
  change which tensors autograd saves (frozen weights save no inputs); they are measured within
  1%, and 2% catches a wrong rule (e.g. keeping the normalized inputs of frozen norms: ~11%, or
  the q/k/v input of every block: ~5%), though not one single tensor of one block (~1.2%).
- FLOPs: predicted hardware FLOPs within 2% of torch's FlopCounterMode for one forward+backward
  (LoRA too: measured within 0.2%, where the full-training formula is 34-58% off).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from llmtrain.plan import activations as act
from llmtrain.plan.api import plan_recipe
from llmtrain.plan.comm import group_spans
from llmtrain.plan.costmodel import act_shape, estimate, rank_memory
from llmtrain.plan.report import plan_to_dict
from llmtrain.recipe.gpus import GPUS
from llmtrain.recipe.load import load_recipe
from tests.costmodel_cases import CASES, COMMON, GEMMA, LORA, MOE  # noqa: F401 (COMMON, MOE: re-exported)
from tests.helpers_plan import REPO, render_text


# ---- the plan carries the cost model ---------------------------------------------------------------
def _plan(path: str, overrides: list[str] | None = None, nodes=None, gpus=None):
    return plan_recipe(load_recipe(REPO / path, overrides), None, nodes, gpus)


@pytest.mark.parametrize("method", ["ring", "allgather"])
def test_selective_cp_blocks_are_planned_per_rank(method):
    """The selective policy keeps every CP kernel block's output + lse; with the zigzag split rank
    ``i`` of the ring keeps ``(cp + 1 + i) / 2`` blocks' worth, all-gather 2 (rank 0: 1.5, its first
    chunk has no prefix). The plan's worst rank keeps the most loaded rank's (measured at cp 2:
    benchmarks/planner_fidelity.py)."""
    overrides = COMMON + ["parallel.cp=4", f"parallel.cp_method={method}", "train.activation_checkpointing=selective"]
    recipe = load_recipe(REPO / "recipes/debug.yaml", overrides)
    plan = plan_recipe(recipe, None, 1, 4)
    v = plan.validation
    blocks = [rank_memory(recipe, v.dims, v.batch, 0, i).saved_detail for i in range(4)]
    key = "ring_saved_blocks" if method == "ring" else "attn_out"
    per_rank = [d[key] for d in blocks]
    unit = per_rank[-1] / (4 if method == "ring" else 2)
    expect = [2.5, 3, 3.5, 4] if method == "ring" else [1.5, 2, 2, 2]
    assert [b / unit for b in per_rank] == expect
    assert rank_memory(recipe, v.dims, v.batch, 0).saved_detail[key] == per_rank[-1]


def test_plan_json_has_cost_keys_and_consistent_numbers():
    d = plan_to_dict(_plan("recipes/llama3-70b.yaml"))
    mem, t = d["memory"], d["time"]
    assert set(mem["breakdown_gib"]) == {"params", "grads", "optimizer", "activations", "other"}
    assert sum(mem["breakdown_gib"].values()) == pytest.approx(mem["peak_gib"], abs=1e-4)
    assert len(mem["per_rank"]) == d["parallel"]["pp"] and max(r["peak_gib"] for r in mem["per_rank"]) == mem["peak_gib"]
    assert mem["fits"] == (mem["peak_gib"] <= mem["capacity_gib"])
    assert d["bubble_fraction"] == d["pipeline"]["bubble_fraction"]
    assert {"step_s", "tokens_per_s_per_gpu", "tflops_per_gpu", "mfu", "breakdown_s"} <= set(t)
    assert t["step_s"] == pytest.approx(sum(t["breakdown_s"].values()))
    tokens = d["batch"]["tokens_per_step"]
    assert t["tokens_per_s_per_gpu"] == pytest.approx(tokens / t["step_s"] / d["world_size"])
    assert t["mfu"] == pytest.approx(d["flops"]["model_flops_per_gpu_per_step"] / t["step_s"] / 989e12)
    assert 0.2 < t["mfu"] < 0.6
    dims = {c["dim"] for c in d["comm"]}
    assert {"dp", "tp", "pp"} <= dims
    links = {c["dim"]: c["link"] for c in d["comm"]}
    assert links["tp"] == "nvlink" and links["pp"] == "network"


def test_invalid_plan_has_null_cost_keys():
    d = plan_to_dict(_plan("recipes/debug.yaml", ["parallel.tp=3"]))
    assert not d["valid"] and all(d[k] is None for k in ("memory", "flops", "comm", "bubble_fraction", "time"))


def test_text_shows_memory_time_and_mfu_and_what_to_change():
    # the recipe fits with its selective recomputation (73.7 GiB since the TP embedding's gradient is kept in
    # its rows); without recomputation it does not, and the hints name both recomputation modes
    text = render_text(plan_to_dict(_plan("recipes/llama3-405b.yaml", ["train.activation_checkpointing=none"])))
    assert "Memory peak" in text and "does not fit" in text and "MFU" in text and "tokens/s/GPU" in text
    assert "to fit: --set" in text and "--set train.activation_checkpointing=full ->" in text
    assert "Communication per step" in text and "nvlink" in text and "network" in text


def test_link_detection_fast_path_agrees_with_groups():
    for path, nodes, gpus in (("recipes/llama3-405b.yaml", None, None), ("recipes/mixtral-8x7b.yaml", None, None),
                              ("recipes/llama3-8b-128k.yaml", None, None), ("recipes/debug.yaml", 2, 2)):
        plan = _plan(path, None, nodes, gpus)
        dims = plan.validation.dims
        assert group_spans(dims, plan.placement) == group_spans(dims, plan.placement, fast=True)


def test_fp32_bf16_and_recompute_move_memory_the_right_way():
    plan = _plan("recipes/llama3-8b.yaml", ["train.global_batch_size=64"])
    v = plan.validation
    peaks = {}
    hw = {}
    for mode in ("none", "selective", "selective_mm", "full"):
        r = plan.recipe.model_copy(update={"train": plan.recipe.train.model_copy(update={"activation_checkpointing": mode})})
        cost = estimate(r, v.dims, v.batch, plan.placement, hints=False)
        peaks[mode], hw[mode] = cost.worst.activations, cost.flops["hardware_flops_per_step"]
    assert peaks["none"] > peaks["selective"] > peaks["selective_mm"] > peaks["full"] > 0
    assert hw["none"] == hw["selective"] < hw["selective_mm"] < hw["full"]


def test_selective_mm_that_does_not_fit_is_told_to_recompute_fully():
    """selective_mm is not on the hints' recomputation ladder (none -> selective -> full): from it the
    next rung is full (plan/hints.py), never selective (more memory)."""
    text = render_text(plan_to_dict(_plan("recipes/llama3-405b.yaml", ["train.activation_checkpointing=selective_mm",
                                                                       "train.seq_len=16384"])))
    assert "does not fit" in text and "--set train.activation_checkpointing=full ->" in text
    assert "activation_checkpointing=selective " not in text and "activation_checkpointing=none" not in text


# ---- the real engine (its cases: tests/costmodel_cases.py) --------------------------------------------


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("costmodel")
    out = tmp / "out.json"
    spec = tmp / "spec.json"
    spec.write_text(json.dumps({"recipe": str(REPO / "recipes/debug.yaml"), "set": COMMON, "out": str(out),
                                "cases": [{"name": k, "set": v} for k, v in CASES.items()]}))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LLMTRAIN_TENSORBOARD": "0", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, str(REPO / "tests/dist_launch.py"), "4",  # torchrun's agent, forked ranks
                           str(REPO / "tests/costmodel_worker.py"), str(spec)], env=env, capture_output=True, text=True,
                          timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return json.loads(out.read_text())


def _predicted(case: str, rank: dict):
    recipe = load_recipe(REPO / "recipes/debug.yaml", COMMON + CASES[case])
    plan = plan_recipe(recipe, None, 1, 4)
    v = plan.validation
    mem = rank_memory(recipe, v.dims, v.batch, rank["coords"]["pp"], rank["dp_cp_index"])
    x = act_shape(recipe, v.dims, GPUS["cpu"])
    saved = sum(val for k, val in mem.saved_detail.items() if k != "recompute_working_set")
    # under autocast (zero 0/1 in bf16) the matmuls' bf16 weight casts are saved too: the planner's
    # weight buffers (the engine's count excludes only the parameters' own storages)
    casts = mem.other_detail["weight_buffers"] if recipe.train.precision == "bf16" and recipe.train.activation_checkpointing == "none" else 0
    return mem, saved + casts, saved + casts + act.logits_bytes(x)


@pytest.mark.parametrize("case", list(CASES))
def test_model_state_bytes_equal_the_engines_shards(engine, case):
    for rank in engine[case]:
        mem, _, _ = _predicted(case, rank)
        got = (rank["params"], rank["grads"], rank["optimizer"])
        assert (mem.params, mem.grads, mem.optimizer) == got, f"{case} rank {rank['rank']}"


@pytest.mark.parametrize("case", [c for c in CASES if not c.startswith("pp")])
def test_activation_bytes_match_what_backward_keeps(engine, case):
    # With EP a rank keeps the tokens routed to ITS experts; the model assumes balanced routing,
    # and an untrained router on 128 tokens is only roughly balanced: the 10 % there.
    tol = 0.10 if "ep" in case else 0.02
    for rank in engine[case]:
        _, saved, held = _predicted(case, rank)
        assert held == pytest.approx(rank["held_after_forward"], rel=tol), \
            f"{case} rank {rank['rank']} (gloo worker threads idle when counted: {rank['comm_idle']})"
        if rank["saved_hooks"] is not None:  # saved_tensors_hooks, without recomputation
            assert saved == pytest.approx(rank["saved_hooks"], rel=tol), f"{case} rank {rank['rank']}"


@pytest.mark.parametrize("case", [c for c in CASES if c.startswith("pp")])
def test_pipelined_activation_peak_matches_the_plan(engine, case):
    """The most bytes autograd holds during one pipelined step (tests/costmodel_worker.py
    ``SavedPeak``: every tensor a forward saves, until its graph node is freed) against the plan
    of that pipeline rank: a micro batch's saved bytes times the schedule's micro batches in flight
    per chunk (plan/inflight.py, itself checked against torch's orders in
    tests/test_pipeline_inflight.py). 1F1B, interleaved, ZBV and zero-bubble, with FSDP, TP,
    LoRA, tied embeddings, full and (twenty-first session, the policy's cache counted too) selective
    and selective_mm recomputation. Counting also what each recomputation stores, the peak stays
    within the plan's saved bytes plus one recomputed block's working set. Before the twentieth session the harness let torch infer the stage
    shapes with a real forward (+36 % on pp rank 0: what it left saved), and zero-bubble / ZBV were
    planned 40 % low / 23 % high on a rank."""
    for rank in engine[case]:
        mem, saved, _ = _predicted(case, rank)
        tol = 0.10 if "ep" in case else 0.02  # EP: balanced routing assumed (test above); measured +1.3 %
        assert saved == pytest.approx(rank["pp_peak_saved"], rel=tol), f"{case} rank {rank['rank']}"
        # with what recomputation stores for its backward too: at most the plan's working set of one
        # recomputed block more (a split backward's weight pass recomputed once per parameter group and
        # kept every recomputation's leftovers: 4.8x this bound on zero-bubble, engine/parallel/pipeline.py)
        bound = saved + mem.saved_detail.get("recompute_working_set", 0)
        assert rank["pp_peak_all"] <= (1 + tol) * bound, f"{case} rank {rank['rank']}: {rank['pp_peak_all']} > {bound}"


def test_engine_cases_are_not_trivial(engine):
    """Guards the comparison: shards really differ between layouts (the test could not pass by accident)."""
    params = {case: engine[case][0]["params"] for case in ("ddp", "zero3", "hsdp", "tp2")}
    assert len(set(params.values())) == 4
    opt = [r["optimizer"] for r in engine["zero1"]]
    assert len(set(opt)) > 1  # the greedy ZeRO-1 partition is uneven, and predicted rank by rank
    # LoRA: the frozen base is stored (more parameter bytes than full training: + adapters) but
    # has no gradients or AdamW states (under 5 % of the base's)
    lora, full = engine["lora_ddp"][0], engine["ddp"][0]
    assert lora["params"] > full["params"] and lora["grads"] < 0.05 * full["grads"]
    assert lora["optimizer"] < 0.05 * full["optimizer"]
    assert engine["lora_zero3_qv"][0]["grads"] < engine["lora_zero2"][0]["grads"]  # fewer targets, fewer gradients


# ---- FLOPs against torch's counter ----------------------------------------------------------------------
@pytest.mark.parametrize("preset, recompute, lora", [
    ("debug-dense", "none", None), ("debug-dense", "full", None), ("debug-moe", "selective", None),
    ("debug-moe", "full", None),
    # LoRA: frozen weights run no weight gradient; block 0 (frozen embedding below it) and
    # partial targets leave some input gradients out, and the counter sees exactly which
    ("debug-dense", "none", "all-linear"), ("debug-dense", "full", "[wq,wv]"), ("debug-dense", "none", "[w1]"),
    ("debug-dense", "full", "all-linear"),  # an adapter on w2: the recomputation re-runs the frozen w2
    ("debug-dense", "selective", "[wo,w2]"),
    # selective_mm re-runs the forward GEMMs of wk, wo (tp 1) and the dense w3 (MoE blocks: none)
    ("debug-dense", "selective_mm", None), ("debug-moe", "selective_mm", None), ("debug-dense", "selective_mm", "all-linear"),
    # MoE under LoRA: full recomputation re-runs the MoE block whole; "experts:" adds train.lora.experts (the
    # routed experts' adapters, as the dense MLP's per routed slot)
    ("debug-moe", "full", "[w1]"), ("debug-moe", "none", "experts:all-linear"), ("debug-moe", "none", "experts:[w2,wq]"),
    ("debug-moe", "full", "experts:[w1]"), ("debug-moe", "selective", "experts:all-linear"),
])
def test_flops_match_flop_counter(preset, recompute, lora):
    torch = pytest.importorskip("torch")
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from llmtrain.engine.models.llama import Transformer
    from llmtrain.engine.parallel.checkpointing import apply_activation_checkpointing
    from llmtrain.plan.flops import block_flops_per_token, head_flops_per_token, recompute_flops_per_token

    from llmtrain.engine.finetune.lora import apply_lora

    lora_set = [] if lora is None else ["train.lora.rank=4", f"train.lora.targets={lora.removeprefix('experts:')}",
                                        f"train.lora.experts={lora.startswith('experts:')}"]
    recipe = load_recipe(REPO / "recipes/debug.yaml", [f"model.preset={preset}", "parallel.tp=1", "train.seq_len=64",
                                                       f"train.activation_checkpointing={recompute}"] + lora_set)
    m, lk = recipe.model, recipe.train.lora
    torch.manual_seed(0)
    model = Transformer(m)
    if lk is not None:
        apply_lora(model, lk)
    for p in model.parameters():
        p.data.normal_(std=0.02)
    apply_activation_checkpointing(model, recompute)
    tokens = torch.randint(0, m.vocab_size, (2, 64))
    counter = FlopCounterMode(display=False)
    # the math backend runs attention as matmuls the counter sees (CPU flash attention is not counted);
    # it computes the full s x s scores, the no-causal-halving convention of the planner
    with sdpa_kernel(SDPBackend.MATH), counter:
        logits = model(tokens)
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten()).backward()
    predicted = head_flops_per_token(m, lk)
    for layer in range(m.layers):
        split, rep = block_flops_per_token(m, layer, 64, lk)
        rs, rr = recompute_flops_per_token(m, layer, 64, recompute, lk)
        predicted += split + rep + rs + rr
    assert counter.get_total_flops() == pytest.approx(predicted * 2 * 64, rel=0.02)


@pytest.mark.parametrize("targets", ["all-linear", "[wq,wv,w2]", "experts:all-linear", "experts:[wo,w3]"])
def test_lora_inventory_names_shapes_and_trainability_match_the_engine(targets):
    """The planner's parameter list under LoRA is the engine's: every name, (single-rank) shape and
    requires_grad flag of ``apply_lora`` on the meta-device model (the multi-rank layouts are
    compared byte for byte above)."""
    torch = pytest.importorskip("torch")
    from llmtrain.engine.finetune.lora import apply_lora
    from llmtrain.engine.models.llama import Transformer
    from llmtrain.plan.shards import lora_key, rank_params

    experts = targets.startswith("experts:")  # train.lora.experts on the MoE preset: the routed experts' stacked adapters
    recipe = load_recipe(REPO / "recipes/debug.yaml", ["parallel.tp=1", "train.lora.rank=4",
                                                       f"train.lora.targets={targets.removeprefix('experts:')}"]
                         + (["model.preset=debug-moe", "train.lora.experts=true"] if experts else []))
    with torch.device("meta"):
        model = Transformer(recipe.model)
    apply_lora(model, recipe.train.lora)
    engine = {n: (tuple(p.shape), p.requires_grad) for n, p in model.named_parameters()}
    plan = {p.name: (p.shape, p.trainable)
            for p in rank_params(recipe.model, [list(range(recipe.model.layers))], [0], 1, 1, lora_key(recipe.train.lora))}
    assert plan == engine
    assert any(trainable for _, trainable in plan.values()) and not all(trainable for _, trainable in plan.values())


def test_selective_mm_recompute_flops_by_tp_and_block_kind():
    """selective_mm's extra hardware FLOPs per token (forward GEMMs re-run, plan/flops.py), by hand:
    wk + wo + w3 at tp 1; under TP wo keeps its saved reduction (not re-run); an MoE block has no
    dense w3. The FlopCounterMode comparison above checks the tp 1 engine."""
    from llmtrain.plan.flops import recompute_flops_per_token

    m = load_recipe(REPO / "recipes/debug.yaml", ["model.preset=debug-moe", "parallel.tp=1"]).model
    h, kv, q = m.hidden, m.kv_heads * m.head_dim, m.heads * m.head_dim
    dense = next(i for i in range(m.layers) if not m.is_moe_layer(i))
    moe = next(i for i in range(m.layers) if m.is_moe_layer(i))
    assert recompute_flops_per_token(m, dense, 64, "selective_mm") == (2.0 * h * (kv + q + m.ffn_hidden), 0.0)
    assert recompute_flops_per_token(m, dense, 64, "selective_mm", tp=2) == (2.0 * h * (kv + m.ffn_hidden), 0.0)
    assert recompute_flops_per_token(m, moe, 64, "selective_mm") == (2.0 * h * (kv + q), 0.0)
    assert recompute_flops_per_token(m, moe, 64, "selective_mm", tp=4) == (2.0 * h * kv, 0.0)
    assert recompute_flops_per_token(m, dense, 64, "selective") == (0.0, 0.0)


def test_model_flops_count_a_windowed_layers_attention_over_its_window():
    """MFU's model FLOPs: 12 h s per token and layer without causal halving, a windowed layer's 12 h
    min(s, window) (MaxText's count for Gemma 2/3's local layers); the per-layer base of the hardware FLOPs
    keeps 12 h s (the engine's kernels' executed shares are subtracted from it). Gemma 3 1B: 26 layers, a
    window of 512 on all but every sixth."""
    from llmtrain.plan.flops import flops_per_token, model_flops_per_token, window_uncounted
    from llmtrain.recipe.load import validate_recipe_dict

    m = validate_recipe_dict({"model": {"preset": "gemma3-1b"}, "train": {"seq_len": 8192}}).model
    windowed = len(m.windowed_layers)
    assert (windowed, m.layers) == (22, 26)
    assert window_uncounted(m, 8192) == 12.0 * m.hidden * (8192 - 512) * 22
    assert model_flops_per_token(m, 8192) == flops_per_token(m, 8192) - window_uncounted(m, 8192)
    assert model_flops_per_token(m, 512) == flops_per_token(m, 512)  # the window covers the row
    llama = validate_recipe_dict({"model": {"preset": "llama3-8b"}}).model
    assert model_flops_per_token(llama, 8192) == flops_per_token(llama, 8192)  # no window
