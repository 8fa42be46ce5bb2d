"""Hugging Face model families as recipe facts: what each ``model_type`` can express (torch-free).

Read by the recipe/HF-config checks that run before anything starts (``llmtrain launch
--init-from-hf``, ``eval``, ``ckpt export --hf``) and by the engine's tensor map
(:mod:`llmtrain.engine.hf.families`, which re-exports these names). Only the recipe model is
involved here: no tensors, no torch, so the launcher stays light.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmtrain.errors import LLMTrainError, Problem
from llmtrain.recipe.schema import ModelConfig


@dataclass(frozen=True)
class Family:
    """What one HF model_type can express (see :data:`FAMILIES`)."""

    name: str
    architecture: str
    moe: bool = False                 # MoE MLPs (every family is either dense or MoE)
    qkv_bias: bool = False            # q/k/v biases, always (Qwen2) or never
    qk_norm: bool = False             # per-head q/k RMSNorm, always (Qwen3) or never
    sliding: str = "none"             # config.json form: none | plain (Mistral) | qwen (use_sliding_window)
    moe_prefix: str = ""              # HF module of an MoE layer's MLP
    expert_names: tuple[str, str, str] = ("", "", "")  # HF per-expert names of our w1, w3, w2
    dense_layers: bool = False        # MoE models may have dense layers (mlp_only_layers, sparse step)
    fixed_norm_topk: bool = False     # top-k weights always renormalized (Mixtral)
    fused: bool = False               # q/k/v in one qkv_proj, gate/up in one gate_up_proj (Phi-3): ours are row ranges
    rope_scaling: str = "llama3"      # the RoPE scaling rule its transformers config takes (Phi-3: longrope only)
    partial_rotary: bool = False      # RoPE on the first rotary_dim features only (Phi-3's partial_rotary_factor)
    gemma: bool = False               # Gemma 1/2/3: offset norms, scaled embeddings, GeGLU (recipe/hf_gemma.py)
    post_norms: bool = False          # norms on both branch outputs, query_pre_attn_scalar, sliding/full layers (Gemma 2/3)
    softcap: bool = False             # soft-capped attention scores and final logits (Gemma 2)
    local_rope: bool = False          # a RoPE base of its own for the windowed layers (Gemma 3)
    scalars: bool = False             # muP multipliers: embeddings, residual branches, softmax scale, logits (Granite)
    nope: bool = False                # layers without RoPE (no_rope_layers: SmolLM3)
    olmo: bool = False                # only post norms, q/k norms over all heads (OLMo 2)
    fused_experts: bool = False       # experts on disk as 3D tensors, gate/up fused per expert (GraniteMoE)
    qk_all: bool = False              # q/k norms over all heads, not per head (OLMo 2, OLMoE)


FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("llama", "LlamaForCausalLM"),
    Family("mistral", "MistralForCausalLM", sliding="plain"),
    Family("qwen2", "Qwen2ForCausalLM", qkv_bias=True, sliding="qwen"),
    Family("qwen3", "Qwen3ForCausalLM", qk_norm=True, sliding="qwen"),
    Family("mixtral", "MixtralForCausalLM", moe=True, sliding="plain", moe_prefix="block_sparse_moe",
           expert_names=("w1", "w3", "w2"), fixed_norm_topk=True),
    Family("qwen3_moe", "Qwen3MoeForCausalLM", moe=True, qk_norm=True, sliding="qwen", moe_prefix="mlp",
           expert_names=("gate_proj", "up_proj", "down_proj"), dense_layers=True),
    Family("phi3", "Phi3ForCausalLM", sliding="plain", fused=True, rope_scaling="longrope",
           partial_rotary=True),  # Phi-3, Phi-3.5, Phi-4, Phi-4-mini
    Family("gemma", "GemmaForCausalLM", rope_scaling="none", gemma=True),  # Gemma 1 / 1.1 2B, 7B; CodeGemma
    Family("granite", "GraniteForCausalLM", rope_scaling="none", scalars=True),  # IBM Granite 3.x dense
    Family("granitemoe", "GraniteMoeForCausalLM", moe=True, rope_scaling="none", scalars=True,
           moe_prefix="block_sparse_moe", fixed_norm_topk=True, fused_experts=True),  # IBM Granite 3.x MoE
    Family("smollm3", "SmolLM3ForCausalLM", rope_scaling="none", nope=True),  # SmolLM3: NoPE every 4th layer
    Family("olmo2", "Olmo2ForCausalLM", qk_norm=True, rope_scaling="none", olmo=True,
           qk_all=True),  # OLMo 2: post norms only
    Family("olmoe", "OlmoeForCausalLM", moe=True, qk_norm=True, rope_scaling="none", moe_prefix="mlp",
           expert_names=("gate_proj", "up_proj", "down_proj"), qk_all=True),  # OLMoE: Llama's norms, OLMo's q/k norms
    Family("gemma2", "Gemma2ForCausalLM", sliding="gemma", rope_scaling="none", gemma=True, post_norms=True,
           softcap=True),  # Gemma 2 2B, 9B, 27B (recipe/hf_gemma.py)
    Family("gemma3_text", "Gemma3ForCausalLM", qk_norm=True, sliding="gemma", rope_scaling="linear",
           gemma=True, post_norms=True, local_rope=True),  # Gemma 3 1B (the text-only checkpoints; recipe/hf_gemma.py)
)}

# the recipe switches that only Gemma has, with the value every other family needs
GEMMA_SWITCHES = {"norm_offset": False, "post_norms": False, "embed_scale": False, "mlp_activation": "silu"}

SUPPORTED = ", ".join(FAMILIES)


def family_of(cfg: ModelConfig) -> Family:
    return FAMILIES[cfg.hf_family]


# -- what a family can express ----------------------------------------------------------------

def family_problems(cfg: ModelConfig) -> list[Problem]:
    """Every feature of ``cfg`` its Hugging Face family (``model.family``) cannot express."""
    f = family_of(cfg)
    out: list[Problem] = []

    def bad(path: str, message: str, hint: str) -> None:
        out.append(Problem(path, f"{message} (model.family {f.name})", hint))

    if cfg.is_moe and not f.moe:
        bad("model.family", f"{f.name} has no experts but model.moe.num_experts is {cfg.moe.num_experts}",
            "use model.family mixtral, qwen3_moe, granitemoe or olmoe, or a dense model (model.moe.num_experts: 1)")
    if f.moe and not cfg.is_moe:
        bad("model.family", f"{f.name} is a mixture-of-experts family but the model is dense",
            "use model.family llama/mistral/qwen2/qwen3/phi3/granite, or set model.moe.num_experts")
    if cfg.qkv_bias != f.qkv_bias:
        bad("model.qkv_bias", f"qkv_bias is {cfg.qkv_bias}; {f.name} {'always has' if f.qkv_bias else 'has no'} "
            "q/k/v biases", "use model.family qwen2 for q/k/v biases" if cfg.qkv_bias else
            f"set model.qkv_bias: {str(f.qkv_bias).lower()}")
    if cfg.qk_norm != f.qk_norm:
        bad("model.qk_norm", f"qk_norm is {cfg.qk_norm}; {f.name} {'always has' if f.qk_norm else 'has no'} "
            "q/k norms", "use model.family qwen3 or qwen3_moe for q/k norms" if cfg.qk_norm else
            f"set model.qk_norm: {str(f.qk_norm).lower()}")
    if cfg.rope_scaling is not None and cfg.rope_scaling.type != f.rope_scaling:
        bad("model.rope_scaling", f"{cfg.rope_scaling.type} RoPE scaling; transformers' {f.name} takes only "
            f"{f.rope_scaling} scaling" if f.rope_scaling != "none" else f"{cfg.rope_scaling.type} RoPE scaling; "
            f"transformers' {f.name} takes none", "use model.family " + {"longrope": "phi3", "linear": "gemma3_text"}.get(cfg.rope_scaling.type, "llama")
            + " or drop model.rope_scaling")
    if cfg.rope_dim != cfg.head_dim and not f.partial_rotary:
        bad("model.rotary_dim", f"rotary_dim {cfg.rope_dim} of head_dim {cfg.head_dim}; {f.name} rotates whole heads",
            "drop model.rotary_dim or use model.family phi3")
    elif cfg.rope_dim != cfg.head_dim and int(cfg.head_dim * (cfg.rope_dim / cfg.head_dim)) != cfg.rope_dim:
        bad("model.rotary_dim", f"rotary_dim {cfg.rope_dim} of head_dim {cfg.head_dim} is no partial_rotary_factor "
            "transformers turns back into it (int(head_dim x factor))", "use a rotary_dim such as head_dim x 3/4")
    if cfg.qk_norm and (cfg.qk_norm_width == "all") != f.qk_all:
        bad("model.qk_norm_width", f"qk_norm_width {cfg.qk_norm_width}; {f.name}'s q/k norms are "
            + ("over all heads" if f.qk_all else "per head"), f"set model.qk_norm_width: {'all' if f.qk_all else 'head'}")
    if cfg.pre_norms == f.olmo:
        bad("model.pre_norms", f"pre_norms is {cfg.pre_norms}; {f.name} " + ("has none (only post norms)" if f.olmo
            else "normalizes the attention's and the MLP's inputs"), f"set model.pre_norms: {str(not f.olmo).lower()}"
            + ("" if f.olmo else ", or use model.family olmo2"))
    for name, plain in GEMMA_SWITCHES.items():
        want = plain if not f.gemma else {"mlp_activation": "gelu_tanh", "post_norms": f.post_norms}.get(name, True)
        if f.olmo and name == "post_norms":
            want = True
        if getattr(cfg, name) != want:
            bad(f"model.{name}", f"{name} is {getattr(cfg, name)}; {f.name} needs {want}",
                f"set model.{name}: {str(want).lower() if isinstance(want, bool) else want}"
                + ("" if f.gemma else ", or use model.family gemma, gemma2 or gemma3_text"))
    if not f.post_norms:
        for name in (() if f.scalars else ("attention_scale",)) + (() if f.sliding == "qwen" else ("full_attention_layers",)):
            if getattr(cfg, name) is not None:
                bad(f"model.{name}", f"{name} is set; {f.name} has no such setting (Gemma 2 and 3 have)",
                    f"drop model.{name}, or use model.family gemma2 or gemma3_text")
    if not f.nope and cfg.nope_layers:
        bad("model.nope_layers", f"nope_layers {cfg.nope_layers[:8]}; {f.name} applies RoPE in every layer (SmolLM3 "
            "has NoPE layers)", "drop model.nope_layers, or use model.family smollm3")
    if not f.scalars:
        for name in ("embed_multiplier", "residual_multiplier", "logit_divisor"):
            if getattr(cfg, name) is not None:
                bad(f"model.{name}", f"{name} is set; {f.name} has no such multiplier (Granite has)",
                    f"drop model.{name}, or use model.family granite or granitemoe")
    if not f.local_rope and cfg.local_rope_theta is not None:
        bad("model.local_rope_theta", f"local_rope_theta is set; {f.name} has one RoPE base (Gemma 3 has two)",
            "drop model.local_rope_theta, or use model.family gemma3_text")
    if not f.softcap:
        for name in ("attention_softcap", "logit_softcap"):
            if getattr(cfg, name) is not None:
                bad(f"model.{name}", f"{name} is set; {f.name} has no soft-capping (Gemma 2 has)",
                    f"drop model.{name}, or use model.family gemma2")
    full = sorted(set(cfg.full_attention_layers or ()))
    if f.sliding == "qwen" and full != list(range(len(full))):  # Qwen's max_window_layers: the first layers
        bad("model.full_attention_layers", f"full_attention_layers {full[:8]}; {f.name}'s full-attention layers are "
            "the first max_window_layers", f"use model.full_attention_layers: [0, ..., {max(len(full), 1) - 1}]")
    if cfg.sliding_window is not None and f.sliding == "none":
        bad("model.sliding_window", f"sliding_window {cfg.sliding_window}; {f.name} has none",
            "drop model.sliding_window or use model.family mistral")
    if cfg.is_moe:
        m = cfg.moe
        if m.shared_experts:
            bad("model.moe.shared_experts", f"{m.shared_experts} shared experts; no supported Hugging Face family "
                "has them", "use model.moe.shared_experts: 0")
        if m.router != "softmax":
            bad("model.moe.router", f"router {m.router!r}; supported Hugging Face families route with softmax",
                "use model.moe.router: softmax")
        if m.balance != "aux_loss":
            bad("model.moe.balance", f"balance {m.balance!r} (learned expert_bias); Hugging Face routers have no "
                "bias", "use model.moe.balance: aux_loss")
        if f.fixed_norm_topk and not m.norm_topk_prob:
            bad("model.moe.norm_topk_prob", f"norm_topk_prob is false; {f.name} always renormalizes the top-k "
                "weights", "use model.moe.norm_topk_prob: true or model.family qwen3_moe")
        dense = [i for i in range(cfg.layers) if not cfg.is_moe_layer(i)]
        if dense and not f.dense_layers:
            bad("model.moe.dense_layers", f"layers {dense[:8]} are dense (first_dense_layers/sparse_step/"
                f"dense_layers); every {f.name} layer is MoE", "use model.family qwen3_moe (mlp_only_layers)")
    return out


def require_hf_compatible(cfg: ModelConfig) -> None:
    """Raise one problem per feature of ``cfg`` its family cannot express (see :func:`family_problems`)."""
    problems = family_problems(cfg)
    if problems:
        raise LLMTrainError(problems)


require_dense = require_hf_compatible  # the pre-family name, kept for existing callers


# What transformers' config classes (5.x) take for keys a config.json omits, so that a file is read as
# transformers reads it: SmolLM3-3B's own config.json has no tie_word_embeddings, and SmolLM3Config ties by
# default (untied, the model had 262M parameters more and no lm_head.weight to load); MistralConfig's window
# is 4096 unless the file says null (we read an omitted one as none); the other keys were refused as missing.
# Read by recipe/hf_config.py model_from_hf_config; Gemma's bases, windows and caps: recipe/hf_gemma.py.
# tests/test_hf_config_defaults.py checks these against the installed transformers.
HF_DEFAULTS: dict[str, dict] = {
    "llama": dict(rope_theta=10000.0, rms_norm_eps=1e-6, max_position_embeddings=2048),
    "mistral": dict(rope_theta=10000.0, rms_norm_eps=1e-6, max_position_embeddings=131072, sliding_window=4096),
    "mixtral": dict(rope_theta=1000000.0, rms_norm_eps=1e-5, max_position_embeddings=131072),
    "qwen2": dict(rope_theta=10000.0, rms_norm_eps=1e-6, max_position_embeddings=32768),
    "qwen3": dict(rope_theta=10000.0, rms_norm_eps=1e-6, max_position_embeddings=32768),
    "qwen3_moe": dict(rope_theta=10000.0, rms_norm_eps=1e-6, max_position_embeddings=32768),
    "phi3": dict(rope_theta=10000.0, rms_norm_eps=1e-5, max_position_embeddings=4096),
    "olmo2": dict(rope_theta=10000.0, rms_norm_eps=1e-5, max_position_embeddings=2048),
    "olmoe": dict(rope_theta=10000.0, rms_norm_eps=1e-5, max_position_embeddings=4096),
    "granite": dict(rope_theta=10000.0, rms_norm_eps=1e-6, max_position_embeddings=2048),
    "granitemoe": dict(rope_theta=10000.0, rms_norm_eps=1e-6, max_position_embeddings=2048),
    "smollm3": dict(rope_theta=2000000.0, rms_norm_eps=1e-6, max_position_embeddings=32768, tie_word_embeddings=True),
    # Gemma's bases, windows and caps: recipe/hf_gemma.py's own defaults; head_dim is 256 unless given (not hidden / heads)
    "gemma": dict(head_dim=256, rms_norm_eps=1e-6, max_position_embeddings=8192, tie_word_embeddings=True),
    "gemma2": dict(head_dim=256, rms_norm_eps=1e-6, max_position_embeddings=8192, tie_word_embeddings=True),
    "gemma3_text": dict(head_dim=256, rms_norm_eps=1e-6, max_position_embeddings=131072, tie_word_embeddings=True),
}
