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

GQA: K/V travel with their local kv_heads (``[b, kv_heads, s_local, d]``, not repeated by the
model: ``context.make_cp_attention``); each step repeats the block it uses to the query heads
(``context_blocks.repeat_kv``) just for its kernel call, so the ring moves ``heads / kv_heads``
times fewer bytes (Megatron-Core, Llama 3).

Backward walks the same steps: each block's kernel backward gets the saved *merged* output and
lse (the flash trick, ``context_blocks``), K/V travel again together with the accumulating dK/dV
(acc dtype: fp32 at least, kv_heads: the block's repeated heads' gradients are summed into them),
which after the last step take one more hop home to their owner.

Memory: forward keeps the running output and lse (acc dtype, ``O(s_local d)``), the K/V in flight,
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


def rotate(tensors: list[torch.Tensor], group, rank: int, cp: int) -> list[torch.Tensor]:
    """Send each tensor to the next cp rank and receive the previous rank's (one batched P2P)."""
    nxt = dist.get_global_rank(group, (rank + 1) % cp)
    prv = dist.get_global_rank(group, (rank - 1) % cp)
    tensors = [t.contiguous() for t in tensors]
    received = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors]
    ops = [dist.P2POp(dist.isend, t, nxt, group) for t in tensors]
    ops += [dist.P2POp(dist.irecv, r, prv, group) for r in received]
    for req in dist.batch_isend_irecv(ops):
        req.wait()
    return received


def _step_kind(step: int, src: int, rank: int) -> str:
    """``diag`` (own K/V, causal), ``kv_half`` (all queries x first half of K/V) or ``q_half``
    (second half of the queries x all K/V): the module docstring."""
    if step == 0:
        return "diag"
    return "kv_half" if src < rank else "q_half"


class RingAttention(torch.autograd.Function):
    """Causal ring attention on this rank's zigzag shard: q ``[b, heads, s_local, d]``, k and v
    ``[b, kv_heads, s_local, d]`` (GQA: not repeated; module docstring)."""

    @staticmethod
    def forward(ctx, q, k, v, group, cp: int):
        rank, scale, half = dist.get_rank(group), default_scale(q), q.shape[2] // 2
        n_rep = q.shape[1] // k.shape[1]
        out = lse = None
        aux = {}
        kv = [k, v]
        for step in range(cp):
            src = (rank - step) % cp
            kind = _step_kind(step, src, rank)
            keys = slice(None, half) if kind == "kv_half" else slice(None)
            kr, vr = repeat_kv(*kv, keys, n_rep)  # GQA: repeated after the exchange
            if kind == "diag":
                blk_out, blk_lse, aux[kind] = block_forward(q, kr, vr, True, scale)
                out, lse = start_accumulators(blk_out, blk_lse)
            elif kind == "kv_half":
                blk_out, blk_lse, aux[kind] = block_forward(q, kr, vr, False, scale)
                merge_(out, lse, blk_out, blk_lse)
            else:
                blk_out, blk_lse, aux[kind] = block_forward(q[:, :, half:], kr, vr, False, scale)
                merge_(out[:, :, half:], lse[:, :, half:], blk_out, blk_lse)
            del blk_out, blk_lse, kr, vr
            if step < cp - 1:
                kv = rotate(kv, group, rank, cp)
        del kv
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.cp, ctx.scale, ctx.aux = group, cp, scale, aux
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group, cp, scale, aux = ctx.group, ctx.cp, ctx.scale, ctx.aux
        rank, half = dist.get_rank(group), q.shape[2] // 2
        n_rep = q.shape[1] // k.shape[1]
        acc = acc_dtype(q.dtype)
        dout = dout.to(q.dtype)
        # contiguous accumulators: rotate() sends them without a copy (zeros_like would keep the
        # model's transposed layout and make every hop copy them first)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        travel = [k, v, torch.zeros(k.shape, dtype=acc, device=k.device), torch.zeros(v.shape, dtype=acc, device=v.device)]
        for step in range(cp):
            src = (rank - step) % cp
            kind = _step_kind(step, src, rank)
            kb, vb, dk_acc, dv_acc = travel
            keys = slice(None, half) if kind == "kv_half" else slice(None)
            kr, vr = repeat_kv(kb, vb, keys, n_rep)  # GQA (forward's)
            if kind == "q_half":
                dqb, dkb, dvb = block_backward(dout[:, :, half:], q[:, :, half:], kr, vr, out[:, :, half:],
                                               lse[:, :, half:], False, scale, aux[kind])
                dq[:, :, half:].add_(dqb)
            else:
                dqb, dkb, dvb = block_backward(dout, q, kr, vr, out, lse, kind == "diag", scale, aux[kind])
                dq.add_(dqb)
            del kr, vr, dqb
            # the repeated heads' gradients summed per KV head: dK/dV travel with kv_heads only
            add_kv_grad_(dk_acc[:, :, keys], dkb, n_rep)
            add_kv_grad_(dv_acc[:, :, keys], dvb, n_rep)
            del dkb, dvb
            if step < cp - 1:
                travel = rotate([kb, vb, dk_acc, dv_acc], group, rank, cp)
            else:  # the accumulators belong to rank + 1 (whose K/V we hold): one last hop home
                travel = rotate([dk_acc, dv_acc], group, rank, cp)
        dk, dv = travel
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def ring_attention(q, k, v, group: dist.ProcessGroup, cp: int):
    return RingAttention.apply(q, k, v, group, cp)
