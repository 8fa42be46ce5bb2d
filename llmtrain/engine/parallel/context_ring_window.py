"""Ring attention for a windowed layer: only the (query chunk, key chunk) pairs inside the window run, each
on the rows and keys of its visible scores' bounding box.

The ring (``context_ring.py``) groups each step's work into one block of up to four ``c x c`` chunk
pairs (zigzag: rank ``r`` holds chunks ``r`` and ``2 cp - 1 - r``). Under a sliding window shorter than
the row most pairs see nothing, and the grouped blocks would run them anyway; here each step runs only
its visible pairs (``plan/ringwindow.py`` ``step_boxes``: from chunk positions, no device sync, the rule
the planner counts with), each one masked kernel call on its box's view of the model's mask (this
rank's rows, keys in ring order: ``models/masks.py``; a pair of different chunks under a window shorter
than a chunk: the first ``window - 1`` rows against the last ``window - 1`` keys), merged into those rows by
their log-sum-exp. The rank's own diagonal pairs run first, so every row has a key before anything merges
(rows of a later pair that see none of its keys get lse -inf: ``context_blocks.masked_block_forward``).

Everything else is the ring's: K/V travel one hop per step while the step's pairs run, the backward
walks the same steps with the merged output and lse (the flash trick), and the dK/dV accumulators follow
one step behind and take one more hop home. A step with no visible pair still passes K/V (and in the
backward the accumulators) on: every rank posts the same P2P sequence. Without a mask (a row no longer
than the window: no band) the diagonal pairs run ``is_causal`` and the others unmasked. A window that
reaches only a few chunks does not walk the ring at all: each rank fetches just the chunks its pairs read
(``context_exchange.py``, chosen by ``plan/ringwindow.py`` ``use_exchange``); this walk is for wider windows.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from llmtrain.engine.parallel.context_blocks import (acc_dtype, add_kv_grad_, box_backward_, box_forward_,
                                                     box_slices, default_scale, repeat_kv)
from llmtrain.engine.parallel.context_ring import finish_rotate, start_rotate, walk_ring
from llmtrain.plan.ringwindow import step_boxes


def _pair_mask(mask: torch.Tensor | None, box: tuple[int, ...], src: int, chunk: int) -> torch.Tensor | None:
    """Box ``(i, j, r0, r1, k0, k1)``'s view of ``mask``: rows ``r0 .. r1`` of local chunk ``i``, keys ``k0 ..
    k1`` of src's local chunk ``j`` (columns ``src s_local + j c ...`` in ring order)."""
    if mask is None:
        return None
    i, j, r0, r1, k0, k1 = box
    lo = src * 2 * chunk + j * chunk
    return mask[..., i * chunk + r0:i * chunk + r1, lo + k0:lo + k1]


class WindowedRingAttention(torch.autograd.Function):
    """q ``[b, heads, s_local, d]``, k and v ``[b, kv_heads, s_local, d]`` (GQA: not repeated), ``mask``
    the model's (this rank's rows, keys in ring order) or None, ``window`` the layer's (module docstring)."""

    @staticmethod
    def forward(ctx, q, k, v, group, cp: int, mask, softcap, window: int):
        rank, scale, c = dist.get_rank(group), default_scale(q), q.shape[2] // 2
        b, h, s, d = q.shape
        n_rep = h // k.shape[1]
        # fresh accumulators in the [b, s, h, d] layout the kernels return (wo's input stays a view)
        out = torch.empty(b, s, h, d, dtype=acc_dtype(q.dtype), device=q.device).transpose(1, 2)
        lse = torch.empty(b, h, s, dtype=acc_dtype(q.dtype), device=q.device)
        aux = {}
        for step, src, kv in walk_ring(k, v, group, rank, cp):  # the next K/V travel meanwhile
            for box in step_boxes(rank, src, cp, c, window):
                i, j = box[:2]
                rows, keys = box_slices(box, c)
                kr, vr = repeat_kv(*kv, keys, n_rep)
                aux[step, i, j] = box_forward_(out, lse, q, kr, vr, rows, _pair_mask(mask, box, src, c),
                                               step == 0 and i == j, scale, softcap)
                del kr, vr
        del kv  # the last K/V received: freed before the output's cast
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, mask)  # the mask: the model's, shared by its layers
        ctx.group, ctx.cp, ctx.scale, ctx.aux, ctx.window = group, cp, scale, aux, window  # (the cap: in aux)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, mask = ctx.saved_tensors
        group, cp, scale = ctx.group, ctx.cp, ctx.scale
        rank, c = dist.get_rank(group), q.shape[2] // 2
        n_rep = q.shape[1] // k.shape[1]
        acc = acc_dtype(q.dtype)
        dout = dout.to(q.dtype)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)  # contiguous: the accumulators travel uncopied
        kv = [k, v]
        grads = [torch.zeros(k.shape, dtype=acc, device=k.device), torch.zeros(v.shape, dtype=acc, device=v.device)]
        grads_pending = None
        for step in range(cp):
            src = (rank - step) % cp
            kv_pending = start_rotate(kv, group, rank, cp) if step < cp - 1 else None
            computed = []
            for box in step_boxes(rank, src, cp, c, ctx.window):
                i, j = box[:2]
                rows, keys = box_slices(box, c)
                kr, vr = repeat_kv(*kv, keys, n_rep)
                dkb, dvb = box_backward_(dq, dout, q, kr, vr, out, lse, rows, _pair_mask(mask, box, src, c),
                                         step == 0 and i == j, scale, ctx.aux[step, i, j])
                computed.append((keys, dkb, dvb))
                del kr, vr
            # this step's dK/dV accumulators, one step behind the K/V, arrive while the pairs ran
            if grads_pending is not None:
                grads, grads_pending = finish_rotate(grads_pending), None
            for keys, dkb, dvb in computed:
                add_kv_grad_(grads[0][:, :, keys], dkb, n_rep)
                add_kv_grad_(grads[1][:, :, keys], dvb, n_rep)
            del computed
            grads_pending = start_rotate(grads, group, rank, cp)  # on to the next rank; after the last step, home
            if kv_pending is not None:
                kv, kv_pending = finish_rotate(kv_pending), None
        dk, dv = finish_rotate(grads_pending)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None


def windowed_ring_attention(q, k, v, group: dist.ProcessGroup, cp: int, window: int, mask: torch.Tensor | None = None,
                            softcap: float | None = None):
    return WindowedRingAttention.apply(q, k, v, group, cp, mask, None if softcap is None else float(softcap), window)
