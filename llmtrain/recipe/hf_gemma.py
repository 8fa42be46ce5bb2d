"""Gemma 1, 2 and 3 text (``gemma``, ``gemma2``, ``gemma3_text``) ``config.json`` <-> recipe ``model`` (torch-free).

Gemma 3 is our decoder with its switches on (:mod:`llmtrain.engine.models.llama`): unit-offset
RMSNorms (``norm_offset``), norms on both branch outputs (``post_norms``), embeddings times
sqrt(hidden) (``embed_scale``), GeGLU MLPs (``mlp_activation: gelu_tanh``), q/k norms, a softmax
scale of ``query_pre_attn_scalar ** -0.5`` (``attention_scale``), and two kinds of layers:
``sliding_attention`` layers (a window of ``sliding_window`` tokens, RoPE base
``local_rope_theta``, no scaling) and ``full_attention`` layers (``full_attention_layers``, RoPE
base ``rope_theta`` with the config's scaling, ``linear`` for 4B and larger).

Both config.json forms are read, as transformers 5 reads them: 5.x's ``rope_parameters`` per
layer type and ``layer_types``, and 4.x's ``rope_theta`` / ``rope_local_base_freq`` /
``rope_scaling`` (the full layers') and ``sliding_window_pattern`` (every ``pattern``-th layer
full, default 6). Defaults are transformers' (``Gemma3TextConfig``): thetas 1e6 / 1e4, window
4096, ``query_pre_attn_scalar`` 256, tied embeddings. Written: both forms, so 4.5x and 5.x read it.

Refused in one line (the engine would be another model): soft-capping of attention logits or of
the final logits (Gemma 2's; null in Gemma 3), bidirectional attention, an activation other than
``gelu_pytorch_tanh``, RoPE types other than default (sliding layers) and default / linear (full
layers).

Gemma 1 (``gemma``: 2B, 7B, Gemma 1.1, CodeGemma) is the Llama block with Gemma's offset norms,
scaled embeddings and GeGLU (``hidden_act``: the released files say ``gelu``, which transformers
reads as the tanh approximation, ``gelu_pytorch_tanh``), one RoPE base, full attention in every
layer, softmax scale ``1 / sqrt(head_dim)``: no post norms, q/k norms, windows or soft-caps.

Gemma 2 (``gemma2``: 2B, 9B, 27B) is Gemma 3's block without q/k norms, with one RoPE base for every
layer (``rope_theta``, default 10,000, no scaling), layers alternating sliding / full (sliding
first: transformers' default ``layer_types``; 4.x always alternates, 5.x reads ``layer_types``),
and soft-capping of the attention scores and of the final logits (``attn_logit_softcapping`` 50,
``final_logit_softcapping`` 30 by default: ``model.attention_softcap`` / ``logit_softcap``, run by
the engine's own attention kernel, ``engine/models/softcap.py``).

The multimodal ``gemma3`` checkpoints (Gemma 3 4B, 12B, 27B: ``Gemma3ForConditionalGeneration``)
hold this language model beside a vision tower: :func:`text_part` reads their ``text_config``
with transformers' ``Gemma3TextConfig`` defaults for the keys the released files leave out (the
original gemma-3-4b-it names only hidden_size, intermediate_size, num_hidden_layers, rope_scaling
and sliding_window), and :func:`text_tensor_name` maps their tensor names to the text model's
(vision tower and projector left out). What is trained and exported is the language model, as
``gemma3_text``. ``final_logit_softcapping`` in such a text_config is dropped: transformers'
``Gemma3ForConditionalGeneration`` does not apply it (only ``Gemma3ForCausalLM`` does), so the
released model's logits are uncapped.
"""

from __future__ import annotations

from typing import Any

from llmtrain.recipe.schema import ModelConfig

GEMMA3_THETA = {"full_attention": 1_000_000.0, "sliding_attention": 10_000.0}
GEMMA2_THETA = 10_000.0
GEMMA2_SOFTCAP = {"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}  # Gemma2Config's defaults
SOFTCAP_FIELDS = {"attn_logit_softcapping": "attention_softcap", "final_logit_softcapping": "logit_softcap"}
# transformers' Gemma3TextConfig defaults (5.x; tests/test_families.py compares them) for the keys a
# multimodal gemma3 config.json's text_config may leave out
GEMMA3_TEXT_DEFAULTS = {
    "vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "attention_bias": False, "query_pre_attn_scalar": 256,
    "sliding_window": 4096, "attn_logit_softcapping": None, "use_bidirectional_attention": False,
}
# the multimodal model's tensors that are not the language model's
VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")


def is_multimodal(conf: object) -> bool:
    """A multimodal Gemma 3 config.json (``model_type: gemma3`` with a ``text_config`` object)."""
    return isinstance(conf, dict) and conf.get("model_type") == "gemma3" and isinstance(conf.get("text_config"), dict)


def text_part(conf: object) -> object:
    """The language model's config of a multimodal Gemma 3 config.json (module docstring); any other
    document unchanged."""
    if not is_multimodal(conf):
        return conf
    text = {**GEMMA3_TEXT_DEFAULTS, **conf["text_config"], "model_type": "gemma3_text", "final_logit_softcapping": None}
    text.setdefault("tie_word_embeddings", conf.get("tie_word_embeddings", True))
    return text


def text_tensor_name(name: str) -> str | None:
    """A multimodal Gemma 3 tensor's name in the text model (``model.layers.0...``); None for the vision
    tower and projector. The released files (and transformers 5's save) say ``language_model.model.``;
    transformers 5's module tree says ``model.language_model.``."""
    if name.startswith(VISION_PREFIXES):
        return None
    for prefix in ("language_model.model.", "model.language_model."):
        if name.startswith(prefix):
            return "model." + name[len(prefix):]
    if name in ("language_model.lm_head.weight", "lm_head.weight"):
        return "lm_head.weight"
    return name


def _per_type(conf: dict) -> dict[str, dict]:
    """``{layer_type: rope params}`` as transformers 5 resolves them (``convert_rope_params_to_dict``)."""
    params = conf.get("rope_parameters")
    out: dict[str, dict] = {"full_attention": {}, "sliding_attention": {}}
    if isinstance(params, dict) and any(k in params for k in out):
        for kind in out:
            if isinstance(params.get(kind), dict):
                out[kind] = dict(params[kind])
    if isinstance(conf.get("rope_scaling"), dict):
        out["full_attention"].update(conf["rope_scaling"])
    out["full_attention"].setdefault("rope_theta", conf.get("rope_theta", GEMMA3_THETA["full_attention"]))
    out["sliding_attention"].setdefault("rope_theta", conf.get("rope_local_base_freq",
                                                               GEMMA3_THETA["sliding_attention"]))
    return out


def _kind(params: dict) -> str:
    return str(params.get("rope_type", params.get("type", "default")))


def _gemma2(conf: dict) -> bool:
    return conf.get("model_type") == "gemma2"


def _gemma1(conf: dict) -> bool:
    return conf.get("model_type") == "gemma"


def _single_theta(conf: dict) -> object:
    """Gemma 1's and 2's one RoPE base (``rope_parameters`` or 4.x's ``rope_theta``; default 1e4)."""
    params = conf.get("rope_parameters")
    if isinstance(params, dict) and params.get("rope_theta") is not None:
        return params["rope_theta"]
    return conf.get("rope_theta", GEMMA2_THETA)


def layer_types(conf: dict) -> list[str] | None:
    """Each layer's attention kind: ``layer_types``, else ``sliding_window_pattern`` (default 6; Gemma 2:
    every second layer full, always)."""
    layers = conf.get("num_hidden_layers")
    given = conf.get("layer_types")
    if isinstance(given, list):
        return given
    if given is not None:  # not a list: no fallback to the pattern (an untrusted file says something else)
        return None
    pattern = 2 if _gemma2(conf) else conf.get("sliding_window_pattern", 6)
    if type(layers) is not int or type(pattern) is not int or pattern < 1:
        return None
    return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]


def gemma_problems(conf: dict, bad) -> None:
    """Call ``bad(field, value, why)`` for each gemma / gemma2 / gemma3_text setting the engine does not run."""
    if _gemma1(conf):  # transformers 5 reads hidden_act, the released "gelu" meaning the tanh approximation
        act, allowed = conf.get("hidden_act", "gelu_pytorch_tanh"), ("gelu", "gelu_pytorch_tanh")
    else:
        act, allowed = conf.get("hidden_activation", conf.get("hidden_act", "gelu_pytorch_tanh")), ("gelu_pytorch_tanh",)
    if act not in allowed:
        bad("hidden_act" if _gemma1(conf) else "hidden_activation", act,
            "only the tanh-approximated GELU (gelu_pytorch_tanh) is implemented")
    for key in SOFTCAP_FIELDS:
        v = conf.get(key)
        if v is not None and not _gemma2(conf):
            bad(key, v, "soft-capping is Gemma 2's (model_type gemma2); Gemma 1 and 3 have none")
        elif v is not None and (type(v) not in (int, float) or not 0 < v < float("inf")):
            bad(key, v, "it must be a positive number or null")
    if conf.get("use_bidirectional_attention"):
        bad("use_bidirectional_attention", conf.get("use_bidirectional_attention"), "only causal attention is implemented")
    if conf.get("attention_bias", False) is not False:
        bad("attention_bias", conf.get("attention_bias"), "our attention has no biases here")
    if _gemma1(conf):  # one RoPE, every layer full
        _single_rope_problems(conf, bad)
        return
    types = layer_types(conf)
    if types is None or len(types) != conf.get("num_hidden_layers") or any(
            t not in ("sliding_attention", "full_attention") for t in types):
        bad("layer_types", conf.get("layer_types", conf.get("sliding_window_pattern")),
            "it must name sliding_attention or full_attention for each of num_hidden_layers")
    _common_problems(conf, bad)
    if _gemma2(conf):
        _single_rope_problems(conf, bad)
        return
    rope = _per_type(conf)
    if _kind(rope["sliding_attention"]) != "default":
        bad("rope_parameters.sliding_attention.rope_type", _kind(rope["sliding_attention"]),
            "the sliding layers are implemented with default RoPE")
    if _kind(rope["full_attention"]) not in ("default", "linear"):
        bad("rope_parameters.full_attention.rope_type", _kind(rope["full_attention"]),
            "the full-attention layers are implemented with default and linear RoPE")
    for kind, params in rope.items():
        for key in ("rope_theta", "factor"):
            v = params.get(key)
            if v is not None and (type(v) not in (int, float) or not 0 < v < float("inf")):
                bad(f"rope_parameters.{kind}.{key}", v, "it must be a positive number")


def _single_rope_problems(conf: dict, bad) -> None:
    """Gemma 1 and 2: one RoPE (``rope_parameters`` or 4.x's ``rope_theta``), default type only."""
    params = conf.get("rope_parameters") or conf.get("rope_scaling") or {}
    kind = _kind(params) if isinstance(params, dict) else "?"
    if kind != "default":
        bad("rope_parameters.rope_type", kind, f"{conf.get('model_type')} is implemented with default RoPE")
    theta = _single_theta(conf)
    if type(theta) not in (int, float) or not 0 < theta < float("inf"):
        bad("rope_theta", theta, "it must be a positive number")


def _common_problems(conf: dict, bad) -> None:
    if "sliding_window" in conf and conf["sliding_window"] is None:
        bad("sliding_window", None, "the sliding_attention layers need a window")
    scalar = conf.get("query_pre_attn_scalar", 256)
    if type(scalar) not in (int, float) or not 0 < scalar < float("inf"):
        bad("query_pre_attn_scalar", scalar, "it must be a positive number")


def gemma_fields(conf: dict) -> dict[str, Any]:
    """The recipe ``model`` fields a gemma / gemma2 / gemma3_text config sets beyond the common ones
    (checked first: :func:`gemma_problems`)."""
    if _gemma1(conf):  # no windows, post norms, query scalar or soft-caps
        return {"rope_theta": float(_single_theta(conf)), "local_rope_theta": None, "rope_scaling": None,
                "sliding_window": None, "full_attention_layers": None, "attention_scale": None,
                "tie_embeddings": bool(conf.get("tie_word_embeddings", True)), "norm_offset": True, "post_norms": False,
                "embed_scale": True, "mlp_activation": "gelu_tanh"}
    types = layer_types(conf) or []
    common = {
        "sliding_window": conf.get("sliding_window", 4096),
        "full_attention_layers": [i for i, t in enumerate(types) if t == "full_attention"],
        "attention_scale": float(conf.get("query_pre_attn_scalar", 256)) ** -0.5,
        "tie_embeddings": bool(conf.get("tie_word_embeddings", True)),
        "norm_offset": True, "post_norms": True, "embed_scale": True, "mlp_activation": "gelu_tanh",
    }
    if _gemma2(conf):  # absent keys take Gemma2Config's defaults (50 / 30), an explicit null none
        caps = {ours: conf.get(key, GEMMA2_SOFTCAP[key]) for key, ours in SOFTCAP_FIELDS.items()}
        return {**common, "rope_theta": float(_single_theta(conf)), "local_rope_theta": None, "rope_scaling": None,
                **{k: None if v is None else float(v) for k, v in caps.items()}}
    rope = _per_type(conf)
    full = rope["full_attention"]
    return {
        **common, "rope_theta": float(full["rope_theta"]),
        "local_rope_theta": float(rope["sliding_attention"]["rope_theta"]),
        "rope_scaling": {"type": "linear", "factor": float(full.get("factor", 1.0)), "low_freq_factor": None,
                         "high_freq_factor": None, "original_max_seq_len": 8192, "short_factor": None,
                         "long_factor": None, "attention_factor": None} if _kind(full) == "linear" else None,
    }


def query_pre_attn_scalar(cfg: ModelConfig) -> int | float:
    """The config.json value whose ``** -0.5`` is ``cfg.attention_scale`` (default: head_dim); an int
    where it is one (transformers 5 types the field int: 256 for Gemma 3 1B-12B, 168 for 27B)."""
    if cfg.attention_scale is None:
        return cfg.head_dim
    scalar = cfg.attention_scale ** -2
    return round(scalar) if abs(scalar - round(scalar)) < 1e-6 * scalar else scalar


def gemma_config(cfg: ModelConfig) -> dict[str, Any]:
    """The gemma / gemma2 / gemma3_text keys of :func:`llmtrain.recipe.hf_config.hf_config` (both config forms)."""
    windowed = set(cfg.windowed_layers)
    types = ["sliding_attention" if i in windowed else "full_attention" for i in range(cfg.layers)]
    if cfg.hf_family == "gemma":  # Gemma 1: hf_config's RoPE, no windows
        return {"hidden_act": "gelu_pytorch_tanh", "use_bidirectional_attention": False, "attention_bias": False}
    if cfg.hf_family == "gemma2":  # one RoPE (rope_parameters / rope_theta: hf_config's), the soft-caps
        return {"hidden_activation": "gelu_pytorch_tanh", "hidden_act": "gelu_pytorch_tanh",
                "query_pre_attn_scalar": query_pre_attn_scalar(cfg), "sliding_window": cfg.sliding_window or 4096,
                "layer_types": types, "attn_logit_softcapping": cfg.attention_softcap,
                "final_logit_softcapping": cfg.logit_softcap, "use_bidirectional_attention": False,
                "attention_bias": False}
    local = float(cfg.local_rope_theta if cfg.local_rope_theta is not None else cfg.rope_theta)
    full = {"rope_type": "default", "rope_theta": float(cfg.rope_theta)}
    scaling = None
    if cfg.rope_scaling is not None:  # family_problems: linear only
        scaling = {"rope_type": "linear", "factor": float(cfg.rope_scaling.factor)}
        full.update(scaling)
    out = {
        "hidden_activation": "gelu_pytorch_tanh", "hidden_act": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": query_pre_attn_scalar(cfg), "sliding_window": cfg.sliding_window or 4096,
        "layer_types": types, "rope_parameters": {"full_attention": full,
                                                  "sliding_attention": {"rope_type": "default", "rope_theta": local}},
        "rope_theta": float(cfg.rope_theta), "rope_local_base_freq": local, "rope_scaling": scaling,
        "attn_logit_softcapping": None, "final_logit_softcapping": None, "use_bidirectional_attention": False,
        "attention_bias": False,
    }
    for pattern in range(1, cfg.layers + 1):  # 4.x reads only the pattern: write it where one gives these layers
        if layer_types({"num_hidden_layers": cfg.layers, "sliding_window_pattern": pattern}) == types:
            out["sliding_window_pattern"] = pattern
            break
    return out
