"""Hugging Face ``config.json`` <-> recipe ``model``, per family (the tensors: :mod:`llmtrain.engine.hf.families`).

Torch-free, with the recipe: the launcher checks a model directory's config.json against the
recipe before anything starts without importing the engine (``llmtrain.engine.hf.config_json``
re-exports these names).

* :func:`hf_config` writes the family's own config.json (``model_type``, ``architectures`` and
  the family's field names), readable by transformers 4.45+ and 5.x: RoPE as ``rope_theta`` +
  ``rope_scaling`` (4.x) and ``rope_parameters`` (5.x), ``torch_dtype`` and ``dtype`` (fp32, as
  trained).
* :func:`model_from_hf_config` reads one into recipe ``model`` fields (the architecture comes from
  config.json). A model_type or a field our engine cannot run is a one-line error naming the
  model_type and the field (:func:`unsupported_problems`) -- never a silently different model.
* :func:`config_problems` lists every disagreement between the recipe's model and config.json
  at once, one :class:`Problem` per field (dotted recipe path, both values, the fix).
  ``max_position_embeddings`` is not compared: training on shorter sequences than the model
  supports is fine. ``router_aux_loss_coef`` is read but not compared (a training choice).

config.json is untrusted (DESIGN.md §4): types are checked (:func:`_type_problems`) before any
arithmetic or comparison.
"""

from __future__ import annotations

from llmtrain.errors import LLMTrainError, Problem
from llmtrain.recipe.model import longrope_attention
from llmtrain.recipe.schema import ModelConfig
from llmtrain.safeio import printable

from llmtrain.recipe.hf_moe import moe_config_json, moe_fields
from llmtrain.recipe.hf_families import FAMILIES, HF_DEFAULTS, SUPPORTED, family_of, require_hf_compatible
from llmtrain.recipe.hf_gemma import gemma_config, gemma_fields, gemma_problems, text_part
from llmtrain.recipe.hf_types import BOOL_KEYS, FLOAT_KEYS, HINT, INT_KEYS, _type_problems  # noqa: F401 (re-exported)

# model_types people will try, and why they do not load (the others get the generic message)
NOT_SUPPORTED = {
    "deepseek_v3": "multi-head latent attention (MLA) is not implemented",
    "deepseek_v2": "multi-head latent attention (MLA) is not implemented",
    "qwen2_moe": "its shared expert with a sigmoid gate has no counterpart (model.moe.shared_experts are ungated)",
    "gemma3": "its config.json has no text_config object to read the language model from",
    "granitemoeshared": "its shared expert has no counterpart in a Hugging Face family here (granitemoe has none)",
    "granitemoehybrid": "its Mamba 2 layers are not implemented",
}
ROPE_TYPES = ("default", "llama3", "longrope", "linear")  # each family takes default and its own (Family.rope_scaling)
OPTIONAL = ("model.rope_scaling", "model.sliding_window", "model.rotary_dim", "model.local_rope_theta",
            "model.attention_scale", "model.attention_softcap", "model.logit_softcap", "model.embed_multiplier",
            "model.residual_multiplier", "model.logit_divisor")  # None is a value here, not a missing key


# -- recipe -> config.json --------------------------------------------------------------------

def hf_config(cfg: ModelConfig) -> dict:
    """``config.json`` of the ``*ForCausalLM`` of ``cfg``'s family, equal to our model (fp32)."""
    require_hf_compatible(cfg)
    f = family_of(cfg)
    theta = float(cfg.rope_theta)
    rope = {"rope_type": "default", "rope_theta": theta}
    scaling = None
    if cfg.rope_scaling is not None and cfg.rope_scaling.type == "longrope":  # "type" too: transformers 4.x's key
        s = cfg.rope_scaling
        scaling = {"rope_type": "longrope", "type": "longrope", "short_factor": list(s.short_factor),
                   "long_factor": list(s.long_factor), "attention_factor": float(s.attention_factor),
                   "original_max_position_embeddings": s.original_max_seq_len}
        rope = {**scaling, "rope_theta": theta}
    elif cfg.rope_scaling is not None and cfg.rope_scaling.type == "llama3":  # gemma's linear: gemma_config
        s = cfg.rope_scaling
        scaling = {"rope_type": "llama3", "factor": float(s.factor), "low_freq_factor": float(s.low_freq_factor),
                   "high_freq_factor": float(s.high_freq_factor), "original_max_position_embeddings": s.original_max_seq_len}
        rope = {**scaling, "rope_theta": theta}
    out = {
        "architectures": [f.architecture], "model_type": f.name,
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden, "intermediate_size": cfg.ffn_hidden,
        "num_hidden_layers": cfg.layers, "num_attention_heads": cfg.heads, "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_dim, "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": float(cfg.norm_eps),
        "rope_theta": theta, "rope_scaling": scaling, "rope_parameters": rope,
        "tie_word_embeddings": bool(cfg.tie_embeddings), "hidden_act": "silu", "attention_dropout": 0.0,
        "initializer_range": 0.02, "bos_token_id": None, "eos_token_id": None, "pad_token_id": None,
        "use_cache": True, "torch_dtype": "float32", "dtype": "float32",
    }
    if f.name == "llama":
        out.update(attention_bias=False, mlp_bias=False, pretraining_tp=1)
    if f.name in ("qwen3", "qwen3_moe"):
        out["attention_bias"] = False
    if cfg.rope_dim != cfg.head_dim:  # partial rotary (family_problems: phi3, and int(head_dim x factor) == rope_dim)
        partial = cfg.rope_dim / cfg.head_dim
        rope["partial_rotary_factor"] = out["partial_rotary_factor"] = partial  # rope is out's rope_parameters
    if f.name == "phi3":  # no dropout (as trained); the RoPE length before any (longrope) extension
        original = cfg.rope_scaling.original_max_seq_len if cfg.rope_scaling is not None else cfg.max_seq_len
        out.update(resid_pdrop=0.0, embd_pdrop=0.0, original_max_position_embeddings=original)
    if f.sliding == "plain":
        out["sliding_window"] = cfg.sliding_window
    elif f.sliding == "qwen":  # the window applies to layers >= max_window_layers (family_problems: a prefix is full)
        full = len(cfg.full_attention_layers or ()) if cfg.sliding_window is not None else cfg.layers
        out.update(use_sliding_window=cfg.sliding_window is not None, sliding_window=cfg.sliding_window,
                   max_window_layers=full, layer_types=["full_attention" if i < full else "sliding_attention"
                                                        for i in range(cfg.layers)])
    if f.gemma:
        out.update(gemma_config(cfg))
    if f.qk_all:  # OLMo 2, OLMoE: no biases; the norms are the recipe's switches (OLMo 2's post norms, q/k norms
        out.update(attention_bias=False)  # over all heads)
    if f.nope:  # SmolLM3: 1 = RoPE, 0 = NoPE per layer (transformers' naming); no sliding window
        nope = set(cfg.nope_layers or ())
        out.update(no_rope_layers=[0 if i in nope else 1 for i in range(cfg.layers)], use_sliding_window=False,
                   sliding_window=None, layer_types=["full_attention"] * cfg.layers, attention_bias=False,
                   mlp_bias=False)
    if f.scalars:  # Granite: its four muP scalars (1 = none; its softmax scale is attention_multiplier itself)
        out.update(embedding_multiplier=float(cfg.embed_multiplier or 1.0),
                   residual_multiplier=float(cfg.residual_multiplier or 1.0),
                   attention_multiplier=float(cfg.attention_scale if cfg.attention_scale is not None
                                              else cfg.head_dim ** -0.5),
                   logits_scaling=float(cfg.logit_divisor or 1.0), attention_bias=False, mlp_bias=False)
    out.update(moe_config_json(f.name, cfg))
    return out


# -- config.json -> recipe --------------------------------------------------------------------

def _rope(conf: dict) -> dict:
    params = conf.get("rope_parameters") or conf.get("rope_scaling") or {}
    return params if isinstance(params, dict) else {}


def _rope_type(conf: dict) -> str:
    params = _rope(conf)
    kind = str(params.get("rope_type", params.get("type", "default")))
    if conf.get("model_type") == "phi3" and kind in ("su", "yarn"):  # Phi3Config's own renaming (early Phi-3 128k)
        return "longrope"
    return kind


def _longrope(conf: dict) -> dict:
    """Recipe ``rope_scaling`` of a longrope config, resolved as transformers' ``_compute_longrope_parameters``:
    the attention factor from ``factor`` or max / original positions when not given."""
    r = _rope(conf)
    original = r.get("original_max_position_embeddings") or conf.get("original_max_position_embeddings") \
        or conf.get("max_position_embeddings")
    factor = r.get("factor")
    if factor is None and conf.get("max_position_embeddings") and original:
        factor = conf["max_position_embeddings"] / original
    attention = r.get("attention_factor")
    if attention is None:
        attention = longrope_attention(factor, original)
    return {"type": "longrope", "factor": None, "low_freq_factor": None, "high_freq_factor": None,
            "original_max_seq_len": original, "short_factor": [float(v) for v in r.get("short_factor") or []],
            "long_factor": [float(v) for v in r.get("long_factor") or []], "attention_factor": float(attention)}


def _partial(conf: dict) -> float:
    """``partial_rotary_factor``: in rope_parameters (transformers 5) or at the top level (Phi-3 style)."""
    for params in (_rope(conf), conf):
        if params.get("partial_rotary_factor") is not None:
            return float(params["partial_rotary_factor"])
    return 1.0


def _rotary_dim(conf: dict, partial: float) -> int | None:
    """Rotated features per head, ``int(head_dim x partial)`` as transformers computes it; None: not even >= 2."""
    heads, hidden = conf.get("num_attention_heads"), conf.get("hidden_size")
    head_dim = conf.get("head_dim") or (hidden // heads if hidden and heads else None)
    if head_dim is None:
        return None
    dim = int(head_dim * partial)
    return dim if dim >= 2 and dim % 2 == 0 else None


def _hf_theta(conf: dict) -> float | None:
    params = _rope(conf)
    if params.get("rope_theta") is not None:
        return float(params["rope_theta"])
    return float(conf["rope_theta"]) if conf.get("rope_theta") is not None else None


def _nope_layers(conf: dict) -> list[int] | None:
    """SmolLM3's NoPE layers: ``no_rope_layers`` (per layer 1 = RoPE, 0 = none), else every
    ``no_rope_layer_interval``-th layer (default 4), as transformers' SmolLM3Config; None: malformed."""
    layers, flags = conf.get("num_hidden_layers"), conf.get("no_rope_layers")
    if type(layers) is not int:
        return None
    if flags is None:
        interval = conf.get("no_rope_layer_interval", 4)
        return [i for i in range(layers) if (i + 1) % interval == 0] if type(interval) is int and interval >= 1 else None
    if not isinstance(flags, list) or len(flags) != layers or any(type(f) is not int or f not in (0, 1) for f in flags):
        return None
    return [i for i, f in enumerate(flags) if f == 0]


def _qwen_full_layers(conf: dict) -> list[int] | None:
    """Qwen2/3's full-attention layers under ``use_sliding_window``: ``layer_types``' full ones when given
    (transformers 5 writes them) and they come first, else the layers below ``max_window_layers``
    (transformers' rule); None: not such a list."""
    layers, types = conf.get("num_hidden_layers"), conf.get("layer_types")
    if types is not None:
        if not isinstance(types, list) or len(types) != layers or any(
                t not in ("full_attention", "sliding_attention") for t in types):
            return None
        full = [i for i, t in enumerate(types) if t == "full_attention"]
        return full if full == list(range(len(full))) else None
    mwl = conf.get("max_window_layers", 0) or 0
    return list(range(min(mwl, layers))) if type(layers) is int else []


def unsupported_problems(conf: dict, where: str) -> list[Problem]:
    """Every reason the engine cannot run ``conf``'s model, each naming the model_type and field."""
    conf = text_part(conf)
    mt = conf.get("model_type")
    name = printable(repr(mt), 40)
    if not isinstance(mt, str) or mt not in FAMILIES:  # an object or a list is not hashable: checked first
        why = NOT_SUPPORTED.get(mt) if isinstance(mt, str) else None
        return [Problem(where, f"config.json model_type={name} is not supported" + (f" ({why})" if why else ""),
                        f"use one of: {SUPPORTED}")]
    out = []

    def bad(field: str, value, why: str) -> None:
        out.append(Problem(where, f"config.json of model_type={name} has {field}={printable(repr(value), 60)}: {why}",
                           f"supported: {SUPPORTED} with standard blocks"))

    if FAMILIES[mt].gemma:  # its own activation, RoPE per layer type, soft-capping (recipe/hf_gemma.py)
        gemma_problems(conf, bad)
        return out
    if conf.get("hidden_act", "silu") != "silu":
        bad("hidden_act", conf.get("hidden_act"), "only SwiGLU (silu) MLPs are implemented")
    if mt == "smollm3":
        if _nope_layers(conf) is None:
            bad("no_rope_layers", conf.get("no_rope_layers", conf.get("no_rope_layer_interval")),
                "it must be 0 (NoPE) or 1 (RoPE) for each of num_hidden_layers, or an interval >= 1")
        if conf.get("use_sliding_window"):
            bad("use_sliding_window", True, "SmolLM3's sliding window (on its NoPE layers) is not implemented")
    if mt in ("llama", "qwen3", "qwen3_moe", "granite", "granitemoe", "smollm3", "olmo2", "olmoe") \
            and conf.get("attention_bias", False) is not False:
        bad("attention_bias", conf.get("attention_bias"), "it includes an o_proj bias, which our attention has not")
    if mt in ("llama", "granite", "smollm3") and conf.get("mlp_bias", False) is not False:
        bad("mlp_bias", conf.get("mlp_bias"), "our MLPs have no biases")
    kind = _rope_type(conf)
    if kind not in ("default", FAMILIES[mt].rope_scaling):
        bad("rope_type", kind, f"{mt} is implemented with default and {FAMILIES[mt].rope_scaling} RoPE")
    partial = _partial(conf)  # its type: _type_problems (FLOAT_KEYS)
    if partial != 1.0 and not FAMILIES[mt].partial_rotary:
        bad("partial_rotary_factor", partial, f"{mt} rotates whole heads (partial rotary is phi3's)")
    elif partial != 1.0 and (partial > 1.0 or _rotary_dim(conf, partial) is None):
        bad("partial_rotary_factor", partial, "it must leave an even number >= 2 of rotated features per head")
    if mt == "olmoe" and conf.get("clip_qkv") is not None:
        bad("clip_qkv", conf.get("clip_qkv"), "clamping q, k and v is not implemented (OLMoE's releases have none)")
    if mt == "mixtral" and conf.get("router_jitter_noise", 0.0) not in (0, 0.0, None):
        bad("router_jitter_noise", conf.get("router_jitter_noise"), "router jitter is not implemented")
    if FAMILIES[mt].sliding == "qwen" and conf.get("use_sliding_window") and conf.get("layer_types") is not None \
            and _qwen_full_layers(conf) is None:
        bad("layer_types", conf.get("layer_types"), "it must be a list of sliding_attention / full_attention per layer, "
            "the full ones first (max_window_layers)")
    return out


def model_from_hf_config(conf: dict, where: str = "config.json") -> dict:
    """Recipe ``model`` fields (a dict for ``ModelConfig``) of an HF ``config.json``; a wrong type or
    an unsupported model_type / field raises :class:`LLMTrainError` (one problem per finding). Keys the
    file omits take transformers' defaults (:data:`HF_DEFAULTS`)."""
    conf = text_part(conf)  # a multimodal Gemma 3: its language model (recipe/hf_gemma.py)
    problems = _type_problems(conf, where) or unsupported_problems(conf, where)
    if problems:
        raise LLMTrainError(problems)
    mt = conf["model_type"]
    conf = {**HF_DEFAULTS.get(mt, {}), **conf}  # (a base in rope_parameters still wins: _hf_theta)
    heads, hidden = conf.get("num_attention_heads"), conf.get("hidden_size")
    out = {
        "family": mt, "layers": conf.get("num_hidden_layers"), "hidden": hidden, "heads": heads,
        "kv_heads": conf.get("num_key_value_heads") or heads, "ffn_hidden": conf.get("intermediate_size"),
        "vocab_size": conf.get("vocab_size"), "max_seq_len": conf.get("max_position_embeddings"),
        "rope_theta": _hf_theta(conf), "norm_eps": conf.get("rms_norm_eps"),
        "tie_embeddings": bool(conf.get("tie_word_embeddings", False)),
        "head_dim": conf.get("head_dim") or (hidden // heads if hidden and heads else None),
        "qkv_bias": FAMILIES[mt].qkv_bias, "qk_norm": FAMILIES[mt].qk_norm, "rope_scaling": None,
        "sliding_window": None, "rotary_dim": _rotary_dim(conf, _partial(conf)) if _partial(conf) != 1.0 else None,
    }
    if _rope_type(conf) == "llama3":
        r = _rope(conf)
        out["rope_scaling"] = {"type": "llama3", "factor": float(r.get("factor", 8.0)),
                               "low_freq_factor": float(r.get("low_freq_factor", 1.0)),
                               "high_freq_factor": float(r.get("high_freq_factor", 4.0)),
                               "original_max_seq_len": r.get("original_max_position_embeddings",
                                                             conf.get("max_position_embeddings")),
                               "short_factor": None, "long_factor": None, "attention_factor": None}
    elif _rope_type(conf) == "longrope":
        out["rope_scaling"] = _longrope(conf)
    sliding = FAMILIES[mt].sliding
    if sliding == "plain" or (sliding == "qwen" and conf.get("use_sliding_window")):
        out["sliding_window"] = conf.get("sliding_window")
    if sliding == "qwen" and conf.get("use_sliding_window") and conf.get("sliding_window") is not None:
        out["full_attention_layers"] = _qwen_full_layers(conf) or None  # layers below max_window_layers
    if FAMILIES[mt].gemma:
        out.update(gemma_fields(conf))
    if FAMILIES[mt].olmo:  # OLMo 2's block: post norms only, q/k norms over all heads
        out.update(pre_norms=False, post_norms=True, qk_norm_width="all")
    elif FAMILIES[mt].qk_all:  # OLMoE: Llama's norms, q/k norms over all heads
        out["qk_norm_width"] = "all"
    if FAMILIES[mt].nope:  # SmolLM3: checked first (unsupported_problems)
        out["nope_layers"] = _nope_layers(conf) or None
    if FAMILIES[mt].scalars:  # Granite: GraniteConfig's defaults are 1 (a softmax scale of 1, not 1 / sqrt(d))
        scale = lambda key: None if float(conf.get(key, 1.0)) == 1.0 else float(conf[key])  # noqa: E731
        out.update(embed_multiplier=scale("embedding_multiplier"), residual_multiplier=scale("residual_multiplier"),
                   logit_divisor=scale("logits_scaling"), attention_scale=float(conf.get("attention_multiplier", 1.0)))
    moe = moe_fields(mt, conf)
    if moe is not None:
        out["moe"] = moe
    return out


# -- comparison ---------------------------------------------------------------------------------

def _moe_layers(m: dict) -> list[int]:
    moe = m.get("moe") or {}
    if (moe.get("num_experts") or 1) <= 1:
        return []
    step, dense = moe.get("sparse_step", 1), set(moe.get("dense_layers", []))
    return [i for i in range(m["layers"] or 0) if (i + 1) % step == 0 and i not in dense]


def config_problems(conf: dict, cfg: ModelConfig, where: str = "--init-from-hf") -> list[Problem]:
    """Every way an HF ``config.json`` differs from the recipe's model (empty: it loads exactly)."""
    try:
        theirs = model_from_hf_config(conf, where)
    except LLMTrainError as exc:
        return exc.problems
    rope = cfg.rope_scaling.model_dump() if cfg.rope_scaling is not None else None
    moe = theirs.get("moe") or {}
    their_moe = _moe_layers(theirs)
    our_moe = [i for i in range(cfg.layers) if cfg.is_moe_layer(i)]
    fields = [("model.family", cfg.hf_family, theirs["family"], "model_type"),
              ("model.hidden", cfg.hidden, theirs["hidden"], "hidden_size"),
              ("model.layers", cfg.layers, theirs["layers"], "num_hidden_layers"),
              ("model.heads", cfg.heads, theirs["heads"], "num_attention_heads"),
              ("model.kv_heads", cfg.kv_heads, theirs["kv_heads"], "num_key_value_heads"),
              ("model.head_dim", cfg.head_dim, theirs["head_dim"], "head_dim"),
              ("model.rotary_dim", cfg.rope_dim if cfg.rope_dim != cfg.head_dim else None, theirs["rotary_dim"],
               "head_dim x partial_rotary_factor"),  # None on both sides: whole heads
              ("model.vocab_size", cfg.vocab_size, theirs["vocab_size"], "vocab_size"),
              ("model.tie_embeddings", bool(cfg.tie_embeddings), theirs["tie_embeddings"], "tie_word_embeddings"),
              ("model.norm_eps", float(cfg.norm_eps), theirs["norm_eps"], "rms_norm_eps"),
              ("model.rope_theta", float(cfg.rope_theta), theirs["rope_theta"], "rope_theta"),
              ("model.rope_scaling", rope, theirs["rope_scaling"], "rope_scaling"),
              ("model.qkv_bias", cfg.qkv_bias, theirs["qkv_bias"], f"model_type={theirs['family']}"),
              ("model.qk_norm", cfg.qk_norm, theirs["qk_norm"], f"model_type={theirs['family']}"),
              ("model.sliding_window", cfg.sliding_window, theirs["sliding_window"], "sliding_window"),
              ("model.full_attention_layers", sorted(cfg.full_attention_layers or []),
               sorted(theirs.get("full_attention_layers") or []), "layer_types"),
              ("model.local_rope_theta", cfg.local_rope_theta, theirs.get("local_rope_theta"), "rope_local_base_freq"),
              ("model.attention_scale", cfg.attention_scale, theirs.get("attention_scale"),
               "query_pre_attn_scalar ** -0.5"),
              ("model.attention_softcap", cfg.attention_softcap, theirs.get("attention_softcap"), "attn_logit_softcapping"),
              ("model.logit_softcap", cfg.logit_softcap, theirs.get("logit_softcap"), "final_logit_softcapping"),
              ("model.nope_layers", sorted(cfg.nope_layers or []), sorted(theirs.get("nope_layers") or []),
               "no_rope_layers"),
              ("model.pre_norms", cfg.pre_norms, theirs.get("pre_norms", True), f"model_type={theirs['family']}"),
              ("model.qk_norm_width", cfg.qk_norm_width if cfg.qk_norm else "head",
               theirs.get("qk_norm_width", "head"), f"model_type={theirs['family']}"),
              ("model.embed_multiplier", cfg.embed_multiplier, theirs.get("embed_multiplier"), "embedding_multiplier"),
              ("model.residual_multiplier", cfg.residual_multiplier, theirs.get("residual_multiplier"),
               "residual_multiplier"),
              ("model.logit_divisor", cfg.logit_divisor, theirs.get("logit_divisor"), "logits_scaling"),
              ("model.moe.num_experts", cfg.moe.num_experts, moe.get("num_experts", 1), "num_experts")]
    if len(their_moe) < (theirs["layers"] or 0):  # some dense layers: their width matters
        fields.append(("model.ffn_hidden", cfg.ffn_hidden, theirs["ffn_hidden"], "intermediate_size"))
    if moe and cfg.is_moe:
        fields += [("model.moe.top_k", cfg.moe.top_k, moe["top_k"], "num_experts_per_tok"),
                   ("model.moe.expert_ffn_hidden", cfg.expert_ffn, moe["expert_ffn_hidden"],
                    "moe_intermediate_size" if theirs["family"] == "qwen3_moe" else "intermediate_size"),
                   ("model.moe.norm_topk_prob", cfg.moe.norm_topk_prob, moe["norm_topk_prob"], "norm_topk_prob")]
        if our_moe != their_moe:
            dense = [i for i in range(cfg.layers) if i not in their_moe]
            fields.append(("model.moe.dense_layers", [i for i in range(cfg.layers) if i not in our_moe], dense,
                           "mlp_only_layers/decoder_sparse_step"))
    problems = []
    for path, ours, value, key in fields:
        missing = value is None and path not in OPTIONAL
        if missing or (float(ours) != float(value) if isinstance(ours, float) and value is not None else ours != value):
            problems.append(Problem(path, f"recipe has {ours}, {where} config.json has {key}={printable(repr(value), 80)}",
                                    f"set {path}={value} with --set, or use matching weights"))
    return problems
