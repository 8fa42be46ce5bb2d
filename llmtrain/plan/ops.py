"""Time model v2 (``cluster.time_model: v2``): compute seconds per operation of a block.

v1 divides a rank's hardware FLOPs by ``peak x COMPUTE_EFFICIENCY[gpu]`` (one constant fitted
on A100-era Megatron runs). v2 prices each operation of a micro batch on one pipeline rank:

- **GEMMs** from their per-rank shapes after the TP / CP / EP splits (``m`` tokens, ``k`` in,
  ``n`` out; the backward's data and weight gradients are two more GEMMs of the same FLOPs,
  ``(m, k) <- (m, n) x (n, k)`` and ``(k, n) <- (k, m) x (m, n)``) at
  ``min(peak x MAMF x wave efficiency, intensity x HBM)``: :data:`MAMF` is the best measured
  bf16 matmul fraction of the peak per GPU (S. Bekman, ml-engineering, "Maximum Achievable
  Matmul FLOPS comparison table"); the roofline caps small-``k`` / thin GEMMs at the bytes they
  move (``e (mk + kn + mn)``); the size curve is NVIDIA's tile and wave quantization (Matrix
  Multiplication Background User's Guide): output tiles (:data:`TILES`) over the GPU's SMs,
  efficiency ``useful tile area / (waves x SMs x tile area)``. No constant is fitted to a published run.
- **Attention** from the flash kernel's FLOPs at its published rate for the length of one call
  (:data:`ATTENTION_MEASURED`: the kernels' own benchmark figures, FA2 / FA1 on A100 and H100,
  FA3 and cuDNN on H100, 512 to 16k tokens), forward ``4 s_q s_kv d`` per head, backward 2.5x the
  forward (the kernels recompute the scores: the papers' own FLOP convention for the backward
  rate), halved when the part the kernels execute (``flops.attention_executed``: 1/2 for causal
  SDPA, Ulysses and the zigzag ring and all-gather).
- **Memory-bound ops** (RMSNorm: fused, or ``planner.norm: unfused`` by :func:`norm_bytes`, RoPE, SwiGLU, residual adds, the loss, FSDP2's copy-in/out of
  gathered weights and gradients) from the bytes they move at :data:`HBM_EFFICIENCY` of the
  datasheet bandwidth. The optimizer step stays v1's (already bytes / HBM).
- **Recomputation**: ``full`` re-runs the block's forward (GEMMs but the last one, attention and
  element-wise ops, as flops.py counts it); ``selective`` re-runs only the element-wise ops;
  ``selective_mm`` (torchtitan's op policy) those and the forward GEMMs of wk, the dense MLP's
  w3 and, without TP, wo (engine/parallel/checkpointing.py).

Beside the kernels (docs/planner.md section 9): compute slowed while NCCL's CTAs hold SMs
(:func:`overlap_slowdown`), eager launches bounding small passes (:func:`launch_seconds`), and
the attention kernel of the stack (``planner.attention_kernel``: the engine's SDPA is FA2).

``train.precision: fp8`` runs the blocks' nn.Linear GEMMs at the FP8 peak times the measured FP8
matmul fraction (:data:`MAMF_FP8`). LoRA is not modelled here: v2 falls back to v1's compute
for LoRA recipes (costmodel.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from math import ceil, log2

from llmtrain.recipe.gpus import GPUSpec

# Measured best bf16 matmul / dense peak (S. Bekman, ml-engineering, compute/accelerator/README.md,
# "Maximum Achievable Matmul FLOPS comparison table", BF16: A100 SXM 271.2/312, H100 SXM 794.5/989
# ("H200 is the same"), B200 1745/2250, GB200 1822/2500, MI300X 781.9/1300 (ROCm 6.2); H100 PCIe
# 600.3/756); cpu a nominal 0.5. Before the thirteenth session h200 took GH200's 828.6 (a 900 W part).
MAMF = {"a100-80g": 0.869, "a100-40g": 0.869, "h100-sxm": 0.803, "h100-pcie": 0.794, "h200": 0.803,
        "b200": 0.776, "gb200": 0.729, "mi300x": 0.601, "cpu": 0.5}
# The same table's FP8 (float8_e4m3fn) rows, for GEMMs at the FP8 peak: H100 SXM 1402.6/1979, H200 SXM
# 1453.4/1979, B200 1745 -> 3432.5/4500, GB200 3615.6/5000; H100 PCIe (not measured) at H100 SXM's.
MAMF_FP8 = {"h100-sxm": 0.709, "h100-pcie": 0.709, "h200": 0.734, "b200": 0.763, "gb200": 0.723}
# Streaming multiprocessors (compute units) per GPU: the vendors' architecture whitepapers
# (A100 108, H100 SXM 132, H100 PCIe 114, H200 132, B200 148, MI300X 304 CUs).
SMS = {"a100-80g": 108, "a100-40g": 108, "h100-sxm": 132, "h100-pcie": 114, "h200": 132, "b200": 148,
       "gb200": 148, "mi300x": 304, "cpu": 1}
# cuBLAS picks the output tile per shape: the large 128x256 tile (the guide's example) where the
# output fills the GPU, smaller ones (fewer idle SMs in the last wave, but less data reuse per
# tile) for small outputs. The reuse penalty of the smaller tiles is an assumption (no per-tile
# measurement was found): 128x128 at 0.9 and 64x128 at 0.75 of the large tile's rate.
TILES = ((128, 256, 1.0), (128, 128, 0.9), (64, 128, 0.75))
# Flash attention (forward, backward) fraction of the bf16 peak, head dim 128, causal, by the key length
# of one kernel call: the kernels' own published benchmarks (bf16/fp16, batch x length = 16k tokens,
# 2048 hidden; the papers' FLOP convention: forward 4 s^2 d per head, halved causal, backward 2.5x).
# ``ATTENTION_MEASURED[(kernel, family)] = (what, TFLOP/s at ATTENTION_LENGTHS, peak of that GPU)``:
# - FlashAttention-2 and FlashAttention(-1) forward + backward, causal, head dim 128: flash-attn's
#   assets/flash2_a100_fwd_bwd_benchmark.png (A100 80GB SXM4, panel d) and
#   assets/flash2_h100_fwd_bwd_benchmark.png (H100 80GB SXM5, panel d) (Dao 2023, arXiv:2307.08691);
# - FlashAttention-3 and cuDNN forward, causal, head dim 128: assets/flash3_fp16_fwd.png panel (d)
#   (H100 SXM5; Shah et al. 2024, arXiv:2407.08608: the cuDNN of mid-2024; later releases may be faster).
# ``fa2`` is the engine's kernel, SDPA's FLASH_ATTENTION backend (torch 2.13:
# torch._C._get_sdp_priority_order() is [FLASH, EFFICIENT, MATH, CUDNN], _get_fa3_sdp_enabled() False);
# ``fa1`` (``planner.attention_kernel: fa1``) is flash-attn 1.x's CUDA kernel; llm-foundry 0.3's Triton
# FlashAttention (``attn_impl: triton``) measures within 1-3 % of it at 2k-8k on A100 (the same figure's
# "FlashAttention Triton" bars: 68, 74, 78 against 69, 76, 80) and has no H100 bar; ``fa3``
# (``planner.attention_kernel: fa3``) FlashAttention-3; ``cudnn`` cuDNN's fused flash attention, what
# Transformer Engine runs on Hopper and later when both it and flash-attn apply ("Transformer Engine
# prefers cuDNN flash attention on Hopper+ architectures, and Tri Dao flash attention on Ampere":
# NVIDIA/NeMo docs/source/performance/memory_optimizations.rst, NeMo PR 9188).
# Between the measured lengths the rate is interpolated in log2(length); outside, the nearest is kept.
ATTENTION_LENGTHS = (512, 1024, 2048, 4096, 8192, 16384)
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
HBM_EFFICIENCY = 0.8  # element-wise kernels reach ~80 % of the datasheet HBM bandwidth (assumption, docs)
# SMs an NCCL collective holds while it overlaps compute: one CTA per channel. Measured: an H100
# all-gather launched 24 CTAs beside a 132-CTA GEMM, whose time nearly doubled (a second wave;
# NVIDIA developer forum, "Compute-Communication Overlap Causes Severe GEMM Performance Degradation
# because of Tail Effect"); NCCL caps channels at NCCL_MAX_CTAS (32 by default).
NCCL_CTAS = 24
# Kernels per block and micro batch (forward, backward): eager as the engine runs it (2 fused norms,
# 7 GEMMs, RoPE's 3 kernels on q and on k, SDPA, SiLU and the product, 2 residual adds = 20; the
# backward's 14 GEMMs, attention, norms, RoPE, SwiGLU and the residual gradients = 28); compiled:
# the GEMMs and attention stay, Inductor fuses the element-wise ops into ~4 / ~5 kernels (assumed).
KERNELS = {"eager": (20, 28), "compiled": (12, 20), "gemm": 8}  # gemm: GEMMs + attention of the forward
LAUNCH_S = 10e-6  # CPU cost of one eager op launch (dispatcher + CUDA launch); assumption (docs/planner.md 9)


def wave_efficiency(m: int, n: int, gpu: GPUSpec, sms: int | None = None) -> float:
    """Tile and wave quantization: the share of the SM-time spent on useful output, for the best
    of :data:`TILES` (each at its reuse factor)."""
    sms = sms or SMS.get(gpu.rates_key, 108)
    best = 0.0
    for tm, tn, factor in TILES:
        waves = ceil(ceil(m / tm) * ceil(n / tn) / sms)
        best = max(best, factor * min(1.0, (m * n) / (tm * tn * sms * waves)))
    return best


def mamf(gpu: GPUSpec, peak: float | None = None) -> float:
    """Measured best matmul fraction of ``peak``: :data:`MAMF_FP8`'s where the GEMM runs at the FP8
    peak (``train.precision: fp8``), else :data:`MAMF` (bf16)."""
    if peak is not None and gpu.peak_flops_fp8 > 0 and peak >= gpu.peak_flops_fp8:
        return MAMF_FP8.get(gpu.rates_key, MAMF.get(gpu.rates_key, 0.75))
    return MAMF.get(gpu.rates_key, 0.75)


def gemm_seconds(m: float, n: float, k: float, gpu: GPUSpec, peak: float | None = None, e: int = 2,
                 sms: int | None = None) -> float:
    """One ``(m, k) x (k, n)`` GEMM on ``gpu`` (``peak``: the tensor-core peak to use, bf16 default;
    ``sms``: run on only that many SMs, the others held by a concurrent NCCL kernel)."""
    if m <= 0 or n <= 0 or k <= 0:
        return 0.0
    flops = 2.0 * m * n * k
    peak = gpu.peak_flops_bf16 if peak is None else peak
    fraction = mamf(gpu, peak)
    if sms:
        peak *= sms / SMS.get(gpu.rates_key, 108)
    hbm = gpu.hbm_bytes_per_s or 2e12
    intensity = flops / (e * (m * k + k * n + m * n))
    # compute-bound: the measured ceiling, less the idle SMs of the last wave; memory-bound: the bytes
    rate = min(peak * fraction * wave_efficiency(int(m), int(n), gpu, sms), intensity * hbm)
    return flops / rate


def gemm_fwd_bwd(m: float, n: float, k: float, gpu: GPUSpec, peak: float | None = None,
                 sms: int | None = None) -> tuple[float, float]:
    """(forward, backward) seconds of a linear layer ``y = x W^T``: x ``(m, k)``, W ``(n, k)``; the
    backward is the input gradient ``(m, k)`` and the weight gradient ``(n, k)`` (reduced over m)."""
    return (gemm_seconds(m, n, k, gpu, peak, sms=sms),
            gemm_seconds(m, k, n, gpu, peak, sms=sms) + gemm_seconds(n, k, m, gpu, peak, sms=sms))


def membound_seconds(nbytes: float, gpu: GPUSpec) -> float:
    return nbytes / ((gpu.hbm_bytes_per_s or 2e12) * HBM_EFFICIENCY)


@lru_cache(maxsize=1024)
def attention_fractions(kernel: str, rates_key: str, kv_len: int) -> tuple[float, float]:
    """(forward, backward) fraction of the bf16 peak of flash ``kernel`` (``engine`` = ``fa2``) on
    a GPU of ``rates_key`` for kernel calls over ``kv_len`` keys (:data:`ATTENTION_MEASURED`)."""
    kernel = "fa2" if kernel == "engine" else kernel
    family = ATTENTION_FAMILY.get(rates_key)
    if family is None:
        f, b = ATTENTION.get(rates_key, (0.5, 0.4))
        return (f / 2, b / 2) if kernel == "fa1" else (f, b)
    if (kernel, family) not in ATTENTION_MEASURED:
        kernel = "fa2"  # fa3 / cudnn where they were not measured (A100): the stack's FA2
    what, tflops, peak = ATTENTION_MEASURED[(kernel, family)]
    x = log2(min(max(kv_len, ATTENTION_LENGTHS[0]), ATTENTION_LENGTHS[-1]))
    i = min(int(x) - 9, len(ATTENTION_LENGTHS) - 2)  # ATTENTION_LENGTHS[i] = 2^(9 + i)
    rate = (tflops[i] + (tflops[i + 1] - tflops[i]) * (x - 9 - i)) / peak
    r = ATTENTION_SPLIT[kernel]
    fwd = rate if what == "fwd" else rate * (1 + 2.5 / r) / 3.5  # 3.5 / rate = 1 / fwd + 2.5 / (r fwd)
    return fwd, r * fwd


def attention_seconds(b: int, s_q: int, s_kv: int, heads: int, hd: int, executed: float,
                      gpu: GPUSpec, sms: int | None = None, kernel: str = "engine", e: int = 2,
                      kv_len: int = 0) -> tuple[float, float]:
    """(forward, backward) seconds of attention over ``heads`` local heads (``sms``: on that many
    SMs; the kernel's rate scales with them). ``kernel`` (``planner.attention_kernel``): ``engine``
    (SDPA's FA2), ``fa3``, ``fa1``, each at its measured rate for calls over ``kv_len`` keys
    (default ``s_kv``; :func:`attention_fractions`), or ``materialized`` (two batched GEMMs
    forward, four backward, over all blocks, plus the softmax and dropout bytes of every score:
    :data:`MATERIALIZED_BYTES`)."""
    if kernel == "materialized":
        m, scores = b * heads * s_q, b * heads * s_q * s_kv
        qk = gemm_seconds(m, s_kv, hd, gpu, e=e, sms=sms)  # scores = q k^T; (probs v) has the same FLOPs
        fwd_b, bwd_b = (f(e) * scores for f in MATERIALIZED_BYTES)
        return 2 * qk + membound_seconds(fwd_b, gpu), 4 * qk + membound_seconds(bwd_b, gpu)
    fwd_flops = 4.0 * b * s_q * s_kv * heads * hd * executed
    f, bw = attention_fractions(kernel, gpu.rates_key, kv_len or s_kv)
    peak = gpu.peak_flops_bf16 * ((sms / SMS.get(gpu.rates_key, 108)) if sms else 1.0)
    return fwd_flops / (peak * f), 2.5 * fwd_flops / (peak * bw)


@dataclass(frozen=True)
class BlockShape:
    """What one pipeline rank's micro batch looks like to the kernels."""

    b: int  # micro batch
    s: int  # tokens per CP rank
    seq: int  # the full sequence (attention's keys)
    h: int
    heads: int
    kv_heads: int
    hd: int
    ffn: int
    vocab: int
    tp: int
    sp: bool
    e: int  # activation bytes
    cp: int = 1
    attn_executed: float = 0.5  # share of the full score blocks the kernels run (flops.attention_executed)
    experts: int = 0  # MoE: routed experts, top-k, shared experts, their width, EP degree
    top_k: int = 0
    shared: int = 0
    expert_ffn: int = 0
    ep: int = 1
    recompute: str = "none"
    fp8_peak: float = 0.0  # > 0: the blocks' nn.Linear GEMMs run at this peak (train.precision fp8)
    attention: str = "engine"  # planner.attention_kernel: engine (SDPA, FA2), fa3, fa1, materialized
    norm_unfused: bool = False  # planner.norm unfused (eager composite RMSNorm) and not train.compile
    kv_len: int = 0  # keys of one attention kernel call: ring / all-gather CP's blocks (s), else the sequence (0)


def norm_bytes(e: int, unfused: bool) -> tuple[int, int]:
    """(forward, backward) HBM bytes per normalized element of one RMSNorm (``e``: activation bytes).

    Fused (``nn.RMSNorm``'s kernel, the engine): read x and write y forward (``2e``); backward read
    x and dy, write dx (``3e``). Unfused (``planner.norm: unfused``: torchtitan 2024's
    ``norm_type = "rmsnorm"``, ``(x.float() * rsqrt(x.float().pow(2).mean(-1) + eps)).type_as(x) * w``
    in eager mode), counted kernel by kernel, reads and writes per element (per-row tensors free):
    forward ``float()`` e + 4, ``pow`` 8, ``mean`` 4, ``x * rsqrt`` 8, ``type_as`` 4 + e, ``* w``
    2e: ``4e + 28``; backward by autograd's formulas (torch ``derivatives.yaml``): ``* w`` 6e (the
    input gradient 2e, the weight's product 3e and its row sum e), ``type_as`` e + 4, ``* rsqrt`` 24
    (8 for the input, 16 for the per-row gradient's product and sum), ``mean`` 4 (the expanded
    gradient), ``pow`` 28 (``grad * 2 * x``: three kernels), the two gradients of ``x.float()``
    summed 12, ``float()`` 4 + e: ``8e + 76``. An estimate of the memory traffic, not a
    measurement (an allocator or kernel that fuses two of these would move less)."""
    if unfused:
        return 4 * e + 28, 8 * e + 76
    return 2 * e, 3 * e


def _elementwise(x: BlockShape, moe: bool) -> tuple[float, float]:
    """(forward, backward) HBM bytes of a block's element-wise ops, per rank and micro batch."""
    t, e, tok = x.tp, x.e, x.b * x.s
    rep = 1 if x.sp else t  # norms and residual adds run on all tokens on every TP rank without SP
    hdim = x.h * tok / t * rep
    qk = (x.heads + x.kv_heads) * x.hd * tok / t
    width = (x.top_k + x.shared) * x.expert_ffn if moe else x.ffn
    act = width * tok / t
    # 2 norms (fused, or planner.norm unfused: norm_bytes); RoPE as engine/models/rope.py runs it (cast to fp32, complex multiply, cast back:
    # 2e + 16 bytes per element each way); SwiGLU as two eager kernels (silu, then the product: 5e
    # forward, 8e backward); 2 residual adds
    rope = (2 * e + 16) * qk
    nf, nb = norm_bytes(e, x.norm_unfused)
    fwd = 2 * nf * hdim + rope + 5 * e * act + 2 * 3 * e * hdim
    bwd = 2 * nb * hdim + rope + 8 * e * act + 2 * 3 * e * hdim
    if moe:  # dispatch gather and combine scatter of the routed copies (read + write each way)
        fwd += 2 * 2 * e * x.top_k * x.h * tok
        bwd += 2 * 2 * e * x.top_k * x.h * tok
    return fwd, bwd


@lru_cache(maxsize=4096)  # pure in hashable arguments; plan --search prices the same shapes many times
def block_seconds(x: BlockShape, gpu: GPUSpec, moe: bool, sms: int | None = None) -> tuple[float, float]:
    """(forward, backward incl. recomputation) seconds of one block on one rank, one micro batch."""
    tok, t = x.b * x.s, x.tp
    lin = x.fp8_peak or None  # nn.Linear GEMMs under fp8 (MoE experts and the router stay bf16)
    q, kv = x.heads * x.hd / t, x.kv_heads * x.hd / t
    # (m, n, k, peak, count, recomputed under full AC): wq, wk, wv, wo, then the MLP
    gemms = [(tok, q, x.h, lin, 1, True), (tok, kv, x.h, lin, 1, True), (tok, kv, x.h, lin, 1, True),
             (tok, x.h, q, lin, 1, True)]
    # selective_mm re-runs these forward GEMMs: wk, wo without TP (under TP its reduced output is
    # saved), the dense MLP's w3 (below; an MoE block has none)
    again_mm = gemm_seconds(tok, kv, x.h, gpu, lin, sms=sms) + (gemm_seconds(tok, x.h, q, gpu, lin, sms=sms) if t == 1 else 0.0)
    if moe:
        local = max(1, x.experts // max(1, x.ep))
        per = tok * x.top_k / local  # routed tokens per local expert (balanced routing)
        ef = x.expert_ffn / t
        gemms += [(tok, x.experts, x.h, None, 1, True), (per, ef, x.h, None, 2 * local, True),
                  (per, x.h, ef, None, local, True)]
        if x.shared:  # the shared experts' w2 is the block's last GEMM (flops.py: not recomputed)
            sf = x.shared * x.expert_ffn / t
            gemms += [(tok, sf, x.h, None, 2, True), (tok, x.h, sf, None, 1, False)]
    else:
        gemms += [(tok, x.ffn / t, x.h, lin, 2, True), (tok, x.h, x.ffn / t, lin, 1, False)]
        again_mm += gemm_seconds(tok, x.ffn / t, x.h, gpu, lin, sms=sms)
    fwd = bwd = again = 0.0
    for m, n, k, peak, count, recomputed in gemms:
        f, b_ = gemm_fwd_bwd(m, n, k, gpu, peak, sms)
        fwd, bwd = fwd + count * f, bwd + count * b_
        again += count * f if recomputed else 0.0
    af, ab = attention_seconds(x.b, x.s, x.seq, max(1, x.heads // t), x.hd, x.attn_executed, gpu, sms, x.attention, x.e,
                               x.kv_len)
    ef_s, eb_s = (membound_seconds(v, gpu) for v in _elementwise(x, moe))
    fwd, bwd = fwd + af + ef_s, bwd + ab + eb_s
    if x.recompute == "full":
        bwd += again + af + ef_s
    elif x.recompute == "selective":
        bwd += ef_s
    elif x.recompute == "selective_mm":
        bwd += ef_s + again_mm
    return fwd, bwd


@lru_cache(maxsize=4096)  # pure in hashable arguments; plan --search prices the same shapes many times
def head_seconds(x: BlockShape, gpu: GPUSpec, sms: int | None = None) -> tuple[float, float]:
    """Final norm, output GEMM (vocabulary split over TP) and the fp32 cross-entropy."""
    tok = x.b * x.s
    f, b_ = gemm_fwd_bwd(tok, x.vocab / x.tp, x.h, gpu, sms=sms)
    logits = x.vocab / x.tp * tok
    # upcast to fp32 (read e, write 4), log-softmax (read 4, write 4) forward; backward read 4 and
    # write the e-byte gradient of the logits, plus the final norm (norm_bytes)
    nf, nb = norm_bytes(x.e, x.norm_unfused)
    f += membound_seconds(logits * (x.e + 12) + nf * x.h * tok, gpu)
    b_ += membound_seconds(logits * (4 + x.e) + nb * x.h * tok, gpu)
    return f, b_


def fsdp_copy_seconds(gathers: float, reduces: float, unsharded_params: int, gpu: GPUSpec, e: int,
                      reduce_bytes: int) -> float:
    """FSDP2's copy-out of every all-gathered weight (read + write ``e`` bytes per unsharded element)
    and the copy-in of every reduce-scattered gradient (read + write ``reduce_bytes``)."""
    return membound_seconds(unsharded_params * (gathers * 2 * e + reduces * 2 * reduce_bytes), gpu)


def shape_of(recipe, dims, gpu: GPUSpec, attn_executed: float) -> BlockShape:
    """The :class:`BlockShape` of a validated recipe's micro batch on one rank."""
    from llmtrain.plan.memory import compute_bytes  # noqa: PLC0415  (memory imports the schema)

    m, p, t = recipe.model, recipe.parallel, recipe.train
    fp8 = gpu.peak_flops_fp8 if t.precision == "fp8" and gpu.peak_flops_fp8 > 0 else 0.0
    return BlockShape(b=t.micro_batch_size, s=t.seq_len // dims.cp, seq=t.seq_len, h=m.hidden, heads=m.heads,
                      kv_heads=m.kv_heads, hd=m.head_dim, ffn=m.ffn_hidden, vocab=m.vocab_size, tp=dims.tp,
                      sp=p.sequence_parallel and dims.tp > 1, e=compute_bytes(t.precision), cp=dims.cp,
                      attn_executed=attn_executed, experts=m.moe.num_experts if m.is_moe else 0, top_k=m.moe.top_k,
                      shared=m.moe.shared_experts, expert_ffn=m.expert_ffn if m.is_moe else 0, ep=dims.ep,
                      recompute=t.activation_checkpointing, fp8_peak=fp8, attention=recipe.planner.attention_kernel,
                      norm_unfused=recipe.planner.norm == "unfused" and not t.compile,
                      kv_len=t.seq_len // dims.cp if dims.cp > 1 and p.cp_method != "ulysses" else 0)


def rank_seconds(x: BlockShape, gpu: GPUSpec, dense_layers: int, moe_layers: int, last: bool,
                 sms: int | None = None) -> tuple[float, float]:
    """(forward, backward) compute seconds of one micro batch on a pipeline rank holding
    ``dense_layers`` + ``moe_layers`` blocks (and the output head when ``last``); ``sms``: on
    only that many SMs (:func:`overlap_slowdown`)."""
    fwd = bwd = 0.0
    for n, moe in ((dense_layers, False), (moe_layers, True)):
        if n:
            f, b = block_seconds(x, gpu, moe, sms)
            fwd, bwd = fwd + n * f, bwd + n * b
    if last:
        f, b = head_seconds(x, gpu, sms)
        fwd, bwd = fwd + f, bwd + b
    return fwd, bwd


@lru_cache(maxsize=4096)  # pure in hashable arguments; plan --search prices the same shapes many times
def overlap_slowdown(x: BlockShape, gpu: GPUSpec, dense_layers: int, moe_layers: int, last: bool) -> float:
    """Share of compute throughput lost while an NCCL collective runs beside it (issue 18, 9.1 (a)).

    NCCL's kernels are ordinary CTAs, one per channel, resident for the whole collective, so the
    compute kernels that overlap it get only ``SMs - NCCL_CTAS`` SMs: the GEMMs lose peak in
    proportion and re-quantize their waves on fewer SMs (the tail effect), attention loses peak
    in proportion, memory-bound ops are taken as unaffected (HBM, not SMs, bounds them; NCCL's
    own HBM traffic is not charged: an under-estimate). Returns ``1 - t(all SMs) / t(fewer)``:
    a hidden collective of ``T`` seconds costs ``T x`` this much extra compute time."""
    full = SMS.get(gpu.rates_key, 108)
    if full <= NCCL_CTAS:
        return 0.0
    f0, b0 = rank_seconds(x, gpu, dense_layers, moe_layers, last)
    f1, b1 = rank_seconds(x, gpu, dense_layers, moe_layers, last, sms=full - NCCL_CTAS)
    return max(0.0, 1.0 - (f0 + b0) / (f1 + b1)) if f1 + b1 > 0 else 0.0


def launch_seconds(x: BlockShape, layers: int, compiled: bool, fsdp: bool) -> tuple[float, float]:
    """(forward, backward) CPU seconds to launch one micro batch's kernels of ``layers`` blocks
    (issue 18, 9.1 (c)). The GPU runs behind the CPU's launches; a pass takes
    ``max(GPU time, CPU launch time)`` (costmodel.py), so launches cost nothing while the GPU is
    busier. Kernel counts (:data:`KERNELS`) are the engine's block as ops.py prices it; FSDP adds
    its gather + copy-out per block and pass, reduce-scatter + copy-in in the backward;
    recomputation re-launches the forward (``full``) or its element-wise kernels (``selective``; and
    ``selective_mm`` also the GEMMs of wk, wo without TP and w3 in a dense model: MoE blocks have none)."""
    fwd, bwd = KERNELS["compiled" if compiled else "eager"]
    elementwise = fwd - KERNELS["gemm"]
    if x.recompute == "full":
        bwd += fwd
    elif x.recompute == "selective":
        bwd += elementwise
    elif x.recompute == "selective_mm":
        bwd += elementwise + 1 + (x.tp == 1) + (x.experts == 0)
    if fsdp:
        fwd, bwd = fwd + 2, bwd + 4
    return layers * fwd * LAUNCH_S, layers * bwd * LAUNCH_S
