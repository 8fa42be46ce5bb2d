"""Activation checkpointing per transformer block.

- ``full``: the whole block is recomputed in backward (``checkpoint_wrapper``, non-reentrant);
  only the block input is kept: the least memory, about one extra forward of compute.
- ``selective``: an op-level policy (``create_selective_checkpoint_contexts``) keeps the outputs
  of matmuls and of scaled-dot-product attention — the expensive ops — and recomputes the cheap
  element-wise ones (norms, SiLU, RoPE, residual adds), which hold most of the activation bytes
  of a block relative to their compute (Korthikanti et al. 2022 make the same trade-off).
"""

from __future__ import annotations


import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

_SAVE = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
}


def _policy(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in _SAVE else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_context():
    return create_selective_checkpoint_contexts(_policy)


def apply_activation_checkpointing(model: nn.Module, mode: str) -> None:
    if mode == "none":
        return
    layers = model.layers
    for key in list(layers.keys()):
        block = layers[key]
        if mode == "full":
            layers[key] = checkpoint_wrapper(block, preserve_rng_state=False)
        else:
            layers[key] = checkpoint_wrapper(block, preserve_rng_state=False, context_fn=_selective_context)


def apply_compile(model: nn.Module) -> None:
    """Compile each transformer block in place (names stay unchanged, FSDP wraps them after)."""
    for block in model.layers.values():
        block.compile(fullgraph=False)


