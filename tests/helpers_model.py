"""Shared pieces of the model unit tests (tests/test_model.py, tests/test_model_moe.py): tiny configs,
a seeded fp64 build, and a one-thread fixture for their tiny matmuls."""

from __future__ import annotations

import pytest
import torch

from llmtrain.engine.models import Transformer, init_weights
from llmtrain.recipe.schema import ModelConfig


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    # Tiny matmuls: intra-op threads only add contention on a 2-core CI box (10x slower there).
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def tiny_cfg(**overrides) -> ModelConfig:
    base = dict(layers=2, hidden=32, heads=4, kv_heads=2, ffn_hidden=64, vocab_size=64, max_seq_len=64,
                rope_theta=10000.0, norm_eps=1e-5, tie_embeddings=False)
    base.update(overrides)
    return ModelConfig(**base)


def moe_cfg(hidden: int = 32, **moe) -> ModelConfig:
    spec = dict(num_experts=4, top_k=2, shared_experts=0, expert_ffn_hidden=16, router="softmax",
                balance="aux_loss", aux_loss_coef=0.1)
    spec.update(moe)
    return tiny_cfg(hidden=hidden, moe=spec)


def build(cfg: ModelConfig, seed: int = 0, dtype=torch.float64) -> Transformer:
    model = Transformer(cfg)
    init_weights(model, seed)
    return model.to(dtype)
