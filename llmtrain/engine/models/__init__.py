"""Model code of the engine: Llama-style dense/MoE decoder, RoPE, MoE block, initialization.

Typical use (build on meta, parallelize, then materialize and initialize)::

    with torch.device("meta"):
        model = Transformer(recipe.model)
    # ... apply TP / PP split / EP / activation checkpointing / FSDP here ...
    model.to_empty(device=device)
    init_weights(model, seed=recipe.train.seed)
"""

from llmtrain.engine.models.init import canonical_name, init_weights
from llmtrain.engine.models.llama import Attention, Transformer, TransformerBlock, causal_sdpa
from llmtrain.engine.models.moe import (
    AuxLossAutoScaler,
    FeedForward,
    MoE,
    Routing,
    load_balancing_loss,
    route_tokens,
    set_aux_loss_scale,
    update_expert_bias,
)
from llmtrain.engine.models.rope import apply_rope, rope_cos_sin

__all__ = [
    "Attention", "AuxLossAutoScaler", "FeedForward", "MoE", "Routing", "Transformer", "TransformerBlock",
    "apply_rope", "canonical_name", "causal_sdpa", "init_weights", "load_balancing_loss", "rope_cos_sin",
    "route_tokens", "set_aux_loss_scale", "update_expert_bias",
]
