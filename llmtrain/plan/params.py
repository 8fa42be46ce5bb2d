"""Parameter counts (total and, for MoE, active per token) from the model config alone.

Counted exactly as the engine builds the model: embedding, per block two RMSNorm weights,
q/k/v/o projections (no biases), a SwiGLU MLP (three matrices) or an MoE block (router,
routed experts, shared experts of the same width, and a per-expert bias buffer that is not a
parameter), the final norm and the output layer (absent when embeddings are tied).
"""

from __future__ import annotations

from dataclasses import dataclass

from llmtrain.recipe.schema import ModelConfig


@dataclass(frozen=True)
class ParamCount:
    total: int
    active: int
    embedding: int
    per_dense_block: int
    per_moe_block: int
    expert: int  # one routed expert


def count_params(m: ModelConfig) -> ParamCount:
    h, hd = m.hidden, m.hidden // m.heads
    attn = h * m.heads * hd + 2 * h * m.kv_heads * hd + m.heads * hd * h
    norms = 2 * h
    dense_mlp = 3 * h * m.ffn_hidden
    dense_block = attn + norms + dense_mlp
    expert = 3 * h * m.expert_ffn
    n_moe = max(0, m.layers - m.moe.first_dense_layers) if m.is_moe else 0
    moe_block = attn + norms + h * m.moe.num_experts + (m.moe.num_experts + m.moe.shared_experts) * expert
    moe_active = attn + norms + h * m.moe.num_experts + (m.moe.top_k + m.moe.shared_experts) * expert
    embedding = m.vocab_size * h
    head = 0 if m.tie_embeddings else m.vocab_size * h
    outer = embedding + head + h
    n_dense = m.layers - n_moe
    total = outer + n_dense * dense_block + n_moe * moe_block
    active = outer + n_dense * dense_block + n_moe * moe_active
    return ParamCount(total, active, embedding, dense_block, moe_block if n_moe else 0, expert if n_moe else 0)
