"""The model's RMSNorms: Llama's (``x / rms(x) * w``) and Gemma's unit-offset form (``* (1 + w)``).

:class:`RMSNorm` is torch's ``nn.RMSNorm`` with a dtype fix for autocast. :class:`OffsetRMSNorm`
(``model.norm_offset``, Gemma 2/3) computes, like transformers' ``Gemma3RMSNorm``, in fp32 whatever
the input dtype: ``(x.float() * rsqrt(mean(x.float()^2) + eps)) * (1 + w.float())``, cast back to
the input's dtype; its weights start at 0 (the identity). Why keep the offset rather than storing
``1 + w`` in a plain RMSNorm at import: in bf16 a weight near 1 has a resolution of 2^-8, a weight
near 0 far finer, which is why Gemma centres them on 0; a bf16 ``1 + w`` would round away what
the checkpoint holds and change the model. It is an autograd Function that keeps what a fused
RMSNorm kernel keeps, the input (its own dtype) and the fp32 ``rsqrt`` per row, and recomputes the
normalized input in backward, instead of the fp32 upcast, the normalized tensor and the product
that eager autograd would keep (``plan/activations.py`` counts it so on every device).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.RMSNorm):
    """``nn.RMSNorm`` that casts its weight to the input's dtype when they differ: under autocast
    (zero 0/1 in bf16) the weight is the fp32 master and the activations bf16, and torch's fused
    kernel refuses mismatched dtypes (it falls back to the composite op, which also saves the
    normalized input). The output keeps the input's dtype either way, so the residual stream stays
    bf16 (:meth:`Transformer.forward`) as it does under FSDP's bf16 parameters."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if w is not None and w.dtype != x.dtype:
            w = w.to(x.dtype)
        return F.rms_norm(x, self.normalized_shape, w, self.eps)


class _OffsetRMSNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        xf = x.float()
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        out = (xf * rstd) * (1.0 + weight.float())
        ctx.save_for_backward(x, rstd, weight)
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, rstd, weight = ctx.saved_tensors
        normed = x.float() * rstd
        g = grad.float()
        d_weight = None
        if ctx.needs_input_grad[1]:
            d_weight = (g * normed).sum(dim=tuple(range(g.dim() - 1))).to(weight.dtype)
        d_x = None
        if ctx.needs_input_grad[0]:
            gn = g * (1.0 + weight.float())
            d_x = (rstd * (gn - normed * (gn * normed).mean(-1, keepdim=True))).to(x.dtype)
        return d_x, d_weight, None


class OffsetRMSNorm(nn.Module):
    """Gemma's RMSNorm: ``x / rms(x) * (1 + weight)`` in fp32 (module docstring); weight starts at 0."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _OffsetRMSNormFn.apply(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}, offset=1"


def make_norm(dim: int, eps: float, offset: bool) -> nn.Module:
    """The model's norm over ``dim`` features (``model.norm_offset``: Gemma's form)."""
    return OffsetRMSNorm(dim, eps=eps) if offset else RMSNorm(dim, eps=eps)
