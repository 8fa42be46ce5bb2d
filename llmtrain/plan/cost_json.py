"""A :class:`~llmtrain.plan.costmodel.CostModel` as the ``memory`` / ``flops`` / ``comm`` / ``time``
keys of ``llmtrain plan --json`` (docs/plan-json.md); the text report renders the same dict."""

from __future__ import annotations

from llmtrain.plan.costmodel import GIB, CostModel, RankMemory
from llmtrain.plan.dims import ParallelDims
from llmtrain.plan.steptime import efficiency


def _gib(n: float) -> float:
    return round(n / GIB, 6)


def memory_dict(mem: RankMemory) -> dict:
    return {"params": _gib(mem.params), "grads": _gib(mem.held_grads), "optimizer": _gib(mem.optimizer),
            "activations": _gib(mem.activations), "other": _gib(mem.other)}


def cost_to_dict(cm: CostModel, dims: ParallelDims) -> dict:
    w = cm.worst
    per_rank = []
    for worst, best, held, layers in cm.per_pp:
        per_rank.append({"pp": worst.pp_rank, "ranks": dims.world_size // dims.pp, "stages": held, "layers": layers,
                         "peak_gib": _gib(worst.peak), "peak_gib_min": _gib(best.peak),
                         "worst_dp_index": worst.dp_index, "trainable_params": worst.trainable_params,
                         **{f"{k}_gib": v for k, v in memory_dict(worst).items()}})
    return {
        "memory": {
            "gpu": cm.gpu.name, "capacity_gib": _gib(cm.gpu.memory_bytes), "peak_gib": _gib(w.peak), "fits": cm.fits,
            "headroom_gib": _gib(cm.gpu.memory_bytes - w.peak), "phase": w.phase, "dp_state": cm.mode.label,
            "worst_rank": {"rank": cm.worst_rank, "pp": w.pp_rank, "dp_index": w.dp_index},
            "breakdown_gib": memory_dict(w),
            "other_gib": {k: _gib(v) for k, v in w.other_detail.items()},
            "activations_gib": {k: _gib(v) for k, v in sorted(w.activation_detail.items(), key=lambda kv: -kv[1])},
            "per_rank": per_rank, "hints": cm.hints,
            "trainable_params_per_rank": max(worst.trainable_params for worst, *_ in cm.per_pp),
        },
        "flops": cm.flops,
        "comm": [c.to_dict() for c in cm.comms],
        "bubble_fraction": cm.bubble,
        "time": {**cm.time.to_dict(), "compute_efficiency": efficiency(cm.gpu), "time_model": cm.time_model,
                 "planner_assumptions": cm.assumptions,
                 "peak_tflops": cm.gpu.peak_flops_bf16 / 1e12,
                 "mfu_peak_tflops": cm.gpu.mfu_peak / 1e12,  # differs under cluster.gpu_power_w (recipe/gpus.py)
                 "network_gbps_per_gpu": cm.gpu.internode_bytes_per_s * 8 / 1e9},  # cluster.network_gbps's share
    }
