"""Working memory of one context-parallel attention call (the CP kernels' transient buffers,
beside the saved activations of ``activations.py``): counted into the plan's "other" memory as
``cp_attention`` (costmodel.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from llmtrain.plan.activations import ActShape

LSE = 4  # fp32 log-sum-exp bytes (activations.LSE)


def ring_transient_bytes(x: ActShape, acc: int, one: int) -> int:
    """Working memory of one ring attention call (``engine/parallel/context_ring.py``: fused kernel
    blocks, nothing ``[s_local, s_local]``), derived tensor by tensor from the code. ``Q`` = one
    local q-sized tensor, ``K`` one k-sized (kv_heads: ``Q kv_heads / heads``), acc = fp32 at
    least. Its peak is in the backward, whose steps overlap their transfers (thirteenth session):
    while a block's kernels run, the dq accumulator (acc Q), the block's K/V and the next block's
    in flight (``4 e K``; at step 0 the contiguous copies of the model's transposed k, v being
    sent and the received ones), the dK/dV accumulators (at step 0 the fresh ones, ``2 acc K``;
    later the previous step's sent and this step's received, ``4 acc K``) and the block's own
    tensors: K/V repeated to the query heads for the kernel under GQA (``2 e Q``, a half block's
    ``e Q``), dq (``e Q``, ``q_half``: ``e Q / 2``) and dK/dV of the block's keys (``2 e Q`` under
    GQA, else ``2 e K``; half for ``kv_half``). Without a next block (the last step: all of cp 2's
    half blocks) nothing is in flight. Between blocks, when the accumulators are sent on:
    ``acc Q + 4 (acc + e) K``, what the whole backward held before the overlap. Without GQA at cp 4
    in fp32: 46 Q (36 Q before the overlap); the forward (running output, K/V in use and in flight,
    one block) is smaller. The kernels' own buffers are not counted."""
    e, gqa = x.e, x.kv_heads < x.heads
    kv = one * x.kv_heads // x.heads  # one local k-sized tensor (kv_heads)
    rep_full, rep_half = (2 * e * one, e * one) if gqa else (0, 0)
    grads_full = 2 * e * (one if gqa else kv)  # one block's dK, dV (over the repeated heads under GQA)
    inflight = 2 * e * kv if x.cp >= 3 else 0  # the next K/V during a middle step's kernels
    step0 = acc * one + 2 * acc * kv + 4 * e * kv + rep_full + e * one + grads_full
    q_half = acc * one + 2 * e * kv + inflight + 4 * acc * kv + rep_full + e * one // 2 + grads_full
    kv_half = acc * one + 2 * e * kv + inflight + 4 * acc * kv + rep_half + e * one + grads_full // 2
    hop = acc * one + 4 * (acc + e) * kv
    return max(step0, q_half, kv_half, hop)


def cp_transient_bytes(x: ActShape) -> int:
    """Working memory of one context-parallel attention call. Ring: :func:`ring_transient_bytes`.

    All-gather (``engine/parallel/context.py``; zigzag: two query chunks of ``c`` = half the local
    tokens): its peak is in ``PrefixCausalAttention``'s backward on rank 0, beyond the saved
    full-sequence K/V: the dq accumulator (acc Q), the full-sequence dK and dV (``2 cp e Q``) and
    the largest block's gradients — the second chunk's prefix of ``(2 cp - 1) c`` keys:
    ``(2 cp - 1) e Q`` for its dK/dV and ``e Q / 2`` for its dq: ``(acc + (4 cp - 1/2) e) Q``. The
    forward's reorder (one extra full-sequence V, ``cp e Q``) and backward's (dK in rank order
    while dV waits, after the saved K/V are freed) stay below it. Measured on CPU (RSS, 16K
    tokens, 1 head of 64, fp32): cp 2 9.2 Q, cp 4 17.8 Q against 8.5 Q and 16.5 Q here (the rest:
    the CPU kernel's own buffers; in bf16 its fp32 accumulators add 4-8 bf16 Q more, not
    counted). (The contiguous shards before: ``(acc + (4 cp - 1) e) Q``, priced ``2 e Q`` then.)
    GQA: the saved full-sequence K/V and the dK/dV accumulators have kv_heads (``2 cp e K``,
    ``K = Q kv_heads / heads``), and the largest block also holds its keys repeated to the query
    heads for the kernel (``(2 cp - 1) e Q``, K and V): ``(acc + 2 cp e K / Q + (4 cp - 3/2) e) Q``
    (derived from the code as the ring's GQA terms, not measured); without GQA the formula above.

    All-gather with a mask or the soft-cap (``x.masked``: one masked call over the gathered K/V repeated
    to the query heads, which the activations count): its backward's dK and dV at the query heads over
    the whole sequence and dq, ``(2 cp + 1) e Q``, and in 16-bit the kernel's fp32 dq accumulator,
    ``(acc - e) Q``. Measured on CPU (RSS beyond the saved tensors and the output, 16K tokens, head_dim
    64): fp32 one head cp 2 5.45 Q, cp 4 9.95 Q; 4 heads on 1 K/V head cp 4 8.24 Q; bf16 2 heads on 1
    cp 4 10.7 Q; against 5, 9, 9 and 10 Q here."""
    if x.cp <= 1:
        return 0
    acc = max(x.e, LSE)
    one = x.b * x.s * x.heads * x.head_dim // x.tp  # elements of one local q-sized tensor
    if x.cp_method == "ring":
        return ring_transient_bytes(x, acc, one)
    if x.cp_method == "allgather" and x.masked:
        return (2 * x.cp + 1) * x.e * one + (acc - x.e) * one
    if x.cp_method == "allgather":
        kv = one * x.kv_heads // x.heads
        rep = (2 * x.cp - 1) * x.e * one if x.kv_heads < x.heads else 0  # the largest block's K/V repeated
        return acc * one + 2 * x.cp * x.e * kv + rep + (4 * x.cp - 1) * x.e * one // 2
    return 2 * x.e * one  # ulysses: the all-to-all buffers
