"""Model FLOPs per token, shared by the planner and the engine's MFU.

``6 N + 12 L h s``: 6 FLOPs per parameter per token for forward + backward over the matmul
parameters ``N`` (active parameters for MoE, without the input embedding, which is a lookup;
the output layer counts even when it shares the embedding matrix), plus the attention score
and value matmuls, ``12 L h s`` for sequence length ``s`` (PaLM, Chowdhery et al. 2022,
appendix B). The attention term is counted WITHOUT the causal halving,
as PaLM and Megatron do, so MFU numbers compare across projects; recomputation is not counted
(these are model FLOPs, not hardware FLOPs).
"""

from __future__ import annotations

from llmtrain.plan.params import attention_params, count_params
from llmtrain.recipe.schema import ModelConfig


def flops_per_token(model: ModelConfig, seq_len: int) -> float:
    params = count_params(model)
    matmul_params = params.active - params.embedding
    if model.tie_embeddings:  # the shared matrix is still a matmul in the output layer
        matmul_params += model.vocab_size * model.hidden
    return 6.0 * matmul_params + 12.0 * model.layers * model.hidden * seq_len


# ---- per-layer FLOPs (same convention), for per-stage compute and hardware FLOPs ------------------
# A transformer block's share of ``flops_per_token``: 6 x its parameters (norm weights included,
# as above) + 12 h s for the attention scores and values. Summed over the blocks and the head
# (6 x (output layer + final norm)) this is exactly ``flops_per_token``. ``replicated`` is the
# part the engine does not split over tensor parallelism (an MoE block's router and experts).
def block_flops_per_token(model: ModelConfig, layer: int, seq_len: int) -> tuple[float, float]:
    """(tp-split, tp-replicated) model FLOPs per token of block ``layer``, forward + backward."""
    h = model.hidden
    attn = attention_params(model) + 2 * h  # q, o, k, v (+ biases, q/k norms), two norms
    split = 6.0 * attn + 12.0 * h * seq_len
    if model.is_moe_layer(layer):
        moe = h * model.moe.num_experts + (model.moe.top_k + model.moe.shared_experts) * 3 * h * model.expert_ffn
        return split, 6.0 * moe
    return split + 6.0 * 3 * h * model.ffn_hidden, 0.0


def head_flops_per_token(model: ModelConfig) -> float:
    """Output layer and final norm, forward + backward (the embedding is a lookup: 0)."""
    return 6.0 * (model.vocab_size * model.hidden + model.hidden)


def recompute_flops_per_token(model: ModelConfig, layer: int, seq_len: int, recompute: str) -> tuple[float, float]:
    """Extra hardware FLOPs per token of block ``layer`` from activation recomputation.

    ``full`` re-runs the block's forward in backward: one third of its forward + backward FLOPs
    (the output layer is not checkpointed), minus the block's last matmul -- torch's
    non-reentrant checkpoint stops recomputing once every tensor backward needs exists again
    (``set_checkpoint_early_stop``, on by default), and the down projection's output feeds only
    the residual add, which saves nothing (dense: ``w2``; MoE: the shared experts' ``w2``).
    ``selective`` keeps every matmul and SDPA output (``engine/parallel/checkpointing.py``) and
    recomputes only element-wise ops (norms, RoPE, SiLU, residual adds): no matmul FLOPs, 0.
    """
    if recompute != "full":
        return 0.0, 0.0
    split, replicated = block_flops_per_token(model, layer, seq_len)
    h = model.hidden
    if model.is_moe_layer(layer):
        return split / 3.0, replicated / 3.0 - 2.0 * h * model.moe.shared_experts * model.expert_ffn
    return split / 3.0 - 2.0 * h * model.ffn_hidden, replicated / 3.0
