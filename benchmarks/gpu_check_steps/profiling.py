"""Where the engine's steps go (issue 18 item 6). ``dense_profile`` below; ``moe_profile``: the first GPU record ran the MoE rows 1.7x slower
than planned while the dense rows ran within 10 %, and a step time alone cannot say whether the GPU
was busy (kernels priced too fast: grouped GEMMs at small sizes, the token permutation) or idle (the
host: launches of the many small routing kernels, and ``counts.tolist()``, one device-to-host sync per
MoE layer, engine/models/grouped_experts.py). ``moe_profile`` runs the speed rows' MoE model for a few
eager steps under torch.profiler and records, per step: the wall time, the summed kernel time (busy =
kernel / wall), the kernels and host syncs, the kernel time by category, and the costliest kernels,
beside the planner's step for the same recipe. On CPU (the ``--tiny`` smoke test) the same tables
from the CPU ops, so the code runs in CI. cuBLAS's Hopper GEMMs are ``nvjet_*`` kernels (CUDA 12.4+),
counted as GEMMs.
"""

from __future__ import annotations

from . import planned, recipe, step

STEPS, WARMUP = 4, 2
# kernel-name fragments of each category (lower case), first match wins
CATEGORIES = (
    ("attention", ("flash", "fmha", "cudnn", "attention", "sdpa")),
    ("gemm", ("gemm", "cutlass", "xmma", "cublas", "nvjet", "sm90_", "sm80_", "grouped_mm", "matmul", "aten::mm",
              "aten::bmm", "aten::addmm", "_grouped_mm")),
    ("permute", ("index", "scatter", "gather", "sort", "radix", "bincount", "cumsum", "histogram", "nonzero",
                 "topk", "aten::cat", "catarraybatched")),
)
SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "aten::_local_scalar_dense")
LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")


def category(name: str) -> str:
    low = name.lower()
    for cat, parts in CATEGORIES:
        if any(p in low for p in parts):
            return cat
    return "elementwise/other"


def summarize(averages, cuda: bool, steps: int, wall_s: float) -> dict:
    """Per-step figures from a profiler's ``key_averages()``: device kernels on CUDA, else the CPU's
    aten ops (self time) as their stand-in."""
    from torch.autograd import DeviceType

    kernels, by_cat, host = [], {}, {"syncs": 0, "launches": 0}
    for e in averages:
        if cuda and e.device_type == DeviceType.CUDA and e.self_device_time_total > 0:
            kernels.append((e.key, e.count, e.self_device_time_total))
        elif not cuda and e.key.startswith("aten::") and e.self_cpu_time_total > 0:
            kernels.append((e.key, e.count, e.self_cpu_time_total))
        if e.key in SYNCS:
            host["syncs"] += e.count
        if e.key in LAUNCHES:
            host["launches"] += e.count
    for key, count, us in kernels:
        c = by_cat.setdefault(category(key), {"ms": 0.0, "kernels": 0})
        c["ms"] += us / 1e3 / steps
        c["kernels"] += count / steps
    kernel_ms = sum(us for _, _, us in kernels) / 1e3 / steps
    wall_ms = wall_s * 1e3 / steps
    top = sorted(kernels, key=lambda k: -k[2])[:12]
    return {"wall_ms": wall_ms, "kernel_ms": kernel_ms, "busy": kernel_ms / wall_ms if wall_ms else None,
            "kernels_per_step": sum(c for _, c, _ in kernels) / steps,
            "syncs_per_step": host["syncs"] / steps, "launches_per_step": host["launches"] / steps,
            "by_category": {k: {"ms": round(v["ms"], 3), "kernels": round(v["kernels"], 1)} for k, v in by_cat.items()},
            "top": [{"name": k[:120], "category": category(k), "per_step": c / steps, "ms": us / 1e3 / steps}
                    for k, c, us in top]}


@step("moe_profile", est_s=25, group="options")
def moe_profile(ctx) -> dict:
    from .speed import FULL, MOE, TINY, TINY_MOE

    size, fields = (TINY, TINY_MOE) if ctx.tiny else (FULL, MOE)
    plan = planned(recipe(ctx, fields, precision="bf16", seq=size["seq"], micro=size["micro"], steps=1))
    loss, measured = profiled_steps(ctx, fields, size, compiled=False)
    return {"config": "moe_eager (profiled)", "seq": size["seq"], "micro_batch": size["micro"], "steps": STEPS,
            "loss_last": loss, **measured, **plan,
            "note": "wall includes the profiler's own overhead (a few % on CUDA); busy = kernel / wall"}


def profiled_steps(ctx, fields: dict, size: dict, compiled: bool) -> tuple[float, dict]:
    """The model of ``fields`` trained on one fixed batch (fp32 weights, bf16 autocast: the trainer's
    path on one GPU), the first WARMUP steps unrecorded (the profiler's own warm-up is the last of
    them), then STEPS under torch.profiler: (the last loss, :func:`summarize`'s tables)."""
    import torch
    from torch.profiler import ProfilerActivity, profile, schedule

    from llmtrain.recipe.schema import ModelConfig

    from .fsdp1 import build, train_fixed

    cfg = ModelConfig(**fields)
    model = build(cfg, ctx.device, "bf16", compile_=compiled, fsdp=False)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ctx.cuda else [])
    with profile(activities=activities, schedule=schedule(wait=WARMUP - 1, warmup=1, active=STEPS)) as prof:
        losses, times = train_fixed(model, cfg, ctx.device, WARMUP + STEPS, size["micro"], size["seq"], lr=3e-4,
                                    autocast=True, after_step=prof.step)
    measured = summarize(prof.key_averages(), ctx.cuda, STEPS, sum(times[WARMUP:]))
    del model, prof
    if ctx.cuda:
        torch.cuda.empty_cache()
    return losses[-1], measured


def planned_parts(r, step_s: float | None) -> dict:
    """Time model v2's seconds per step of recipe ``r`` (one GPU, one micro batch per step, no
    recomputation) by kernel category: the blocks' and the output layer's GEMMs (three at full tokens:
    train_fixed's unchunked ``F.cross_entropy``), the attention kernels, the blocks' element-wise ops
    (``ops.block_parts``), and the rest of the planned step (norm and loss kernels, the optimizer, the
    weights' autocast copies: ``step_s``, the planned step, less the rest)."""
    from llmtrain.plan import ops
    from llmtrain.plan.dims import ParallelDims
    from llmtrain.plan.flops import attention_executed
    from llmtrain.plan.losstime import head_gemm_seconds
    from llmtrain.recipe.gpus import cluster_gpu

    gpu = cluster_gpu(r.cluster.gpu, r.cluster.gpu_power_w)
    x = ops.shape_of(r, ParallelDims(1, 1, 1, 1, 1, 1), gpu, attention_executed(1, r.parallel.cp_method))
    parts = ops.block_parts(x, gpu, moe=False)
    layers, tokens = r.model.layers, r.train.micro_batch_size * r.train.seq_len
    out = {name: 1e3 * layers * sum(fb) for name, fb in parts.items()}
    out["gemm"] += 1e3 * sum(head_gemm_seconds("unchunked", tokens, r.model.vocab_size, r.model.hidden, gpu))
    if step_s is not None:
        out["rest"] = 1e3 * step_s - sum(out.values())
    return {k: round(v, 3) for k, v in out.items()}


@step("dense_profile", est_s=35, group="options")
def dense_profile(ctx) -> dict:
    """The speed rows' 1.2B dense model, eager and compiled (compiled not at ``--tiny``), a few steps
    under torch.profiler: kernel time by category beside v2's price of each (:func:`planned_parts`).
    What it decides (docs/planner.md 9.2): whether GEMMs inside a training step run at the rate
    ``gemmtime.GEMM_FIT`` took from isolated GEMMs (the sustained-power question), and whether the
    element-wise kernels, eager and fused by Inductor, cost what v2's byte counts say."""
    from .speed import DENSE, FULL, TINY, TINY_DENSE

    size, fields = (TINY, TINY_DENSE) if ctx.tiny else (FULL, DENSE)
    rows = []
    for compiled in (False,) if ctx.tiny else (False, True):
        r = recipe(ctx, fields, precision="bf16", seq=size["seq"], micro=size["micro"], steps=1, compile_=compiled)
        # train_fixed's loss is F.cross_entropy over the whole fp32 logits: the plan prices that one
        r = r.model_copy(update={"planner": r.planner.model_copy(update={"loss": "unchunked"})})
        plan = planned(r)
        loss, measured = profiled_steps(ctx, fields, size, compiled)
        rows.append({"config": "dense_compiled" if compiled else "dense_eager", "loss_last": loss, **measured,
                     "planned_ms": planned_parts(r, plan.get("planned_step_s")), **plan})
    return {"seq": size["seq"], "micro_batch": size["micro"], "steps": STEPS, "rows": rows,
            "note": "measured by_category ms per step (GPU kernels) beside planned_ms (v2, same categories; "
                    "planned 'rest' against measured elementwise/other less the blocks' elementwise share)"}
