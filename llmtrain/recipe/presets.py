"""Model presets: architecture numbers from each model's published configuration.

Sources (the ``config.json`` of the official Hugging Face release, and the papers):
- Llama 3 / 3.1: "The Llama 3 Herd of Models" (arXiv:2407.21783), Table 3, and
  meta-llama/Meta-Llama-3.1-{8B,70B,405B}/config.json (rope_theta 500000, rms_norm_eps 1e-5,
  vocab 128256, max_position_embeddings 131072).
- Mixtral 8x7B: mistralai/Mixtral-8x7B-v0.1/config.json (8 experts, top-2, softmax router,
  router_aux_loss_coef 0.02, rope_theta 1e6, vocab 32000, 32768 positions).
- DeepSeek-V3: deepseek-ai/DeepSeek-V3/config.json and arXiv:2412.19437 (61 layers, hidden
  7168, 128 heads, 256 routed experts of 2048, 1 shared, top-8, sigmoid scores,
  auxiliary-loss-free bias balancing, first 3 layers dense with 18432, vocab 129280).
  DeepSeek-V3 uses multi-head latent attention (MLA); llmtrain models it as multi-head
  attention with head_dim = hidden / heads, which has ~8% more attention parameters
  (12.5B vs 11.4B over 61 layers) and gives 672B total / 38B active parameters against the
  published 671B / 37B (the 14B multi-token-prediction module is not modelled).
- ``debug-dense`` / ``debug-moe``: tiny CPU models for tests and the README's main job.
"""

from __future__ import annotations

from typing import Any

PRESETS: dict[str, dict[str, Any]] = {
    "llama3-8b": dict(
        layers=32, hidden=4096, heads=32, kv_heads=8, ffn_hidden=14336, vocab_size=128256,
        max_seq_len=131072, rope_theta=500000.0, norm_eps=1e-5, tie_embeddings=False,
    ),
    "llama3-70b": dict(
        layers=80, hidden=8192, heads=64, kv_heads=8, ffn_hidden=28672, vocab_size=128256,
        max_seq_len=131072, rope_theta=500000.0, norm_eps=1e-5, tie_embeddings=False,
    ),
    "llama3-405b": dict(
        layers=126, hidden=16384, heads=128, kv_heads=8, ffn_hidden=53248, vocab_size=128256,
        max_seq_len=131072, rope_theta=500000.0, norm_eps=1e-5, tie_embeddings=False,
    ),
    "mixtral-8x7b": dict(
        layers=32, hidden=4096, heads=32, kv_heads=8, ffn_hidden=14336, vocab_size=32000,
        max_seq_len=32768, rope_theta=1000000.0, norm_eps=1e-5, tie_embeddings=False,
        moe=dict(
            num_experts=8, top_k=2, shared_experts=0, expert_ffn_hidden=14336,
            first_dense_layers=0, router="softmax", balance="aux_loss", aux_loss_coef=0.02,
        ),
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
