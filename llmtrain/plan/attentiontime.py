"""Flash-attention kernel time for time model v2 (``ops.py`` calls :func:`attention_seconds`).

Each kernel (the engine's SDPA, or the stack's ``planner.attention_kernel``) runs at its measured
rate for the key length of one call (:data:`ATTENTION_MEASURED`; the engine's SDPA on Hopper and
Blackwell: :data:`SDPA_MEASURED`, this project's own GPU record), or, for ``materialized``
(Megatron-LM before FlashAttention), as batched GEMMs plus the bytes of the scores through HBM.
docs/planner.md section 9, term (g), and 9.2.
"""

from __future__ import annotations

from functools import lru_cache
from math import log2

from llmtrain.plan.gemmtime import SMS, gemm_seconds, membound_seconds
from llmtrain.recipe.gpus import GPUSpec

# Flash attention (forward, backward) fraction of the bf16 peak, head dim 128, causal, by the key length
# of one kernel call: the kernels' own published benchmarks (bf16/fp16, batch x length = 16k tokens,
# 2048 hidden; the papers' FLOP convention: forward 4 s^2 d per head, halved causal, backward 2.5x).
# ``ATTENTION_MEASURED[(kernel, family)] = (what, TFLOP/s at ATTENTION_LENGTHS, peak of that GPU)``:
# - FlashAttention-2 and FlashAttention(-1) forward + backward, causal, head dim 128: flash-attn's
#   assets/flash2_a100_fwd_bwd_benchmark.png (A100 80GB SXM4, panel d) and
#   assets/flash2_h100_fwd_bwd_benchmark.png (H100 80GB SXM5, panel d) (Dao 2023, arXiv:2307.08691);
# - FlashAttention-3 and cuDNN forward, causal, head dim 128: assets/flash3_fp16_fwd.png panel (d)
#   (H100 SXM5; Shah et al. 2024, arXiv:2407.08608: the cuDNN of mid-2024; later releases may be faster).
# ``fa2`` (``planner.attention_kernel: fa2``) is SDPA's FLASH_ATTENTION backend, what torch chose on
# CUDA before cuDNN's attention became its first choice (torch 2.5.1 made cuDNN opt-in, pytorch PR
# 138522, so torchtitan's 2024-2025 runs ran FA2: its PR 1000 only allows cuDNN under CP, after FLASH),
# and what the engine's ring / all-gather CP blocks call explicitly (engine/parallel/context_blocks.py:
# ``_scaled_dot_product_flash_attention``), and the engine's SDPA off Hopper / Blackwell (A100);
# ``fa1`` (``planner.attention_kernel: fa1``) is flash-attn 1.x's CUDA kernel; llm-foundry 0.3's Triton
# FlashAttention (``attn_impl: triton``) measures within 1-3 % of it at 2k-8k on A100 (the same figure's
# "FlashAttention Triton" bars: 68, 74, 78 against 69, 76, 80) and has no H100 bar; ``fa3``
# (``planner.attention_kernel: fa3``) FlashAttention-3; ``cudnn`` cuDNN's fused flash attention, what
# Transformer Engine runs on Hopper and later when both it and flash-attn apply ("Transformer Engine
# prefers cuDNN flash attention on Hopper+ architectures, and Tri Dao flash attention on Ampere":
# NVIDIA/NeMo docs/source/performance/memory_optimizations.rst, NeMo PR 9188).
# Between the measured lengths the rate is interpolated in log2(length); outside, the nearest is kept.
ATTENTION_LENGTHS = (512, 1024, 2048, 4096, 8192, 16384)
# The engine's ``F.scaled_dot_product_attention`` on Hopper / Blackwell (``planner.attention_kernel:
# engine`` there; off them it is ``fa2``): torch puts cuDNN's attention first on sm90 / sm100 when its
# bundled cuDNN is newer than 9.15 (aten sdp_utils.cpp ``check_prefer_cudnn_attention``, in torch 2.10;
# the bundled cuDNN crosses it from torch 2.11, and the engine needs torch >= 2.13). Measured, not
# published: the GPU check's ``kernel_rates`` (benchmarks/results/gpu_check.json, one H100 SXM, torch
# 2.11.0+cu130), causal, head dim 128, the rows with >= 8 heads (the 4-head row, 1 x 4 x 8192, ran at
# 0.58x the 32-head rate: too few tiles to fill the SMs, an occupancy effect v2 does not model for any
# kernel); backward from forward + backward as 3.5 / total = 1 / fwd + 2.5 / bwd. Fitted by
# ``python benchmarks/gpu_fit.py`` (tests/test_gpu_fit.py checks these equal its fit of the record):
# ``SDPA_MEASURED[family] = (key lengths, forward TFLOP/s, backward TFLOP/s, peak of that GPU)``.
SDPA_MEASURED = {
    "h100": ((2048, 8192, 32768), (443, 602, 627), (395, 526, 540), 989),
}
ATTENTION_MEASURED = {
    ("fa2", "a100"): ("fwd+bwd", (99, 133, 155, 173, 182, 189), 312),
    ("fa1", "a100"): ("fwd+bwd", (55, 62, 69, 76, 80, 83), 312),
    ("fa2", "h100"): ("fwd+bwd", (163, 221, 265, 294, 308, 328), 989),
    ("fa1", "h100"): ("fwd+bwd", (98, 109, 108, 126, 135, 137), 989),
    ("fa3", "h100"): ("fwd", (292, 423, 521, 579, 602, 616), 989),
    ("cudnn", "h100"): ("fwd", (315, 410, 484, 518, 529, 539), 989),
}
# Which measurement prices a GPU: Hopper's for H100 PCIe, H200 and (assumed) Blackwell; none for MI300X
# and CPU, which keep the fixed fractions of ``ATTENTION``; fa3 off Hopper / Blackwell is FA2.
ATTENTION_FAMILY = {"a100-80g": "a100", "a100-40g": "a100", "h100-sxm": "h100", "h100-pcie": "h100",
                    "h200": "h100", "b200": "h100", "gb200": "h100"}
# Backward rate / forward rate, to split a measured forward + backward rate (and to derive FA3's
# backward from its forward): FA2 on A100 "50-73 %" forward, backward lower (0.50 / 0.65, as before
# the curves); FA3's backward "1.5-1.75x" FA2's (0.48 / 0.62). FA1 taken at FA2's split, cuDNN at
# FA3's (assumed: no backward bars were published beside the forward ones used here).
ATTENTION_SPLIT = {"fa2": 0.50 / 0.65, "fa1": 0.50 / 0.65, "fa3": 0.48 / 0.62, "cudnn": 0.48 / 0.62}
# Fixed (forward, backward) fractions where no curve was measured (MI300X assumed below FA2-on-A100).
ATTENTION = {"mi300x": (0.45, 0.35), "cpu": (0.5, 0.5)}
# ``planner.attention_kernel: materialized`` (Megatron-LM 2021, before FlashAttention): the scores
# ``b x heads x s x s`` go through HBM; HBM bytes per score element forward (fused scale-mask-softmax:
# read + write e; dropout: read e, write e + a 1-byte mask) and backward (dropout and softmax
# gradients: read the gradient, probabilities and mask, write the gradient).
MATERIALIZED_BYTES = (lambda e: 4 * e + 1, lambda e: 5 * e + 1)
# The engine's soft-capped attention (``model.attention_softcap``, Gemma 2: engine/models/softcap.py):
# not fused, so every score goes through HBM in each of its element-wise steps, counted from the
# kernel's ops per score element (e: the inputs' bytes; fp32 steps 4 + 4): forward, the product's
# output (e), its upcast (e + 4), scale, tanh, times cap, plus mask (8 each), the log-sum-exp's two
# reads (8), minus lse and exp (16), the probabilities' cast (4 + e): 3e + 64; backward, that again
# up to the probabilities (2e + 52), their cast for dv (4 + e), dp's output and upcast, minus delta,
# times p (2e + 24), 1 - t^2 (24), its product, the scale (20), the cast for dq / dk (4 + e): 6e + 128.
# Two GEMMs forward and five backward (the scores recomputed, then dv, dp, dq, dk), over every block.
SOFTCAP_BYTES = (lambda e: 3 * e + 64, lambda e: 6 * e + 128)


@lru_cache(maxsize=1024)
def attention_fractions(kernel: str, rates_key: str, kv_len: int) -> tuple[float, float]:
    """(forward, backward) fraction of the bf16 peak of flash ``kernel`` on a GPU of ``rates_key`` for
    kernel calls over ``kv_len`` keys: ``engine`` (SDPA's choice) at :data:`SDPA_MEASURED` where that
    GPU family was measured, else as ``fa2``; the others at :data:`ATTENTION_MEASURED`."""
    family = ATTENTION_FAMILY.get(rates_key)
    if kernel == "engine" and family in SDPA_MEASURED:
        lengths, fwd, bwd, peak = SDPA_MEASURED[family]
        return _interpolated(lengths, fwd, kv_len) / peak, _interpolated(lengths, bwd, kv_len) / peak
    kernel = "fa2" if kernel == "engine" else kernel
    if family is None:
        f, b = ATTENTION.get(rates_key, (0.5, 0.4))
        return (f / 2, b / 2) if kernel == "fa1" else (f, b)
    if (kernel, family) not in ATTENTION_MEASURED:
        kernel = "fa2"  # fa3 / cudnn where they were not measured (A100): the stack's FA2
    what, tflops, peak = ATTENTION_MEASURED[(kernel, family)]
    rate = _interpolated(ATTENTION_LENGTHS, tflops, kv_len) / peak
    r = ATTENTION_SPLIT[kernel]
    fwd = rate if what == "fwd" else rate * (1 + 2.5 / r) / 3.5  # 3.5 / rate = 1 / fwd + 2.5 / (r fwd)
    return fwd, r * fwd


def _interpolated(lengths: tuple[int, ...], values: tuple[float, ...], x: int) -> float:
    """``values`` at key length ``x``, linear in log2(length) between the measured ``lengths`` (the
    nearest outside them)."""
    if x <= lengths[0]:
        return values[0]
    for i in range(1, len(lengths)):
        if x <= lengths[i]:
            t = (log2(x) - log2(lengths[i - 1])) / (log2(lengths[i]) - log2(lengths[i - 1]))
            return values[i - 1] + (values[i] - values[i - 1]) * t
    return values[-1]


def attention_seconds(b: int, s_q: int, s_kv: int, heads: int, hd: int, executed: float,
                      gpu: GPUSpec, sms: int | None = None, kernel: str = "engine", e: int = 2,
                      kv_len: int = 0) -> tuple[float, float]:
    """(forward, backward) seconds of attention over ``heads`` local heads (``sms``: on that many
    SMs; the kernel's rate scales with them). ``kernel`` (``planner.attention_kernel``): ``engine``
    (SDPA: cuDNN on Hopper / Blackwell, else FA2), ``fa2``, ``fa3``, ``cudnn``, ``fa1``, each at its measured rate for calls over ``kv_len`` keys
    (default ``s_kv``; :func:`attention_fractions`), or ``materialized`` (two batched GEMMs
    forward, four backward, over all blocks, plus the softmax and dropout bytes of every score:
    :data:`MATERIALIZED_BYTES`), or ``softcap`` (the engine's soft-capped kernel: two GEMMs forward,
    five backward, over all blocks, and :data:`SOFTCAP_BYTES` per score)."""
    if kernel == "softcap":
        m, scores = b * heads * s_q, b * heads * s_q * s_kv
        qk = gemm_seconds(m, s_kv, hd, gpu, e=e, sms=sms)
        fwd_b, bwd_b = (f(e) * scores for f in SOFTCAP_BYTES)
        return 2 * qk + membound_seconds(fwd_b, gpu), 5 * qk + membound_seconds(bwd_b, gpu)
    if kernel == "materialized":
        m, scores = b * heads * s_q, b * heads * s_q * s_kv
        qk = gemm_seconds(m, s_kv, hd, gpu, e=e, sms=sms)  # scores = q k^T; (probs v) has the same FLOPs
        fwd_b, bwd_b = (f(e) * scores for f in MATERIALIZED_BYTES)
        return 2 * qk + membound_seconds(fwd_b, gpu), 4 * qk + membound_seconds(bwd_b, gpu)
    fwd_flops = 4.0 * b * s_q * s_kv * heads * hd * executed
    f, bw = attention_fractions(kernel, gpu.rates_key, kv_len or s_kv)
    peak = gpu.peak_flops_bf16 * ((sms / SMS.get(gpu.rates_key, 108)) if sms else 1.0)
    return fwd_flops / (peak * f), 2.5 * fwd_flops / (peak * bw)
