"""Time model v2 (plan/ops.py, plan/commtime.py, ``cluster.time_model``): pure and fast.

Hand-computed values are checked to 1e-9 relative (float rounding only: the formulas are
evaluated the same way by hand here); the v1 regression number to 1e-6 relative (it was
printed by benchmarks/planner_vs_published.py before v2 existed).
"""

from __future__ import annotations

from math import ceil

import pytest

from llmtrain.plan import commtime, ops
from llmtrain.engine.trainer import resolve_dims
from llmtrain.plan.api import plan_recipe
from llmtrain.plan.costmodel import estimate
from llmtrain.recipe.gpus import GPUS
from llmtrain.recipe.load import validate_recipe_dict

H100 = GPUS["h100-sxm"]


def test_gemm_compute_bound_hand_computed():
    """8192^3 bf16 on h100-sxm: compute-bound (intensity 2731 FLOP/B x 3.35 TB/s >> peak), the
    128x256 tile gives 2048 tiles in 16 waves of 132 SMs: 2048 / 2112 useful; at MAMF 0.803 x the
    GPU check's fit 0.884 (gemmtime.GEMM_FIT); A100 at its MAMF 0.869 x the fit from Korthikanti et al.'s
    per-layer times, 0.854 (benchmarks/layer_fit.py)."""
    n = 8192
    flops = 2.0 * n**3
    wave = (n * n) / (128 * 256 * 132 * ceil(ceil(n / 128) * ceil(n / 256) / 132))
    assert wave == pytest.approx(2048 / 2112)
    expected = flops / (989e12 * 0.803 * 0.884 * wave)
    assert ops.gemm_seconds(n, n, n, H100) == pytest.approx(expected, rel=1e-9)
    assert 1.58e-3 < expected < 1.64e-3  # ~681 TFLOP/s (the record's sustained 8192^3: 684)
    a100 = GPUS["a100-80g"]
    assert ops.gemm_seconds(n, n, n, a100) == pytest.approx(
        flops / (312e12 * 0.869 * 0.854 * ops.wave_efficiency(n, n, a100)), rel=1e-9)


def test_fp8_gemms_run_at_the_measured_fp8_fraction():
    """A GEMM at the FP8 peak runs at the measured FP8 matmul fraction (ml-engineering's FP8 MAMF
    rows: H100 SXM 1402.6 of 1979, H200 1453.4; no FP8 GEMM was measured here, so no fit), bf16 at
    the bf16 one x the GPU check's fit (H200 "the same" as H100 SXM)."""
    n = 8192
    wave = ops.wave_efficiency(n, n, H100)
    fp8 = ops.gemm_seconds(n, n, n, H100, peak=H100.peak_flops_fp8)
    assert fp8 == pytest.approx(2.0 * n**3 / (1979e12 * 0.709 * wave), rel=1e-9)
    h200 = GPUS["h200"]
    assert ops.mamf(h200) == ops.mamf(H100) == pytest.approx(0.803 * 0.884, rel=1e-12)
    assert ops.mamf(h200, h200.peak_flops_fp8) == 0.734 and ops.mamf(H100, H100.peak_flops_fp8) == 0.709
    assert ops.mamf(GPUS["a100-80g"], 312e12) == pytest.approx(0.869 * 0.854, rel=1e-12)  # no FP8 tensor cores: bf16's


def test_gemm_memory_bound_and_membound_op():
    """A 16-row GEMM is bound by its bytes at the datasheet HBM bandwidth; an element-wise op
    moves its bytes at 80 % of it."""
    m, n, k = 16, 8192, 8192
    nbytes = 2 * (m * k + k * n + m * n)
    assert ops.gemm_seconds(m, n, k, H100) == pytest.approx(nbytes / 3.35e12, rel=1e-9)
    assert ops.membound_seconds(1e9, H100) == pytest.approx(1e9 / (3.35e12 * 0.8), rel=1e-9)


def test_gemm_of_less_than_one_row_is_priced_not_a_crash():
    """An expert's expected rows can be under one (seq_len 1, top-2 of 8 experts: 0.25 tokens each);
    such a GEMM runs one tile, priced between zero and a one-row GEMM. (int(0.25) tiles used to
    divide by zero: `llmtrain plan` of a valid recipe died with a ZeroDivisionError traceback, found
    by the recipe fuzz run unseeded, thirty-fourth session.)"""
    quarter, one = ops.gemm_seconds(0.25, 128, 64, H100), ops.gemm_seconds(1, 128, 64, H100)
    assert 0 < quarter <= one
    fwd, bwd = ops.gemm_fwd_bwd(0.25, 128, 64, H100)
    assert fwd > 0 and bwd > 0


def test_allreduce_in_node_vs_two_nodes():
    """1 GiB all-reduce: 8 GPUs on NVLink (360 GB/s NCCL bus bandwidth one way, 14 ring steps of
    3.4 us + 8.4 us base); 16 GPUs on 2 nodes with 8 per node (all 8 NICs: 8 x 40 GB/s, 28 NVLink
    steps + 2 network steps of 9.6 us, x 1.9 plateau); the same 16 with one GPU per node (data
    parallel over TP 8) goes through one NIC and is ~8x slower."""
    m = float(1 << 30)
    in_node = 8.4e-6 + 14 * 3.4e-6 + 2 * 7 / 8 * m / 360e9
    assert commtime.collective_seconds("all-reduce", m, 8, H100) == pytest.approx(in_node, rel=1e-9)
    vol = 2 * 15 / 16 * m
    two = (8.4e-6 + 28 * 3.4e-6 + 2 * 9.6e-6) * 1.9 + max(7 / 8 * vol / 360e9, vol / (8 * 40e9))
    assert commtime.collective_seconds("all-reduce", m, 16, H100, local=8) == pytest.approx(two, rel=1e-9)
    one_nic = commtime.collective_seconds("all-reduce", m, 16, H100, local=1)
    assert 7.5 < one_nic / two < 8.5


def test_monotonic_in_size():
    gemms = [ops.gemm_seconds(m, 4096, 4096, H100) for m in (64, 512, 2048, 8192, 32768)]
    assert gemms == sorted(gemms) and len(set(gemms)) == len(gemms)
    for op in ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "p2p"):
        for local in (None, 8, 1):
            t = [commtime.collective_seconds(op, float(x), 16, H100, local) for x in (1e3, 1e6, 1e8, 1e10)]
            assert t == sorted(t) and len(set(t)) == len(t), (op, local)


def test_local_members():
    """Rank 0's group members on its node: data parallel over TP 8 has 1 per node, FSDP over 64
    GPUs without TP 8, TP 8 all of them."""
    from llmtrain.plan.dims import ParallelDims

    dims = ParallelDims(pp=1, dp_replicate=1, dp_shard=8, cp=1, tp=8)
    assert commtime.local_members(dims, 8, ("dp_shard", "cp")) == 1
    assert commtime.local_members(dims, 8, ("tp",)) == 8
    dims = ParallelDims(pp=1, dp_replicate=1, dp_shard=64, cp=1, tp=1)
    assert commtime.local_members(dims, 8, ("dp_shard", "cp")) == 8


def _plan(time_model: str | None):
    cluster = dict(nodes=1, gpus_per_node=8, gpu="h100-sxm")
    if time_model:
        cluster["time_model"] = time_model
    recipe = validate_recipe_dict(dict(
        model=dict(preset="llama3-8b"), parallel=dict(zero=3, dp_shard=-1),
        train=dict(seq_len=8192, micro_batch_size=2, global_batch_size=16, activation_checkpointing="selective"),
        cluster=cluster))
    plan = plan_recipe(recipe)
    v = plan.validation
    return estimate(recipe, v.dims, v.batch, plan.placement, dp_overlap=True, hints=False)


def test_switch_absent_is_v2_and_v2_keeps_bytes():
    """Without ``cluster.time_model`` the planner is v2 (the default since the fourteenth session);
    ``v1`` still prints the number it printed before v2 (torchtitan Llama 3.1 8B row: 11,795.456
    tokens/s/GPU); v2 changes time only, never bytes or FLOPs."""
    default, v1, v2 = _plan(None), _plan("v1"), _plan("v2")
    assert default.time.to_dict() == v2.time.to_dict()
    assert v1.time.tokens_per_s_per_gpu == pytest.approx(11795.456, rel=1e-6)
    assert v2.time.step_s != v1.time.step_s
    assert v2.worst.peak == v1.worst.peak and v2.flops == v1.flops
    assert [(c.op, c.message_bytes, c.count) for c in v2.comms] == [(c.op, c.message_bytes, c.count) for c in v1.comms]


# -- issue 18 section 9.1 terms: overlap interference, FSDP per-block waits, launches, attention kernels ----


def _shape(**kw):
    base = dict(b=1, s=8192, seq=8192, h=4096, heads=32, kv_heads=8, hd=128, ffn=14336, vocab=128256, tp=1, sp=False, e=2)
    return ops.BlockShape(**(base | kw))


def test_overlap_slowdown_from_the_ctas_nccl_holds():
    """With NCCL's 24 CTAs resident, 108 of 132 H100 SMs are left: the GEMMs and attention lose at least
    24/132 of their rate (wave re-quantization can only add to it), the memory-bound ops nothing, so the
    lost share sits between the SM share times the compute share and a little above the SM share."""
    x = _shape()
    lost = ops.overlap_slowdown(x, H100, 32, 0, True)
    assert 0.5 * 24 / 132 < lost < 0.3
    # a GEMM on 108 SMs vs 132: peak scales, and the waves are re-counted on 108 SMs
    full, fewer = ops.gemm_seconds(8192, 4096, 4096, H100), ops.gemm_seconds(8192, 4096, 4096, H100, sms=108)
    assert fewer / full >= 132 / 108 - 1e-9
    cpu = GPUS["cpu"]
    assert ops.overlap_slowdown(x, cpu, 1, 0, False) == 0.0  # 1 "SM": no NCCL CTAs to hold


def test_fsdp_per_block_waits_exceed_the_pooled_window():
    """4 equal blocks, 1 s of gathers per pass (0.25 s each), 0.6 s of compute (0.15 s per block):
    each later block waits 0.25 - 0.15 = 0.1 s, so 0.25 + 3 x 0.1 = 0.55 s; v1 pools the slack
    (0.25 + max(0, 0.75 - 0.6) = 0.4 s). With compute to spare both give only the first gather."""
    from llmtrain.plan.comm import Comm
    from llmtrain.plan.steptime import _fsdp_exposed, fsdp_block_exposed

    c = Comm("dp", "all-gather", 8, 1.0, 1, "nvlink", 1.0, "fsdp-gather")
    assert fsdp_block_exposed(c, 0.25, 0.6) == pytest.approx(0.55, rel=1e-9)
    assert _fsdp_exposed(c, 0.25, 0.6) == pytest.approx(0.40, rel=1e-9)
    assert fsdp_block_exposed(c, 0.25, 4.0) == pytest.approx(0.25, rel=1e-9)


def test_launches_bound_small_blocks_only():
    """A pass takes max(GPU, CPU launches): tiny blocks are launch-bound, compile launches fewer
    kernels; at the published sizes the GPU is busier and launches cost nothing."""
    tiny = _shape(s=128, seq=128, h=256, heads=4, kv_heads=4, hd=64, ffn=768, vocab=1000)
    f_gpu, _ = ops.rank_seconds(tiny, H100, 4, 0, False)
    f_cpu, b_cpu = ops.launch_seconds(tiny, 4, compiled=False, fsdp=False)
    assert f_cpu == pytest.approx(4 * 20 * 10e-6) and b_cpu == pytest.approx(4 * 28 * 10e-6)
    assert f_cpu > f_gpu
    assert ops.launch_seconds(tiny, 4, compiled=True, fsdp=False)[0] < f_cpu
    full = ops.launch_seconds(tiny.__class__(**{**tiny.__dict__, "recompute": "full"}), 4, False, True)
    assert full == pytest.approx((4 * 22 * 10e-6, 4 * (28 + 20 + 4) * 10e-6))
    big = _shape()
    assert ops.launch_seconds(big, 32, False, True)[0] < ops.rank_seconds(big, H100, 32, 0, False)[0]


def _fwd_bwd_tflops(kernel: str, gpu, s: int) -> tuple[float, float]:
    """(forward + backward, forward) TFLOP/s of one causal call over ``s`` tokens, in the
    benchmarks' convention (forward 4 s^2 d per head, halved causal; backward 2.5x)."""
    f, b = ops.attention_seconds(1, s, s, 16, 128, 0.5, gpu, kernel=kernel)
    flops = 4.0 * s * s * 16 * 128 * 0.5
    return 3.5 * flops / (f + b) / 1e12, flops / f / 1e12


def test_attention_rates_are_the_published_curves():
    """Each kernel prices a causal call at its published rate for that length: flash-attn's FA2 /
    FA1 forward + backward bars (A100 and H100, head dim 128) and FA3 / cuDNN forward bars; log2
    interpolation between the measured lengths, the nearest beyond them; the backward/forward
    split of ops.ATTENTION_SPLIT. ``engine`` is FA2 off Hopper (A100 here)."""
    a100 = GPUS["a100-80g"]
    assert _fwd_bwd_tflops("fa2", H100, 8192)[0] == pytest.approx(308, rel=1e-9)
    assert _fwd_bwd_tflops("fa2", H100, 2048)[0] == pytest.approx(265, rel=1e-9)
    assert _fwd_bwd_tflops("engine", a100, 2048)[0] == pytest.approx(155, rel=1e-9)
    assert _fwd_bwd_tflops("fa1", H100, 2048)[0] == pytest.approx(108, rel=1e-9)
    assert _fwd_bwd_tflops("fa1", a100, 4096)[0] == pytest.approx(76, rel=1e-9)
    assert _fwd_bwd_tflops("fa3", H100, 8192)[1] == pytest.approx(602, rel=1e-9)
    assert _fwd_bwd_tflops("cudnn", H100, 2048)[1] == pytest.approx(484, rel=1e-9)
    # log2 interpolation: 2^11.5 tokens sit halfway between the 2k and 4k bars
    assert _fwd_bwd_tflops("fa2", H100, round(2 ** 11.5))[0] == pytest.approx((265 + 294) / 2, rel=1e-3)
    # beyond the measured lengths the nearest bar: 16k's for 262k, 512's for 128
    assert _fwd_bwd_tflops("fa2", H100, 262144)[0] == pytest.approx(328, rel=1e-9)
    assert _fwd_bwd_tflops("fa2", H100, 128)[0] == pytest.approx(163, rel=1e-9)
    # the split: FA2's backward at 0.50 / 0.65 of its forward rate
    f, b = ops.attention_fractions("fa2", "h100-sxm", 8192)
    assert b / f == pytest.approx(0.50 / 0.65, rel=1e-12)
    # shorter calls are slower per FLOP, for every kernel
    for kernel in ("engine", "fa2", "fa1", "fa3", "cudnn"):
        rates = [_fwd_bwd_tflops(kernel, H100, s)[0] for s in (512, 2048, 8192, 16384)]
        assert rates == sorted(rates), kernel
    # no FA3 / cuDNN measurement on A100: those stacks run FA2 there; MI300X keeps fixed fractions
    assert ops.attention_seconds(1, 2048, 2048, 24, 96, 0.5, a100, kernel="fa3") == \
        ops.attention_seconds(1, 2048, 2048, 24, 96, 0.5, a100)
    assert ops.attention_fractions("engine", "mi300x", 512) == ops.attention_fractions("engine", "mi300x", 16384)
    a100_mat_f, a100_mat_b = ops.attention_seconds(1, 2048, 2048, 24, 96, 0.5, a100, kernel="materialized")
    qk = ops.gemm_seconds(24 * 2048, 2048, 96, a100)
    assert a100_mat_f == pytest.approx(2 * qk + ops.membound_seconds(9 * 24 * 2048 * 2048, a100), rel=1e-9)
    assert a100_mat_b > a100_mat_f


def test_context_parallel_prices_attention_at_its_block_length():
    """Ring and all-gather CP run their kernels over blocks of the rank's tokens (seq / cp keys),
    Ulysses over the whole sequence: at 8,192 tokens and cp 4, the ring's blocks are priced at the
    2k bar, Ulysses at the 8k bar. The engine's ring and all-gather blocks call FA2's op themselves
    (engine/parallel/context_blocks.py), so ``engine`` prices them as FA2 even on Hopper, where its
    Ulysses (plain SDPA) runs cuDNN's kernel."""
    base = dict(model=dict(preset="llama3-8b"), train=dict(seq_len=8192, micro_batch_size=1, global_batch_size=2),
                cluster=dict(nodes=1, gpus_per_node=8, gpu="h100-sxm", time_model="v2"))
    shapes = {}
    for method in ("ring", "allgather", "ulysses"):
        recipe = validate_recipe_dict(base | dict(parallel=dict(cp=4, cp_method=method)))
        shapes[method] = ops.shape_of(recipe, resolve_dims(recipe, 8), H100, 0.5)
    assert shapes["ring"].kv_len == shapes["allgather"].kv_len == 2048 and shapes["ulysses"].kv_len == 0
    assert shapes["ring"].attention == shapes["allgather"].attention == "fa2"
    assert shapes["ulysses"].attention == "engine"
    ring = ops.attention_seconds(1, 2048, 8192, 32, 128, 0.5, H100, kv_len=2048, kernel="fa2")
    whole = ops.attention_seconds(1, 2048, 8192, 32, 128, 0.5, H100, kernel="fa2")
    assert sum(ring) / sum(whole) == pytest.approx(308 / 265, rel=1e-9)


def test_v2_breakdown_has_the_overlap_term_and_v1_none():
    """v2's breakdown adds the interference seconds (hidden FSDP traffic x lost share); v1 stays as it was."""
    v1, v2 = _plan("v1"), _plan("v2")
    assert "overlap" not in v1.time.breakdown
    assert v2.time.breakdown["overlap"] > 0
    assert v2.time.step_s == pytest.approx(sum(v2.time.breakdown.values()), rel=1e-9)


@pytest.mark.parametrize("tp, moe", [(1, False), (2, False), (1, True)])
def test_selective_mm_recomputes_the_wk_w3_wo_forward_gemms(tp, moe):
    """``selective_mm`` (torchtitan's op policy) costs selective's backward plus the forward GEMMs
    of wk, the dense w3 and, without TP, wo, hand-built from gemm_seconds; forward unchanged; the
    backward launches those 3 (tp 2: 2; MoE: no dense w3) GEMM kernels more."""
    extra = dict(experts=8, top_k=2, expert_ffn=1792) if moe else {}
    sel, mm = (_shape(tp=tp, sp=tp > 1, recompute=r, **extra) for r in ("selective", "selective_mm"))
    (fs, bs), (fm, bm) = ops.block_seconds(sel, H100, moe), ops.block_seconds(mm, H100, moe)
    tok, q, kv = 8192, 32 * 128 / tp, 8 * 128 / tp
    again = ops.gemm_seconds(tok, kv, 4096, H100)
    again += ops.gemm_seconds(tok, 4096, q, H100) if tp == 1 else 0.0
    again += 0.0 if moe else ops.gemm_seconds(tok, 14336 / tp, 4096, H100)
    assert fm == pytest.approx(fs, rel=1e-12) and bm == pytest.approx(bs + again, rel=1e-9)
    assert again > 0.05 * fs  # 23 % of the block's forward (tp 1), 19 % (tp 2), 10 % (MoE: wk, wo): a real term
    n = 1 + (tp == 1) + (not moe)
    assert ops.launch_seconds(mm, 4, False, False)[1] == pytest.approx(ops.launch_seconds(sel, 4, False, False)[1] + 4 * n * 10e-6)


def test_fsdp_backward_gathers_and_reduce_scatters_share_the_link():
    """v2: in the backward FSDP2 prefetches the next block's gather while this block's
    reduce-scatter runs, on the same link, so a block waits for their sum. Hand-computed, 4 blocks
    (block_fraction 1/4), 2 micro batches: gathers 4 x 2 s (2 forward, 2 backward), one 3 s
    reduce-scatter (last micro batch), t_f = 4 s, t_b = 4 s per micro batch.
    Forward, per micro batch: first block 0.5 s, the others 0.5 s each against 1 s of compute:
    0.5 s; x 2. Backward with the reduce-scatter: 5 s on the link, first block 1.25 s, then
    3 x (1.25 - 1) s: 2.0 s, split 2 : 3 between gather and reduce-scatter; the other micro
    batch's gathers alone: 0.5 s. Priced apart (each with the whole backward window) the same
    backward would expose only 0.5 + 0.75 s."""
    from llmtrain.plan.comm import Comm
    from llmtrain.plan.steptime import fsdp_shared_link_exposed

    gather = Comm("dp", "all-gather", 8, 1e9, 4, "nvlink", 8.0, "fsdp-gather")
    reduce = Comm("dp", "reduce-scatter", 8, 1e9, 1, "nvlink", 3.0, "fsdp-reduce")
    g, r = fsdp_shared_link_exposed(gather, reduce, 0.25, 4.0, 4.0, 2)
    assert g == pytest.approx(2 * 0.5 + 2.0 * 0.4 + 0.5, rel=1e-12)
    assert r == pytest.approx(2.0 * 0.6, rel=1e-12)
    assert g + r > 2 * 0.5 + 0.5 + 0.75  # sharing the link exposes more than pricing each alone
    # with room to spare (t_b = 8 s: 2 s of compute per block) only the first block's share waits
    g, r = fsdp_shared_link_exposed(gather, reduce, 0.25, 4.0, 8.0, 2)
    assert (g, r) == (pytest.approx(1.0 + 1.25 * 0.4 + 0.5), pytest.approx(1.25 * 0.6))


def test_each_fsdp_unit_and_gradient_bucket_pays_its_collective_latency():
    """v2 prices a message issued as several collectives (FSDP2's per-unit gathers and reduce-scatters:
    one per block plus the root; the DP gradient buckets) as that many collectives of its share, each
    with NCCL's latency: exactly ``units x collective_seconds(message / units)``, more than one
    collective of the whole. 8B (32 blocks, the root: 33 units) FSDP over 2 nodes; zero 1 in 25 MiB
    buckets."""
    def plan(**par):
        d = {"model": {"preset": "llama3-8b"}, "parallel": par,
             "train": {"seq_len": 8192, "micro_batch_size": 1, "global_batch_size": 16, "precision": "bf16"},
             "cluster": {"nodes": 2, "gpus_per_node": 8, "gpu": "h100-sxm", "time_model": "v2"}}
        rc = validate_recipe_dict(d)
        p = plan_recipe(rc)
        return estimate(rc, p.validation.dims, p.validation.batch, p.placement, hints=False), p.validation.dims

    fsdp, dims = plan(zero=3)
    gather = next(c for c in fsdp.comms if c.phase == "fsdp-gather")
    assert gather.units == 33
    local = commtime.local_members(dims, 8, ("dp_shard", "cp"))
    whole = commtime.collective_seconds("all-gather", gather.message_bytes, 16, H100, local)
    assert gather.per_item_s == pytest.approx(33 * commtime.collective_seconds(
        "all-gather", gather.message_bytes / 33, 16, H100, local), rel=1e-9)
    assert gather.per_item_s > whole
    grads = next(c for c in plan(zero=1, dp_bucket_mb=25)[0].comms if c.dim == "dp" and c.op == "all-reduce")
    assert grads.units == ceil(grads.message_bytes / (25 * 2**20))


def test_engine_sdpa_on_hopper_is_the_measured_cudnn_rate():
    """``engine`` on Hopper / Blackwell prices SDPA at the GPU check's measured rates
    (attentiontime.SDPA_MEASURED: forward 443 / 602 / 627, backward 395 / 526 / 540 TFLOP/s at 2k /
    8k / 32k keys), log2-interpolated, nearest beyond; off Hopper (A100) it is FA2's curve."""
    from llmtrain.plan.attentiontime import SDPA_MEASURED

    lengths, fwd, bwd, peak = SDPA_MEASURED["h100"]
    for s, f, b in zip(lengths, fwd, bwd, strict=True):
        ff, bb = ops.attention_fractions("engine", "h100-sxm", s)
        assert (ff * peak, bb * peak) == (pytest.approx(f, rel=1e-9), pytest.approx(b, rel=1e-9))
    mid = ops.attention_fractions("engine", "h100-sxm", 4096)[0] * peak
    assert mid == pytest.approx((443 + 602) / 2, rel=1e-9)  # 4096 is halfway between 2^11 and 2^13
    assert ops.attention_fractions("engine", "h100-sxm", 512) == ops.attention_fractions("engine", "h100-sxm", 2048)
    assert ops.attention_fractions("engine", "b200", 8192) == ops.attention_fractions("engine", "h100-sxm", 8192)
    assert ops.attention_fractions("engine", "a100-80g", 8192) == ops.attention_fractions("fa2", "a100-80g", 8192)
    # faster than the FA2 price at every measured length (1.5-1.8x forward + backward)
    for s in lengths:
        assert sum(ops.attention_seconds(1, s, s, 32, 128, 0.5, H100)) < \
            sum(ops.attention_seconds(1, s, s, 32, 128, 0.5, H100, kernel="fa2")) / 1.4
