"""Model presets: architecture numbers from each model's published configuration.

Sources (the ``config.json`` of the official Hugging Face release, and the papers):
- Llama 3 / 3.1: "The Llama 3 Herd of Models" (arXiv:2407.21783), Table 3, and
  meta-llama/Llama-3.1-{8B,70B,405B}/config.json (rope_theta 500000, rms_norm_eps 1e-5,
  vocab 128256, max_position_embeddings 131072, rope_scaling {rope_type llama3, factor 8,
  low_freq_factor 1, high_freq_factor 4, original_max_position_embeddings 8192}).
  ``llama3-8b``/``-70b``/``-405b`` are the earlier presets (no rope scaling), kept as they were;
  the ``llama3.1-*`` presets add the scaling of the 3.1 release.
- Llama 3.2: meta-llama/Llama-3.2-{1B,3B}/config.json (1B: 16 layers, hidden 2048, 32 heads,
  8 KV heads, head_dim 64, ffn 8192; 3B: 28 layers, hidden 3072, 24 heads, 8 KV heads,
  head_dim 128, ffn 8192; both tied embeddings, rope_scaling llama3 factor 32, low 1, high 4,
  original 8192).
- Qwen2.5-7B: Qwen/Qwen2.5-7B/config.json (28 layers, hidden 3584, 28 heads, 4 KV heads, ffn
  18944, vocab 152064, q/k/v biases, rope_theta 1e6, rms_norm_eps 1e-6, untied, 131072
  positions, use_sliding_window false).
- Qwen3: Qwen/Qwen3-8B and Qwen/Qwen3-32B/config.json (8B: 36 layers, hidden 4096, 32 heads,
  8 KV heads, ffn 12288; 32B: 64 layers, hidden 5120, 64 heads, 8 KV heads, ffn 25600; both
  head_dim 128, q/k norms, vocab 151936, rope_theta 1e6, rms_norm_eps 1e-6, 40960 positions,
  untied). Qwen/Qwen3-30B-A3B/config.json: 48 layers, hidden 2048, 32 heads, 4 KV heads,
  head_dim 128, 128 experts of moe_intermediate_size 768, top-8, norm_topk_prob true,
  decoder_sparse_step 1, no mlp_only_layers, router_aux_loss_coef 0.001 (intermediate_size
  6144 is unused: no dense layer).
- Mistral-7B v0.3: mistralai/Mistral-7B-v0.3/config.json (32 layers, hidden 4096, 32 heads,
  8 KV heads, ffn 14336, vocab 32768, rope_theta 1e6, 32768 positions, sliding_window null).
  Mistral-7B v0.1: mistralai/Mistral-7B-v0.1/config.json (the same shape with vocab 32000,
  rope_theta 1e4 and sliding_window 4096: sequences past 4,096 tokens attend to a band).
- Qwen2.5 0.5B / 1.5B / 3B / 14B / 32B / 72B: Qwen/Qwen2.5-*/config.json (q/k/v biases, rope_theta 1e6,
  rms_norm_eps 1e-6; 0.5B-3B tied with vocab 151936 and 32768 positions, 14B-72B untied with 152064
  and 131072). Counts (transformers' own): 494,032,768, 1,543,714,304, 3,085,938,688,
  14,770,033,664, 32,763,876,352, 72,706,203,648, the model cards' 0.49B, 1.54B, 3.09B, 14.7B and
  72.7B; the 32B card says 32.5B (and 31.0B without embeddings, ours 31.2B): the shape is its
  config.json's, the card's figure is not reproduced.
- Mistral NeMo 12B: mistralai/Mistral-Nemo-Base-2407/config.json (40 layers, hidden 5120, 32 heads of
  head_dim 128, not hidden / heads, 8 KV heads, ffn 14336, vocab 131072 (Tekken), rope_theta 1e6,
  1,024,000 positions, no window, untied; NeMo's MistralNeMoConfig12B the same shape).
- Mixtral 8x7B: mistralai/Mixtral-8x7B-v0.1/config.json (8 experts, top-2, softmax router,
  router_aux_loss_coef 0.02, rope_theta 1e6, vocab 32000, 32768 positions).
- Phi-3-mini-4k: microsoft/Phi-3-mini-4k-instruct/config.json (32 layers, hidden 3072, 32 heads,
  32 KV heads, ffn 8192, vocab 32064, rope_theta 1e4, rms_norm_eps 1e-5, 4096 positions,
  sliding_window 2047: past 2,047 tokens each token sees itself and the 2,046 before it; untied;
  3,821,079,552 parameters). Phi-4: microsoft/phi-4/config.json (40 layers, hidden 5120, 40
  heads, 10 KV heads, ffn 17920, vocab 100352, rope_theta 250000, rms_norm_eps 1e-5, 16384
  positions, no sliding window, untied). Both ``phi3`` (fused qkv_proj / gate_up_proj on disk).
- Gemma 1 2B / 7B: google/gemma-{2b,7b}/config.json and the Gemma report (arXiv:2403.08295, Table 1:
  d_model, layers, heads, KV heads, head size, feed-forward width as gate + up): 2B 18 layers, hidden
  2048, 8 heads / 1 KV, ffn 16384; 7B 28 layers, hidden 3072, 16 / 16, ffn 24576; head_dim 256,
  vocab 256000, tied, rms_norm_eps 1e-6, 8192 positions, rope_theta 1e4, hidden_act gelu (read as
  the tanh approximation). Counts: transformers' own on the meta device.
- Gemma 2 2B / 9B / 27B: google/gemma-2-{2b,9b,27b}/config.json (gemma2: 2B 26 layers, hidden 2304,
  8 heads / 4 KV, ffn 9216; 9B 42 layers, hidden 3584, 16 / 8, ffn 14336; 27B 46 layers, hidden
  4608, 32 / 16 heads of head_dim 128, ffn 36864, query_pre_attn_scalar 144; all head_dim 256
  unless said, query_pre_attn_scalar 256, vocab 256000, tied, rms_norm_eps 1e-6, 8192 positions,
  rope_theta 1e4, sliding_window 4096 on the even layers (0, 2, ...), attn_logit_softcapping 50,
  final_logit_softcapping 30). Counts: transformers' own on the meta device.
- Gemma 3 1B: google/gemma-3-1b-pt/config.json (gemma3_text: 26 layers, hidden 1152, 4 heads, 1 KV
  head, head_dim 256, ffn 6912 GeGLU, vocab 262144, tied, rms_norm_eps 1e-6, 32768 positions;
  sliding_window 512 with every 6th layer full (sliding_window_pattern 6: layers 5, 11, 17, 23),
  rope_theta 1e6 on full layers, rope_local_base_freq 1e4 on sliding ones, query_pre_attn_scalar
  256; 999,885,952 parameters, transformers' own count).
- Gemma 3 4B / 12B / 27B, the language models of the multimodal google/gemma-3-{4b,12b,27b}-pt
  (``gemma3``: text_config, transformers' Gemma3TextConfig defaults for the keys it omits): 4B 34
  layers, hidden 2560, 8 heads / 4 KV, ffn 10240; 12B 48 layers, hidden 3840, 16 / 8, ffn 15360 (an
  unsloth copy of its config.json in full); 27B 62 layers, hidden 5376, 32 / 16 heads of head_dim 128,
  ffn 21504, query_pre_attn_scalar 168 (a multimodal config's text_config, AI-Hypercomputer/maxtext's
  gemma3-27b.yml for the depth); all head_dim 256 unless said, vocab 262208, 131072 positions,
  sliding_window 1024 (pattern 6), full layers rope_theta 1e6 with linear factor 8, local 1e4.
  Counts are the text model's (no vision tower), transformers' own on the meta device.
- DeepSeek-V3: deepseek-ai/DeepSeek-V3/config.json and arXiv:2412.19437 (61 layers, hidden
  7168, 128 heads, 256 routed experts of 2048, 1 shared, top-8, sigmoid scores,
  auxiliary-loss-free bias balancing, first 3 layers dense with 18432, vocab 129280).
  DeepSeek-V3 uses multi-head latent attention (MLA); llmtrain models it as multi-head
  attention with head_dim = hidden / heads, which has ~8% more attention parameters
  (12.5B vs 11.4B over 61 layers) and gives 672B total / 38B active parameters against the
  published 671B / 37B (the 14B multi-token-prediction module is not modelled). It has no
  ``family``: it cannot be exported to or loaded from Hugging Face.
- OLMo 2 1B / 7B / 13B: allenai/OLMo-2-0425-1B, OLMo-2-1124-7B and OLMo-2-1124-13B/config.json (olmo2:
  1B 16 layers, hidden 2048, 16 heads, ffn 8192; 7B 32, 4096, 32, 11008; 13B 40, 5120, 40, 13824; no GQA,
  vocab 100352, rope_theta 500000, rms_norm_eps 1e-6, 4096 positions, untied; 13B's file in full in a
  public repository, 1B's and 7B's as NVIDIA Megatron-Bridge's tests mirror them). 1,484,916,736,
  7,298,617,344 and 13,716,198,400 parameters (transformers' own count; the cards' 1.48B, 7.3B, 13.7B).
- SmolLM3-3B: HuggingFaceTB/SmolLM3-3B/config.json (36 layers, hidden 2048, 16 heads, 4 KV heads, ffn
  11008, vocab 128256, rope_theta 5e6, rms_norm_eps 1e-6, 65536 positions, no RoPE in every 4th layer
  (3, 7, ..., 35); tied: the file has no tie_word_embeddings and SmolLM3Config ties by default);
  3,075,098,624 parameters.
- GraniteMoE 1B-A400M: ibm-granite/granite-3.1-1b-a400m-instruct/config.json (granitemoe: 24 layers,
  hidden 1024, 16 heads, 8 KV heads, 32 experts of 512, top-8, vocab 49155, rope_theta 1.5e6,
  rms_norm_eps 1e-6, 131072 positions, tied; embedding 12, residual 0.22, attention 0.015625,
  logits_scaling 6; router_aux_loss_coef 0). 1,334,628,352 parameters, 428,658,688 active.
- ``debug-dense`` / ``debug-moe``: tiny CPU models for tests and the README's main job.

Every preset with a Hugging Face counterpart sets ``family`` (the model_type that
``ckpt export --hf`` writes and ``--init-from-hf`` expects). Exact parameter counts of the HF
architectures are asserted in tests/test_families.py.
"""

from __future__ import annotations

from typing import Any

_LLAMA31: dict[str, Any] = dict(
    vocab_size=128256, max_seq_len=131072, rope_theta=500000.0, norm_eps=1e-5, tie_embeddings=False, family="llama",
    rope_scaling=dict(type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_seq_len=8192),
)
_QWEN3: dict[str, Any] = dict(
    vocab_size=151936, max_seq_len=40960, rope_theta=1000000.0, norm_eps=1e-6, tie_embeddings=False, qk_norm=True,
    family="qwen3",
)

_GEMMA3 = dict(  # what Gemma 3 4B, 12B and 27B share (their text_config; transformers' defaults otherwise)
    max_seq_len=131072, rope_theta=1000000.0, local_rope_theta=10000.0, norm_eps=1e-6, tie_embeddings=True,
    sliding_window=1024, attention_scale=0.0625, qk_norm=True, norm_offset=True, post_norms=True, embed_scale=True,
    mlp_activation="gelu_tanh", family="gemma3_text",
)

_QWEN25 = dict(rope_theta=1000000.0, norm_eps=1e-6, qkv_bias=True, family="qwen2")
_QWEN25_SMALL = dict(vocab_size=151936, max_seq_len=32768, tie_embeddings=True, **_QWEN25)  # 0.5B-3B: tied
_QWEN25_LARGE = dict(vocab_size=152064, max_seq_len=131072, tie_embeddings=False, **_QWEN25)  # 7B and up
_GEMMA1 = dict(  # what Gemma 1 2B and 7B share (their config.json)
    vocab_size=256000, max_seq_len=8192, rope_theta=10000.0, norm_eps=1e-6, tie_embeddings=True, norm_offset=True,
    embed_scale=True, mlp_activation="gelu_tanh", family="gemma",
)
_GEMMA2 = dict(  # what Gemma 2 2B, 9B and 27B share (their config.json)
    vocab_size=256000, max_seq_len=8192, rope_theta=10000.0, norm_eps=1e-6, tie_embeddings=True, sliding_window=4096,
    attention_scale=0.0625, attention_softcap=50.0, logit_softcap=30.0, norm_offset=True, post_norms=True,
    embed_scale=True, mlp_activation="gelu_tanh", family="gemma2",
)

_OLMO2 = dict(  # what OLMo 2 1B, 7B and 13B share (their config.json): post norms only, q/k norms over all heads
    vocab_size=100352, max_seq_len=4096, rope_theta=500000.0, norm_eps=1e-6, tie_embeddings=False, qk_norm=True,
    qk_norm_width="all", pre_norms=False, post_norms=True, family="olmo2",
)

PRESETS: dict[str, dict[str, Any]] = {
    "llama3-8b": dict(
        layers=32, hidden=4096, heads=32, kv_heads=8, ffn_hidden=14336, vocab_size=128256,
        max_seq_len=131072, rope_theta=500000.0, norm_eps=1e-5, tie_embeddings=False, family="llama",
    ),
    "llama3-70b": dict(
        layers=80, hidden=8192, heads=64, kv_heads=8, ffn_hidden=28672, vocab_size=128256,
        max_seq_len=131072, rope_theta=500000.0, norm_eps=1e-5, tie_embeddings=False, family="llama",
    ),
    "llama3-405b": dict(
        layers=126, hidden=16384, heads=128, kv_heads=8, ffn_hidden=53248, vocab_size=128256,
        max_seq_len=131072, rope_theta=500000.0, norm_eps=1e-5, tie_embeddings=False, family="llama",
    ),
    "mixtral-8x7b": dict(
        layers=32, hidden=4096, heads=32, kv_heads=8, ffn_hidden=14336, vocab_size=32000,
        max_seq_len=32768, rope_theta=1000000.0, norm_eps=1e-5, tie_embeddings=False, family="mixtral",
        moe=dict(
            num_experts=8, top_k=2, shared_experts=0, expert_ffn_hidden=14336,
            first_dense_layers=0, router="softmax", balance="aux_loss", aux_loss_coef=0.02,
        ),
    ),
    "llama3.1-8b": dict(
        layers=32, hidden=4096, heads=32, kv_heads=8, ffn_hidden=14336, **_LLAMA31,
    ),
    "llama3.1-70b": dict(
        layers=80, hidden=8192, heads=64, kv_heads=8, ffn_hidden=28672, **_LLAMA31,
    ),
    "llama3.1-405b": dict(
        layers=126, hidden=16384, heads=128, kv_heads=8, ffn_hidden=53248, **_LLAMA31,
    ),
    "llama3.2-1b": dict(
        layers=16, hidden=2048, heads=32, kv_heads=8, head_dim=64, ffn_hidden=8192,
        **{**_LLAMA31, "tie_embeddings": True, "rope_scaling": {**_LLAMA31["rope_scaling"], "factor": 32.0}},
    ),
    "llama3.2-3b": dict(
        layers=28, hidden=3072, heads=24, kv_heads=8, head_dim=128, ffn_hidden=8192,
        **{**_LLAMA31, "tie_embeddings": True, "rope_scaling": {**_LLAMA31["rope_scaling"], "factor": 32.0}},
    ),
    "qwen2.5-0.5b": dict(layers=24, hidden=896, heads=14, kv_heads=2, ffn_hidden=4864, **_QWEN25_SMALL),
    "qwen2.5-1.5b": dict(layers=28, hidden=1536, heads=12, kv_heads=2, ffn_hidden=8960, **_QWEN25_SMALL),
    "qwen2.5-3b": dict(layers=36, hidden=2048, heads=16, kv_heads=2, ffn_hidden=11008, **_QWEN25_SMALL),
    "qwen2.5-14b": dict(layers=48, hidden=5120, heads=40, kv_heads=8, ffn_hidden=13824, **_QWEN25_LARGE),
    "qwen2.5-32b": dict(layers=64, hidden=5120, heads=40, kv_heads=8, ffn_hidden=27648, **_QWEN25_LARGE),
    "qwen2.5-72b": dict(layers=80, hidden=8192, heads=64, kv_heads=8, ffn_hidden=29568, **_QWEN25_LARGE),
    "qwen2.5-7b": dict(
        layers=28, hidden=3584, heads=28, kv_heads=4, ffn_hidden=18944, vocab_size=152064,
        max_seq_len=131072, rope_theta=1000000.0, norm_eps=1e-6, tie_embeddings=False, qkv_bias=True,
        family="qwen2",
    ),
    "qwen3-8b": dict(
        layers=36, hidden=4096, heads=32, kv_heads=8, head_dim=128, ffn_hidden=12288, **_QWEN3,
    ),
    "qwen3-32b": dict(
        layers=64, hidden=5120, heads=64, kv_heads=8, head_dim=128, ffn_hidden=25600, **_QWEN3,
    ),
    "qwen3-30b-a3b": dict(
        layers=48, hidden=2048, heads=32, kv_heads=4, head_dim=128, ffn_hidden=6144,
        **{**_QWEN3, "family": "qwen3_moe"},
        moe=dict(
            num_experts=128, top_k=8, shared_experts=0, expert_ffn_hidden=768, first_dense_layers=0,
            router="softmax", balance="aux_loss", aux_loss_coef=0.001, norm_topk_prob=True, sparse_step=1,
            dense_layers=[],
        ),
    ),
    "mistral-7b": dict(
        layers=32, hidden=4096, heads=32, kv_heads=8, ffn_hidden=14336, vocab_size=32768,
        max_seq_len=32768, rope_theta=1000000.0, norm_eps=1e-5, tie_embeddings=False, family="mistral",
    ),
    "mistral-7b-v0.1": dict(
        layers=32, hidden=4096, heads=32, kv_heads=8, ffn_hidden=14336, vocab_size=32000,
        max_seq_len=32768, rope_theta=10000.0, norm_eps=1e-5, tie_embeddings=False, sliding_window=4096,
        family="mistral",
    ),
    "mistral-nemo-12b": dict(
        layers=40, hidden=5120, heads=32, kv_heads=8, head_dim=128, ffn_hidden=14336, vocab_size=131072,
        max_seq_len=1024000, rope_theta=1000000.0, norm_eps=1e-5, tie_embeddings=False, family="mistral",
    ),
    "phi3-mini-4k": dict(
        layers=32, hidden=3072, heads=32, kv_heads=32, ffn_hidden=8192, vocab_size=32064, max_seq_len=4096,
        rope_theta=10000.0, norm_eps=1e-5, tie_embeddings=False, sliding_window=2047, family="phi3",
    ),
    "phi4-14b": dict(
        layers=40, hidden=5120, heads=40, kv_heads=10, ffn_hidden=17920, vocab_size=100352, max_seq_len=16384,
        rope_theta=250000.0, norm_eps=1e-5, tie_embeddings=False, family="phi3",
    ),
    "gemma-2b": dict(
        layers=18, hidden=2048, heads=8, kv_heads=1, head_dim=256, ffn_hidden=16384, **_GEMMA1,
    ),
    "gemma-7b": dict(
        layers=28, hidden=3072, heads=16, kv_heads=16, head_dim=256, ffn_hidden=24576, **_GEMMA1,
    ),
    "gemma2-2b": dict(
        layers=26, hidden=2304, heads=8, kv_heads=4, head_dim=256, ffn_hidden=9216,
        full_attention_layers=list(range(1, 26, 2)), **_GEMMA2,
    ),
    "gemma2-9b": dict(
        layers=42, hidden=3584, heads=16, kv_heads=8, head_dim=256, ffn_hidden=14336,
        full_attention_layers=list(range(1, 42, 2)), **_GEMMA2,
    ),
    "gemma2-27b": dict(
        layers=46, hidden=4608, heads=32, kv_heads=16, head_dim=128, ffn_hidden=36864,
        full_attention_layers=list(range(1, 46, 2)), **{**_GEMMA2, "attention_scale": 144**-0.5},
    ),
    "gemma3-1b": dict(
        layers=26, hidden=1152, heads=4, kv_heads=1, head_dim=256, ffn_hidden=6912, vocab_size=262144,
        max_seq_len=32768, rope_theta=1000000.0, local_rope_theta=10000.0, norm_eps=1e-6, tie_embeddings=True,
        sliding_window=512, full_attention_layers=[5, 11, 17, 23], attention_scale=0.0625, qk_norm=True,
        norm_offset=True, post_norms=True, embed_scale=True, mlp_activation="gelu_tanh", family="gemma3_text",
    ),
    "gemma3-4b": dict(
        layers=34, hidden=2560, heads=8, kv_heads=4, head_dim=256, ffn_hidden=10240, vocab_size=262208,
        full_attention_layers=list(range(5, 34, 6)), rope_scaling=dict(type="linear", factor=8.0), **_GEMMA3,
    ),
    "gemma3-12b": dict(
        layers=48, hidden=3840, heads=16, kv_heads=8, head_dim=256, ffn_hidden=15360, vocab_size=262208,
        full_attention_layers=list(range(5, 48, 6)), rope_scaling=dict(type="linear", factor=8.0), **_GEMMA3,
    ),
    "gemma3-27b": dict(
        layers=62, hidden=5376, heads=32, kv_heads=16, head_dim=128, ffn_hidden=21504, vocab_size=262208,
        full_attention_layers=list(range(5, 62, 6)), rope_scaling=dict(type="linear", factor=8.0),
        **{**_GEMMA3, "attention_scale": 168**-0.5},
    ),
    "olmo2-1b": dict(layers=16, hidden=2048, heads=16, kv_heads=16, ffn_hidden=8192, **_OLMO2),
    "olmo2-7b": dict(layers=32, hidden=4096, heads=32, kv_heads=32, ffn_hidden=11008, **_OLMO2),
    "olmo2-13b": dict(layers=40, hidden=5120, heads=40, kv_heads=40, ffn_hidden=13824, **_OLMO2),
    "smollm3-3b": dict(
        layers=36, hidden=2048, heads=16, kv_heads=4, ffn_hidden=11008, vocab_size=128256, max_seq_len=65536,
        rope_theta=5000000.0, norm_eps=1e-6, tie_embeddings=True, nope_layers=list(range(3, 36, 4)), family="smollm3",
    ),
    "granitemoe-1b-a400m": dict(
        layers=24, hidden=1024, heads=16, kv_heads=8, ffn_hidden=512, vocab_size=49155, max_seq_len=131072,
        rope_theta=1500000.0, norm_eps=1e-6, tie_embeddings=True, embed_multiplier=12.0, residual_multiplier=0.22,
        logit_divisor=6.0, attention_scale=0.015625, family="granitemoe",
        moe=dict(num_experts=32, top_k=8, expert_ffn_hidden=512, first_dense_layers=0, router="softmax",
                 balance="aux_loss", aux_loss_coef=0.0),
    ),
    "deepseek-v3": dict(
        layers=61, hidden=7168, heads=128, kv_heads=128, ffn_hidden=18432, vocab_size=129280,
        max_seq_len=163840, rope_theta=10000.0, norm_eps=1e-6, tie_embeddings=False,
        moe=dict(
            num_experts=256, top_k=8, shared_experts=1, expert_ffn_hidden=2048,
            first_dense_layers=3, router="sigmoid", balance="bias", aux_loss_coef=0.0001,
        ),
    ),
    "debug-dense": dict(
        layers=4, hidden=128, heads=8, kv_heads=4, ffn_hidden=352, vocab_size=512,
        max_seq_len=512, rope_theta=10000.0, norm_eps=1e-5, tie_embeddings=False,
    ),
    "debug-moe": dict(
        layers=4, hidden=128, heads=8, kv_heads=4, ffn_hidden=352, vocab_size=512,
        max_seq_len=512, rope_theta=10000.0, norm_eps=1e-5, tie_embeddings=False,
        moe=dict(
            num_experts=4, top_k=2, shared_experts=1, expert_ffn_hidden=128,
            first_dense_layers=1, router="softmax", balance="aux_loss", aux_loss_coef=0.01,
        ),
    ),
}
