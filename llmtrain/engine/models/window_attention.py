"""A windowed layer's attention without context parallelism: only the score boxes its window can see.

SDPA with the dense band mask runs every score of the row (a kernel given a mask skips nothing), ``s^2``
per head where ``s window`` are visible: at 8,192 tokens Gemma 3's window of 1,024 leaves 7/8 of them
masked. Here the row is cut into chunks near the window's length and each (query chunk, key chunk) pair
with a visible score runs the bounding box of those scores (``plan/localwindow.py``, the rule the planner
counts with: positions only, no device sync), one masked kernel call each on its view of the model's mask
(``context_blocks.masked_block_forward``: CPU's flash kernel with the mask, CUDA's memory-efficient kernel
with a bias, or the soft-capped kernel for Gemma 2), merged into its rows by log-sum-exp, each query
chunk's diagonal first (every row sees itself). The backward runs the same boxes with the merged output
and lse (the flash trick, as ring CP's blocks). Saved for backward what SDPA's kernel saves: q, k, v, the
output and the fp32 lse (the mask by reference: the model's, shared by its layers); under selective
recomputation the policy keeps every box call's output and lse. A row whose chunks do not fit
(``localwindow.local_chunk`` None) and compiled blocks (``train.compile``: Inductor traces SDPA, not this
Function's loop) keep the dense masked call.
"""

from __future__ import annotations

import torch

# the module, its names looked up at call time: context_blocks imports the models package (the soft-capped
# kernel), whose llama.py imports this file, so either may be imported first
from llmtrain.engine.parallel import context_blocks as blocks
from llmtrain.plan.localwindow import local_boxes, local_chunk


class LocalWindowAttention(torch.autograd.Function):
    """q ``[b, heads, s, d]``, k and v ``[b, heads or kv_heads, s, d]``, ``mask`` the model's additive mask of
    the layer (window band, packed rows' samples) broadcastable to ``[b, heads, s, s]``."""

    @staticmethod
    def forward(ctx, q, k, v, mask, softcap, window: int):
        b, h, s, d = q.shape
        c, n_rep, scale = local_chunk(s, window), h // k.shape[1], blocks.default_scale(q)
        out = torch.empty(b, s, h, d, dtype=blocks.acc_dtype(q.dtype), device=q.device).transpose(1, 2)
        lse = torch.empty(b, h, s, dtype=blocks.acc_dtype(q.dtype), device=q.device)
        aux = {}
        for box in local_boxes(s, window):  # each query chunk's diagonal first: every row sees itself
            rows, keys = blocks.box_slices(box, c)
            kr, vr = blocks.repeat_kv(k, v, keys, n_rep)
            aux[box[:2]] = blocks.box_forward_(out, lse, q, kr, vr, rows, mask[..., rows, keys], box[0] == box[1],
                                               scale, softcap)
            del kr, vr
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, mask)
        ctx.scale, ctx.aux, ctx.window = scale, aux, window
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, mask = ctx.saved_tensors
        s = q.shape[2]
        c, n_rep, acc = local_chunk(s, ctx.window), q.shape[1] // k.shape[1], blocks.acc_dtype(q.dtype)
        dout = dout.to(q.dtype)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        dk = torch.zeros(k.shape, dtype=acc, device=k.device)
        dv = torch.zeros(v.shape, dtype=acc, device=v.device)
        for box in local_boxes(s, ctx.window):
            rows, keys = blocks.box_slices(box, c)
            kr, vr = blocks.repeat_kv(k, v, keys, n_rep)
            dkb, dvb = blocks.box_backward_(dq, dout, q, kr, vr, out, lse, rows, mask[..., rows, keys],
                                            box[0] == box[1], ctx.scale, ctx.aux[box[:2]])
            blocks.add_kv_grad_(dk[:, :, keys], dkb, n_rep)
            blocks.add_kv_grad_(dv[:, :, keys], dvb, n_rep)
            del kr, vr, dkb, dvb
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


def runs_local(seq: int, window: int | None) -> bool:
    """Whether a windowed layer over ``seq`` tokens runs its boxes here (module docstring)."""
    return local_chunk(seq, window) is not None and not torch.compiler.is_compiling()


def local_window_attention(q, k, v, mask: torch.Tensor, window: int, softcap: float | None = None):
    return LocalWindowAttention.apply(q, k, v, mask, None if softcap is None else float(softcap), window)
