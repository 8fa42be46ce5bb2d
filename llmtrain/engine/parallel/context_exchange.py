"""A windowed layer's context parallelism by neighbour exchange: each rank fetches only the keys its window
needs, straight from their owners.

On the ring (``context_ring.py``, ``context_ring_window.py``) every rank's K/V visit every other rank, one hop
per step, whatever the layer needs: ``2 (cp - 1)`` chunks received per forward pass. Under a sliding window of
a few chunks (the local layers of Gemma 2/3 and Mistral at long context) a query chunk sees only itself and
the keys just before it, so most of those hops carry keys nobody reads. Here each rank exchanges, at each
step ``t`` of ``1 .. cp - 1`` where anything is needed, directly with ranks ``r - t`` (receive) and ``r + t``
(send), and only the keys a visible pair's box reads: a suffix of each chunk, its last ``window - 1`` keys
under a window shorter than a chunk (``plan/ringwindow.py`` ``exchange_plan``: from chunk positions alone,
so every rank knows every rank's needs and the P2P calls match without a handshake). With a window within
one chunk a middle rank receives ``2 (window - 1)`` key positions instead of the ring's ``2 (cp - 1)``
chunks. The boxes run as in the windowed ring: one masked kernel call each on its view of the model's mask
(keys in ring order, ``models/masks.py``), the rank's own diagonal pairs first, merged by log-sum-exp. Used
where no rank sends or receives more than ``(cp - 1)`` chunks' worth (``ringwindow.use_exchange``, the
planner's rule too); wider windows walk the ring.

Order of the P2P calls (matching on NCCL's one stream per group as on gloo): every rank posts its steps in
increasing ``t``; in the forward the next step's exchange is posted before this step's boxes run (it travels
meanwhile); in the backward each step posts its K/V exchange, waits, runs its boxes and posts the step's
gradients back to their owners (``dK/dV`` of the received keys to ``r - t``, its own keys' from ``r + t``),
waited for one step later. So every rank's calls are ordered by (step, phase) and no two ranks wait on each
other in opposite orders (prefetching the backward's next K/V before this step's gradients would break that
order between ranks whose active steps differ). The backward's K/V exchange is therefore not overlapped (the
ring's is): the exchange is chosen only where it moves at most half the ring's bytes.

Memory: forward holds at most two steps' received keys (in use and in flight, at most two chunks each: less
than the ring's two K/V blocks); backward one step's received K/V, their fp32 gradients and the previous step's
in flight. Saved for backward as the ring: q, k, v, the merged output and lse (the received keys are fetched
again in backward, as the ring sends its K/V again).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from llmtrain.engine.parallel.context_blocks import (acc_dtype, add_kv_grad_, box_backward_, box_forward_,
                                                     box_slices, default_scale, repeat_kv)
from llmtrain.engine.parallel.context_ring_window import _pair_mask
from llmtrain.plan.ringwindow import exchange_plan, step_boxes


def _part(t: torch.Tensor, j: int, k0: int, c: int) -> torch.Tensor:
    """Local chunk ``j``'s key positions from ``k0`` to its end (``[b, heads, c - k0, d]``, a view)."""
    return t[:, :, j * c + k0:(j + 1) * c]


def _post(sends: list[torch.Tensor], dst: int, shapes: list[tuple], like: torch.Tensor, src: int, group):
    """One batched P2P: ``sends`` to cp rank ``dst``, fresh buffers of ``shapes`` (``like``'s dtype and
    device) from ``src``; returns (received, requests, the contiguous copies sent, kept alive until the wait)."""
    sends = [x.contiguous() for x in sends]
    received = [torch.empty(shape, dtype=like.dtype, device=like.device) for shape in shapes]
    ops = [dist.P2POp(dist.isend, x, dist.get_global_rank(group, dst), group) for x in sends]
    ops += [dist.P2POp(dist.irecv, r, dist.get_global_rank(group, src), group) for r in received]
    return received, (dist.batch_isend_irecv(ops) if ops else []), sends


def _wait(pending) -> list[torch.Tensor]:
    received, reqs, _sent = pending
    for req in reqs:
        req.wait()
    return received


def _shapes(x: torch.Tensor, parts, c: int) -> list[tuple]:
    """K then V for each ``(j, k0)`` of ``parts``: ``x``'s shape with ``c - k0`` key positions."""
    b, heads, _, d = x.shape
    return [(b, heads, c - k0, d) for _, k0 in parts for _ in range(2)]


def _post_kv(k, v, rank: int, cp: int, c: int, step, group):
    """Step ``(t, recv, send)``'s K/V exchange: the key suffixes ``send`` of this rank's chunks to ``r + t``,
    rank ``r - t``'s suffixes ``recv`` from it (K then V per chunk, chunks in increasing order on both sides)."""
    t, recv, send = step
    sends = [x for j, k0 in send for x in (_part(k, j, k0, c), _part(v, j, k0, c))]
    return _post(sends, (rank + t) % cp, _shapes(k, recv, c), k, (rank - t) % cp, group)


def _received(recv, tensors: list[torch.Tensor]) -> dict[int, tuple[torch.Tensor, torch.Tensor, int]]:
    """``j -> (K, V, k0)``: the received suffixes of src's chunks and where each starts in its chunk."""
    return {j: (tensors[2 * n], tensors[2 * n + 1], k0) for n, (j, k0) in enumerate(recv)}


def _own(k, v, c: int) -> dict[int, tuple[torch.Tensor, torch.Tensor, int]]:
    """``j -> (K, V, 0)`` of this rank's two local chunks (views), as :func:`_received` lays them out."""
    return {j: (_part(k, j, 0, c), _part(v, j, 0, c), 0) for j in range(2)}


def _box_kv(chunks, box, c: int, n_rep: int):
    """Box ``(i, j, r0, r1, k0, k1)``'s keys out of ``chunks[j]`` (a suffix from its ``k0``), repeated for GQA."""
    kc, vc, start = chunks[box[1]]
    return repeat_kv(kc, vc, slice(box[4] - start, box[5] - start), n_rep)


class WindowExchangeAttention(torch.autograd.Function):
    """q ``[b, heads, s_local, d]``, k and v ``[b, kv_heads, s_local, d]`` (GQA: not repeated), ``mask`` the
    model's (this rank's rows, keys in ring order) or None, ``window`` the layer's (module docstring)."""

    @staticmethod
    def forward(ctx, q, k, v, group, cp: int, mask, softcap, window: int):
        rank, scale, c = dist.get_rank(group), default_scale(q), q.shape[2] // 2
        b, h, s, d = q.shape
        n_rep = h // k.shape[1]
        steps = exchange_plan(cp, c, window)[rank]
        out = torch.empty(b, s, h, d, dtype=acc_dtype(q.dtype), device=q.device).transpose(1, 2)
        lse = torch.empty(b, h, s, dtype=acc_dtype(q.dtype), device=q.device)
        aux = {}

        def run(t: int, chunks) -> None:
            src = (rank - t) % cp
            for box in step_boxes(rank, src, cp, c, window):
                i, j = box[:2]
                kr, vr = _box_kv(chunks, box, c, n_rep)
                aux[t, i, j] = box_forward_(out, lse, q, kr, vr, box_slices(box, c)[0], _pair_mask(mask, box, src, c),
                                            t == 0 and i == j, scale, softcap)
                del kr, vr

        pending = _post_kv(k, v, rank, cp, c, steps[0], group) if steps else None  # travels during step 0
        run(0, _own(k, v, c))
        for n, step in enumerate(steps):
            got = _received(step[1], _wait(pending))
            pending = _post_kv(k, v, rank, cp, c, steps[n + 1], group) if n + 1 < len(steps) else None
            run(step[0], got)
            del got
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, mask)  # the mask: the model's, shared by its layers
        ctx.group, ctx.cp, ctx.scale, ctx.aux, ctx.window = group, cp, scale, aux, window
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, mask = ctx.saved_tensors
        group, cp, scale, window = ctx.group, ctx.cp, ctx.scale, ctx.window
        rank, c = dist.get_rank(group), q.shape[2] // 2
        n_rep = q.shape[1] // k.shape[1]
        acc = acc_dtype(q.dtype)
        dout = dout.to(q.dtype)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        dk = torch.zeros(k.shape, dtype=acc, device=k.device)
        dv = torch.zeros(v.shape, dtype=acc, device=v.device)

        def run(t: int, chunks, grads) -> None:
            """Step ``t``'s boxes: dq into ``dq``, the keys' dK/dV into ``grads[j]`` (laid out as ``chunks[j]``)."""
            src = (rank - t) % cp
            for box in step_boxes(rank, src, cp, c, window):
                i, j = box[:2]
                kr, vr = _box_kv(chunks, box, c, n_rep)
                dkb, dvb = box_backward_(dq, dout, q, kr, vr, out, lse, box_slices(box, c)[0],
                                         _pair_mask(mask, box, src, c), t == 0 and i == j, scale, ctx.aux[t, i, j])
                keys = slice(box[4] - chunks[j][2], box[5] - chunks[j][2])
                add_kv_grad_(grads[j][0][:, :, keys], dkb, n_rep)
                add_kv_grad_(grads[j][1][:, :, keys], dvb, n_rep)
                del kr, vr, dkb, dvb

        def land(pending, send) -> None:
            """The previous step's gradients of this rank's key suffixes ``send``, from the rank that used them."""
            got = _wait(pending)
            for n, (j, k0) in enumerate(send):
                _part(dk, j, k0, c).add_(got[2 * n])
                _part(dv, j, k0, c).add_(got[2 * n + 1])

        run(0, _own(k, v, c), _own(dk, dv, c))  # the own chunks' gradients straight into dk / dv
        landing = None
        for t, recv, send in exchange_plan(cp, c, window)[rank]:
            got = _received(recv, _wait(_post_kv(k, v, rank, cp, c, (t, recv, send), group)))
            grads = {j: (torch.zeros(kc.shape, dtype=acc, device=k.device), torch.zeros(vc.shape, dtype=acc, device=v.device))
                     for j, (kc, vc, _) in got.items()}
            run(t, got, grads)
            del got
            # the received suffixes' gradients home to rank r - t; this rank's suffixes' from rank r + t
            pending = _post([g for j, _ in recv for g in grads[j]], (rank - t) % cp, _shapes(dk, send, c), dk,
                            (rank + t) % cp, group)
            del grads
            if landing is not None:
                land(*landing)
            landing = (pending, send)
        if landing is not None:
            land(*landing)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None


def window_exchange_attention(q, k, v, group: dist.ProcessGroup, cp: int, window: int, mask: torch.Tensor | None = None,
                              softcap: float | None = None):
    return WindowExchangeAttention.apply(q, k, v, group, cp, mask, None if softcap is None else float(softcap), window)
