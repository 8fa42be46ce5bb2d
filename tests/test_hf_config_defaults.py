"""Keys a config.json omits are read as transformers reads them (llmtrain/recipe/hf_families.py ``HF_DEFAULTS``).

Found with SmolLM3-3B's own config.json, which has no ``tie_word_embeddings``: SmolLM3Config ties by
default, and we read it untied (3,337,766,912 parameters and an ``lm_head.weight`` the checkpoint does not
have, against transformers' 3,075,098,624). The table is checked against the installed transformers'
config classes, and the SmolLM3-3B file (its architecture keys, as published) gives transformers' count.
"""

from __future__ import annotations

import pytest

from llmtrain.plan.params import count_params
from llmtrain.recipe.hf_config import HF_DEFAULTS, model_from_hf_config
from llmtrain.recipe.schema import ModelConfig

transformers = pytest.importorskip("transformers")

# HuggingFaceTB/SmolLM3-3B config.json's architecture keys, as published (no tie_word_embeddings key)
SMOLLM3_3B = {
    "architectures": ["SmolLM3ForCausalLM"], "attention_bias": False, "hidden_act": "silu", "hidden_size": 2048,
    "intermediate_size": 11008, "layer_types": ["full_attention"] * 36, "max_position_embeddings": 65536,
    "max_window_layers": 28, "mlp_bias": False, "model_type": "smollm3", "no_rope_layer_interval": 4,
    "no_rope_layers": [1, 1, 1, 0] * 9, "num_attention_heads": 16, "num_hidden_layers": 36, "num_key_value_heads": 4,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 5000000.0, "sliding_window": None,
    "use_sliding_window": False, "vocab_size": 128256,
}


@pytest.mark.parametrize("model_type", sorted(HF_DEFAULTS))
def test_defaults_are_transformers_config_defaults(model_type):
    conf = transformers.AutoConfig.for_model(model_type)
    for key, ours in HF_DEFAULTS[model_type].items():
        theirs = conf.rope_parameters["rope_theta"] if key == "rope_theta" else getattr(conf, key)
        assert theirs == ours, f"{model_type}.{key}: transformers {theirs}, ours {ours}"
    assert bool(conf.tie_word_embeddings) == HF_DEFAULTS[model_type].get("tie_word_embeddings", False), model_type


def test_smollm3_without_a_tie_key_is_tied_as_transformers_builds_it():
    torch = pytest.importorskip("torch")
    cfg = ModelConfig(**model_from_hf_config(SMOLLM3_3B))
    assert cfg.tie_embeddings and cfg.nope_layers == list(range(3, 36, 4))
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(
            **{k: v for k, v in SMOLLM3_3B.items() if k != "architectures"}))
    assert count_params(cfg).total == sum(p.numel() for p in model.parameters()) == 3_075_098_624


def test_omitted_base_norm_eps_and_length_take_the_family_defaults():
    conf = {k: v for k, v in SMOLLM3_3B.items() if k not in ("rope_theta", "rms_norm_eps", "max_position_embeddings")}
    cfg = ModelConfig(**model_from_hf_config(conf))
    assert (cfg.rope_theta, cfg.norm_eps, cfg.max_seq_len) == (2000000.0, 1e-6, 32768)
    llama = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
             "num_hidden_layers": 2, "vocab_size": 100}
    cfg = ModelConfig(**model_from_hf_config(llama))
    assert (cfg.rope_theta, cfg.norm_eps, cfg.max_seq_len, cfg.tie_embeddings) == (10000.0, 1e-6, 2048, False)
    mistral = {**llama, "model_type": "mistral"}  # MistralConfig: a 4096-token window unless the file says null
    assert ModelConfig(**model_from_hf_config(mistral)).sliding_window == 4096
    assert ModelConfig(**model_from_hf_config({**mistral, "sliding_window": None})).sliding_window is None
    gemma = {"model_type": "gemma", "hidden_size": 3072, "intermediate_size": 24576, "num_attention_heads": 16,
             "num_hidden_layers": 2, "vocab_size": 1000, "rope_theta": 10000.0}  # Gemma 7B's width: 256-wide heads
    assert ModelConfig(**model_from_hf_config(gemma)).head_dim == 256
