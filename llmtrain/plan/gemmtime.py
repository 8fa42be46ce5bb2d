"""GEMM and memory-bound kernel time for time model v2 (``ops.py`` assembles a block from these).

A GEMM of per-rank shape ``(m, k) x (k, n)`` runs at ``min(peak x MAMF x wave efficiency,
intensity x HBM)``: :data:`MAMF` / :data:`MAMF_FP8` are the best measured matmul fractions of the
peak per GPU (S. Bekman, ml-engineering, "Maximum Achievable Matmul FLOPS comparison table"), the
wave efficiency NVIDIA's tile and wave quantization (Matrix Multiplication Background User's
Guide) over :data:`TILES` and the GPU's SMs, and the roofline caps thin GEMMs at the bytes they
move. Element-wise ops move their bytes at :data:`HBM_EFFICIENCY` of the datasheet bandwidth.
docs/planner.md section 9 lists every constant with its source.
"""

from __future__ import annotations

from math import ceil

from llmtrain.recipe.gpus import GPUSpec

# Measured best bf16 matmul / dense peak (S. Bekman, ml-engineering, compute/accelerator/README.md,
# "Maximum Achievable Matmul FLOPS comparison table", BF16, the mean of 100 iterations at the best
# shape: A100 SXM 271.2/312, H100 SXM 794.5/989 ("H200 is the same"), B200 1745/2250, GB200
# 1822/2500, MI300X 668.4/1300 (ROCm 6.3, TunableOp); cpu a nominal 0.5. H100 PCIe: not measured
# there, H100 SXM's fraction assumed. Before the eighteenth session mi300x took 781.9 (a 2024-10
# ROCm 6.2 reading of the finder before its cache-flush fix of 2025-01-03, since replaced in that
# table) and h100-pcie 0.794 (600.3/756, a figure the table's history does not contain). Before the
# thirteenth session h200 took GH200's 828.6 (a 900 W part).
MAMF = {"a100-80g": 0.869, "a100-40g": 0.869, "h100-sxm": 0.803, "h100-pcie": 0.803, "h200": 0.803,
        "b200": 0.776, "gb200": 0.729, "mi300x": 0.514, "cpu": 0.5}
# What the GEMMs of the published rows' per-rank shapes reach on an H100 SXM, as a share of the price
# above: this project's GPU check (``kernel_rates``, benchmarks/results/gpu_check.json: 14 shapes x
# forward / backward, bf16, torch 2.11 + cuBLAS of CUDA 13.0, median of the 28 measured / priced rates;
# 0.76-1.05 at n >= 1024, 0.52 / 0.61 at n = 128). Bekman's figure is the best shape's mean of 100
# short iterations; at the rows' shapes cuBLAS reaches about an eighth less, and the same record's
# 3 s of back-to-back 8192^3 GEMMs held 684 TFLOP/s at the 700 W limit (SM clock 1410 of 1980 MHz),
# 0.86 of MAMF. Fitted by ``python benchmarks/gpu_fit.py`` (tests/test_gpu_fit.py checks it equals
# the fit of the committed record); H100 PCIe and H200, whose MAMF is H100 SXM's, take it too;
# bf16 only (no FP8 GEMM was measured: MAMF_FP8 stands), and no other GPU was measured.
# A100 (80 and 40 GB, one chip): fitted by ``python benchmarks/layer_fit.py`` from Korthikanti et al.
# 2022's Table 4 (arXiv:2205.05198: forward + backward of one 22B layer on A100 with Megatron-LM, five
# recomputation / SP experiments, each priced 9-11 % fast unfitted; the median of the five fits, which
# span 0.837-0.862), the layer's whole shortfall charged to its GEMMs (tests/test_layer_fit.py).
# B200, GB200, MI300X: nothing measured, MAMF alone. L40S: no MAMF reading either (the table has none), so
# ``mamf`` gives it 0.75 of its peak (an assumption, recipe/gpus.py ASSUMED).
GEMM_FIT = {"h100-sxm": 0.884, "h100-pcie": 0.884, "h200": 0.884, "a100-80g": 0.854, "a100-40g": 0.854}
# The same for FP8 GEMMs (``MAMF_FP8``): fitted by the same script from a record's ``fp8_gemms``
# (the GPU check times them since the twenty-fifth session); empty until a record has them.
GEMM_FIT_FP8: dict[str, float] = {}
# The same table's FP8 (float8_e4m3fn) rows, for GEMMs at the FP8 peak: H100 SXM 1402.6/1979, H200 SXM
# 1453.4/1979, B200 1745 -> 3432.5/4500, GB200 3615.6/5000; H100 PCIe (not measured) at H100 SXM's.
MAMF_FP8 = {"h100-sxm": 0.709, "h100-pcie": 0.709, "h200": 0.734, "b200": 0.763, "gb200": 0.723}
# Streaming multiprocessors (compute units) per GPU: the vendors' architecture whitepapers
# (A100 108, H100 SXM 132, H100 PCIe 114, H200 132, B200 148, MI300X 304 CUs; L40S 142, the AD102 count of
# TechPowerUp's entry, recipe/gpus.py SOURCES). A100 PCIe takes the A100's through its die (a100-80g).
SMS = {"a100-80g": 108, "a100-40g": 108, "h100-sxm": 132, "h100-pcie": 114, "h200": 132, "b200": 148,
       "gb200": 148, "mi300x": 304, "l40s": 142, "cpu": 1}
# cuBLAS picks the output tile per shape: the large 128x256 tile (the guide's example) where the
# output fills the GPU, smaller ones (fewer idle SMs in the last wave, but less data reuse per
# tile) for small outputs. The reuse penalty of the smaller tiles is an assumption (no per-tile
# measurement was found): 128x128 at 0.9 and 64x128 at 0.75 of the large tile's rate.
TILES = ((128, 256, 1.0), (128, 128, 0.9), (64, 128, 0.75))
HBM_EFFICIENCY = 0.8  # element-wise kernels reach ~80 % of the datasheet HBM bandwidth (assumption, docs)


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
    """Measured matmul fraction of ``peak``: :data:`MAMF_FP8`'s where the GEMM runs at the FP8 peak
    (``train.precision: fp8``) x :data:`GEMM_FIT_FP8`, else :data:`MAMF` (bf16) x :data:`GEMM_FIT`."""
    if peak is not None and gpu.peak_flops_fp8 > 0 and peak >= gpu.peak_flops_fp8:
        return MAMF_FP8.get(gpu.rates_key, MAMF.get(gpu.rates_key, 0.75)) * GEMM_FIT_FP8.get(gpu.rates_key, 1.0)
    return MAMF.get(gpu.rates_key, 0.75) * GEMM_FIT.get(gpu.rates_key, 1.0)


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
    # compute-bound: the measured ceiling, less the idle SMs of the last wave; memory-bound: the bytes.
    # A dimension under one row (an expert's expected tokens: seq_len 1, top-2 of 8 experts gives 0.25)
    # still runs one tile: at least 1 (int(0.25) was 0 tiles, 0 waves, a ZeroDivisionError in plan)
    rate = min(peak * fraction * wave_efficiency(max(1, int(m)), max(1, int(n)), gpu, sms), intensity * hbm)
    return flops / rate


def gemm_fwd_bwd(m: float, n: float, k: float, gpu: GPUSpec, peak: float | None = None,
                 sms: int | None = None) -> tuple[float, float]:
    """(forward, backward) seconds of a linear layer ``y = x W^T``: x ``(m, k)``, W ``(n, k)``; the
    backward is the input gradient ``(m, k)`` and the weight gradient ``(n, k)`` (reduced over m)."""
    return (gemm_seconds(m, n, k, gpu, peak, sms=sms),
            gemm_seconds(m, k, n, gpu, peak, sms=sms) + gemm_seconds(n, k, m, gpu, peak, sms=sms))


def membound_seconds(nbytes: float, gpu: GPUSpec) -> float:
    return nbytes / ((gpu.hbm_bytes_per_s or 2e12) * HBM_EFFICIENCY)
