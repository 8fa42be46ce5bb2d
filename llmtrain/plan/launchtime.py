"""Eager kernel launches for time model v2 (docs/planner.md section 9, term (c)).

The GPU runs behind the CPU's launches, so a pass takes ``max(GPU seconds, kernels x LAUNCH_S)``
(costmodel.py): launches cost nothing while the GPU is the busier, and bound short passes (small
micro batches, thin blocks) when it is not. :func:`launch_seconds` counts the kernels of one micro
batch's blocks as the engine launches them (``ops.py`` prices their GPU time; ``ops`` re-exports
these names).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from llmtrain.plan.loratime import LORA_KERNELS

if TYPE_CHECKING:
    from llmtrain.plan.ops import BlockShape

# Kernels per block and micro batch (forward, backward): eager as the engine runs it (2 fused norms,
# 7 GEMMs, RoPE's 3 kernels on q and on k, SDPA, SiLU and the product, 2 residual adds = 20; the
# backward's 14 GEMMs, attention, norms, RoPE, SwiGLU and the residual gradients = 28); compiled:
# the GEMMs and attention stay, and Inductor's scheduler makes the element-wise ops 5 forward and 6
# backward kernels (counted on the engine's block without GQA, tests/test_block_traffic.py's compile).
KERNELS = {"eager": (20, 28), "compiled": (13, 21), "gemm": 8}  # gemm: GEMMs + attention of the forward
LAUNCH_S = 10e-6  # CPU cost of one eager op launch (dispatcher + CUDA launch); assumption (docs/planner.md 9)


def launch_seconds(x: BlockShape, layers: int, compiled: bool, fsdp: bool) -> tuple[float, float]:
    """(forward, backward) CPU seconds to launch one micro batch's kernels of ``layers`` blocks
    (issue 18, 9.1 (c)). The GPU runs behind the CPU's launches; a pass takes
    ``max(GPU time, CPU launch time)`` (costmodel.py), so launches cost nothing while the GPU is
    busier. Kernel counts (:data:`KERNELS`) are the engine's block as ops.py prices it; FSDP adds
    its gather + copy-out per block and pass, reduce-scatter + copy-in in the backward;
    recomputation re-launches the forward (``full``) or its element-wise kernels (``selective``; and
    ``selective_mm`` also the GEMMs of wk, wo without TP and w3 in a dense model: MoE blocks have none).
    LoRA: each adapted projection adds :data:`~llmtrain.plan.loratime.LORA_KERNELS`, and the frozen
    bases launch no weight-gradient GEMM (7 fewer backward kernels per block)."""
    fwd, bwd = KERNELS["compiled" if compiled else "eager"]
    elementwise = fwd - KERNELS["gemm"]
    if x.lora is not None:
        adapted = len(x.lora[1])
        fwd, bwd = fwd + adapted * (LORA_KERNELS[0] + x.lora[2]), bwd - 7 + adapted * (LORA_KERNELS[1] + x.lora[2])
    if x.recompute == "full":
        bwd += fwd
    elif x.recompute == "selective":  # core_attention: the attention kernels (materialized: 4, a flash kernel: 1)
        bwd += (4 if x.attention == "materialized" else 1) if x.recompute_attention else elementwise
    elif x.recompute == "selective_mm":
        bwd += elementwise + 1 + (x.tp == 1) + (x.experts == 0)
    if fsdp:
        fwd, bwd = fwd + 2, bwd + 4
    return layers * fwd * LAUNCH_S, layers * bwd * LAUNCH_S
