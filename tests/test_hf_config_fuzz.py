"""Fuzz: hostile Hugging Face ``config.json`` documents through the torch-free config checks.

``launch --init-from-hf``, ``eval`` and ``ckpt export`` read a model directory's config.json
(untrusted, docs/security.md) with :func:`~llmtrain.recipe.hf_config.model_from_hf_config` and
compare it with the recipe's model with :func:`~llmtrain.recipe.hf_config.config_problems`.
Two tracebacks were found there by hand (``model_type`` an object: unhashable; a string
``partial_rotary_factor``: ``float()``), so this runs the same path over generated documents
(hypothesis, derandomized): each starts from a real config.json of every family (our
``hf_config`` of each preset and of longrope Phi-3.5- and Phi-4-mini-shaped models, transformers 4.x and 5.x
RoPE fields both written; Phi-4's hub config as released, ``rope_scaling: null`` at the top
level; a Phi-3.5-style one with the early ``type: su`` longrope) and gets 1-4 mutations: a key
(top level or inside ``rope_parameters``/``rope_scaling``) set to a hostile value (wrong types,
NaN, infinities, huge, zero and negative numbers, control characters, deep nesting), deleted,
or an unknown key added; ``model_type`` replaced; the whole document replaced by JSON that is
not an object.

Asserted for every document, as the CLI would run it:

* ``model_from_hf_config`` returns recipe fields or raises :class:`LLMTrainError`, whose lines
  are single printable lines;
* returned fields validate as a ``ModelConfig`` or raise pydantic's ``ValidationError``, which
  ``validation_line`` turns into one line (``eval``'s path);
* ``config_problems`` against each family's preset model returns problems (never raises), each
  one printable line; and a model that validated has a tensor map or a one-line refusal.
"""

from __future__ import annotations

import copy
import math
from collections import Counter

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from llmtrain.engine.checkpoint_meta import validation_line
from llmtrain.errors import LLMTrainError
from llmtrain.recipe.hf_config import config_problems, hf_config, model_from_hf_config
from llmtrain.recipe.schema import ModelConfig

EXAMPLES = 1000  # 12,000 unseeded by hand: clean (thirty-fifth session)
FUZZ = dict(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

PRESETS = ["llama3.1-8b", "llama3.2-1b", "mistral-7b", "qwen2.5-7b", "qwen3-8b", "mixtral-8x7b", "qwen3-30b-a3b",
           "phi3-mini-4k", "phi4-14b", "mistral-7b-v0.1", "gemma3-1b", "gemma2-2b", "gemma-2b"]
GEMMA3_1B_HUB = {  # google/gemma-3-1b-pt config.json as released (transformers 4.50): the 4.x RoPE / pattern fields
    "architectures": ["Gemma3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "attn_logit_softcapping": None, "bos_token_id": 2, "cache_implementation": "hybrid", "eos_token_id": 1,
    "final_logit_softcapping": None, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 1152,
    "initializer_range": 0.02, "intermediate_size": 6912, "max_position_embeddings": 32768, "model_type": "gemma3_text",
    "num_attention_heads": 4, "num_hidden_layers": 26, "num_key_value_heads": 1, "pad_token_id": 0,
    "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000, "rope_scaling": None,
    "rope_theta": 1000000, "sliding_window": 512, "sliding_window_pattern": 6, "torch_dtype": "bfloat16",
    "use_cache": True, "vocab_size": 262144}
GEMMA2_9B_HUB = {  # google/gemma-2-9b config.json as released (transformers 4.42): top-level rope_theta, no layer_types
    "architectures": ["Gemma2ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "attn_logit_softcapping": 50.0, "bos_token_id": 2, "cache_implementation": "hybrid", "eos_token_id": 1,
    "final_logit_softcapping": 30.0, "head_dim": 256, "hidden_act": "gelu_pytorch_tanh",
    "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 3584, "initializer_range": 0.02, "intermediate_size": 14336,
    "max_position_embeddings": 8192, "model_type": "gemma2", "num_attention_heads": 16, "num_hidden_layers": 42,
    "num_key_value_heads": 8, "pad_token_id": 0, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06,
    "rope_theta": 10000.0, "sliding_window": 4096, "sliding_window_size": 4096, "torch_dtype": "float32",
    "transformers_version": "4.42.0.dev0", "use_cache": True, "vocab_size": 256000}
GEMMA_7B_HUB = {  # google/gemma-7b config.json as released (transformers 4.38): hidden_act gelu, no head_dim default
    "architectures": ["GemmaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 2,
    "eos_token_id": 1, "head_dim": 256, "hidden_act": "gelu", "hidden_size": 3072, "initializer_range": 0.02,
    "intermediate_size": 24576, "max_position_embeddings": 8192, "model_type": "gemma", "num_attention_heads": 16,
    "num_hidden_layers": 28, "num_key_value_heads": 16, "pad_token_id": 0, "rms_norm_eps": 1e-06, "rope_scaling": None,
    "rope_theta": 10000.0, "torch_dtype": "bfloat16", "transformers_version": "4.38.0.dev0", "use_cache": True,
    "vocab_size": 256000}
PHI4_HUB = {  # microsoft/phi-4 config.json as released (transformers 4.47): top-level RoPE fields, no head_dim
    "architectures": ["Phi3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 100257,
    "embd_pdrop": 0.0, "eos_token_id": 100265, "hidden_act": "silu", "hidden_size": 5120, "initializer_range": 0.02,
    "intermediate_size": 17920, "max_position_embeddings": 16384, "model_type": "phi3", "num_attention_heads": 40,
    "num_hidden_layers": 40, "num_key_value_heads": 10, "original_max_position_embeddings": 16384,
    "pad_token_id": 100349, "resid_pdrop": 0.0, "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 250000,
    "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
    "vocab_size": 100352}
LONGROPE = ModelConfig(preset="phi3-mini-4k", max_seq_len=131072, sliding_window=None, rope_scaling={
    "type": "longrope", "original_max_seq_len": 4096, "short_factor": [1.0 + 0.02 * i for i in range(48)],
    "long_factor": [1.5 + 0.5 * i for i in range(48)]})  # Phi-3.5-mini's shape (its factors are not these)
PHI35_HUB = {**PHI4_HUB, "hidden_size": 3072, "intermediate_size": 8192, "num_attention_heads": 32,
             "num_hidden_layers": 32, "num_key_value_heads": 32, "max_position_embeddings": 131072,
             "original_max_position_embeddings": 4096, "rope_theta": 10000.0, "sliding_window": 262144,
             "vocab_size": 32064, "rope_scaling": {"type": "su", "short_factor": LONGROPE.rope_scaling.short_factor,
                                                   "long_factor": LONGROPE.rope_scaling.long_factor}}
PHI4_MINI = LONGROPE.model_copy(update={"heads": 24, "kv_heads": 8, "head_dim": 128, "rotary_dim": 96,
                                         "tie_embeddings": True, "vocab_size": 200064})  # its shape, not its factors
GEMMA3_4B_HUB = {"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"], "mm_tokens_per_image": 256,
                 "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                                 "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                                 "sliding_window": 1024},
                 "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 1152}}  # as released, sparse
GRANITE = ModelConfig(preset="llama3.2-1b", family="granite", rope_scaling=None, embed_multiplier=12.0,
                      residual_multiplier=0.22, attention_scale=0.015625, logit_divisor=8.0)  # Granite 3's scalars
SMOLLM3 = ModelConfig(preset="llama3.2-1b", family="smollm3", rope_scaling=None, nope_layers=[3, 7, 11, 15])  # NoPE
OLMO2 = ModelConfig(preset="llama3.2-1b", family="olmo2", rope_scaling=None, tie_embeddings=False, pre_norms=False,
                    post_norms=True, qk_norm=True, qk_norm_width="all")  # post norms only, q/k norms over all heads
BASES = [hf_config(ModelConfig(preset=p)) for p in PRESETS] + [hf_config(LONGROPE), hf_config(PHI4_MINI), hf_config(GRANITE),
                                                                hf_config(SMOLLM3), hf_config(OLMO2),
                                                                PHI4_HUB,
                                                                PHI35_HUB, GEMMA3_1B_HUB, GEMMA3_4B_HUB, GEMMA2_9B_HUB,
                                                                GEMMA_7B_HUB]
MODELS = [ModelConfig(preset=p) for p in PRESETS] + [LONGROPE, PHI4_MINI, GRANITE, SMOLLM3, OLMO2]

KEYS = sorted({k for b in BASES for k in b} | {"partial_rotary_factor", "mlp_only_layers", "decoder_sparse_step",
                                                 "use_bidirectional_attention",
                                                 "use_sliding_window", "max_window_layers", "router_jitter_noise",
                                                 "mlp_bias", "attention_bias", "num_experts", "rope_type"})
ROPE_KEYS = ["rope_type", "type", "rope_theta", "factor", "low_freq_factor", "high_freq_factor",
             "original_max_position_embeddings", "partial_rotary_factor", "short_factor", "long_factor",
             "full_attention", "sliding_attention"]
HOSTILE = ["", "8", "half", "llama", "phi3", "longrope", "yarn", "\x00\x1b[31m\n", "ü" * 50, "x" * 5000, True, False,
           None, 0, -1, 1, 2, 3, 7, 10**30, -(10**30), 2**63, 1e-300, 0.5, 0.75, 1.0, float("nan"), float("inf"),
           float("-inf"), [], [1], ["llama"], [0, 1, -1], {}, {"rope_type": "llama3"}, {"a": {"b": {"c": [1]}}},
           [[[[[]]]]]]
json_leaf = st.sampled_from(HOSTILE) | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=20)
json_any = st.recursive(json_leaf, lambda inner: st.lists(inner, max_size=4)
                        | st.dictionaries(st.sampled_from(ROPE_KEYS + KEYS[:8]), inner, max_size=4), max_leaves=12) \
    | st.lists(st.floats(allow_nan=True) | st.integers(-3, 3), max_size=60)  # factor lists

mutation = st.one_of(
    st.tuples(st.just("set"), st.sampled_from(KEYS), json_any),
    st.tuples(st.just("rope"), st.sampled_from(["rope_parameters", "rope_scaling"]), st.sampled_from(ROPE_KEYS),
              json_any),
    st.tuples(st.just("del"), st.sampled_from(KEYS)),
    st.tuples(st.just("model_type"), st.sampled_from(
        ["llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe", "phi3", "gemma", "gemma2", "gemma3",
         "gemma3_text", "granite", "granitemoe", "smollm3", "olmo2", "olmoe",
         "deepseek_v3",
         "phi",
         "", "LLAMA", None, 3, ["llama"], {"x": 1}])),
    st.tuples(st.just("doc"), st.sampled_from([None, [], [1, 2], "config", 3, True])),
)


def apply(base: dict, muts: list) -> object:
    conf: object = copy.deepcopy(base)
    for m in muts:
        if not isinstance(conf, dict):
            break
        if m[0] == "set":
            conf[m[1]] = m[2]
        elif m[0] == "rope":
            sub = conf.get(m[1])
            conf[m[1]] = {**(sub if isinstance(sub, dict) else {}), m[2]: m[3]}
        elif m[0] == "del":
            conf.pop(m[1], None)
        elif m[0] == "model_type":
            conf["model_type"] = m[1]
        else:
            conf = m[1]
    return conf


def one_printable_line(line: str) -> bool:
    return "\n" not in line and "\r" not in line and all(c.isprintable() for c in line)


def test_fuzz_hf_config_json():
    stats: Counter = Counter()

    @settings(**FUZZ)
    @given(base=st.sampled_from(BASES), muts=st.lists(mutation, min_size=1, max_size=4))
    def case(base, muts) -> None:
        conf = apply(base, muts)
        try:
            fields = model_from_hf_config(conf, "--init-from-hf")
        except LLMTrainError as exc:
            assert all(one_printable_line(line) for line in exc.lines()), exc.lines()
            stats["refused"] += 1
            fields = None
        if fields is not None:
            try:
                cfg = ModelConfig.model_validate(fields)
            except ValidationError as exc:
                assert one_printable_line(validation_line(exc)), validation_line(exc)
                stats["schema refused"] += 1
            else:
                stats["accepted"] += 1
                try:
                    from llmtrain.engine.hf.families import tensor_map

                    assert tensor_map(cfg)
                except LLMTrainError as exc:
                    assert all(one_printable_line(line) for line in exc.lines()), exc.lines()
                    stats["no tensor map"] += 1
        for model in MODELS:
            for p in config_problems(conf, model, "--init-from-hf"):
                assert one_printable_line(p.line()), p.line()
        stats["documents"] += 1

    case()
    print(f"\nconfig.json fuzz: {dict(sorted(stats.items()))}")
    assert stats["documents"] >= EXAMPLES and stats["refused"] >= 300 and stats["accepted"] >= 100, stats


def test_bases_are_accepted_as_they_are():
    """The unmutated documents load: the fuzz starts from real configs, not from refused ones. The
    4.x-style longrope config (``type: su``, the factors at the top level) reads as the recipe's."""
    for base, model in zip(BASES, MODELS):
        assert config_problems(base, model) == [], base["model_type"]
    assert model_from_hf_config(hf_config(PHI4_MINI))["rotary_dim"] == 96
    assert config_problems(PHI35_HUB, LONGROPE.model_copy(update={"sliding_window": 262144})) == []
    fields = model_from_hf_config(PHI4_HUB)
    assert (fields["family"], fields["hidden"], fields["kv_heads"], fields["sliding_window"]) == ("phi3", 5120, 10, None)
    assert math.isclose(fields["rope_theta"], 250000.0)
    assert config_problems(PHI4_HUB, ModelConfig(preset="phi4-14b")) == []
    assert config_problems(GEMMA3_1B_HUB, ModelConfig(preset="gemma3-1b")) == []  # 4.x fields = the preset
    assert config_problems(GEMMA3_4B_HUB, ModelConfig(preset="gemma3-4b")) == []  # a multimodal one's language model
    assert config_problems(GEMMA2_9B_HUB, ModelConfig(preset="gemma2-9b")) == []  # 4.x: alternating layers, caps
    assert config_problems(GEMMA_7B_HUB, ModelConfig(preset="gemma-7b")) == []  # hidden_act gelu: the tanh GELU
    assert config_problems({**GEMMA2_9B_HUB, "final_logit_softcapping": None}, ModelConfig(preset="gemma2-9b")) != []
