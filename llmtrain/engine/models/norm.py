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


class _SumOverGroup(torch.autograd.Function):
    """The sum of a tensor over a process group, forward; the sum of its gradient over the group,
    backward (every rank's output is the same sum, and each rank's loss depends on it)."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, group) -> torch.Tensor:
        from torch.distributed import _functional_collectives as funcol  # noqa: PLC0415 (only under TP)

        ctx.group = group
        return funcol.wait_tensor(funcol.all_reduce(t.contiguous(), "sum", group))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        from torch.distributed import _functional_collectives as funcol  # noqa: PLC0415

        return funcol.wait_tensor(funcol.all_reduce(grad.contiguous(), "sum", ctx.group)), None


class SplitRMSNorm(RMSNorm):
    """An RMSNorm over a last dimension that tensor parallelism may split: OLMo 2's q and k norms, over
    all heads, which column-parallel wq / wk leave ``heads / tp`` of per rank. Without TP it is
    :class:`RMSNorm`. Under TP (engine/parallel/tensor.py sets ``group`` and ``full`` and makes the
    weight a ``Shard(0)`` DTensor) each rank sums its shard's squares, an all-reduce over the TP group
    (:class:`_SumOverGroup`: its backward all-reduces the gradient) gives the whole row's, and the
    rank scales its shard by its slice of the weight. Eager ops, fp32 inside: it keeps the fp32 input,
    the normalized shard and one rstd per row (plan/norm_activations.py counts them so)."""

    group = None  # the TP process group, set by tensor parallelism
    full = 0  # the whole normalized width (the weight's global size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.group is None:
            return super().forward(x)
        xf = x.float()
        squares = _SumOverGroup.apply(xf.pow(2).sum(-1, keepdim=True), self.group)
        rstd = torch.rsqrt(squares / self.full + (self.eps if self.eps is not None else torch.finfo(xf.dtype).eps))
        w = self.weight.to_local() if hasattr(self.weight, "to_local") else self.weight
        return (xf * rstd).to(x.dtype) * w.to(x.dtype)


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
