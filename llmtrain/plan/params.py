"""Parameter counts (total and, for MoE, active per token) from the model config alone.

Counted exactly as the engine builds the model: embedding, per block two RMSNorm weights,
q/k/v/o projections of ``heads * head_dim`` / ``kv_heads * head_dim`` rows (``head_dim`` may
differ from hidden / heads), q/k/v biases (``qkv_bias``), two per-head q/k norm weights of
``head_dim`` (``qk_norm``), a SwiGLU MLP of ``ffn_hidden`` (three matrices) or, where
``is_moe_layer(i)``, an MoE block (router, routed experts of ``expert_ffn``, shared experts of
the same width, and a per-expert bias buffer that is not a parameter), the final norm and the
output layer (absent when embeddings are tied).
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
    h, hd = m.hidden, m.head_dim
    attn = h * m.heads * hd + 2 * h * m.kv_heads * hd + m.heads * hd * h
    if m.qkv_bias:
        attn += (m.heads + 2 * m.kv_heads) * hd
    if m.qk_norm:  # per head (one head's weights), or OLMo 2's over all heads
        attn += (m.heads + m.kv_heads) * hd if m.qk_norm_width == "all" else 2 * hd
    norms = (2 * m.pre_norms + 2 * m.post_norms) * h  # Gemma's post norms: two more per block; OLMo 2: only those
    dense_mlp = 3 * h * m.ffn_hidden
    dense_block = attn + norms + dense_mlp
    expert = 3 * h * m.expert_ffn
    n_moe = moe_layer_count(m)
    moe_block = attn + norms + h * m.moe.num_experts + (m.moe.num_experts + m.moe.shared_experts) * expert
    moe_active = attn + norms + h * m.moe.num_experts + (m.moe.top_k + m.moe.shared_experts) * expert
    embedding = m.vocab_size * h
    head = 0 if m.tie_embeddings else m.vocab_size * h
    outer = embedding + head + h
    n_dense = m.layers - n_moe
    total = outer + n_dense * dense_block + n_moe * moe_block
    active = outer + n_dense * dense_block + n_moe * moe_active
    return ParamCount(total, active, embedding, dense_block, moe_block if n_moe else 0, expert if n_moe else 0)


def moe_layer_count(m: ModelConfig) -> int:
    """Blocks with an MoE MLP (``ModelConfig.is_moe_layer``)."""
    return sum(1 for i in range(m.layers) if m.is_moe_layer(i)) if m.is_moe else 0


def attention_params(m: ModelConfig) -> int:
    """One block's attention parameters: q/k/v/o, biases and q/k norms (the norms of the block not included)."""
    h, hd = m.hidden, m.head_dim
    return (2 * h * m.heads * hd + 2 * h * m.kv_heads * hd + (m.heads + 2 * m.kv_heads) * hd * m.qkv_bias
            + 2 * hd * m.qk_norm)


def lora_adapter_params(m: ModelConfig, lora) -> int:
    """Adapter parameters of the whole model: per block and target with base ``[out, in]``,
    ``rank x (in + out)`` (``lora_a`` and ``lora_b``, no bias); an MoE block's MLP targets adapt its routed
    experts (``rank x (in + out)`` per expert) with ``lora.experts``, else nothing."""
    if lora is None:
        return 0
    h, q, kv, f = m.hidden, m.heads * m.head_dim, m.kv_heads * m.head_dim, m.ffn_hidden
    sizes = {"wq": h + q, "wk": h + kv, "wv": h + kv, "wo": q + h, "w1": h + f, "w2": f + h, "w3": h + f}
    attention = sum(sizes[t] for t in lora.target_names if t in ("wq", "wk", "wv", "wo"))
    mlp = sum(sizes[t] for t in lora.target_names if t in ("w1", "w2", "w3"))
    n_moe = moe_layer_count(m)
    experts = 0
    if lora.experts and n_moe:
        ef = m.expert_ffn
        experts = m.moe.num_experts * sum(h + ef for t in lora.target_names if t in ("w1", "w2", "w3"))
    return lora.rank * (m.layers * attention + (m.layers - n_moe) * mlp + n_moe * experts)


def trainable_params(m: ModelConfig, lora) -> int:
    """Parameters that get gradients: all of them, or with ``train.lora`` only the adapters."""
    return count_params(m).total if lora is None else lora_adapter_params(m, lora)
