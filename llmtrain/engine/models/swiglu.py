"""``silu(gate) * up`` (and Gemma's ``gelu_tanh(gate) * up``) that keeps only its inputs for backward.

Eager autograd keeps three tensors of the MLP's width for this product: ``gate`` (for SiLU's
backward), ``silu(gate)`` and ``up`` (for the product's). ``silu(gate)`` is cheap to compute again
from ``gate``, so :class:`SwiGLUProduct` keeps ``gate`` and ``up`` only and recomputes it in
backward: a quarter less of the dense MLP's (and every expert's) saved activations without
recomputation, 2 bytes per hidden unit and token in bf16 (w2 still keeps the product as its input).
Megatron-Core's fused ``bias_swiglu`` does the same; torch.compile's partitioner finds it on its
own, eager PyTorch does not, hence this function.

Gradients are the eager ones bit for bit: the same kernels in the same order (``silu_backward`` of
``grad * up`` for ``gate``; ``grad * silu(gate)`` for ``up``, with ``silu(gate)`` recomputed by the
same kernel). What is kept follows what needs a gradient: ``gate`` whenever either input does
(``up``'s gradient needs ``silu(gate)``), ``up`` only when ``gate`` needs one (frozen LoRA bases:
the planner's LoRA terms, plan/activations.py).

GeGLU (``model.mlp_activation: gelu_tanh``, Gemma's ``gelu_pytorch_tanh``) is the same product with
``F.gelu(gate, approximate="tanh")`` and its own backward kernel, keeping the same two tensors, so
the planner's MLP terms hold for both.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class SwiGLUProduct(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        need_gate, need_up = ctx.needs_input_grad
        ctx.save_for_backward(gate if (need_gate or need_up) else None, up if need_gate else None)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        gate, up = ctx.saved_tensors
        need_gate, need_up = ctx.needs_input_grad
        d_gate = torch.ops.aten.silu_backward(grad * up, gate) if need_gate else None
        d_up = grad * F.silu(gate) if need_up else None
        return d_gate, d_up


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` (:class:`SwiGLUProduct` when a gradient is needed)."""
    if torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad):
        return SwiGLUProduct.apply(gate, up)
    return F.silu(gate) * up


class GeGLUProduct(torch.autograd.Function):
    """:class:`SwiGLUProduct` with the tanh-approximated GELU (transformers' ``gelu_pytorch_tanh``)."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        need_gate, need_up = ctx.needs_input_grad
        ctx.save_for_backward(gate if (need_gate or need_up) else None, up if need_gate else None)
        return F.gelu(gate, approximate="tanh") * up

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        gate, up = ctx.saved_tensors
        need_gate, need_up = ctx.needs_input_grad
        d_gate = torch.ops.aten.gelu_backward(grad * up, gate, approximate="tanh") if need_gate else None
        d_up = grad * F.gelu(gate, approximate="tanh") if need_up else None
        return d_gate, d_up


def gated(gate: torch.Tensor, up: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """``act(gate) * up`` for ``model.mlp_activation`` (silu: :func:`swiglu`; gelu_tanh: GeGLU)."""
    if activation == "silu":
        return swiglu(gate, up)
    if torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad):
        return GeGLUProduct.apply(gate, up)
    return F.gelu(gate, approximate="tanh") * up
