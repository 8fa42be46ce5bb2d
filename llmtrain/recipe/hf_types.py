"""The types of an untrusted Hugging Face ``config.json``, checked before any arithmetic on its values
(torch-free; split out of :mod:`llmtrain.recipe.hf_config`, which re-exports these names)."""

from __future__ import annotations

from llmtrain.errors import Problem
from llmtrain.recipe.hf_families import SUPPORTED
from llmtrain.safeio import printable

INT_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size",
            "vocab_size", "head_dim", "max_position_embeddings", "num_local_experts", "num_experts",
            "num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step", "sliding_window",
            "sliding_window_pattern", "max_window_layers", "no_rope_layer_interval")
FLOAT_KEYS = ("rms_norm_eps", "rope_theta", "factor", "low_freq_factor", "high_freq_factor", "router_aux_loss_coef",
              "partial_rotary_factor", "attention_factor", "rope_local_base_freq", "query_pre_attn_scalar",
              "attn_logit_softcapping", "final_logit_softcapping", "embedding_multiplier", "residual_multiplier",
              "attention_multiplier", "logits_scaling")
BOOL_KEYS = ("tie_word_embeddings", "norm_topk_prob", "use_sliding_window", "use_bidirectional_attention")
HINT = f"use a Hugging Face config.json of one of: {SUPPORTED}"


def _type_problems(conf: dict, where: str) -> list[Problem]:
    """``config.json`` values of the wrong type (an untrusted file: checked before arithmetic)."""
    if not isinstance(conf, dict):
        return [Problem(where, "config.json is not a JSON object", HINT)]
    problems = []
    for key in INT_KEYS:
        v = conf.get(key)
        if v is not None and (type(v) is not int or v <= 0):
            problems.append(Problem(where, f"config.json {key}={printable(repr(v), 60)} is not a positive integer", HINT))
    for key in BOOL_KEYS:
        v = conf.get(key)
        if v is not None and type(v) is not bool:
            problems.append(Problem(where, f"config.json {key}={printable(repr(v), 60)} is not true/false", HINT))
    layers = conf.get("mlp_only_layers")
    if layers is not None and (not isinstance(layers, list) or any(type(i) is not int or i < 0 for i in layers)):
        problems.append(Problem(where, f"config.json mlp_only_layers={printable(repr(layers), 60)} is not a list of "
                                "layer indices", HINT))
    for params in (conf, conf.get("rope_parameters"), conf.get("rope_scaling")):
        if params is not None and not isinstance(params, dict):
            problems.append(Problem(where, "config.json rope_parameters/rope_scaling is not an object", HINT))
            continue
        for key in FLOAT_KEYS:
            v = (params or {}).get(key)
            if v is not None and (type(v) not in (int, float) or not 0 <= v < float("inf")
                                  or (v == 0 and key != "router_aux_loss_coef")):
                problems.append(Problem(where, f"config.json {key}={printable(repr(v), 60)} is not a positive number", HINT))
        v = (params or {}).get("original_max_position_embeddings")
        if v is not None and (type(v) is not int or v <= 0):
            problems.append(Problem(where, f"config.json original_max_position_embeddings={printable(repr(v), 60)} "
                                    "is not a positive integer", HINT))
        for key in ("short_factor", "long_factor"):  # longrope: lists of positive numbers (their count: plan)
            v = (params or {}).get(key)
            if v is not None and (not isinstance(v, list) or len(v) > 65536 or not all(
                    type(x) in (int, float) and 0 < x < float("inf") for x in v)):
                problems.append(Problem(where, f"config.json {key}={printable(repr(v), 60)} is not a list of positive "
                                        "numbers", HINT))
    return problems
