"""Memory-bound work of the engine's ring and all-gather context parallelism besides its attention
kernels (time model v2): the bytes that ``engine/parallel/context_ring.py`` and
``context_blocks.PrefixCausalAttention`` move per block, rank and micro batch, each op as that
code runs it (tests/test_cp_traffic.py counts the engine's ops under a dispatch mode against
these sums).

Per layer and micro batch on one rank (``O`` = the rank's attention output elements, ``b x heads /
tp x s_local x head_dim``; ``e`` the activation bytes, ``a`` = 4 the fp32 accumulators):

- **merge** of a block's output into the running fp32 output, ``merge_``: the output scaled in
  place (``2a``), the block's output times its weight (``e + a``), added in place (``3a``):
  ``(6a + e)`` per merged element; the first block of each query range copied to fp32 (``e + a``)
  and the merged output cast back (``a + e``);
- **GQA's repeat** of each block's key range to the query heads, ``repeat_kv`` (K and V, read with
  their kv_heads, written repeated), in the forward and again in the backward; none where the
  K/V arrive repeated (``planner.cp_kv: repeated``) or without GQA;
- **backward accumulators**: each block's dQ added into the fp32 dQ (``2a + e``), and its
  repeated heads' dK/dV added into the dK/dV of the key range one copy at a time
  (``add_kv_grad_``: ``2t + e`` per repeated element, ``t`` the accumulator's bytes: fp32 in the
  ring, which sends them around, the activation dtype in the all-gather's, which autograd returns);
  the accumulators cast back at the end;
- the **ring's first send** of each pass copies the model's K/V (transposed views) contiguous;
- the **all-gather's reorder** of the gathered K/V from rank order into global order, one copy
  each way (the gather's own layout is the model's K/V memory: its permute copies nothing).

Ring: the rank that merges most is priced, ``cp - 1`` (every block after its diagonal one is "all
its queries x half the keys", so every merge spans all its rows; rank 0 merges half-rows only):
the step waits for the slowest rank. The all-gather's ranks are equal but rank 0, whose first
chunk has no prefix to merge; a rank ``>= 1`` is priced. The merges' log-sum-exp ops are in
(:data:`MERGE_LSE` per row, ``1 / head_dim`` of the rest); the accumulators' zero fills (one write
each, allocations the count leaves out) are not. Recomputation re-runs the forward's part (ops.block_seconds adds the
attention's forward again). Ulysses moves its data by all-to-all and runs plain SDPA: none.
"""

from __future__ import annotations

ACC = 4  # bytes of the fp32 merge and gradient accumulators (context_blocks.acc_dtype)
# per merged row, the log-sum-exp's part of merge_ (fp32): logaddexp (3 x 4), two differences (2 x 12),
# two exps (2 x 8), the weights read again by the two products (2 x 4), the new lse copied (8)
MERGE_LSE = 68


def _repeat(b: int, hl: int, kvl: int, keys: int, d: int, e: int) -> float:
    """``repeat_kv`` of ``keys`` keys, K and V: read with kv_heads, written repeated (0 without GQA)."""
    return 0.0 if hl == kvl else 2.0 * e * b * (kvl + hl) * keys * d


def _kv_grad_add(b: int, hl: int, kvl: int, keys: int, d: int, e: int, acc: int) -> float:
    """``add_kv_grad_`` into dK and dV of ``keys`` keys: one ``acc += grad`` per repeated head copy."""
    return 2.0 * (2 * acc + e) * b * hl * keys * d


def cp_attention_bytes(method: str, cp: int, b: int, heads: int, kv_heads: int, s: int, d: int,
                       e: int) -> tuple[float, float]:
    """(forward, backward) bytes of one layer's CP attention outside its kernels on one rank, one
    micro batch: ``heads`` / ``kv_heads`` the rank's query and moved K/V heads, ``s`` its local
    tokens (module docstring); ``method`` ring, allgather (the engine's) or torch (:func:`torch_cp_bytes`).
    0 for ulysses and without CP."""
    if cp <= 1 or method not in ("ring", "allgather", "torch"):
        return 0.0, 0.0
    a, hl, kvl = ACC, heads, kv_heads
    out, rows = b * hl * s * d, b * hl * s  # output elements, and its rows (one log-sum-exp each)
    kv_local = b * kvl * s * d
    if method == "torch":
        return torch_cp_bytes(cp, out, rows, kv_local, e)
    if method == "ring":  # rank cp - 1: the diagonal block, then cp - 1 blocks of all rows x s / 2 keys
        half = s // 2
        repeats = _repeat(b, hl, kvl, s, d, e) + (cp - 1) * _repeat(b, hl, kvl, half, d, e)
        fwd = (2 * 2 * e * kv_local  # the first send's contiguous copies of the model's K and V (transposed views)
               + repeats
               + (e + a) * out + 2 * a * rows  # the first block's output and lse copied to fp32
               + (cp - 1) * ((6 * a + e) * out + MERGE_LSE * rows)
               + (a + e) * out)  # cast back
        bwd = (2 * 2 * e * kv_local + repeats  # the saved K and V sent again; the repeats again
               + cp * (2 * a + e) * out  # dQ += each block's
               + _kv_grad_add(b, hl, kvl, s, d, e, a) + (cp - 1) * _kv_grad_add(b, hl, kvl, half, d, e, a)
               + (a + e) * out + 2 * (a + e) * kv_local)  # the accumulators cast back
        return fwd, bwd
    # all-gather, rank 1 (as every rank >= 1): chunks of c tokens at offsets c and (2 cp - 2) c, each a
    # diagonal block and a prefix block over the keys before it
    c = s // 2
    keys = 2 * c + c + (2 * cp - 2) * c  # keys read by the rank's four blocks
    kv_seq = b * kvl * cp * s * d
    repeats = _repeat(b, hl, kvl, keys, d, e)
    fwd = (2 * 2 * e * kv_seq  # the gathered K and V reordered into global order (one copy each)
           + repeats
           + (e + a) * out + 2 * a * rows  # each chunk's diagonal block copied into the fp32 output, and its lse
           + 2 * ((6 * a + e) * out / 2 + MERGE_LSE * rows / 2)  # each chunk's prefix block merged
           + (a + e) * out)
    bwd = (repeats
           + 4 * (2 * a + e) * (out / 2)  # dQ rows += each of the four blocks'
           + _kv_grad_add(b, hl, kvl, keys, d, e, e)
           + (a + e) * out  # dQ cast back
           + 2 * 2 * e * kv_seq)  # dK and dV put back into rank order
    return fwd, bwd


def torch_cp_bytes(cp: int, out: int, rows: int, kv: int, e: int) -> tuple[float, float]:
    """torch's ``context_parallel`` (``torch.distributed.tensor.experimental._context_parallel``,
    ``_templated_ring_attention`` and its backward, read at torch 2.13; the same loop for its all-gather
    and ring rotations, load balanced, ``convert_to_f32``): ``cp`` kernel calls per layer, each step's
    output folded over the rank's rows by ``_SDPAMerger`` (the block output cast to fp32, then
    ``out - sigmoid(lse_b - lse) * (out - out_b)``: three passes, 32 bytes per element, and 60 per row
    for the log-sum-exp), K/V made contiguous and concatenated for every send; backward fp32 dQ / dK /
    dV accumulators, dK / dV concatenated for every send, and ``_partial_update``'s half-row adds
    followed by a full copy (``torch.cat``). Rank ``cp - 1`` is priced: every step after its first
    covers all of its rows, the most bytes (tests/test_cp_traffic.py counts torch's code per rank). ``kv``:
    the rank's K (or V) elements as torch gets them (torchtitan repeats them to the query heads first)."""
    a, steps = ACC, cp - 1
    fwd = (4 * e * kv * cp  # K and V made contiguous (the model's transposed views), then one concatenation per send
           + (e + a) * out + steps * ((e + a) * out + 8 * a * out + 60 * rows) + (a + e) * out)
    bwd = (4 * e * kv * cp  # the saved K and V again
           + 2 * (2 * a + e) * kv  # first step: dK, dV += the block's
           + steps * ((2 * a + e) * kv + 2 * 2 * a * kv)  # then half-row adds and _partial_update's full copies
           + 2 * 2 * a * kv * (cp + 1)  # dK / dV concatenated per send (and flattened once from the model's layout)
           + cp * (2 * a + e) * out + (a + e) * out + 2 * (a + e) * kv)  # dQ adds, the casts back
    return fwd, bwd
