"""Step time, throughput and MFU from FLOPs, communication and the pipeline bubble.

Model (per pipeline rank ``r``, per micro batch):

    t_mb(r) = hardware FLOPs(r) / (peak x COMPUTE_EFFICIENCY[gpu])    forward + backward (+ recompute)
            + TP collectives                                          not overlapped (the engine has no async TP)
            + CP: ring passes beyond the attention compute they hide behind; Ulysses / all-gather in full
            + EP all-to-alls x EP_EXPOSED                             (0 for dualpipev, which overlaps them)

    step = m x max_r t_mb(r) x (1 + bubble)                           bubble: llmtrain.plan.bubble
         + DP exposed + PP fill/drain P2P + optimizer

DP exposure follows the engine: zero 0/1 all-reduce (and ZeRO-1's broadcast) run after the last
backward (``GradientAllReduce`` is called once per step), so they are fully exposed unless
``dp_overlap=True`` (Megatron/DDP-style bucketed overlap with the last micro batch's backward,
used for the published-system comparisons in docs/planner.md). FSDP2 prefetches the next
block's all-gather and reduce-scatters the previous block's gradients while computing, so only
the first block's all-gather, the last block's reduce-scatter and whatever exceeds the compute
of that pass are exposed. PP point-to-point sends overlap with compute in the steady state;
the ``2 (p v - 1)`` sends along the fill and drain path are exposed. The optimizer step is
memory-bound: ~32 bytes of HBM traffic per stepped parameter (fp32 param, grad, m, v read;
param, m, v written; temporaries).

Calibration (``COMPUTE_EFFICIENCY``: the fraction of the dense bf16 peak that a transformer
layer's kernels reach on large shapes, GEMMs and attention together). Fitted once against the
published systems in docs/planner.md (Megatron-LM on A100, Llama 3 on H100) and kept there;
``HBM_BYTES_PER_S`` are datasheet memory bandwidths.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from llmtrain.plan.comm import Comm
from llmtrain.recipe.gpus import GPUSpec

COMPUTE_EFFICIENCY = {"h100-sxm": 0.60, "h200": 0.62, "a100-80g": 0.70, "b200": 0.55, "cpu": 0.5}
HBM_BYTES_PER_S = {"h100-sxm": 3.35e12, "h200": 4.8e12, "a100-80g": 2.04e12, "b200": 8.0e12, "cpu": 5e10}
OPTIMIZER_BYTES_PER_PARAM = 32
BUCKET_BYTES = 25 << 20  # DDP's default bucket (bucket_cap_mb=25), for dp_overlap
EP_EXPOSED = 0.5  # share of EP all-to-all time not hidden behind compute (no DeepEP-style overlap)


@dataclass
class RankWork:
    """One pipeline rank's work per micro batch, and its communication per step."""

    fwd_flops: float  # hardware FLOPs of one micro batch's forward on this rank
    bwd_flops: float  # backward, including recomputation
    attn_flops: float  # of which attention scores/values (forward + backward), for CP overlap
    comms: list[Comm] = field(default_factory=list)
    block_fraction: float = 1.0  # largest block / all parameters of the rank (FSDP prefetch granularity)
    stepped_params: int = 0  # parameters whose AdamW update this rank computes


@dataclass
class StepTime:
    step_s: float
    breakdown: dict[str, float]
    tokens_per_s_per_gpu: float
    tflops_per_gpu: float  # model FLOPs (MFU numerator)
    hw_tflops_per_gpu: float  # hardware FLOPs incl. recomputation
    mfu: float
    slowest_pp_rank: int

    def to_dict(self) -> dict:
        return {"step_s": self.step_s, "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu,
                "tflops_per_gpu": self.tflops_per_gpu, "hw_tflops_per_gpu": self.hw_tflops_per_gpu,
                "mfu": self.mfu, "slowest_pp_rank": self.slowest_pp_rank, "breakdown_s": self.breakdown}


def efficiency(gpu: GPUSpec) -> float:
    return COMPUTE_EFFICIENCY.get(gpu.name, 0.55)


def _fsdp_exposed(c: Comm, block_fraction: float, window: float) -> float:
    per = c.seconds / c.count if c.count else 0.0
    return c.count * (per * block_fraction + max(0.0, per * (1 - block_fraction) - window))


def step_time(ranks: list[RankWork], gpu: GPUSpec, microbatches: int, bubble: float, schedule: str | None,
              tokens_per_step: int, world: int, model_flops_step: float, hw_flops_step: float,
              chunks_per_rank: int = 1, dp_overlap: bool = False) -> StepTime:
    rate = gpu.peak_flops_bf16 * efficiency(gpu)
    m = microbatches
    ep_share = 0.0 if schedule == "dualpipev" else EP_EXPOSED
    per_rank = []
    for w in ranks:
        t_f, t_b = w.fwd_flops / rate, w.bwd_flops / rate
        tp = sum(c.seconds for c in w.comms if c.dim == "tp") / m
        cp = 0.0
        for c in w.comms:
            if c.dim != "cp":
                continue
            cp += max(0.0, c.seconds / m - w.attn_flops / rate) if c.phase == "cp-ring" else c.seconds / m
        ep = ep_share * sum(c.seconds for c in w.comms if c.dim == "ep") / m
        dp = 0.0
        for c in w.comms:
            if c.phase == "step":
                if dp_overlap:  # bucketed: all but the last bucket hide behind the last backward (or next forward)
                    last = c.seconds * min(1.0, BUCKET_BYTES / max(1.0, c.message_bytes))
                    dp += last + max(0.0, c.seconds - last - (t_f if c.op == "broadcast" else t_b))
                else:
                    dp += c.seconds
            elif c.phase == "fsdp-gather":
                dp += _fsdp_exposed(c, w.block_fraction, t_f if c.count <= m else (t_f + t_b) / 2)
            elif c.phase == "fsdp-reduce":
                dp += _fsdp_exposed(c, w.block_fraction, t_b)
        pp = sum(c.per_item_s for c in w.comms if c.dim == "pp")
        optimizer = w.stepped_params * OPTIMIZER_BYTES_PER_PARAM / HBM_BYTES_PER_S.get(gpu.name, 2e12)
        per_rank.append(dict(compute=t_f + t_b, tp=tp, cp=cp, ep=ep, dp=dp, pp_msg=pp, optimizer=optimizer))
    slowest = max(range(len(per_rank)), key=lambda i: sum(per_rank[i][k] for k in ("compute", "tp", "cp", "ep")))
    s = per_rank[slowest]
    t_mb = s["compute"] + s["tp"] + s["cp"] + s["ep"]
    pipeline = m * t_mb
    bubble_s = pipeline * bubble
    n_ranks = len(ranks)
    pp_s = 2 * (n_ranks * chunks_per_rank - 1) * max(r["pp_msg"] for r in per_rank) if n_ranks > 1 else 0.0
    dp_s = max(r["dp"] for r in per_rank)
    opt_s = max(r["optimizer"] for r in per_rank)
    step = pipeline + bubble_s + dp_s + pp_s + opt_s
    breakdown = {"compute": m * s["compute"], "tp_comm": m * s["tp"], "cp_comm": m * s["cp"], "ep_comm": m * s["ep"],
                 "bubble": bubble_s, "dp_comm": dp_s, "pp_comm": pp_s, "optimizer": opt_s}
    tflops = model_flops_step / world / step / 1e12
    return StepTime(step, breakdown, tokens_per_step / step / world, tflops, hw_flops_step / world / step / 1e12,
                    tflops * 1e12 / gpu.peak_flops_bf16, slowest)
