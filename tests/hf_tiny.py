"""Tiny random Hugging Face checkpoints, one per family, written by transformers' own ``save_pretrained``.

Shared by the interop tests (families, loading, export). Decisions:

* **transformers' own classes** build and save each model (DESIGN.md §6: never hand-made JSON or
  safetensors), so what the tests read is what a user downloads: per-expert tensor names on disk,
  ``rope_parameters`` of transformers 5.x, ``model.safetensors.index.json`` when sharded.
* **Sharded**: ``max_shard_size`` is computed from the model's byte size so that ``shards`` files
  come out (at least 2 when ``shards >= 2``; transformers never splits a tensor, so the count can
  differ by one). Sharded loading is the case real checkpoints hit.
* **Every switch is non-trivial** in these configs, so that a wrong mapping cannot pass by luck:
  GQA (kv_heads < heads) everywhere; llama3 rope scaling (theta 1e4, head_dim 8: wavelengths 6.3,
  63, 628, 6283) with ``original_max_position_embeddings`` 128, so that all three frequency bands
  occur (kept: < 32, smoothed: 32..128, divided by factor: > 128);
  Qwen3's ``head_dim`` (12) differs from hidden / heads (8); the Qwen3-MoE expert width (24)
  differs from the dense width (64), its ``mlp_only_layers`` makes layer 0 dense and
  ``norm_topk_prob`` is False (the non-default of our recipe); Mixtral renormalizes; Phi-3's
  fused ``qkv_proj`` has GQA blocks of unequal size; ``phi3_longrope`` has distinct per-pair
  short factors, an attention factor of 1.13 (512 positions over an original 128), RoPE on 6 of
  each head's 8 features (partial rotary 0.75) and tied embeddings, as Phi-4-mini; ``mistral_swa``
  a sliding window of 8 tokens, shorter than every sequence the tests run (32, 48); ``gemma3``
  (gemma3_text) sliding and full layers (window 8), distinct RoPE bases (1e5 with linear factor 4
  on the full layer, 100 on the sliding ones), a softmax scale of 12 ** -0.5 with head_dim 8, GeGLU,
  offset and post norms, scaled embeddings, q/k norms, tied embeddings; ``gemma2`` the same block
  without q/k norms, one RoPE base, full / sliding / full / sliding... as transformers alternates
  (window 8), and soft-capping at caps small enough to bend the tiny model's values (attention
  scores at 1.0: the logits move by 0.6 without it; logits, whose largest is 0.92, at 0.5); ``gemma``
  (Gemma 1) with the released ``hidden_act: gelu`` (transformers' tanh GELU); ``granite`` with its
  embedding, residual and softmax multipliers and logit divisor at 3, 0.5, 0.2 and 2.5; ``smollm3``
  with NoPE layers 1 and 3 of 4; ``olmo2`` with its post-norm-only block and q/k norms over all heads.
* **Random but not tiny-valued**: transformers initializes norms to 1 and biases to 0; they are
  re-drawn here (norms around 1, biases ~0.1) so that a dropped bias or a mis-permuted q/k norm
  changes the logits. ``seed`` fixes everything.

Sizes are tiny (hidden 32, 2 layers, vocab 128) so a forward pass is milliseconds on CPU.
"""

from __future__ import annotations

from pathlib import Path

FAMILIES = ("llama", "llama3", "mistral", "mistral_swa", "qwen2", "qwen3", "mixtral", "qwen3_moe", "phi3",
            "phi3_longrope", "gemma3", "gemma2", "gemma", "granite", "granitemoe", "smollm3", "olmo2", "olmoe")

COMMON = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5, tie_word_embeddings=False,
              bos_token_id=None, eos_token_id=None, pad_token_id=None)


def tiny_config(family: str, *, tie: bool | None = None):
    """The transformers config object of the tiny ``family`` model (``tie`` overrides tie_word_embeddings)."""
    import transformers as tf

    kw = dict(COMMON)
    if family == "llama":
        conf = tf.LlamaConfig(**kw, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    elif family == "llama3":
        kw.update(tie_word_embeddings=True, max_position_embeddings=512)
        conf = tf.LlamaConfig(**kw, rope_parameters={
            "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 128})
    elif family == "mistral":
        conf = tf.MistralConfig(**kw, sliding_window=None, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    elif family == "mistral_swa":  # Mistral v0.1: a sliding window (8) shorter than the tests' sequences (32, 48)
        conf = tf.MistralConfig(**kw, sliding_window=8, rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    elif family == "qwen2":
        conf = tf.Qwen2Config(**kw, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    elif family == "qwen3":
        conf = tf.Qwen3Config(**kw, head_dim=12, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    elif family == "mixtral":
        conf = tf.MixtralConfig(**kw, num_local_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.02,
                                sliding_window=None, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    elif family == "qwen3_moe":
        conf = tf.Qwen3MoeConfig(**kw, head_dim=12, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                                 norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[0],
                                 router_aux_loss_coef=0.001,
                                 rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    elif family == "phi3":  # fused qkv_proj (GQA: q 32 + k 16 + v 16 rows) and gate_up_proj (64 + 64 rows)
        conf = tf.Phi3Config(**kw, sliding_window=None, original_max_position_embeddings=128,
                             rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 1.0})
    elif family == "phi3_longrope":  # Phi-4-mini style: longrope over 512 positions of an original 128 (attention
        kw.update(max_position_embeddings=512, tie_word_embeddings=True)  # x 1.13), RoPE on 6 of 8 features, tied
        conf = tf.Phi3Config(**kw, sliding_window=None, original_max_position_embeddings=128, rope_parameters={
            "rope_type": "longrope", "rope_theta": 1e4, "partial_rotary_factor": 0.75,
            "short_factor": [1.0, 1.5, 2.5], "long_factor": [2.0, 3.0, 5.0]})
    elif family == "gemma3":  # gemma3_text: 3 layers (sliding, full, sliding), window 8, every switch off its default
        kw.update(num_hidden_layers=3, max_position_embeddings=512, tie_word_embeddings=True)
        conf = tf.Gemma3TextConfig(**kw, head_dim=8, sliding_window=8, query_pre_attn_scalar=12,
                                   layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                                   rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0,
                                                                       "rope_theta": 1e5},
                                                    "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}})
    elif family == "gemma2":  # 3 layers: sliding, full, sliding (Gemma2Config's rule), window 8, caps that bite
        kw.update(num_hidden_layers=3, tie_word_embeddings=True)
        conf = tf.Gemma2Config(**kw, head_dim=8, sliding_window=8, query_pre_attn_scalar=12,
                               attn_logit_softcapping=1.0, final_logit_softcapping=0.5,
                               rope_parameters={"rope_type": "default", "rope_theta": 100.0})
    elif family == "gemma":  # Gemma 1: offset norms, scaled embeddings, GeGLU (the released "gelu"), tied
        kw.update(tie_word_embeddings=True)
        conf = tf.GemmaConfig(**kw, head_dim=8, hidden_act="gelu", rope_parameters={"rope_type": "default",
                                                                                   "rope_theta": 100.0})
    elif family == "granite":  # Granite's four muP scalars, none of them 1 (nor the softmax scale 1 / sqrt(8))
        kw.update(tie_word_embeddings=True)
        conf = tf.GraniteConfig(**kw, embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.2,
                                logits_scaling=2.5, rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    elif family == "granitemoe":  # Granite's scalars on a Mixtral-routed MoE: 4 experts of 24, top 2, tied; its
        kw.update(tie_word_embeddings=True, intermediate_size=24)  # experts' gate/up fused per expert on disk
        conf = tf.GraniteMoeConfig(**kw, num_local_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.01,
                                   embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.2,
                                   logits_scaling=2.5, rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    elif family == "smollm3":  # 4 layers, the second and fourth NoPE (no_rope_layers: 1 = RoPE, 0 = none), tied
        kw.update(num_hidden_layers=4, tie_word_embeddings=True)
        conf = tf.SmolLM3Config(**kw, no_rope_layers=[1, 0, 1, 0],
                                rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    elif family == "olmo2":  # post norms only, q/k norms over all heads (32 and 16 features), untied
        conf = tf.Olmo2Config(**kw, rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    elif family == "olmoe":  # OLMoE: Llama's norms, q/k norms over all heads (32 and 16 features), 4 experts of 24,
        kw.update(intermediate_size=24)  # top 2 without renormalization, untied
        conf = tf.OlmoeConfig(**kw, num_experts=4, num_experts_per_tok=2, norm_topk_prob=False, router_aux_loss_coef=0.01,
                              rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    else:
        raise ValueError(f"unknown tiny family {family!r}; use one of {FAMILIES}")
    if tie is not None:
        conf.tie_word_embeddings = tie
    return conf


def build_tiny(family: str, *, tie: bool | None = None, seed: int = 0):
    """A tiny random ``AutoModelForCausalLM`` of ``family`` in fp32, eval mode (not saved)."""
    import torch
    import transformers as tf

    conf = tiny_config(family, tie=tie)
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(conf, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            elif p.dim() >= 2 and "embed" not in name:
                p.copy_(0.08 * torch.randn(p.shape, generator=gen))
    return model.eval()


def save_tiny(family: str, out_dir: Path, *, shards: int = 3, tie: bool | None = None, seed: int = 0) -> Path:
    """Build the tiny ``family`` model and ``save_pretrained`` it into ``out_dir`` in about ``shards`` files."""
    out_dir = Path(out_dir)
    model = build_tiny(family, tie=tie, seed=seed)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    size = max(1, total // max(1, shards)) + 1 if shards > 1 else total * 4 + (1 << 20)
    model.save_pretrained(out_dir, max_shard_size=size)
    return out_dir


def save_tiny_gemma3_multimodal(out_dir: Path, *, shards: int = 3, seed: int = 0) -> Path:
    """A tiny ``Gemma3ForConditionalGeneration`` (Gemma 3 4B and larger on the hub: a vision tower beside
    the language model) whose language model is the tiny ``gemma3`` one, saved by transformers (tensor
    names ``language_model.model.*`` and ``vision_tower.*``, as the released files)."""
    import torch
    import transformers as tf

    out_dir = Path(out_dir)
    vision = dict(model_type="siglip_vision_model", hidden_size=16, intermediate_size=32, num_attention_heads=2,
                  num_hidden_layers=1, image_size=28, patch_size=14, vision_use_head=False)
    conf = tf.Gemma3Config(text_config=tiny_config("gemma3").to_dict(), vision_config=vision, mm_tokens_per_image=4)
    torch.manual_seed(seed)
    model = tf.Gemma3ForConditionalGeneration(conf).eval()
    model.model.language_model.load_state_dict(build_tiny("gemma3", seed=seed).model.state_dict())
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    model.save_pretrained(out_dir, max_shard_size=max(1, total // max(1, shards)) + 1)
    return out_dir


def lora_model(cfg, state: dict, lora_cfg, seed: int = 1):
    """Our model of ``cfg`` with ``state`` (full tensors, ours) and LoRA adapters of ``lora_cfg`` drawn at random
    (B is zero at init: both drawn, so that every adapter matters), for the PEFT interop tests."""
    import torch

    from llmtrain.engine.finetune.lora import apply_lora, is_adapter_key
    from llmtrain.engine.models.llama import Transformer

    ours = Transformer(cfg)
    ours.load_state_dict(state)
    apply_lora(ours, lora_cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if is_adapter_key(name):
                p.copy_(0.08 * torch.randn(p.shape, generator=gen))
    return ours

