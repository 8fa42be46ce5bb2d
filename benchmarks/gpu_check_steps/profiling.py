"""Where the engine's MoE step goes (issue 18 item 6): the first GPU record ran the MoE rows 1.7x slower
than planned while the dense rows ran within 10 %, and a step time alone cannot say whether the GPU
was busy (kernels priced too fast: grouped GEMMs at small sizes, the token permutation) or idle (the
host: launches of the many small routing kernels, and ``counts.tolist()``, one device-to-host sync per
MoE layer, engine/models/grouped_experts.py). ``moe_profile`` runs the speed rows' MoE model for a few
eager steps under torch.profiler and records, per step: the wall time, the summed kernel time (busy =
kernel / wall), the kernels and host syncs, the kernel time by category, and the costliest kernels,
beside the planner's step for the same recipe. On CPU (the ``--tiny`` smoke test) the same tables
from the CPU ops, so the code runs in CI.
"""

from __future__ import annotations

from . import planned, recipe, step

STEPS, WARMUP = 4, 2
# kernel-name fragments of each category (lower case), first match wins
CATEGORIES = (
    ("attention", ("flash", "fmha", "cudnn", "attention", "sdpa")),
    ("gemm", ("gemm", "cutlass", "xmma", "cublas", "sm90_", "sm80_", "grouped_mm", "matmul", "aten::mm", "aten::bmm",
              "aten::addmm", "_grouped_mm")),
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
    import torch
    from torch.profiler import ProfilerActivity, profile, schedule

    from llmtrain.recipe.schema import ModelConfig

    from .fsdp1 import build, train_fixed
    from .speed import FULL, MOE, TINY, TINY_MOE

    size, fields = (TINY, TINY_MOE) if ctx.tiny else (FULL, MOE)
    cfg = ModelConfig(**fields)
    plan = planned(recipe(ctx, fields, precision="bf16", seq=size["seq"], micro=size["micro"], steps=1))
    model = build(cfg, ctx.device, "bf16", compile_=False, fsdp=False)  # fp32 weights, bf16 autocast: the trainer's
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ctx.cuda else [])
    # the first WARMUP steps unrecorded (the profiler's own warm-up is the last of them), then STEPS recorded
    with profile(activities=activities, schedule=schedule(wait=WARMUP - 1, warmup=1, active=STEPS)) as prof:
        losses, times = train_fixed(model, cfg, ctx.device, WARMUP + STEPS, size["micro"], size["seq"], lr=3e-4,
                                    autocast=True, after_step=prof.step)
    out = {"config": "moe_eager (profiled)", "seq": size["seq"], "micro_batch": size["micro"], "steps": STEPS,
           "loss_last": losses[-1], **summarize(prof.key_averages(), ctx.cuda, STEPS, sum(times[WARMUP:])), **plan,
           "note": "wall includes the profiler's own overhead (a few % on CUDA); busy = kernel / wall"}
    del model
    if ctx.cuda:
        torch.cuda.empty_cache()
    return out
