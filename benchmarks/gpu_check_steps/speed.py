"""Step groups (c)-(f): speed of the engine's own training loop, beside the planner and HF.

Run order and estimates: RUN_ORDER at the end (1B dense compiled first, then its HF peer, then
eager / AC / FSDP2, MoE, the compiled peer last); the estimates' assumptions: __init__.py.

Most configurations run :func:`llmtrain.engine.trainer.train` itself (synthetic data, world 1:
the trainer then skips FSDP and computes under bf16 autocast with fp32 weights) for ``warmup +
reps`` steps and take the per-step tokens/s the trainer reports; the ``*_fsdp1`` rows wrap the
model in FSDP2 on a 1-rank group instead (bf16 ``MixedPrecisionPolicy``, fp32 master weights;
:func:`fsdp_row`). The median of the timed steps is reported, with

- ``mfu`` = tokens/s x :func:`llmtrain.plan.flops.flops_per_token` (the planner's convention:
  6 x matmul params + attention, no recomputation) / the GPU's dense bf16 peak
  (llmtrain/recipe/gpus.py, the ``h200`` entry on an H200);
- ``peak_mem_gib`` = ``torch.cuda.max_memory_allocated`` over the run;
- ``planned_step_s`` / ``planned_peak_gib`` = ``llmtrain plan``'s prediction for the very same
  recipe on one GPU of that kind (the planner's first GPU calibration points), and
  ``step_s_vs_plan`` / ``peak_vs_plan`` = measured / planned.

The peer (d) is transformers' ``LlamaForCausalLM`` with the same config, as HF's Trainer runs it
with ``bf16=True``: fp32 parameters under bf16 autocast, SDPA attention, fused AdamW, the same
fp32 cross-entropy, gradient clipping at 1.0, same batch; ``vs_hf`` = our tokens/s / its.
At ``--tiny`` (CPU smoke) ``compile`` is left off (a cold compile alone costs more than the
smoke test's budget), which the row says.
"""

from __future__ import annotations

import statistics
import time

from . import (
    ASSUMED_MFU,
    COMPILE_COLD_S,
    COMPILE_WARM_S,
    HF_COMPILE_S,
    planned,
    recipe,
    step,
    train_est_s,
    train_run,
)

DENSE = dict(layers=16, hidden=2048, heads=16, kv_heads=8, ffn_hidden=8192, vocab_size=32000, max_seq_len=2048,
             rope_theta=500000.0, norm_eps=1e-5, tie_embeddings=False)  # 1.2B (benchmarks/gpu_throughput.py)
MOE = dict(layers=8, hidden=1024, heads=16, kv_heads=8, ffn_hidden=2816, vocab_size=32000, max_seq_len=2048,
           rope_theta=500000.0, norm_eps=1e-5, tie_embeddings=False,
           moe=dict(num_experts=8, top_k=2, expert_ffn_hidden=1408, first_dense_layers=1))
TINY_DENSE = dict(layers=2, hidden=64, heads=4, kv_heads=2, ffn_hidden=128, vocab_size=256, max_seq_len=64,
                  rope_theta=10000.0, norm_eps=1e-5, tie_embeddings=False)
TINY_MOE = dict(TINY_DENSE, moe=dict(num_experts=4, top_k=2, expert_ffn_hidden=64))
FULL = dict(seq=2048, micro=4, warmup=3, reps=8)
TINY = dict(seq=32, micro=2, warmup=1, reps=2)


def _size(ctx) -> dict:
    return TINY if ctx.tiny else FULL


def speed_row(ctx, name: str, model: dict, compile_: bool, ac: str = "none", precision: str = "bf16") -> dict:
    import torch

    from llmtrain.plan.flops import flops_per_token

    s = _size(ctx)
    compiled = compile_ and not ctx.tiny
    r = recipe(ctx, model, precision=precision, seq=s["seq"], micro=s["micro"], steps=s["warmup"] + s["reps"],
               lr=3e-4, compile_=compiled, ac=ac)
    plan = planned(r)
    if ctx.cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(ctx.device)
    t0 = time.perf_counter()
    res, rows = train_run(ctx, r, ctx.device)  # no run dir: no checkpoint (train_run's docstring)
    wall = time.perf_counter() - t0
    timed = [row["tokens_per_s"] for row in rows[s["warmup"]:]]
    if not timed:
        raise RuntimeError(f"no per-step metrics after {s['warmup']} warmup steps: {len(rows)} rows")
    tps = statistics.median(timed)
    step_s = s["micro"] * s["seq"] / tps
    peak_gib = torch.cuda.max_memory_allocated(ctx.device) / 2**30 if ctx.cuda else None
    out = {"config": name, "precision": precision, "compile": compiled if not (compile_ and ctx.tiny) else "off at --tiny",
           "activation_checkpointing": ac, "seq": s["seq"], "micro_batch": s["micro"], "warmup": s["warmup"],
           "reps": s["reps"], "step_s": step_s, "tokens_per_s": tps,
           "mfu": tps * flops_per_token(r.model, s["seq"]) / ctx.peak_flops, "peak_mem_gib": peak_gib,
           "loss_first_last": [res.losses[0], res.losses[-1]], "wall_s": wall, **plan}
    if "planned_step_s" in plan:
        out["step_s_vs_plan"] = step_s / plan["planned_step_s"]
        out["peak_vs_plan"] = (peak_gib / plan["planned_peak_gib"]) if peak_gib else None
    ctx.shared.setdefault("speed", {})[name] = tps
    res = None
    if ctx.cuda:
        torch.cuda.empty_cache()
    return out


def dense_compiled(ctx) -> dict:
    """~1B dense, bf16, torch.compile per block, no AC, the trainer on one GPU (bf16 autocast, no
    FSDP: dense_compiled_fsdp1 is the FSDP2 row): the MFU target, first of the speed rows."""
    return speed_row(ctx, "dense_compiled", TINY_DENSE if ctx.tiny else DENSE, compile_=True)


def dense_eager(ctx) -> dict:
    return speed_row(ctx, "dense_eager", TINY_DENSE if ctx.tiny else DENSE, compile_=False)


def fsdp_row(ctx, name: str, fields: dict, compile_: bool) -> dict:
    """``fields`` wrapped in FSDP2 on a 1-rank group (bf16 MixedPrecisionPolicy, fp32 master
    weights; gpu_check_steps/fsdp1.py), own loop with the engine's fused AdamW and clipping on a
    fixed batch: the per-rank compute path of every multi-GPU zero 2/3 run. planned_* is the
    planner's one-GPU prediction of the same recipe (which, like the engine on one rank, assumes
    no FSDP: the gap is FSDP's own cost on one rank)."""
    import statistics

    import torch

    from llmtrain.plan.flops import flops_per_token
    from llmtrain.recipe.schema import ModelConfig

    from .fsdp1 import build, train_fixed

    s = _size(ctx)
    cfg = ModelConfig(**fields)
    compiled = compile_ and not ctx.tiny
    plan = planned(recipe(ctx, fields, precision="bf16", seq=s["seq"], micro=s["micro"], steps=1, compile_=compiled))
    if ctx.cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(ctx.device)
    model = build(cfg, ctx.device, "bf16", compile_=compiled, fsdp=True)
    losses, times = train_fixed(model, cfg, ctx.device, s["warmup"] + s["reps"], s["micro"], s["seq"], lr=3e-4)
    step_s = statistics.median(times[s["warmup"]:])
    tps = s["micro"] * s["seq"] / step_s
    peak = torch.cuda.max_memory_allocated(ctx.device) / 2**30 if ctx.cuda else None
    out = {"config": name, "precision": "bf16", "path": "FSDP2 1-rank group, MixedPrecisionPolicy bf16",
           "compile": compiled if not (compile_ and ctx.tiny) else "off at --tiny", "step_s": step_s,
           "tokens_per_s": tps, "mfu": tps * flops_per_token(cfg, s["seq"]) / ctx.peak_flops, "peak_mem_gib": peak,
           "loss_first_last": [losses[0], losses[-1]], **plan}
    if "planned_step_s" in plan:
        out["step_s_vs_plan"] = step_s / plan["planned_step_s"]
        out["peak_vs_plan"] = peak / plan["planned_peak_gib"] if peak else None
    ctx.shared.setdefault("speed", {})[name] = tps
    del model
    if ctx.cuda:
        torch.cuda.empty_cache()
    return out


def dense_compiled_fsdp1(ctx) -> dict:
    """dense_compiled's model and batch under FSDP2 on a 1-rank group (fsdp_row)."""
    return fsdp_row(ctx, "dense_compiled_fsdp1", TINY_DENSE if ctx.tiny else DENSE, compile_=True)


def _hf_row(ctx, compile_: bool) -> dict:
    import torch
    import torch.nn.functional as F
    from transformers import LlamaConfig, LlamaForCausalLM

    from llmtrain.engine.hf import hf_config
    from llmtrain.plan.flops import flops_per_token
    from llmtrain.recipe.schema import ModelConfig

    s = _size(ctx)
    cfg = ModelConfig(**(TINY_DENSE if ctx.tiny else DENSE))
    conf = {k: v for k, v in hf_config(cfg).items() if k not in ("architectures", "model_type", "torch_dtype", "dtype")}
    torch.manual_seed(0)
    with torch.device(ctx.device):  # built on the GPU: no CPU init of 1.2B parameters
        model = LlamaForCausalLM._from_config(LlamaConfig(**{**conf, "use_cache": False}), attn_implementation="sdpa",
                                              dtype=torch.float32)
    if model.config._attn_implementation != "sdpa":
        raise RuntimeError(f"HF picked attention {model.config._attn_implementation!r}, not sdpa")
    fwd = torch.compile(model) if compile_ and not ctx.tiny else model
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, fused=True)
    tokens = torch.randint(0, cfg.vocab_size, (s["micro"], s["seq"] + 1), device=ctx.device)
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    if ctx.cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(ctx.device)
    times = []
    for i in range(s["warmup"] + s["reps"]):
        t0 = time.perf_counter()
        with torch.autocast(ctx.device.type, dtype=torch.bfloat16):
            logits = fwd(input_ids=x).logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(0, 1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()  # the engine syncs on the loss every step too
        if i >= s["warmup"]:
            times.append(time.perf_counter() - t0)
    step_s = statistics.median(times)
    tps = s["micro"] * s["seq"] / step_s
    name = "hf_llama_compiled" if compile_ else "hf_llama_eager"
    ours = ctx.shared.get("speed", {})
    out = {"config": name, "compile": (compile_ and not ctx.tiny) or ("off at --tiny" if compile_ else False),
           "step_s": step_s, "tokens_per_s": tps, "mfu": tps * flops_per_token(cfg, s["seq"]) / ctx.peak_flops,
           "peak_mem_gib": torch.cuda.max_memory_allocated(ctx.device) / 2**30 if ctx.cuda else None,
           "vs_hf": {k: v / tps for k, v in ours.items() if k.startswith("dense")}}
    ctx.shared.setdefault("hf", {})[name] = tps
    del model, fwd, opt
    if ctx.cuda:
        torch.cuda.empty_cache()
    return out


def hf_llama_eager(ctx) -> dict:
    """transformers' LlamaForCausalLM, same config, GPU and batch (module docstring); vs_hf of
    every dense row measured so far."""
    return _hf_row(ctx, compile_=False)


def dense_selective_ac(ctx) -> dict:
    return speed_row(ctx, "dense_compiled_selective_ac", TINY_DENSE if ctx.tiny else DENSE, True, "selective")


def dense_full_ac(ctx) -> dict:
    return speed_row(ctx, "dense_compiled_full_ac", TINY_DENSE if ctx.tiny else DENSE, True, "full")


def moe_compiled_fsdp1(ctx) -> dict:
    """Small MoE (8 experts, top 2), compiled, FSDP2 on a 1-rank group (fsdp_row): bf16
    MixedPrecisionPolicy, so the expert inputs are bf16 and the grouped GEMM runs, as on many GPUs."""
    return fsdp_row(ctx, "moe_compiled_fsdp1", TINY_MOE if ctx.tiny else MOE, compile_=True)


def moe_eager(ctx) -> dict:
    """The same MoE through the trainer on one GPU (bf16 autocast, eager): the token stream under
    autocast (bf16 since the nineteenth session, fp32 before) takes the grouped GEMM too (engine/models/moe.py ``grouped_mm_dtype``, issue 19;
    the first wave's per-expert loop), checked by correctness.py's moe_grouped_gemm."""
    return speed_row(ctx, "moe_eager", TINY_MOE if ctx.tiny else MOE, compile_=False)


def hf_llama_compiled(ctx) -> dict:
    """The peer under ``torch.compile(model)``: vs_hf against a compiled HF as well."""
    return _hf_row(ctx, compile_=True)  # also alone (--steps): vs_hf_compiled of the rows in the same record


# ---- run order and estimates (gpu_check_steps/__init__.py: the assumptions) --------------------------
# (c) the acceptance numbers first: 1B dense compiled (MFU, memory, plan), then (d) its HF peer
# (vs_hf); (e) 1B eager and AC; the 1-rank FSDP2 row; (f) MoE; the compiled HF peer last of all.
_F = dict(seq=FULL["seq"], micro=FULL["micro"], steps=FULL["warmup"] + FULL["reps"])
RUN_ORDER = (
    (dense_compiled, "dense_compiled", train_est_s(DENSE, **_F, mfu=ASSUMED_MFU["compiled"], compile_s=COMPILE_COLD_S)),
    (hf_llama_eager, "hf_llama_eager", train_est_s(DENSE, **_F, mfu=ASSUMED_MFU["eager"])),
    (dense_eager, "dense_eager", train_est_s(DENSE, **_F, mfu=ASSUMED_MFU["eager"])),
    (dense_selective_ac, "dense_compiled_selective_ac",
     train_est_s(DENSE, **_F, mfu=ASSUMED_MFU["compiled"], compile_s=COMPILE_WARM_S, recompute=1.1)),
    (dense_full_ac, "dense_compiled_full_ac",
     train_est_s(DENSE, **_F, mfu=ASSUMED_MFU["compiled"], compile_s=COMPILE_WARM_S, recompute=4 / 3)),
    (dense_compiled_fsdp1, "dense_compiled_fsdp1",
     train_est_s(DENSE, **_F, mfu=ASSUMED_MFU["compiled"], compile_s=COMPILE_WARM_S)),
    (moe_eager, "moe_eager", train_est_s(MOE, **_F, mfu=ASSUMED_MFU["moe"])),
    (moe_compiled_fsdp1, "moe_compiled_fsdp1", train_est_s(MOE, **_F, mfu=ASSUMED_MFU["moe"], compile_s=COMPILE_COLD_S)),
    (hf_llama_compiled, "hf_llama_compiled", train_est_s(DENSE, **_F, mfu=ASSUMED_MFU["compiled"], compile_s=HF_COMPILE_S)),
)
for _fn, _name, _est in RUN_ORDER:
    step(_name, est_s=_est)(_fn)
