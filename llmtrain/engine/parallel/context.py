"""Context parallelism on CPU and GPU: the project's own attention over the ``cp`` group.

torch's built-in ``context_parallel`` has no sharding rule for the CPU flash-attention op
(CPU facts note, trap 1), so the three methods are implemented here, each as the model's
``attn_fn(q, k, v)`` on the local sequence shard ([b, heads, s_local, d], K/V heads already
repeated to the query heads). Every collective that carries gradients is either an autograd
op from ``torch.distributed._functional_collectives`` or a custom autograd Function below; never
``torch.distributed.nn.functional`` (wrong gradients on gloo for non-contiguous grads, trap 2).

Sequence sharding (:func:`cp_positions`): ``ring`` uses the load-balanced "zigzag" split — the
sequence is cut into ``2 cp`` chunks and cp rank ``r`` holds chunks ``r`` and ``2 cp - 1 - r``, so
under a causal mask every rank has the same amount of work; ``ulysses`` and ``allgather`` use
contiguous chunks. Inputs, labels and RoPE positions are sharded identically and positions stay
global, so the model computes exactly the full-sequence attention.

- ``allgather``: K and V are all-gathered (backward: reduce-scatter) and each rank attends its
  queries to the whole sequence with a causal mask on global positions. Simple; K/V memory is
  the full sequence.
- ``ulysses`` (Jacobs et al. 2023, arXiv:2309.14509): an all-to-all turns sequence shards of all
  heads into the full sequence of ``heads / cp`` heads, plain causal attention runs locally, and
  a second all-to-all turns it back. Needs heads divisible by tp x cp.
- ``ring`` (Liu et al. 2023, "Ring Attention", arXiv:2310.01889; zigzag balancing as in
  Megatron-Core / torchtitan): K/V blocks travel around the ring with P2P send/recv while each
  rank merges partial attention results with the online-softmax (log-sum-exp) rule; backward
  sends K/V around again together with the accumulating dK/dV, which end at their owner.
  Block attention is computed in fp32 with an explicit mask (memory O(s_local^2) per block).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed._functional_collectives import all_gather_tensor_autograd, all_to_all_single_autograd, wait_tensor


def cp_positions(seq_len: int, cp: int, cp_rank: int, method: str) -> torch.Tensor:
    """Global positions of the tokens this cp rank holds, in local order."""
    if cp == 1:
        return torch.arange(seq_len)
    if method == "ring":
        chunk = seq_len // (2 * cp)
        first, second = cp_rank, 2 * cp - 1 - cp_rank
        return torch.cat([torch.arange(first * chunk, (first + 1) * chunk),
                          torch.arange(second * chunk, (second + 1) * chunk)])
    chunk = seq_len // cp
    return torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk)


def shard_sequence(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Select this rank's tokens (dim 1) of inputs or labels."""
    return x.index_select(1, positions.to(x.device))


# ---------------------------------------------------------------------------------------------
def allgather_attention(q, k, v, group: dist.ProcessGroup, cp: int, positions: torch.Tensor):
    """Queries of the local shard against the all-gathered K/V (contiguous sharding)."""
    k_full = _gather_seq(k, group, cp)
    v_full = _gather_seq(v, group, cp)
    q_pos = positions.to(q.device)
    k_pos = torch.arange(k_full.shape[2], device=q.device)
    mask = q_pos[:, None] >= k_pos[None, :]
    return F.scaled_dot_product_attention(q, k_full, v_full, attn_mask=mask)


def _gather_seq(x: torch.Tensor, group, cp: int) -> torch.Tensor:
    # all_gather_tensor gathers along dim 0: move the sequence there and back
    b, h, s, d = x.shape
    flat = x.permute(2, 0, 1, 3).contiguous()  # [s, b, h, d]
    # wait here, while ``flat`` (a temporary) is alive: the collective then never outlives the
    # buffers it reads (a gloo send thread once segfaulted reading freed memory in a CP job under
    # heavy load; not proven to be this, but nothing overlaps here anyway: SDPA waits next)
    gathered = wait_tensor(all_gather_tensor_autograd(flat, gather_dim=0, group=group))  # [cp*s, b, h, d]
    return gathered.permute(1, 2, 0, 3)


# ---------------------------------------------------------------------------------------------
def ulysses_attention(q, k, v, group: dist.ProcessGroup, cp: int):
    """All-to-all from (all heads, local sequence) to (heads / cp, full sequence) and back."""
    qh, kh, vh = (_seq_to_heads(t, group, cp) for t in (q, k, v))
    out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True)
    return _heads_to_seq(out, group, cp)


def _seq_to_heads(x: torch.Tensor, group, cp: int) -> torch.Tensor:
    b, h, s, d = x.shape
    send = x.reshape(b, cp, h // cp, s, d).permute(1, 0, 2, 3, 4).contiguous()  # [cp(dst), b, h/cp, s, d]
    recv = wait_tensor(all_to_all_single_autograd(send.reshape(cp, -1), None, None, group))  # [cp(src seq chunk), ...]
    recv = recv.reshape(cp, b, h // cp, s, d)
    return recv.permute(1, 2, 0, 3, 4).reshape(b, h // cp, cp * s, d)


def _heads_to_seq(x: torch.Tensor, group, cp: int) -> torch.Tensor:
    b, hc, S, d = x.shape
    s = S // cp
    send = x.reshape(b, hc, cp, s, d).permute(2, 0, 1, 3, 4).contiguous()  # [cp(dst seq chunk), b, h/cp, s, d]
    recv = wait_tensor(all_to_all_single_autograd(send.reshape(cp, -1), None, None, group))  # [cp(src head group), ...]
    recv = recv.reshape(cp, b, hc, s, d)
    return recv.permute(1, 0, 2, 3, 4).reshape(b, cp * hc, s, d)


# ---------------------------------------------------------------------------------------------
def _rotate(tensors: list[torch.Tensor], group, rank: int, cp: int) -> list[torch.Tensor]:
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


class RingAttention(torch.autograd.Function):
    """Causal ring attention over zigzag-sharded sequences (see the module docstring)."""

    @staticmethod
    def forward(ctx, q, k, v, group, cp: int, seq_len: int):
        rank = dist.get_rank(group)
        scale = 1.0 / math.sqrt(q.shape[-1])
        acc = torch.promote_types(q.dtype, torch.float32)  # fp32 at least, fp64 stays fp64
        qf = q.to(acc)
        q_pos = cp_positions(seq_len, cp, rank, "ring").to(q.device)
        out = torch.zeros_like(qf)
        lse = torch.full(q.shape[:-1], float("-inf"), device=q.device, dtype=acc)
        kv = [k, v]
        for step in range(cp):
            src = (rank - step) % cp
            k_pos = cp_positions(seq_len, cp, src, "ring").to(q.device)
            mask = q_pos[:, None] >= k_pos[None, :]
            scores = (qf @ kv[0].to(acc).transpose(-1, -2)) * scale
            scores = scores.masked_fill(~mask, float("-inf"))
            blk_lse = torch.logsumexp(scores, dim=-1)
            probs = torch.exp(scores - _finite(blk_lse)[..., None])
            blk_out = probs @ kv[1].to(acc)
            new_lse = torch.logaddexp(lse, blk_lse)
            out = out * _weight(lse, new_lse)[..., None] + blk_out * _weight(blk_lse, new_lse)[..., None]
            lse = new_lse
            if step < cp - 1:
                kv = _rotate(kv, group, rank, cp)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.cp, ctx.seq_len, ctx.scale = group, cp, seq_len, scale
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group, cp, seq_len, scale = ctx.group, ctx.cp, ctx.seq_len, ctx.scale
        rank = dist.get_rank(group)
        acc = out.dtype
        qf, dout = q.to(acc), dout.to(acc)
        q_pos = cp_positions(seq_len, cp, rank, "ring").to(q.device)
        delta = (dout * out).sum(-1, keepdim=True)
        dq = torch.zeros_like(qf)
        travel = [k, v, torch.zeros_like(k, dtype=acc), torch.zeros_like(v, dtype=acc)]
        for step in range(cp):
            src = (rank - step) % cp
            kb, vb, dk_acc, dv_acc = travel
            k_pos = cp_positions(seq_len, cp, src, "ring").to(q.device)
            mask = q_pos[:, None] >= k_pos[None, :]
            scores = (qf @ kb.to(acc).transpose(-1, -2)) * scale
            probs = torch.exp(scores.masked_fill(~mask, float("-inf")) - lse[..., None])
            dv_acc = dv_acc + probs.transpose(-1, -2) @ dout
            dprobs = dout @ vb.to(acc).transpose(-1, -2)
            dscores = probs * (dprobs - delta)
            dq = dq + (dscores @ kb.to(acc)) * scale
            dk_acc = dk_acc + (dscores.transpose(-1, -2) @ qf) * scale
            travel = [kb, vb, dk_acc, dv_acc]
            if step < cp - 1:
                travel = _rotate(travel, group, rank, cp)
            else:  # the accumulators belong to rank + 1 (whose K/V we hold): one last hop home
                dk_acc, dv_acc = _rotate([dk_acc, dv_acc], group, rank, cp)
        return dq.to(q.dtype), dk_acc.to(k.dtype), dv_acc.to(v.dtype), None, None, None


def _finite(x: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isfinite(x), x, torch.zeros_like(x))


def _weight(part_lse: torch.Tensor, total_lse: torch.Tensor) -> torch.Tensor:
    """exp(part - total), 0 where the part is empty (-inf)."""
    w = torch.exp(part_lse - _finite(total_lse))
    return torch.where(torch.isfinite(part_lse), w, torch.zeros_like(w))


def ring_attention(q, k, v, group: dist.ProcessGroup, cp: int, seq_len: int):
    return RingAttention.apply(q, k, v, group, cp, seq_len)


def make_cp_attention(method: str, group: dist.ProcessGroup, cp: int, cp_rank: int, seq_len: int):
    """The ``attn_fn`` for this rank's blocks."""
    if method == "ring":
        return lambda q, k, v: ring_attention(q, k, v, group, cp, seq_len)
    if method == "ulysses":
        return lambda q, k, v: ulysses_attention(q, k, v, group, cp)
    positions = cp_positions(seq_len, cp, cp_rank, "allgather")
    return lambda q, k, v: allgather_attention(q, k, v, group, cp, positions)


def apply_context_parallel(model, cp_mesh, method: str, seq_len: int) -> None:
    """Swap every block's core attention for the CP one (before AC/compile/FSDP wrap blocks)."""
    cp, cp_rank, group = cp_mesh.size(), cp_mesh.get_local_rank(), cp_mesh.get_group()
    for block in model.layers.values():
        block.attention.attn_fn = make_cp_attention(method, group, cp, cp_rank, seq_len)
