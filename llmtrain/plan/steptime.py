"""Step time, throughput and MFU from FLOPs, communication and the pipeline bubble.

Model (per pipeline rank ``r``, per micro batch):

    t_mb(r) = hardware FLOPs(r) / (peak x COMPUTE_EFFICIENCY[gpu])    forward + backward (+ recompute)
            + TP collectives                                          not overlapped (the engine has no async TP)
            + CP collectives                                          not overlapped (ring: hops beyond each block, ringtime.py)
            + EP all-to-alls                                          not overlapped (dispatch -> experts -> combine)

    step = m x max_r t_mb(r) x (1 + bubble)                           bubble: llmtrain.plan.bubble
         + DP exposed + PP fill/drain P2P + optimizer

DP exposure follows the engine: the zero 0/1 gradient all-reduce is bucketed
(``parallel.dp_bucket_mb``) and each bucket starts during the last micro batch's backward
(engine/parallel/grad_buckets.py; comm phase ``step-overlap``), so only the last bucket and
whatever exceeds that one backward pass are exposed: ``exposed = last + max(0, rest - t_b)``.
With PP the same happens per chunk (virtual stage) when its gradients are final, earlier chunks
hiding behind the later chunks' backward (:func:`bucketed_exposed`); with the zero-bubble
family's weight passes (no hooks) a chunk's buckets start after it, so on every pp rank but
the first the last chunk's reduction is exposed whole. ZeRO-1's
broadcast of the updated parameters runs after the optimizer step (exposed).
The step waits for the pipeline rank whose end-of-step gradient reduction ends last: under GPipe,
1F1B and interleaving rank ``r`` ends ``r`` chunk backwards before rank 0 (schedule.cooldown_lead),
and its reduction runs beside them (:func:`cooldown_exposed`).
``dp_overlap=True`` (Megatron-style, used for the published-system comparisons in
docs/planner.md; in a recipe ``planner.assume_dp_overlap``, and each collective priced so says
it in its note) also overlaps the PP case and ZeRO-1's broadcast (with the next forward). FSDP2 prefetches the next
block's all-gather and reduce-scatters the previous block's gradients while computing, so only
the first block's all-gather, the last block's reduce-scatter and whatever exceeds the compute
of that pass are exposed. PP point-to-point sends overlap with compute in the steady state;
the ``2 (p v - 1)`` sends along the fill and drain path are exposed (``planner.pp_p2p
blocking``, Megatron's waiting sends: all of them). The optimizer step is
memory-bound: 32 bytes of HBM traffic per stepped parameter: the fused AdamW (engine/optim.py) reads
the fp32 parameter, gradient, m and v and writes the parameter, m and v (28), and the gradient norm
(engine/parallel/clip.py) reads the gradient (4; its rescale, only on steps that clip, is not
counted). v1 moves them at the datasheet bandwidth (``HBM_BYTES_PER_S``); v2, since the
twenty-seventh session, at ``gemmtime.HBM_EFFICIENCY`` of it like every memory-bound op.

Calibration (``COMPUTE_EFFICIENCY``: the fraction of the dense bf16 peak that a transformer
layer's kernels reach on large shapes, GEMMs and attention together). Fitted once against the
published systems in docs/planner.md (Megatron-LM on A100, Llama 3 on H100) and kept there;
``HBM_BYTES_PER_S`` are datasheet memory bandwidths.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from llmtrain.plan.asynctp import async_tp_exposed_factor, tp_backward_exposed_factor
from llmtrain.plan.comm import Comm
from llmtrain.plan.gemmtime import membound_seconds
from llmtrain.plan.schedule import cooldown_lead
from llmtrain.recipe.gpus import GPUSpec

COMPUTE_EFFICIENCY = {"h100-sxm": 0.62, "h200": 0.64, "a100-80g": 0.64, "b200": 0.55, "cpu": 0.5}
HBM_BYTES_PER_S = {"h100-sxm": 3.35e12, "h200": 4.8e12, "a100-80g": 2.04e12, "b200": 8.0e12, "cpu": 5e10}
OPTIMIZER_BYTES_PER_PARAM = 32
BUCKET_BYTES = 25 << 20  # DDP's default bucket (bucket_cap_mb=25), for dp_overlap
# Share of the EP all-to-all time on the critical path. The engine dispatches, computes and
# combines one after another, and torch's ScheduleDualPipeV runs an "overlapped" forward/backward
# pair sequentially unless a custom overlap callback is given, so nothing is hidden: 1.0.
# (DeepSeek-V3's DualPipe with its own kernels hides nearly all of it: 0.)
EP_EXPOSED = 1.0
# What `plan` prints beside a collective priced under planner.assume_dp_overlap (or dp_overlap=True)
OVERLAP_NOTE = "; priced overlapped as Megatron-Core does (planner.assume_dp_overlap; the bundled engine does not)"


@dataclass
class RankWork:
    """One pipeline rank's work per micro batch, and its communication per step."""

    fwd_flops: float  # hardware FLOPs of one micro batch's forward on this rank
    bwd_flops: float  # backward, including recomputation
    comms: list[Comm] = field(default_factory=list)
    block_fraction: float = 1.0  # largest block / all parameters of the rank (FSDP prefetch granularity)
    stepped_params: int = 0  # parameters whose AdamW update this rank computes
    # cluster.time_model v2 (plan/ops.py): forward / backward seconds per micro batch priced per
    # operation; None = v1, the FLOPs above at peak x COMPUTE_EFFICIENCY
    fwd_s: float | None = None
    bwd_s: float | None = None
    # v2 only: share of compute throughput lost while a collective runs beside it (ops.overlap_slowdown)
    overlap_slowdown: float = 0.0


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


def matmul_peak(gpu: GPUSpec, precision: str = "bf16", fp8_fraction: float = 0.0) -> float:
    """Dense peak FLOP/s the step's FLOPs run at: bf16, or with ``precision: fp8`` the harmonic
    blend of the FP8 peak for the converted matmuls (``fp8_fraction`` of the FLOPs) and the bf16
    peak for the rest (attention, the output head)."""
    if precision != "fp8" or gpu.peak_flops_fp8 <= 0 or fp8_fraction <= 0:
        return gpu.peak_flops_bf16
    return 1.0 / ((1 - fp8_fraction) / gpu.peak_flops_bf16 + fp8_fraction / gpu.peak_flops_fp8)


def efficiency(gpu: GPUSpec) -> float:
    return COMPUTE_EFFICIENCY.get(gpu.rates_key, 0.55)


def _fsdp_exposed(c: Comm, block_fraction: float, window: float) -> float:
    per = c.seconds / c.count if c.count else 0.0
    return c.count * (per * block_fraction + max(0.0, per * (1 - block_fraction) - window))


def fsdp_block_exposed(c: Comm, block_fraction: float, window: float) -> float:
    """v2: FSDP2's prefetch per block. Block i's all-gather (reduce-scatter) is issued when block
    i-1's compute starts and block i cannot start before it ends, so each block waits
    ``max(0, gather_i - compute_(i-1))`` and the first block's gather is exposed whole:
    ``g_0 + sum_i max(0, g_i - c_(i-1))``, with ``n = 1 / block_fraction`` blocks, the largest
    block's share first and the rest split evenly, and the pass's compute ``window`` split evenly.
    v1 (:func:`_fsdp_exposed`) lets one block's surplus hide behind another's slack; this does not."""
    return c.count * _blocks_wait(c.seconds / c.count, block_fraction, window) if c.count else 0.0


def _blocks_wait(per: float, block_fraction: float, window: float) -> float:
    """One pass of per-block FSDP communication of ``per`` seconds for the whole rank against a
    compute ``window``: the first block's share exposed whole, then ``max(0, comm_i - compute_(i-1))``
    per block (:func:`fsdp_block_exposed`)."""
    n = max(1, round(1 / max(block_fraction, 1e-9)))
    if n == 1:
        return per
    first = per * min(1.0, block_fraction)
    return first + (n - 1) * max(0.0, (per - first) / (n - 1) - window / n)


def fsdp_shared_link_exposed(gather: Comm, reduce: Comm | None, block_fraction: float, t_f: float, t_b: float,
                             m: int) -> tuple[float, float]:
    """v2: (gather, reduce-scatter) exposed seconds per step when FSDP's backward all-gathers and
    reduce-scatters share the rank's link. In the backward FSDP2 prefetches block ``i - 1``'s
    gather (zero 3) while block ``i``'s reduce-scatter runs, on the same NVLink / NICs, so each
    backward block waits for both: the link time per block is the sum. The forward carries the
    gathers alone. Micro batches without a reduce-scatter (the engine reduces on the last one
    unless ``parallel.fsdp_reduce_each_microbatch``) carry only their gathers. The backward's
    exposure is split between the two collectives by their link seconds."""
    per_g = gather.seconds / gather.count if gather.count else 0.0
    fwd_n = min(gather.count, m)
    bwd_g = (gather.count - fwd_n) / m * per_g  # per micro batch backward (zero 3; 0 for zero 2 / pp > 1)
    per_r = reduce.seconds / reduce.count if reduce is not None and reduce.count else 0.0
    n_r = reduce.count if reduce is not None else 0
    fwd = fwd_n * _blocks_wait(per_g, block_fraction, t_f)
    with_r = _blocks_wait(bwd_g + per_r, block_fraction, t_b) if per_r else 0.0
    alone = _blocks_wait(bwd_g, block_fraction, t_b) if bwd_g else 0.0
    bwd_with, bwd_alone = n_r * with_r, max(0.0, m - n_r) * alone
    share = bwd_g / (bwd_g + per_r) if bwd_g + per_r > 0 else 0.0
    return fwd + bwd_with * share + bwd_alone, bwd_with * (1.0 - share)


def bucketed_exposed(c: Comm, t_b: float) -> float:
    """Exposed seconds of the engine's bucketed zero 0/1 gradient all-reduce on one pipeline rank.

    The rank's chunks finish their gradients at ``c.ready`` (:func:`llmtrain.plan.schedule.
    gradient_ready`: ``lead`` single-chunk micro-batch backwards of ``b = t_b / chunks`` before
    the rank's last op); each chunk's share ``d = seconds / chunks`` (layers split evenly) runs
    on the DP link after the chunk before it (buckets start in order). A hooked chunk's buckets
    start during its last backward (the first ``b`` before it ends, the last bucket only at its
    end); an unhooked one's all at its end. Exposed = how far the last reduction ends after the
    rank's last op. One chunk without PP gives ``max(last bucket, seconds - t_b)``, i.e.
    ``last + max(0, rest - t_b)`` (no PP, gpipe, 1f1b).
    """
    ready = c.ready or ((0.0, True),)
    b, d = t_b / len(ready), c.seconds / len(ready)
    last = min(d, c.seconds * (c.bucket_bytes or BUCKET_BYTES) / max(1.0, c.message_bytes))
    finish = float("-inf")
    for lead, hooked in ready:
        end = -lead * b
        start = max(finish, end - b if hooked else end)
        finish = max(start + d, end + last) if hooked else start + d
    return max(0.0, finish)


def cooldown_exposed(grads: list[Comm], window: float) -> None:
    """Take ``window`` seconds (the backwards the pipeline ranks before this one still run after
    its last op, :func:`llmtrain.plan.schedule.cooldown_lead`) off the exposed end-of-step
    gradient reductions ``grads`` of one pipeline rank, the last-issued first: the step waits for
    the rank whose reduction ends last, counted from rank 0's end (the pipeline's)."""
    for c in reversed(grads):
        take = min(c.exposed_s, window)
        if take > 0:
            c.exposed_s -= take
            window -= take
            c.note += f"; {take:.3g} s behind the earlier pipeline stages' last backwards"


def step_time(ranks: list[RankWork], gpu: GPUSpec, microbatches: int, bubble: float, schedule: str | None,
              tokens_per_step: int, world: int, model_flops_step: float, hw_flops_step: float,
              chunks_per_rank: int = 1, dp_overlap: bool = False, pp: int | None = None,
              precision: str = "bf16", fp8_fraction: float = 0.0, v2: bool = False,
              straggler: float = 1.0) -> StepTime:
    """``v2`` (cluster.time_model v2) adds FSDP's per-block waits (:func:`fsdp_block_exposed`) and
    the compute slowed while collectives overlap it (``overlap`` in the breakdown: the hidden
    DP seconds x :attr:`RankWork.overlap_slowdown`). ``straggler``: how much longer every rank's
    compute takes at the slowest GPU's pace (plan/stragglers.py; ``stragglers`` in the breakdown)."""
    fsdp_exposed = fsdp_block_exposed if v2 else _fsdp_exposed
    rate = matmul_peak(gpu, precision, fp8_fraction) * efficiency(gpu)
    m = microbatches
    per_rank = []
    n_ranks = pp or len(ranks)
    backwards = [straggler * (w.bwd_s if w.bwd_s is not None else w.bwd_flops / rate) for w in ranks]
    for i, w in enumerate(ranks):
        t_f = straggler * (w.fwd_s if w.fwd_s is not None else w.fwd_flops / rate)
        t_b = backwards[i]
        fused = [c for c in w.comms if c.phase == "tp-overlap"]  # parallel.async_tp (comm.py)
        fused_factor = async_tp_exposed_factor(sum(c.seconds for c in fused), m * (t_f + t_b),
                                               fused[0].group) if fused else 1.0
        beside = [c for c in w.comms if c.phase == "tp-bwd-overlap"]  # planner.tp_backward_overlap (comm.py)
        beside_factor = tp_backward_exposed_factor(sum(c.seconds for c in beside), m * t_b)
        shared = None
        if v2:  # FSDP's backward gathers and reduce-scatters on one link (fsdp_shared_link_exposed)
            gathers = [c for c in w.comms if c.phase == "fsdp-gather"]
            scatters = [c for c in w.comms if c.phase == "fsdp-reduce" and c.op == "reduce-scatter"]
            if gathers:
                shared = fsdp_shared_link_exposed(gathers[0], scatters[0] if scatters else None, w.block_fraction,
                                                  t_f, t_b, m)
        for c in w.comms:  # the share of each collective on the critical path
            if c.phase == "tp-overlap":
                c.exposed_s = fused_factor * c.seconds
            elif c.phase == "tp-bwd-overlap":
                c.exposed_s = beside_factor * c.seconds
            elif c.dim in ("tp", "cp"):  # the ring's hops behind its blocks: exposed_share (plan/ringtime.py)
                c.exposed_s = c.exposed_share * c.seconds
            elif c.dim == "ep":
                c.exposed_s = EP_EXPOSED * c.seconds
            elif c.phase == "step-overlap" and not dp_overlap:  # the engine's buckets, chunk by chunk
                c.exposed_s = bucketed_exposed(c, t_b)
            elif c.phase in ("step", "step-overlap"):
                if dp_overlap:
                    c.note += OVERLAP_NOTE
                if dp_overlap or c.phase == "step-overlap":  # all but the last bucket hide behind the last backward
                    bucket = c.bucket_bytes or BUCKET_BYTES  # (dp_overlap: ZeRO-1's broadcast behind the next forward)
                    last = c.seconds * min(1.0, bucket / max(1.0, c.message_bytes))
                    c.exposed_s = last + max(0.0, c.seconds - last - (t_f if c.after_step else t_b))
                else:
                    c.exposed_s = c.seconds
            elif c.phase == "fsdp-gather":
                c.exposed_s = shared[0] if shared else fsdp_exposed(c, w.block_fraction,
                                                                    t_f if c.count <= m else (t_f + t_b) / 2)
            elif c.phase == "fsdp-reduce":
                c.exposed_s = shared[1] if shared and c.op == "reduce-scatter" else fsdp_exposed(c, w.block_fraction, t_b)
            elif c.dim == "pp" and c.phase == "pipeline-blocking":  # planner.pp_p2p blocking: every send waits
                c.exposed_s = c.seconds
            elif c.dim == "pp":  # the sends along the fill and drain path
                c.exposed_s = 2 * (n_ranks * chunks_per_rank - 1) * c.per_item_s
        # NCCL collectives hidden beside this rank's compute hold their CTAs there (ops.overlap_slowdown):
        # DP's, and since the twenty-seventh session planner.tp_backward_overlap's async reductions
        # beside the gradient GEMMs (NCCL too; since the twenty-ninth also planner.tp_overlap's bulk
        # reduce-scatters, which userbuffers runs on SMs). Async TP's chunks move by copy engine over
        # symmetric memory (planner.tp_overlap's pipelined ones are priced as them) and the ring CP / PP
        # hops are P2P: not charged.
        hidden = sum(c.seconds - c.exposed_s for c in w.comms if c.dim == "dp" or c.phase == "tp-bwd-overlap")
        lead = cooldown_lead(schedule, n_ranks, i)
        cooldown_exposed([c for c in w.comms if c.dim == "dp" and c.phase in ("step", "step-overlap")
                          and not c.after_step], sum(backwards[i - lead:i]) / max(1, chunks_per_rank))
        by = {d: sum(c.exposed_s for c in w.comms if c.dim == d) for d in ("tp", "cp", "ep", "dp", "pp")}
        optimizer = (membound_seconds(w.stepped_params * OPTIMIZER_BYTES_PER_PARAM, gpu) if v2 else
                     w.stepped_params * OPTIMIZER_BYTES_PER_PARAM / HBM_BYTES_PER_S.get(gpu.name, gpu.hbm_bytes_per_s or 2e12))
        per_rank.append(dict(compute=t_f + t_b, tp=by["tp"] / m, cp=by["cp"] / m, ep=by["ep"] / m, dp=by["dp"],
                             pp=by["pp"], optimizer=optimizer, overlap=max(0.0, hidden) * w.overlap_slowdown))
    slowest = max(range(len(per_rank)), key=lambda i: sum(per_rank[i][k] for k in ("compute", "tp", "cp", "ep")))
    s = per_rank[slowest]
    t_mb = s["compute"] + s["tp"] + s["cp"] + s["ep"]
    pipeline = m * t_mb
    bubble_s = pipeline * bubble
    pp_s = max(r["pp"] for r in per_rank)
    dp_s = max(r["dp"] for r in per_rank)
    opt_s = max(r["optimizer"] for r in per_rank)
    overlap_s = max(r["overlap"] for r in per_rank)
    step = pipeline + bubble_s + dp_s + pp_s + opt_s + overlap_s
    breakdown = {"compute": m * s["compute"] / straggler, "tp_comm": m * s["tp"], "cp_comm": m * s["cp"], "ep_comm": m * s["ep"],
                 "bubble": bubble_s, "dp_comm": dp_s, "pp_comm": pp_s, "optimizer": opt_s}
    if v2:
        breakdown["overlap"] = overlap_s
    if straggler != 1.0:
        breakdown["stragglers"] = m * s["compute"] * (1.0 - 1.0 / straggler)
    tflops = model_flops_step / world / step / 1e12
    return StepTime(step, breakdown, tokens_per_step / step / world, tflops, hw_flops_step / world / step / 1e12,
                    tflops * 1e12 / gpu.mfu_peak, slowest)  # the datasheet peak, also under cluster.gpu_power_w
