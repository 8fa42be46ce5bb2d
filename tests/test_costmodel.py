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


# ---- the real engine ----------------------------------------------------------------------------------
COMMON = ["train.seq_len=64", "train.micro_batch_size=2", "train.global_batch_size=null", "parallel.dp_shard=-1",
          "train.precision=fp32", "parallel.tp=1", "parallel.zero=0"]
MOE = ["model.preset=debug-moe"]
LORA = ["train.lora.rank=4"]
GEMMA = ["model.norm_offset=true", "model.post_norms=true", "model.embed_scale=true", "model.mlp_activation=gelu_tanh",
         "model.qk_norm=true",
         "model.sliding_window=16", "model.full_attention_layers=[1]", "model.local_rope_theta=100",
         "model.attention_scale=0.2", "train.seq_len=128"]
CASES = {
    "ddp": ["parallel.zero=0"],
    "zero1": ["parallel.zero=1"],
    "zero2": ["parallel.zero=2"],
    "zero3": ["parallel.zero=3"],
    "hsdp": ["parallel.zero=3", "parallel.dp_replicate=2"],
    "tp2": ["parallel.tp=2", "parallel.sequence_parallel=false"],
    "tp2_sp_selective": ["parallel.tp=2", "train.activation_checkpointing=selective"],
    # selective keeps wo's reduced output, not its partial sum, and nothing of w2 (engine/parallel/checkpointing.py)
    "tp2_selective": ["parallel.tp=2", "parallel.sequence_parallel=false", "train.activation_checkpointing=selective"],
    "zero1_selective": ["parallel.zero=1", "train.activation_checkpointing=selective"],
    # torchtitan's op policy: selective less wk's, w3's and (without TP) wo's outputs; under TP wo
    # keeps selective's rule (reduced output saved); MoE blocks lose only wk's and wo's; LoRA keeps
    # the adapters' outputs
    "zero1_selective_mm": ["parallel.zero=1", "train.activation_checkpointing=selective_mm"],
    "tp2_sp_selective_mm": ["parallel.tp=2", "train.activation_checkpointing=selective_mm"],
    "moe_zero1_selective_mm": MOE + ["parallel.zero=1", "train.activation_checkpointing=selective_mm"],
    "lora_ddp_selective_mm": LORA + ["train.activation_checkpointing=selective_mm"],
    "tp2_fsdp2": ["parallel.tp=2", "parallel.zero=3"],
    "zero3_full": ["parallel.zero=3", "train.activation_checkpointing=full"],
    "moe_ep2_zero1": MOE + ["parallel.zero=1", "parallel.ep=2"],
    "moe_tp2_zero3": MOE + ["parallel.zero=3", "parallel.tp=2"],  # expert-TP (experts F / tp) under FSDP, SP
    # fewer local experts than FSDP ranks: the stacked experts are split on H, evenly (data_parallel.expert_placement),
    # in the block's unit (no EP: 2 experts over 4 ranks) and in the experts' own unit (ep 2: 1 expert over edp 2)
    "moe_e2_zero3": MOE + ["model.moe.num_experts=2", "parallel.zero=3"],
    "moe_e2_ep2_zero2": MOE + ["model.moe.num_experts=2", "parallel.ep=2", "parallel.zero=2"],
    "cp2_ring": ["parallel.cp=2", "parallel.cp_method=ring"],
    "cp2_allgather": ["parallel.cp=2", "parallel.cp_method=allgather"],  # kernel blocks: no [s, S] mask held
    # a sliding window shorter than the sequence: one additive [S, S] band per micro batch, shared by the layers
    # (models/llama.py attention_bias); under Ulysses over the whole sequence
    "window_zero1": ["model.sliding_window=16", "train.seq_len=256", "parallel.zero=1"],
    "window_cp2_ulysses": ["model.sliding_window=16", "train.seq_len=256", "parallel.cp=2", "parallel.cp_method=ulysses"],
    # Gemma 3's switches (engine/models/norm.py OffsetRMSNorm keeps input + rstd on every device; two post norms
    # per block; GeGLU keeps what SwiGLU keeps) with sliding and full layers
    "qk_norm_zero1": ["model.qk_norm=true", "parallel.zero=1"],  # Qwen3's per-head norms (composite on CPU)
    "qk_norm_tp2_sp": ["model.qk_norm=true", "parallel.tp=2"],  # per head of the TP shard, the whole sequence
    "gemma_zero1": GEMMA + ["parallel.zero=1"],
    "gemma_tp2_sp": GEMMA + ["parallel.tp=2"],
    "gemma_tp2_selective": GEMMA + ["parallel.tp=2", "train.activation_checkpointing=selective"],
    # Gemma 2's soft-capped attention (models/softcap.py keeps q, k, v, out and an fp32 log-sum-exp; one custom op
    # whose outputs selective saves as SDPA's: before, its products were cached, 1.66x the plan)
    "softcap_tp2_selective": GEMMA + ["model.attention_softcap=50", "model.logit_softcap=30", "parallel.tp=2",
                                      "train.activation_checkpointing=selective"],
    "pp2_interleaved_zero3": ["parallel.pp=2", "parallel.zero=3", "parallel.pp_schedule=interleaved-1f1b",
                              "parallel.pp_virtual_stages=2", "train.global_batch_size=8"],
    # LoRA (engine/finetune/lora.py): frozen base (parameters only), adapters with gradients and AdamW
    "lora_ddp": LORA,
    "lora_ddp_w1": LORA + ["train.lora.targets=[w1]"],  # block 0's attention saves nothing
    "lora_zero1": LORA + ["parallel.zero=1"],
    "lora_zero2": LORA + ["parallel.zero=2"],
    "lora_zero3_qv": LORA + ["train.lora.targets=[wq,wv]", "parallel.zero=3"],
    "lora_zero3_full_wo_w2": LORA + ["train.lora.targets=[wo,w2]", "parallel.zero=3",
                                     "train.activation_checkpointing=full"],
    "lora_tp2_zero1": LORA + ["parallel.tp=2", "parallel.zero=1", "parallel.sequence_parallel=false"],
    "lora_tp2_sp_selective": LORA + ["parallel.tp=2", "train.activation_checkpointing=selective"],
    "lora_ddp_dropout": LORA + ["train.lora.dropout=0.1"],  # per-adapter dropped inputs and masks
    "lora_tp2_dropout_wo_w2": LORA + ["train.lora.dropout=0.1", "train.lora.targets=[wo,w2]", "parallel.tp=2"],
    "pp2_zero2_lora": LORA + ["parallel.pp=2", "parallel.zero=2", "train.global_batch_size=8"],
    # tied embeddings under PP (engine/parallel/tied.py): the last stage holds a copy of the embedding
    # (parameter, gradient, AdamW state); V-shaped: rank 0 holds both; TP: each gradient in its weight's rows
    "pp2_zbv_tied_zero1": ["model.tie_embeddings=true", "parallel.pp=2", "parallel.pp_schedule=zbv",
                           "parallel.pp_virtual_stages=2", "parallel.zero=1", "train.global_batch_size=16"],
    "pp2_tp2_tied": ["model.tie_embeddings=true", "parallel.pp=2", "parallel.tp=2", "train.global_batch_size=8"],
    # split backward: a micro batch's activations live until its weight pass (plan/inflight.py)
    "pp2_zero_bubble": ["parallel.pp=2", "parallel.pp_schedule=zero-bubble", "parallel.pp_virtual_stages=2",
                        "train.global_batch_size=16"],
    # selective recomputation under PP: the policy's cache (counted beside what the hooks see, costmodel_worker.py
    # SavedPeak.recompute_caches) per micro batch in flight; with TP + SP wo's reduced output is cached, not its partial sum
    "pp2_1f1b_selective": ["parallel.pp=2", "parallel.pp_schedule=1f1b", "train.activation_checkpointing=selective",
                           "train.global_batch_size=8"],
    "pp2_tp2_interleaved_selective": ["parallel.pp=2", "parallel.tp=2", "parallel.pp_schedule=interleaved-1f1b",
                                      "parallel.pp_virtual_stages=2", "train.activation_checkpointing=selective",
                                      "train.global_batch_size=8"],
    "pp2_interleaved_selective_mm": ["parallel.pp=2", "parallel.pp_schedule=interleaved-1f1b", "parallel.pp_virtual_stages=2",
                                     "train.activation_checkpointing=selective_mm", "train.global_batch_size=16"],
    "pp2_zero_bubble_full": ["parallel.pp=2", "parallel.pp_schedule=zero-bubble", "parallel.pp_virtual_stages=2",
                             "train.activation_checkpointing=full", "train.global_batch_size=16"],
    "pp2_dualpipev": ["parallel.pp=2", "parallel.pp_schedule=dualpipev", "parallel.pp_virtual_stages=2",
                      "train.global_batch_size=16"],
    "pp2_dualpipev_full": ["parallel.pp=2", "parallel.pp_schedule=dualpipev", "parallel.pp_virtual_stages=2",
                           "train.activation_checkpointing=full", "train.global_batch_size=16"],
    "pp2_cp2_1f1b": ["parallel.pp=2", "parallel.cp=2", "parallel.pp_schedule=1f1b", "train.global_batch_size=8"],
    "pp2_moe_ep2_1f1b": MOE + ["parallel.pp=2", "parallel.ep=2", "parallel.pp_schedule=1f1b", "train.global_batch_size=8"],
    "pp2_zero3_lora_selective": LORA + ["parallel.pp=2", "parallel.zero=3", "parallel.pp_schedule=1f1b",
                                        "train.activation_checkpointing=selective", "train.global_batch_size=8"],
    # full recomputation under PP: each chunk keeps its blocks' inputs per micro batch in flight
    "pp2_interleaved_full": ["parallel.pp=2", "parallel.pp_schedule=interleaved-1f1b", "parallel.pp_virtual_stages=2",
                             "train.activation_checkpointing=full", "train.global_batch_size=16"],
    # quantized AdamW moments (engine/quant_optim.py): 8bit quantizes by the LOCAL shard's size (FSDP x TP
    # shards some weights below 4096 elements: those stay fp32), bf16 on ZeRO-1's whole owned tensors
    "tp2_fsdp2_8bit": ["parallel.tp=2", "parallel.zero=3", "train.optimizer.states=8bit"],
    "zero1_bf16": ["parallel.zero=1", "train.optimizer.states=bf16"],
    # bf16 under autocast (zero 0/1: fp32 parameters): the residual stream is bf16 from the embedding
    # on (engine/models/llama.py), so block inputs and norms are 2 bytes and q/k/v (w1/w3, the
    # router and the experts) share one saved bf16 input instead of a cast each
    "ddp_amp": ["train.precision=bf16"],
    "zero1_amp_selective": ["parallel.zero=1", "train.precision=bf16", "train.activation_checkpointing=selective"],
    "tp2_sp_amp": ["parallel.tp=2", "train.precision=bf16"],
    "moe_zero1_amp": MOE + ["parallel.zero=1", "train.precision=bf16"],
    "lora_ddp_amp": LORA + ["train.precision=bf16"],
}


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
])
def test_flops_match_flop_counter(preset, recompute, lora):
    torch = pytest.importorskip("torch")
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from llmtrain.engine.models.llama import Transformer
    from llmtrain.engine.parallel.checkpointing import apply_activation_checkpointing
    from llmtrain.plan.flops import block_flops_per_token, head_flops_per_token, recompute_flops_per_token

    from llmtrain.engine.finetune.lora import apply_lora

    lora_set = [] if lora is None else ["train.lora.rank=4", f"train.lora.targets={lora}"]
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


@pytest.mark.parametrize("targets", ["all-linear", "[wq,wv,w2]"])
def test_lora_inventory_names_shapes_and_trainability_match_the_engine(targets):
    """The planner's parameter list under LoRA is the engine's: every name, (single-rank) shape and
    requires_grad flag of ``apply_lora`` on the meta-device model (the multi-rank layouts are
    compared byte for byte above)."""
    torch = pytest.importorskip("torch")
    from llmtrain.engine.finetune.lora import apply_lora
    from llmtrain.engine.models.llama import Transformer
    from llmtrain.plan.shards import lora_key, rank_params

    recipe = load_recipe(REPO / "recipes/debug.yaml", ["parallel.tp=1", "train.lora.rank=4",
                                                       f"train.lora.targets={targets}"])
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
