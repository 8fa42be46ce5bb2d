"""Time model v2: the memory-bound scaling casts of ``train.precision: fp8`` (torchao Float8Linear).

v2 prices a converted nn.Linear's GEMMs at the FP8 peak (plan/ops.py); the casts that feed them
are separate kernels and were not priced. What torchao's tensorwise dynamic scaling runs per
converted Linear of ``m`` tokens, ``k`` inputs and ``n`` outputs (torchao 0.18,
``float8/float8_linear.py``, ``matmul_with_hp_or_float8_args``; the same code in torchao 2024-12),
each cast being ``hp_tensor_to_float8_dynamic``: an ``amax`` over the tensor, then scale and cast:

- forward: the input (``m k``) and the weight (``n k``) cast;
- backward: the output gradient cast twice (``m n``: for the input gradient, and again for the
  weight gradient), the weight cast again for the input gradient, the saved high-precision input
  cast again for the weight gradient; ``torch._scaled_mm`` takes its first operand row-major and
  its second column-major, so the weight (input gradient), the output gradient's transpose and
  the input (weight gradient) are copied into that layout (1 byte read + 1 written per element).

Bytes per element: eager, ``amax`` reads the ``e``-byte tensor and the cast reads it again and
writes 1 byte (``2e + 1``); compiled (``train.compile``), Inductor fuses the reduction with its
producer and each transposed layout into the cast that makes it, so a cast reads ``e`` and writes
1 per layout (an **assumption**: the fused kernels were not measured). With
``parallel.fp8_all_gather`` the weight arrives in fp8 (FSDP2 casts the shard before the gather:
``1/dp`` of the weight, once per gather) instead of the whole weight.

Which Linears are converted is engine/parallelize.py's rule: every block's attention
projections, the dense MLPs (MoE experts, routers and shared experts stay bf16), not the
output head. The seconds are HBM bytes at :data:`llmtrain.plan.ops.HBM_EFFICIENCY`.
"""

from __future__ import annotations

from llmtrain.plan.ops import BlockShape, membound_seconds
from llmtrain.recipe.gpus import GPUSpec


def _linears(x: BlockShape, moe: bool) -> list[tuple[float, float, float]]:
    """(m, n, k) of each converted Linear of one block on one rank."""
    tok, t = x.b * x.s, x.tp
    q, kv = x.heads * x.hd / t, x.kv_heads * x.hd / t
    out = [(tok, q, x.h), (tok, kv, x.h), (tok, kv, x.h), (tok, x.h, q)]
    if not moe:
        f = x.ffn / t
        out += [(tok, f, x.h), (tok, f, x.h), (tok, x.h, f)]
    return out


def _per_element(x: BlockShape, compiled: bool) -> float:
    """Bytes one cast moves per element: eager ``amax`` + cast ``2e + 1``, compiled ``e + 1``
    (``e``: the compute dtype, bf16 under fp8)."""
    e = x.e if x.e != 4 else 2
    return e + 1 if compiled else 2 * e + 1


def _forward_cast(cast: float, m: float, n: float, k: float, weight_cast_share: float) -> float:
    return cast * m * k + cast * n * k * weight_cast_share


def cast_bytes(x: BlockShape, moe: bool, compiled: bool, weight_cast_share: float) -> tuple[float, float]:
    """(forward, backward) HBM bytes of one block's fp8 casts and layout copies for one micro
    batch; ``weight_cast_share``: 1 when the rank casts the whole weight, ``1/dp`` when FSDP2
    gathers it in fp8 (each gather casts the shard: forward, and again for the backward's)."""
    cast = _per_element(x, compiled)
    copy = 0 if compiled else 2
    fwd = bwd = 0.0
    for m, n, k in _linears(x, moe):
        fwd += _forward_cast(cast, m, n, k, weight_cast_share)
        bwd += 2 * cast * m * n + cast * n * k * weight_cast_share + cast * m * k + copy * (n * k + m * n + m * k)
    return fwd, bwd


def recast_bytes(x: BlockShape, moe: bool, compiled: bool, weight_cast_share: float) -> float:
    """Forward casts re-run by ``selective_mm``'s recomputed GEMMs: wk, the dense w3 and, without
    TP, wo (engine/parallel/checkpointing.py), each its input and weight cast once more."""
    cast = _per_element(x, compiled)
    lin = _linears(x, moe)
    again = [lin[1]] + ([lin[3]] if x.tp == 1 else []) + ([lin[5]] if not moe else [])
    return sum(_forward_cast(cast, m, n, k, weight_cast_share) for m, n, k in again)


def cast_seconds(x: BlockShape, gpu: GPUSpec, dense_layers: int, moe_layers: int, compiled: bool,
                 weight_cast_share: float = 1.0) -> tuple[float, float]:
    """(forward, backward) seconds of the fp8 casts of a pipeline rank's blocks, one micro batch;
    0 unless the recipe trains in fp8 (``x.fp8_peak``). Recomputation re-runs the forward casts of
    what it recomputes: all of them (``full``), those of wk, w3 and wo (``selective_mm``)."""
    if not x.fp8_peak:
        return 0.0, 0.0
    fwd = bwd = 0.0
    for n, moe in ((dense_layers, False), (moe_layers, True)):
        if n:
            f, b = cast_bytes(x, moe, compiled, weight_cast_share)
            again = f if x.recompute == "full" else (
                recast_bytes(x, moe, compiled, weight_cast_share) if x.recompute == "selective_mm" else 0.0)
            fwd, bwd = fwd + n * f, bwd + n * (b + again)
    return membound_seconds(fwd, gpu), membound_seconds(bwd, gpu)
