"""GPU catalog for planning: peak dense bf16 FLOP/s, memory, and link bandwidths.

Every number is per GPU, from the vendor's datasheet (dense, i.e. without 2:4 sparsity):
- h100-sxm: NVIDIA H100 Tensor Core GPU datasheet (SXM5): 989 TFLOPS bf16 dense (1,979 with
  sparsity), 80 GB HBM3, NVLink 4 900 GB/s; DGX H100: 8x ConnectX-7 400 Gb/s, one per GPU.
- h200: NVIDIA H200 Tensor Core GPU datasheet (SXM): 989 TFLOPS bf16 dense, 141 GB HBM3e,
  NVLink 900 GB/s; HGX H200 with one 400 Gb/s ConnectX-7 per GPU.
- a100-80g: NVIDIA A100 datasheet (SXM 80GB): 312 TFLOPS bf16 dense, 80 GB HBM2e, NVLink 3
  600 GB/s; DGX A100: 8x ConnectX-6 HDR 200 Gb/s.
- b200: NVIDIA HGX B200 datasheet: 2.25 PFLOPS bf16 dense per GPU (18 PFLOPS sparse FP4 /
  4.5 PFLOPS sparse bf16 halved), 180 GB HBM3e, NVLink 5 1.8 TB/s; 400 Gb/s ConnectX-7.
- cpu: nominal numbers for planning CPU debug runs; the engine measures the real peak with a
  matmul probe at start.
FP8 dense peaks (same datasheets, without sparsity): H100/H200 SXM 1,979 TFLOPS, B200 4.5
PFLOPS; A100 has no FP8 tensor cores.
Bandwidths are the total (both directions) figures the datasheets quote, in bytes/s.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GPUSpec:
    name: str
    peak_flops_bf16: float  # dense FLOP/s
    memory_bytes: float
    nvlink_bytes_per_s: float  # intra-node, per GPU
    internode_bytes_per_s: float  # per GPU (one NIC per GPU)
    peak_flops_fp8: float = 0.0  # dense FP8 tensor-core FLOP/s; 0 = no FP8 tensor cores (train.precision fp8 refused)


GB = 1e9
GPUS: dict[str, GPUSpec] = {
    "h100-sxm": GPUSpec("h100-sxm", 989e12, 80 * GB, 900 * GB, 400e9 / 8, 1979e12),
    "h200": GPUSpec("h200", 989e12, 141 * GB, 900 * GB, 400e9 / 8, 1979e12),
    "a100-80g": GPUSpec("a100-80g", 312e12, 80 * GB, 600 * GB, 200e9 / 8),
    "b200": GPUSpec("b200", 2250e12, 180 * GB, 1800 * GB, 400e9 / 8, 4500e12),
    "cpu": GPUSpec("cpu", 1e11, 16 * GB, 10 * GB, 1 * GB),
}
