"""Attention with soft-capped scores (Gemma 2's ``attn_logit_softcapping``), and capped logits.

Gemma 2 bounds every attention score before the softmax: ``s' = cap * tanh(s / cap)`` with
``s = q . k / sqrt(head_dim)`` (cap 50), and the final logits the same way (cap 30).
``F.scaled_dot_product_attention`` has no hook for a function of the scores, so this path
computes attention itself.

Why our own kernel and not FlexAttention's ``score_mod`` (the library's way to write it): torch
2.13 refuses FlexAttention's backward on CPU ("FlexAttention does not support backward on CPU"),
and our CPU/gloo runs are the engine's reference. Why not plain autograd over ``matmul``,
``tanh`` and ``softmax`` (transformers' eager attention): autograd would keep the capped scores,
the fp32 probabilities and their bf16 copy until the backward, ``b x heads x s x s`` three times
per layer (about 3 GiB per layer of Gemma 2 9B at 8,192 tokens). :func:`softcap_attention_op`
keeps what a flash kernel keeps, ``q, k, v``, the output and one fp32 log-sum-exp per query,
and recomputes the scores in the backward, one block of queries at a time, so no more than
``b x heads x block x s`` scores exist at once (forward or backward) and none are kept.

Math (the products in the inputs' dtype, the rest fp32, as transformers' eager attention upcasts
the softmax; inputs and outputs in their dtype):
``t = tanh(s / cap)``, ``z = cap * t + bias`` (``bias``: 0 / -inf, causal when None),
``p = exp(z - lse)``, ``o = p v``. Backward: ``dp = do v^T``, ``dz = p * (dp - rowsum(do * o))``,
``ds = dz * (1 - t^2)``, ``dq = ds k / sqrt(d)``, ``dk = ds^T q / sqrt(d)``, ``dv = p^T do``.
Equal to autograd over the eager formula within fp32 rounding (tests/test_softcap.py).
"""

from __future__ import annotations

import math

import torch

# queries per block: the scores of one block ([b, heads, block, s] fp32) are the largest transient
QUERY_BLOCK = 512


def _acc(x: torch.Tensor) -> torch.dtype:
    """The dtype of the math: fp32 (fp64 for fp64 inputs, so tests can compare exactly)."""
    return torch.promote_types(x.dtype, torch.float32)


def _block_bias(bias: torch.Tensor | None, lo: int, hi: int, s: int, like: torch.Tensor) -> torch.Tensor:
    """The additive mask of query rows ``lo:hi`` (broadcastable to [b, h, hi - lo, s]); causal when None."""
    if bias is not None:
        return bias[..., lo:hi, :].to(like.dtype)
    rows = torch.arange(lo, hi, device=like.device).unsqueeze(1)
    cols = torch.arange(s, device=like.device).unsqueeze(0)
    return torch.zeros(hi - lo, s, dtype=like.dtype, device=like.device).masked_fill_(cols > rows, float("-inf"))


def _scores(q: torch.Tensor, k: torch.Tensor, bias, lo: int, hi: int, cap: float, scale: float):
    """(tanh(s / cap), capped and masked scores) of query rows ``lo:hi``: the product in the inputs'
    dtype (a bf16 GEMM under bf16, as transformers' eager attention), the rest in the math's dtype."""
    t = torch.matmul(q[:, :, lo:hi], k.transpose(-1, -2)).to(_acc(q)).mul_(scale / cap).tanh_()
    z = (t * cap).add_(_block_bias(bias, lo, hi, k.shape[2], t))
    return t, z


@torch.library.custom_op("llmtrain::softcap_attention", mutates_args=())
def softcap_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None,
                         cap: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(softmax(cap * tanh(q k^T / (cap sqrt(d))) + bias) v, its fp32 log-sum-exp)`` on [b, heads, s, d].

    One op as the dispatcher sees it (a ``torch.library`` custom op, like SDPA's fused ops): selective
    activation checkpointing saves its outputs (engine/parallel/checkpointing.py ``_SAVE``) instead of
    caching every product inside it, and ``torch.compile`` treats it as opaque. The products run in
    the inputs' dtype, the element-wise math in fp32 (module docstring)."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    b, h, s, _ = q.shape
    # [b, s, h, d] in memory, as the flash kernels return it: the block's ``out.transpose(1, 2).reshape``
    # for wo is then a view, and wo's saved input shares this storage (no second copy kept)
    out = torch.empty(b, s, h, v.shape[-1], dtype=q.dtype, device=q.device).transpose(1, 2)
    lse = torch.empty(b, h, s, dtype=_acc(q), device=q.device)
    for lo in range(0, s, QUERY_BLOCK):
        hi = min(s, lo + QUERY_BLOCK)
        _, z = _scores(q, k, bias, lo, hi, cap, scale)
        lse[:, :, lo:hi] = torch.logsumexp(z, dim=-1)
        z.sub_(lse[:, :, lo:hi].unsqueeze(-1)).exp_()
        out[:, :, lo:hi] = torch.matmul(z.to(v.dtype), v)
    return out, lse


@softcap_attention_op.register_fake
def _(q, k, v, bias, cap):
    b, h, s, _ = q.shape
    out = q.new_empty(b, s, h, v.shape[-1]).transpose(1, 2)
    return out, q.new_empty(b, h, s, dtype=_acc(q))


@torch.library.custom_op("llmtrain::softcap_attention_backward", mutates_args=())
def softcap_attention_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               bias: torch.Tensor | None, out: torch.Tensor, lse: torch.Tensor,
                               cap: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of :func:`softcap_attention_op` w.r.t. q, k, v: the scores recomputed one block of
    queries at a time. The four products run in the inputs' dtype with the probabilities and score
    gradients cast to it (what flash kernels do with bf16 inputs); element-wise math and the
    gradients' sums over query blocks stay fp32."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    s = q.shape[2]
    acc = _acc(q)
    do = grad.to(q.dtype)
    delta = (grad.to(acc) * out.to(acc)).sum(-1)  # rowsum(do * o) [b, h, s]
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.zeros(k.shape, dtype=acc, device=k.device)
    dv = torch.zeros(v.shape, dtype=acc, device=v.device)
    for lo in range(0, s, QUERY_BLOCK):
        hi = min(s, lo + QUERY_BLOCK)
        t, p = _scores(q, k, bias, lo, hi, cap, scale)
        p.sub_(lse[:, :, lo:hi].unsqueeze(-1)).exp_()
        do_b = do[:, :, lo:hi]
        dv += torch.matmul(p.to(v.dtype).transpose(-1, -2), do_b)
        dz = torch.matmul(do_b, v.transpose(-1, -2)).to(acc).sub_(delta[:, :, lo:hi].unsqueeze(-1)).mul_(p)
        del p
        ds = dz.mul_(t.square_().neg_().add_(1.0)).mul_(scale).to(q.dtype)  # d(cap tanh(x / cap)) / dx = 1 - t^2
        dq[:, :, lo:hi] = torch.matmul(ds, k)
        dk += torch.matmul(ds.transpose(-1, -2), q[:, :, lo:hi])
    return dq, dk.to(k.dtype), dv.to(v.dtype)


@softcap_attention_backward.register_fake
def _(grad, q, k, v, bias, out, lse, cap):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)  # contiguous, as the kernel's


def _setup_context(ctx, inputs, output):
    q, k, v, bias, cap = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, bias, out, lse)
    ctx.cap = cap


def _backward(ctx, grad, grad_lse):
    q, k, v, bias, out, lse = ctx.saved_tensors
    dq, dk, dv = softcap_attention_backward(grad.contiguous(), q, k, v, bias, out, lse, ctx.cap)
    return dq, dk, dv, None, None


softcap_attention_op.register_autograd(_backward, setup_context=_setup_context)


def softcap_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                      cap: float) -> torch.Tensor:
    """Core attention with soft-capped scores; ``mask``: an additive float mask (0 / -inf,
    ``models.llama.attention_bias``) or None for causal. Equal head counts (K/V repeated)."""
    return softcap_attention_op(q, k, v, mask, float(cap))[0]


def softcap_logits(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """``cap * tanh(logits / cap)`` (Gemma 2's ``final_logit_softcapping``); the logits when ``cap`` is None."""
    return logits if cap is None else torch.tanh(logits / cap) * cap
