"""Ring attention over zigzag-sharded sequences, every block on a fused SDPA kernel.

Liu et al. 2023, "Ring Attention with Blockwise Transformers" (arXiv:2310.01889); the zigzag
load balancing as in Megatron-Core and torchtitan. The sequence is cut into ``2 cp`` chunks and
cp rank ``r`` holds chunks ``r`` and ``2 cp - 1 - r`` (``context.cp_positions``). K/V blocks travel
around the ring (P2P to the next rank) while each rank folds one block per step into its output
with the log-sum-exp rule (``context_blocks.merge_``). Under the causal mask the steps have a fixed
structure, so no mask is ever built and every block is a plain kernel call:

- step 0, the rank's own K/V: the local order is increasing in global position (chunk ``r`` before
  chunk ``2 cp - 1 - r``), so the global causal mask restricted to the local pair *is* the top-left
  causal mask on local indices — one ``is_causal=True`` call covers both diagonal chunks and the
  fully visible (second chunk x first chunk) block;
- K/V of ``src < r``: every local query sees the first chunk (``src``) fully and none of the
  second (``2 cp - 1 - src``, later than both local chunks): all queries x the first half of K/V;
- K/V of ``src > r``: the first local chunk (``r``) sees nothing; the second (``2 cp - 1 - r``,
  later than both of src's chunks) sees all of it: the second half of the queries x all K/V.

Both later kinds are unmasked and half the work of a full block, which keeps zigzag balanced: each
rank does one diagonal block and ``cp - 1`` half blocks.

Masks (packed rows' samples, a sliding window, Gemma 2's soft-cap; since the forty-first session,
before refused for all-gather or Ulysses): the model hands the ring this rank's rows of its additive
mask with the keys in ring order (``models/masks.py`` ``ring_keys``: rank ``j``'s K/V are columns
``j s_local ...``), so every step's block mask is a view of it, the same rows and keys the block
already uses (:func:`_block_mask`), and the causal structure above still holds (the mask has the causal
part in it; the diagonal block runs whole instead of ``is_causal``). Each block is a masked kernel
call (``context_blocks.masked_block_forward``: CPU's flash kernel with its mask, CUDA's
memory-efficient kernel with a bias, or the soft-capped kernel) whose rows that see no key of the
block (another sample, outside the window) come back with ``lse = -inf`` and add nothing to the
merge; the diagonal block holds every row's own position, so merged rows are never empty. A
windowed layer runs only the chunk pairs inside its window instead of these blocks
(``context_ring_window.py``, ``plan/ringwindow.py``), and a window of a few chunks fetches only those
chunks from their owners instead of walking the ring (``context_exchange.py``); blocks that packed rows' samples leave empty
still run. The mask is saved for backward by reference: the model's one tensor per forward, shared
by its layers.

GQA: K/V travel with their local kv_heads (``[b, kv_heads, s_local, d]``, not repeated by the
model: ``context.make_cp_attention``); each step repeats the block it uses to the query heads
(``context_blocks.repeat_kv``) just for its kernel call, so the ring moves ``heads / kv_heads``
times fewer bytes (Megatron-Core, Llama 3).

Backward walks the same steps: each block's kernel backward gets the saved *merged* output and
lse (the flash trick, ``context_blocks``), K/V travel again, and the accumulating dK/dV (acc
dtype: fp32 at least, kv_heads: the block's repeated heads' gradients are summed into them) follow
one step behind them on the same ring, and after the last step take one more hop home to their
owner.

Overlap (as Transformer Engine's ring does): each step starts the next block's K/V transfer
(:func:`start_rotate`) before its kernels and waits for it after them, so a hop costs only what it
takes beyond the block's compute. In the backward a block's dK/dV accumulator is sent on as soon
as this rank has added its share, and the next rank waits for it only after its own kernels for
that block have run. Every rank posts the same sequence of (send to the next rank, receive from
the previous) pairs, K/V then dK/dV per step, so the P2P messages match in order on NCCL and gloo.

Memory: forward keeps the running output and lse (acc dtype, ``O(s_local d)``), the K/V in use and in flight,
the block's repeated K/V and one block's output; backward the dq accumulator, the travelling
K/V/dK/dV, the block's repeated K/V and its gradients. Saved for backward: q, k and v (kv_heads),
the output (in the input dtype, returned to the model as well) and the fp32 lse — plain SDPA's,
with K/V not repeated. Ranks hold the merged output in the layout the
first kernel returned (on CPU the ``[b, s, h, d]`` memory layout), so the model's
``out.transpose(1, 2).reshape`` stays a view, as with plain SDPA.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from llmtrain.engine.parallel.context_blocks import (acc_dtype, add_kv_grad_, block_backward, block_forward,
                                                     default_scale, merge_, repeat_kv, start_accumulators)


def start_rotate(tensors: list[torch.Tensor], group, rank: int, cp: int) -> tuple[list[torch.Tensor], list, list]:
    """Start sending each tensor to the next cp rank and receiving the previous rank's (one batched
    P2P); :func:`finish_rotate` waits. The caller may compute with the sent tensors meanwhile (they
    are only read); the contiguous copies being sent are kept alive with the requests."""
    nxt = dist.get_global_rank(group, (rank + 1) % cp)
    prv = dist.get_global_rank(group, (rank - 1) % cp)
    tensors = [t.contiguous() for t in tensors]
    received = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors]
    ops = [dist.P2POp(dist.isend, t, nxt, group) for t in tensors]
    ops += [dist.P2POp(dist.irecv, r, prv, group) for r in received]
    return received, dist.batch_isend_irecv(ops), tensors


def finish_rotate(pending: tuple[list[torch.Tensor], list, list]) -> list[torch.Tensor]:
    received, reqs, _sent = pending
    for req in reqs:
        req.wait()
    return received


def rotate(tensors: list[torch.Tensor], group, rank: int, cp: int) -> list[torch.Tensor]:
    """Send each tensor to the next cp rank and receive the previous rank's, and wait."""
    return finish_rotate(start_rotate(tensors, group, rank, cp))


def walk_ring(k: torch.Tensor, v: torch.Tensor, group, rank: int, cp: int):
    """The forward's ``cp`` steps: yields ``(step, src, [k, v] of rank src)``, the next rank's K/V already
    travelling while the caller computes with these (read only: safe to send); waits after each step."""
    kv = [k, v]
    for step in range(cp):
        pending = start_rotate(kv, group, rank, cp) if step < cp - 1 else None
        yield step, (rank - step) % cp, kv
        if pending is not None:
            kv = finish_rotate(pending)


def _step_kind(step: int, src: int, rank: int) -> str:
    """``diag`` (own K/V, causal), ``kv_half`` (all queries x first half of K/V) or ``q_half``
    (second half of the queries x all K/V): the module docstring."""
    if step == 0:
        return "diag"
    return "kv_half" if src < rank else "q_half"


def _block_mask(mask: torch.Tensor | None, kind: str, src: int, s_local: int) -> torch.Tensor | None:
    """The view of ``mask`` (this rank's rows against the whole row's keys in ring order: rank ``j``'s
    K/V are columns ``j s_local ...``, ``masks.ring_keys``) that a step's block uses (module docstring)."""
    if mask is None:
        return None
    half, lo = s_local // 2, src * s_local
    if kind == "kv_half":
        return mask[..., lo:lo + half]
    if kind == "q_half":
        return mask[..., half:, lo:lo + s_local]
    return mask[..., lo:lo + s_local]


class RingAttention(torch.autograd.Function):
    """Causal ring attention on this rank's zigzag shard: q ``[b, heads, s_local, d]``, k and v
    ``[b, kv_heads, s_local, d]`` (GQA: not repeated; module docstring); ``mask`` / ``softcap``:
    masked blocks (module docstring)."""

    @staticmethod
    def forward(ctx, q, k, v, group, cp: int, mask=None, softcap=None):
        rank, scale, half = dist.get_rank(group), default_scale(q), q.shape[2] // 2
        n_rep = q.shape[1] // k.shape[1]
        out = lse = None
        aux = {}
        for step, src, kv in walk_ring(k, v, group, rank, cp):  # the next block's K/V travel meanwhile
            kind = _step_kind(step, src, rank)
            keys = slice(None, half) if kind == "kv_half" else slice(None)
            kr, vr = repeat_kv(*kv, keys, n_rep)  # GQA: repeated after the exchange
            bm = _block_mask(mask, kind, src, q.shape[2])
            causal = kind == "diag" and bm is None  # a mask holds the causal part itself
            if kind == "diag":
                blk_out, blk_lse, aux[kind] = block_forward(q, kr, vr, causal, scale, mask=bm, softcap=softcap)
                out, lse = start_accumulators(blk_out, blk_lse)
            elif kind == "kv_half":
                blk_out, blk_lse, aux[kind] = block_forward(q, kr, vr, False, scale, mask=bm, softcap=softcap)
                merge_(out, lse, blk_out, blk_lse)
            else:
                blk_out, blk_lse, aux[kind] = block_forward(q[:, :, half:], kr, vr, False, scale, mask=bm,
                                                            softcap=softcap)
                merge_(out[:, :, half:], lse[:, :, half:], blk_out, blk_lse)
            del blk_out, blk_lse, kr, vr
        del kv  # the last K/V received: freed before the output's cast
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, mask)  # the mask: the model's, shared by its layers
        ctx.group, ctx.cp, ctx.scale, ctx.aux = group, cp, scale, aux
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, mask = ctx.saved_tensors
        group, cp, scale, aux = ctx.group, ctx.cp, ctx.scale, ctx.aux
        rank, half = dist.get_rank(group), q.shape[2] // 2
        n_rep = q.shape[1] // k.shape[1]
        acc = acc_dtype(q.dtype)
        dout = dout.to(q.dtype)
        # contiguous accumulators: start_rotate() sends them without a copy (zeros_like would keep
        # the model's transposed layout and make every hop copy them first)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        kv = [k, v]
        grads = [torch.zeros(k.shape, dtype=acc, device=k.device), torch.zeros(v.shape, dtype=acc, device=v.device)]
        grads_pending = None
        for step in range(cp):
            src = (rank - step) % cp
            kind = _step_kind(step, src, rank)
            kb, vb = kv
            # K/V of the next block travel while this block's backward runs
            kv_pending = start_rotate(kv, group, rank, cp) if step < cp - 1 else None
            keys = slice(None, half) if kind == "kv_half" else slice(None)
            kr, vr = repeat_kv(kb, vb, keys, n_rep)  # GQA (forward's)
            bm = _block_mask(mask, kind, src, q.shape[2])
            if kind == "q_half":
                dqb, dkb, dvb = block_backward(dout[:, :, half:], q[:, :, half:], kr, vr, out[:, :, half:],
                                               lse[:, :, half:], False, scale, aux[kind], bm)
                dq[:, :, half:].add_(dqb)
            else:
                causal = kind == "diag" and bm is None
                dqb, dkb, dvb = block_backward(dout, q, kr, vr, out, lse, causal, scale, aux[kind], bm)
                dq.add_(dqb)
            del kr, vr, dqb
            # this block's dK/dV accumulators (sent by the previous rank after its own block's
            # backward, one step behind the K/V) arrive while the block's kernels ran
            if grads_pending is not None:
                grads, grads_pending = finish_rotate(grads_pending), None  # frees what was sent
            dk_acc, dv_acc = grads
            # the repeated heads' gradients summed per KV head: dK/dV travel with kv_heads only
            add_kv_grad_(dk_acc[:, :, keys], dkb, n_rep)
            add_kv_grad_(dv_acc[:, :, keys], dvb, n_rep)
            del dkb, dvb
            # on to the next rank, which holds this block next step; after the last step that is
            # the block's owner (rank + 1): the hop home
            grads_pending = start_rotate(grads, group, rank, cp)
            if kv_pending is not None:
                kv, kv_pending = finish_rotate(kv_pending), None  # frees the copies sent
        dk, dv = finish_rotate(grads_pending)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


def ring_attention(q, k, v, group: dist.ProcessGroup, cp: int, mask: torch.Tensor | None = None,
                   softcap: float | None = None):
    """The ring's blocks; a windowed layer's chunk pairs: ``context_ring_window.windowed_ring_attention``."""
    return RingAttention.apply(q, k, v, group, cp, mask, None if softcap is None else float(softcap))
