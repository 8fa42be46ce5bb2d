"""The recipe's ``model`` section: architecture, HF family switches, MoE and RoPE scaling.

Split from :mod:`llmtrain.recipe.schema` (which re-exports every name) by concept; the same
rules apply: strict types, every field described, cross-field rules in plan/validate.py.
"""

from __future__ import annotations

import copy
import math
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from llmtrain.recipe.presets import PRESETS
from llmtrain.recipe.schema_base import BIG, Strict


class MoEConfig(Strict):
    """Mixture-of-experts block settings; only meaningful when ``num_experts > 1``."""

    num_experts: int = Field(1, ge=1, le=65536, description="Routed experts per MoE layer (1 = dense model).")
    top_k: int = Field(2, ge=1, le=64, description="Experts each token is routed to.")
    shared_experts: int = Field(0, ge=0, le=64, description="Always-active shared experts (DeepSeek style).")
    expert_ffn_hidden: int | None = Field(
        None, ge=1, le=BIG, description="Hidden size of each expert's SwiGLU MLP (default: model.ffn_hidden)."
    )
    first_dense_layers: int = Field(0, ge=0, le=BIG, description="Leading layers that use a dense MLP instead of MoE.")
    router: Literal["softmax", "sigmoid"] = Field(
        "softmax", description="Router score function: softmax (Mixtral) or sigmoid (DeepSeek-V3)."
    )
    balance: Literal["aux_loss", "bias"] = Field(
        "aux_loss",
        description="Load balancing: auxiliary loss (Switch/Mixtral) or DeepSeek-V3's auxiliary-loss-free bias update.",
    )
    aux_loss_coef: float = Field(0.01, ge=0, le=10, description="Weight of the auxiliary load-balancing loss.")
    bias_update_rate: float = Field(
        0.001, ge=0, le=1, description="Step size of the bias update when balance is 'bias'."
    )
    capacity_factor: float | None = Field(
        None, gt=0, le=1024, description="Expert capacity = factor x tokens x top_k / experts; overflow tokens are dropped. None = no dropping."
    )
    norm_topk_prob: bool = Field(
        True, description="Softmax router: renormalize the top-k probabilities to sum 1 (Mixtral always; Qwen3-MoE's norm_topk_prob)."
    )
    sparse_step: int = Field(
        1, ge=1, le=BIG, description="Layer i (0-based) is MoE only if (i + 1) is a multiple of this (Qwen's decoder_sparse_step)."
    )
    dense_layers: list[int] = Field(
        default_factory=list, description="Further layer indices (0-based) with a dense MLP of ffn_hidden (Qwen's mlp_only_layers)."
    )

    @field_validator("dense_layers")
    @classmethod
    def _sorted_unique(cls, value: list[int]) -> list[int]:
        if any(i < 0 or i >= BIG for i in value):
            raise ValueError("layer indices must be >= 0")
        return sorted(set(value))


class RopeScaling(Strict):
    """RoPE frequency scaling for long context: Llama 3.1's ``rope_type: llama3`` or Phi-3's ``longrope``."""

    type: Literal["llama3", "longrope", "linear"] = Field(
        "llama3", description="Scaling rule: llama3 (Llama 3.1/3.2/3.3), longrope (Phi-3 128k, Phi-3.5) or linear (Gemma 3's full-attention layers: every frequency divided by factor).")
    factor: float | None = Field(None, gt=0, le=1e6, description="llama3: wavelengths longer than original_max_seq_len / low_freq_factor are divided by this (default 8); linear: every frequency is divided by it (required).")
    low_freq_factor: float | None = Field(None, gt=0, le=1e6, description="llama3: low-frequency boundary original_max_seq_len / low_freq_factor (default 1).")
    high_freq_factor: float | None = Field(None, gt=0, le=1e6, description="llama3: high-frequency boundary (unchanged above it), original_max_seq_len / high_freq_factor (default 4).")
    original_max_seq_len: int = Field(8192, ge=1, le=BIG, description="Context length of pretraining before scaling (HF original_max_position_embeddings).")
    short_factor: list[float] | None = Field(None, max_length=65536, description="longrope: per-pair divisors of the frequencies (head_dim / 2 of them), used up to original_max_seq_len.")
    long_factor: list[float] | None = Field(None, max_length=65536, description="longrope: the divisors for a forward whose longest row passes original_max_seq_len (all its positions), as transformers.")
    attention_factor: float | None = Field(None, gt=0, le=1e6, description="longrope: cos and sin are multiplied by this (default, as transformers: sqrt(1 + ln(s) / ln(original_max_seq_len)), s = max_seq_len / original_max_seq_len, 1 when s <= 1).")

    @model_validator(mode="after")
    def _rule(self) -> RopeScaling:
        if self.type == "linear":
            if self.factor is None:
                raise ValueError("type linear needs factor (every RoPE frequency is divided by it)")
            extra = [n for n in ("low_freq_factor", "high_freq_factor", "short_factor", "long_factor", "attention_factor")
                     if getattr(self, n) is not None]
            if extra:
                raise ValueError(f"{', '.join(extra)} do not belong to type linear (it takes factor only)")
            return self
        if self.type == "llama3":
            if self.short_factor is not None or self.long_factor is not None or self.attention_factor is not None:
                raise ValueError("short_factor, long_factor and attention_factor belong to type longrope")
            self.factor = 8.0 if self.factor is None else self.factor
            self.low_freq_factor = 1.0 if self.low_freq_factor is None else self.low_freq_factor
            self.high_freq_factor = 4.0 if self.high_freq_factor is None else self.high_freq_factor
            if self.high_freq_factor <= self.low_freq_factor:
                raise ValueError(f"high_freq_factor ({self.high_freq_factor}) must exceed low_freq_factor ({self.low_freq_factor})")
            return self
        if self.factor is not None or self.low_freq_factor is not None or self.high_freq_factor is not None:
            raise ValueError("factor, low_freq_factor and high_freq_factor belong to type llama3; longrope takes "
                             "short_factor, long_factor and attention_factor")
        for name in ("short_factor", "long_factor"):
            values = getattr(self, name)
            if values is None:
                raise ValueError(f"type longrope needs {name} (one number per RoPE frequency pair)")
            if not all(0 < v < float("inf") for v in values):
                raise ValueError(f"{name} must hold positive finite numbers")
        return self

    def longrope_attention_factor(self, max_seq_len: int) -> float:
        """``attention_factor``, or transformers' default for a model of ``max_seq_len`` positions."""
        if self.attention_factor is not None:
            return self.attention_factor
        return longrope_attention(max_seq_len / self.original_max_seq_len, self.original_max_seq_len)


def longrope_attention(scale: float | None, original: int | None) -> float:
    """transformers' default longrope attention factor for a context ``scale`` x ``original`` positions."""
    if not scale or scale <= 1.0 or not original or original < 2:
        return 1.0
    return math.sqrt(1 + math.log(scale) / math.log(original))


MODEL_FIELDS = ("layers", "hidden", "heads", "kv_heads", "ffn_hidden", "vocab_size", "max_seq_len",
                "rope_theta", "norm_eps", "tie_embeddings")


class ModelConfig(Strict):
    """Transformer architecture: a preset, with any explicit field overriding it."""

    preset: str | None = Field(None, description=f"Model preset, one of: {', '.join(PRESETS)}. Explicit fields override it.")
    layers: int | None = Field(None, ge=1, le=BIG, description="Transformer blocks.")
    hidden: int | None = Field(None, ge=1, le=BIG, description="Model (embedding) width.")
    heads: int | None = Field(None, ge=1, le=BIG, description="Attention (query) heads.")
    kv_heads: int | None = Field(None, ge=1, le=BIG, description="Key/value heads (grouped-query attention; = heads for MHA).")
    ffn_hidden: int | None = Field(None, ge=1, le=BIG, description="Hidden size of the dense SwiGLU MLP.")
    vocab_size: int | None = Field(None, ge=2, le=BIG, description="Vocabulary size (embedding and output rows).")
    max_seq_len: int | None = Field(None, ge=1, le=BIG, description="Longest sequence the model supports.")
    rope_theta: float | None = Field(None, gt=0, le=1e12, description="RoPE base frequency.")
    norm_eps: float | None = Field(None, gt=0, le=1, description="RMSNorm epsilon.")
    tie_embeddings: bool | None = Field(None, description="Share the input embedding with the output layer.")
    head_dim: int | None = Field(
        None, ge=2, le=BIG, description="Width of one attention head (default hidden / heads; Qwen3 sets it explicitly)."
    )
    rotary_dim: int | None = Field(
        None, ge=2, le=BIG,
        description="Features of each head that RoPE rotates, the first ones (partial rotary: Phi-4-mini's 96 of 128); None = head_dim.",
    )
    qkv_bias: bool = Field(False, description="Biases on the q, k and v projections (Qwen2 / Qwen2.5).")
    qk_norm: bool = Field(False, description="RMSNorm over head_dim on each query and key head before RoPE (Qwen3).")
    qk_norm_width: Literal["head", "all"] = Field(
        "head", description="With qk_norm: normalize each head over head_dim (Qwen3, Gemma 3), or all of q's heads "
        "together and all of k's (OLMo 2: weights of heads x head_dim and kv_heads x head_dim).")
    pre_norms: bool = Field(
        True, description="An RMSNorm on the attention's and on the MLP's input (every family but OLMo 2, which "
        "normalizes only the branch outputs: pre_norms false with post_norms true).")
    rope_scaling: RopeScaling | None = Field(None, description="RoPE frequency scaling (Llama 3.1+ llama3, Phi-3 longrope); None = plain RoPE.")
    sliding_window: int | None = Field(
        None, ge=1, le=BIG,
        description="Sliding-window attention span: a token sees itself and the window - 1 before it (Mistral v0.1, Phi-3-mini-4k's 2047); None = full causal attention.",
    )
    full_attention_layers: list[int] | None = Field(
        None, max_length=BIG,
        description="With sliding_window: the layers (0-based) that attend to the whole causal prefix instead "
        "(Gemma 3: every 6th; Qwen2: the first max_window_layers); None = every layer windowed.",
    )
    local_rope_theta: float | None = Field(
        None, gt=0, le=1e12,
        description="RoPE base of the windowed layers, which then take no rope_scaling (Gemma 3: 10,000 while its "
        "full-attention layers use rope_theta 1,000,000 with linear scaling); None = rope_theta everywhere.",
    )
    mlp_activation: Literal["silu", "gelu_tanh"] = Field(
        "silu", description="Gate activation of the gated MLP: silu (SwiGLU) or gelu_tanh (GeGLU: Gemma's gelu_pytorch_tanh).")
    norm_offset: bool = Field(
        False, description="RMSNorms scale by (1 + weight), in fp32, and their weights start at 0 (Gemma).")
    post_norms: bool = Field(
        False, description="An RMSNorm on the attention's and on the MLP's output before each residual add (Gemma 2/3).")
    embed_scale: bool = Field(
        False, description="Token embeddings multiplied by sqrt(hidden), rounded to the embedding's dtype (Gemma).")
    attention_scale: float | None = Field(
        None, gt=0, le=1e6,
        description="Softmax scale of attention; None = 1 / sqrt(head_dim) (Gemma 3: query_pre_attn_scalar ** -0.5).")
    attention_softcap: float | None = Field(
        None, gt=0, le=1e6,
        description="Soft-capping of attention scores, cap * tanh(score / cap) before the softmax (Gemma 2: 50); "
        "None = none. Runs the engine's own attention kernel (engine/models/softcap.py), not SDPA.")
    logit_softcap: float | None = Field(
        None, gt=0, le=1e6,
        description="Soft-capping of the final logits, cap * tanh(logit / cap), in the loss too (Gemma 2: 30); None = none.")
    nope_layers: list[int] | None = Field(
        None, max_length=BIG,
        description="Layers (0-based) whose attention takes no RoPE (NoPE: SmolLM3's every 4th); None = RoPE in every layer.")
    embed_multiplier: float | None = Field(
        None, gt=0, le=1e6, description="Token embeddings times this (Granite's embedding_multiplier: 12); None = 1.")
    residual_multiplier: float | None = Field(
        None, gt=0, le=1e6,
        description="The attention's and the MLP's outputs times this before each residual add (Granite: 0.22); None = 1.")
    logit_divisor: float | None = Field(
        None, gt=0, le=1e6, description="Logits divided by this, in the loss too (Granite's logits_scaling: 8, 16); None = 1.")
    family: Literal["llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe", "phi3", "gemma", "gemma2",
                    "gemma3_text", "granite", "granitemoe", "smollm3", "olmo2", "olmoe"] | None = Field(
        None,
        description="Hugging Face model_type written by `ckpt export --hf` and expected by --init-from-hf "
        "(default: llama when dense, mixtral when MoE).",
    )
    moe: MoEConfig = Field(default_factory=MoEConfig, description="Mixture-of-experts settings.")

    @model_validator(mode="before")
    @classmethod
    def _merge_preset(cls, data: Any) -> Any:
        if not isinstance(data, dict) or not isinstance(data.get("preset"), str):
            return data
        preset = PRESETS.get(data["preset"])
        if preset is None:
            return data  # reported by the preset field validator
        merged = copy.deepcopy(preset)
        user_moe = data.get("moe")
        for key, value in data.items():
            if key != "moe":
                merged[key] = value
        if isinstance(user_moe, dict):
            overrides_to_dense = isinstance(user_moe.get("num_experts"), int) and user_moe["num_experts"] <= 1
            if overrides_to_dense or "moe" not in preset:
                merged["moe"] = user_moe
            else:
                merged["moe"] = {**preset["moe"], **user_moe}
        elif user_moe is not None:
            merged["moe"] = user_moe
        return merged

    @field_validator("preset")
    @classmethod
    def _known_preset(cls, value: str | None) -> str | None:
        if value is not None and value not in PRESETS:
            raise ValueError(f"unknown preset {value!r}; use one of: {', '.join(PRESETS)}")
        return value

    @model_validator(mode="after")
    def _complete(self) -> ModelConfig:
        missing = [name for name in MODEL_FIELDS if getattr(self, name) is None]
        if missing:
            raise ValueError(
                f"missing {', '.join(missing)}; set model.preset (one of: {', '.join(PRESETS)}) or give them explicitly"
            )
        if self.head_dim is None:  # resolved here so that every reader sees one number
            self.head_dim = max(1, self.hidden // self.heads)
            self.model_fields_set.discard("head_dim")  # still "derived" for validate.py's divisibility check
        r = self.rope_scaling
        if r is not None and r.type == "longrope" and r.attention_factor is None:  # resolved here too
            r.attention_factor = r.longrope_attention_factor(self.max_seq_len)
        return self

    @property
    def rope_dim(self) -> int:
        """Features of each head that RoPE rotates (``rotary_dim``, else all of ``head_dim``)."""
        return self.rotary_dim or self.head_dim

    @property
    def is_moe(self) -> bool:
        return self.moe.num_experts > 1

    @property
    def explicit_head_dim(self) -> bool:
        """head_dim was given (not derived as hidden / heads); then hidden % heads need not be 0."""
        return "head_dim" in self.model_fields_set

    def uses_rope(self, layer: int) -> bool:
        """Whether block ``layer``'s attention applies RoPE (not a ``nope_layers`` layer)."""
        return layer not in (self.nope_layers or ())

    def is_windowed(self, layer: int) -> bool:
        """Whether block ``layer`` uses the sliding window (``sliding_window`` set, not a full-attention layer)."""
        return self.sliding_window is not None and layer not in (self.full_attention_layers or ())

    @property
    def windowed_layers(self) -> list[int]:
        """The layers that use the sliding window (none without one: checked first, since the planner
        asks for every layout it prices)."""
        if self.sliding_window is None:
            return []
        return [i for i in range(self.layers) if self.is_windowed(i)]

    def is_moe_layer(self, layer: int) -> bool:
        """Whether block ``layer`` (0-based) has an MoE MLP (else a dense one of ffn_hidden)."""
        return (self.is_moe and layer >= self.moe.first_dense_layers and (layer + 1) % self.moe.sparse_step == 0
                and layer not in self.moe.dense_layers)

    @property
    def hf_family(self) -> str:
        """The Hugging Face model_type of this model: ``family``, else llama (dense) or mixtral (MoE)."""
        return self.family or ("mixtral" if self.is_moe else "llama")

    @property
    def expert_ffn(self) -> int:
        return self.moe.expert_ffn_hidden or self.ffn_hidden
