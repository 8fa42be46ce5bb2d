"""HBM bytes of a block's memory-bound element-wise work, per micro batch on one rank (time model v2;
split out of :mod:`llmtrain.plan.ops`, which re-exports these and turns the bytes into seconds):
RMSNorm kernels (:func:`norm_bytes`), the engine's eager RoPE, SwiGLU, residual adds, GQA's K/V repeat
and autograd's gradient sums (:func:`_elementwise`), the fused kernels of other stacks
(``planner.block_kernels: fused``), Inductor's kernels under ``train.compile``
(:func:`_compiled_elementwise`) and an MoE block's dispatch and combine (:func:`_with_dispatch`).
Checked against the engine's own ops by tests/test_block_traffic.py."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from llmtrain.plan.ops import BlockShape


def norm_bytes(e: int, unfused: bool, offset: bool = False) -> tuple[int, int]:
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
    measurement (an allocator or kernel that fuses two of these would move less).

    ``offset`` (Gemma's ``model.norm_offset``, engine/models/norm.py ``OffsetRMSNorm``, an autograd
    Function of eager ops on every device unless compiled): forward ``float()`` e + 4, ``pow`` 8,
    ``mean`` 4, ``* rstd`` 8, ``* (1 + w)`` 8, the cast back 4 + e: ``2e + 36``; backward the
    normalized input again (e + 12), the gradient's upcast (e + 4), the weight's product and row sum
    (16), ``g (1 + w)`` 8, its product with the normalized input 12, their mean 4, the two products
    and the difference (28), the cast back (4 + e): ``3e + 88`` (tests/test_block_traffic.py counts
    the Function's ops)."""
    if offset:
        return 2 * e + 36, 3 * e + 88
    if unfused:
        return 4 * e + 28, 8 * e + 76
    return 2 * e, 3 * e


def _elementwise(x: BlockShape, moe: bool) -> tuple[float, float]:
    """(forward, backward) HBM bytes of a block's element-wise ops, per rank and micro batch."""
    if x.compiled and x.kernels == "engine":
        return _compiled_elementwise(x, moe)
    t, e, tok = x.tp, x.e, x.b * x.s
    rep = 1 if x.sp else t  # norms and residual adds run on all tokens on every TP rank without SP
    hdim = x.h * tok / t * rep
    qk = (x.heads + x.kv_heads) * x.hd * tok / t
    width = (x.top_k + x.shared) * x.expert_ffn if moe else x.ffn
    act = width * tok / t
    # 2 norms (fused, or planner.norm unfused: norm_bytes) and 2 residual adds (3e each way). The
    # engine (tests/test_block_traffic.py counts its ops): RoPE as engine/models/rope.py runs it (cast
    # to fp32, complex multiply, cast back: 2e + 16 bytes per element each way); SwiGLU as
    # engine/models/swiglu.py runs it (silu, then the product: 5e forward; backward grad * up,
    # silu_backward, silu again, grad * silu: 11e); with GQA the K/V heads repeated to the query heads
    # (repeat_interleave: read kv, write heads) and summed back in backward; in backward autograd's sums
    # of the input gradients of wq, wk and wv (2) and of the dense MLP's w1 and w3 (1), each on the
    # projections' full [tokens, hidden] input. planner.block_kernels fused: a fused RoPE (2e), a fused
    # activation (read gate and up, write the product: 3e; backward 5e), no repeat, one QKV and one fc1
    # GEMM (no sums).
    nf, nb = norm_bytes(e, x.norm_unfused, x.offset_norm)  # Gemma's post norms: x.norms 4; its offset norms
    # (engine/models/norm.py OffsetRMSNorm): eager fp32 ops
    base_f, base_b = x.norms * nf * hdim + 2 * 3 * e * hdim, x.norms * nb * hdim + 2 * 3 * e * hdim
    if x.kernels == "fused":
        fwd, bwd = base_f + 2 * e * qk + 3 * e * act, base_b + 2 * e * qk + 5 * e * act
    else:
        rope = (2 * e + 16) * qk
        repeat = 2 * e * (x.heads + x.kv_heads) * x.hd * tok / t if x.heads > x.kv_heads and not x.gqa_native else 0.0
        sums = (2 + (0 if moe else 1)) * 3 * e * x.h * tok
        fwd = base_f + rope + 5 * e * act + repeat
        bwd = base_b + rope + 11 * e * act + repeat + sums
    return _with_dispatch(x, moe, fwd, bwd)


def _with_dispatch(x: BlockShape, moe: bool, fwd: float, bwd: float) -> tuple[float, float]:
    """Adds an MoE block's dispatch gather and combine scatter of the routed copies (read + write each way)."""
    if moe:
        routed = 2 * 2 * x.e * x.top_k * x.h * x.b * x.s
        fwd, bwd = fwd + routed, bwd + routed
    return fwd, bwd


def _compiled_elementwise(x: BlockShape, moe: bool) -> tuple[float, float]:
    """(forward, backward) HBM bytes of the engine's block under ``train.compile``: Inductor's kernels.

    Counted kernel by kernel from what Inductor's scheduler generates for the engine's block
    (tests/test_block_traffic.py reads them back from a CPU compile with the GPU's pointwise ``cat``
    lowering, ``force_pointwise_cat``); the GEMMs, attention and, under TP, the collectives stay
    extern kernels that nothing fuses across. Per element of the residual stream (``hdim``):
    forward the first norm (read x, write its output: 2e), the attention's residual add fused into
    the second norm (read x and the attention output, write the norm's output: 3e; the sum itself is
    recomputed where it is read again) and the block's last add (read x, the attention and MLP
    outputs, write: 4e), 9e (eager: 10e). Backward each norm's input gradient in one kernel that
    also sums the projections' input gradients and adds the residual gradient (the MLP norm reads its
    n gradients, x, the attention output and the residual gradient, writes one: ``(n + 4)e``; the
    attention norm ``(n + 3)e``), and one kernel for both norms' weight gradients (a reduction over
    tokens: it reads the summed gradients' summands, x and the attention output again); with dense
    n = 2 (w1, w3) and 3 (wq, wk, wv): 19e (eager 21e). Under TP the input gradients are partial sums
    reduced by a collective: their sum is its own kernel (read n, write 1, on the full [tokens,
    hidden]) and the norms see one gradient each. RoPE (the engine's real formula under compile,
    engine/models/rope.py) fuses with the casts around it and with GQA's K/V repeat: q read and
    written once (2e), k read once and written repeated to the query heads, v's repeat a copy; the
    backward's sums over the repeats fuse with RoPE's backward the same way. ``planner.rope:
    complex`` (torchtitan's ``view_as_complex``): Inductor generates no complex code, so the cast,
    the complex multiply and the cast back stay three kernels (``2e + 16`` per element each way) and
    only k's repeat fuses into the cast back. SwiGLU one kernel each way (read gate and up, write
    the product: 3e; backward read the gradient, gate and up, write two: 5e). The MoE dispatch and
    combine are index kernels, priced as eager."""
    t, e, tok = x.tp, x.e, x.b * x.s
    rep = 1 if x.sp else t
    hdim = x.h * tok / t * rep
    q_el, kv_el = x.heads * x.hd * tok / t, x.kv_heads * x.hd * tok / t
    gqa = x.heads > x.kv_heads and not x.gqa_native  # repeated K/V (plan/gqa.py)
    act = ((x.top_k + x.shared) * x.expert_ffn if moe else x.ffn) * tok / t
    n_attn, n_mlp = 3, (1 if moe else 2)
    if t == 1:
        norms_b, sums = (2 * n_mlp + 2 * n_attn + 9) * e * hdim, 0.0
    else:
        norms_b = 13 * e * hdim
        sums = ((n_attn + 1) + (n_mlp + 1 if n_mlp > 1 else 0)) * e * x.h * tok
    if x.rope == "complex":
        per = 2 * e + 16
        rope = per * q_el + (per * kv_el + e * (q_el - kv_el) + e * (kv_el + q_el) if gqa else per * kv_el)
    else:
        rope = 2 * e * q_el + (2 * e * (kv_el + q_el) if gqa else 2 * e * kv_el)
    fwd = 9 * e * hdim + rope + 3 * e * act
    bwd = norms_b + sums + rope + 5 * e * act
    return _with_dispatch(x, moe, fwd, bwd)
