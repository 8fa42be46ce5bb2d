"""Hugging Face Llama interop: our state dict <-> ``LlamaForCausalLM``'s, recipe model <-> ``config.json``.

Used by ``llmtrain ckpt export --hf OUT`` (checkpoint -> ``OUT/model.safetensors`` + ``OUT/config.json``)
and by ``checkpoint.init_from_hf`` / ``llmtrain launch --init-from-hf DIR`` (start training from
such weights). No ``transformers`` import here: the files are plain safetensors + JSON.

Decisions:

* **RoPE convention.** Our RoPE rotates interleaved pairs ``(2i, 2i+1)`` of each head
  (:mod:`llmtrain.engine.models.rope`); HF Llama rotates half-split pairs ``(i, i + d/2)``
  (``rotate_half``) with the same frequencies. Rather than a second RoPE, the rows of ``wq`` and
  ``wk`` are permuted per head on export: HF row ``j < d/2`` is our row ``2j`` and HF row
  ``d/2 + j`` is our row ``2j + 1`` (the classic Meta -> HF permutation), so q·k dot products,
  and thus logits, are unchanged; import applies the inverse. ``wv``/``wo`` need nothing.
* **Names.** ``tok_embeddings -> model.embed_tokens``, ``layers.N.attention.{wq,wk,wv,wo} ->
  model.layers.N.self_attn.{q,k,v,o}_proj``, ``feed_forward.{w1,w3,w2} -> mlp.{gate,up,down}_proj``,
  ``attention_norm -> input_layernorm``, ``ffn_norm -> post_attention_layernorm``, ``norm ->
  model.norm``, ``output -> lm_head`` (left out when ``tie_embeddings``: HF ties it).
* **Scope.** Dense models only; MoE checkpoints are refused naming ``model.moe`` (HF Llama has
  no experts and our router/expert layout has no single HF counterpart).
* **config.json** is written for transformers 4.45+ and 5.x: ``rope_theta`` (4.x) and
  ``rope_parameters`` (5.x), ``torch_dtype`` and ``dtype``; exported tensors are fp32, as trained.
* **Loading into a sharded model** (:func:`load_hf_weights`): every rank reads the full tensors,
  and ``set_model_state_dict(..., full_state_dict=True)`` places each one on its parameter's
  mesh and placements (FSDP, TP), per local pipeline chunk (only that chunk's keys).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from llmtrain.errors import LLMTrainError, Problem
from llmtrain.recipe.schema import ModelConfig
from llmtrain.safeio import printable

if TYPE_CHECKING:  # torch is imported by the functions that read or write tensors, so that
    import torch   # `llmtrain launch --init-from-hf` can check a directory without importing it

# our per-layer suffix -> HF per-layer suffix (under model.layers.N.)
LAYER_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
TOP_NAMES = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
             "output.weight": "lm_head.weight"}



# -- the tensor map: the one description of "which HF tensors make which of ours" ---------------

@dataclass(frozen=True)
class Source:
    """How one tensor of our full (unsharded) model state dict is made from HF tensors, and back.

    * ``hf``: the HF tensor names. One name: our tensor is that tensor (same shape). Several
      names (``stacked``): our tensor stacks them along a new dim 0 (routed experts: our
      ``w1`` [E, F, H] is HF's ``experts.{e}...weight`` [F, H] for e in 0..E-1).
    * ``head_dim``: when set, dim 0 of each HF tensor is a run of heads of ``head_dim`` rows in
      HF's half-split RoPE order; ours is interleaved (:func:`half_to_interleaved` per head).
      Set for q/k projection weights and biases and for q/k norm weights (one head).

    Readers that want only a slice of our tensor: dim 0 of ours maps to experts (stacked) or to
    rows of the HF tensor (a row slice needs whole heads when ``head_dim`` is set: read the
    covering heads, permute, cut); every other dim maps 1:1.
    """

    hf: tuple[str, ...]
    stacked: bool = False
    head_dim: int | None = None


def tensor_map(cfg: ModelConfig) -> dict[str, Source]:
    """Every key of ``Transformer(cfg).state_dict()`` (no ``model.`` prefix) -> its :class:`Source`.

    ``output.weight`` is absent when embeddings are tied (HF stores only the embedding)."""
    require_dense(cfg)
    out: dict[str, Source] = {}
    for ours, theirs in TOP_NAMES.items():
        if ours == "output.weight" and cfg.tie_embeddings:
            continue
        out[ours] = Source((theirs,))
    for i in range(cfg.layers):
        for ours, theirs in LAYER_NAMES.items():
            rope = ours in ("attention.wq.weight", "attention.wk.weight")
            out[f"layers.{i}.{ours}"] = Source((f"model.layers.{i}.{theirs}",), head_dim=cfg.head_dim if rope else None)
    return out


def to_ours(src: Source, tensors: list[torch.Tensor]) -> torch.Tensor:
    """Our tensor from the HF tensors ``src.hf`` names (in that order)."""
    import torch

    if src.head_dim is not None:
        tensors = [half_to_interleaved(t, t.shape[0] // src.head_dim) for t in tensors]
    return torch.stack(tensors) if src.stacked else tensors[0]


def to_hf(src: Source, ours: torch.Tensor) -> list[torch.Tensor]:
    """The HF tensors (in ``src.hf`` order) of our tensor (new, contiguous tensors)."""
    parts = list(ours.unbind(0)) if src.stacked else [ours]
    if src.head_dim is not None:
        return [interleaved_to_half(t, t.shape[0] // src.head_dim) for t in parts]
    return [t.detach().clone().contiguous() for t in parts]


# -- the RoPE row permutation ------------------------------------------------------------------

def interleaved_to_half(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows of a q/k projection ``[n_heads * d, in]``: per head ``[0, 2, 4, ..., 1, 3, 5, ...]``."""
    d = w.shape[0] // n_heads
    return w.reshape(n_heads, d // 2, 2, -1).transpose(1, 2).reshape(w.shape).contiguous()


def half_to_interleaved(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """The inverse of :func:`interleaved_to_half`."""
    d = w.shape[0] // n_heads
    return w.reshape(n_heads, 2, d // 2, -1).transpose(1, 2).reshape(w.shape).contiguous()


# -- state dicts --------------------------------------------------------------------------------

def require_dense(cfg: ModelConfig) -> None:
    if cfg.is_moe:
        raise LLMTrainError(f"model.moe: {cfg.moe.num_experts} experts; Hugging Face Llama export/import "
                            "supports dense models only", "use a dense model (model.moe.num_experts: 1)",
                            path="model.moe")


def to_hf_state(ours: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Our full (unsharded) model state dict -> ``LlamaForCausalLM`` state dict (new tensors)."""
    require_dense(cfg)
    out: dict[str, torch.Tensor] = {}
    for name, t in ours.items():
        if name in TOP_NAMES:
            if name == "output.weight" and cfg.tie_embeddings:
                continue
            out[TOP_NAMES[name]] = t.detach().clone().contiguous()
            continue
        parts = name.split(".", 2)
        if len(parts) != 3 or parts[0] != "layers" or parts[2] not in LAYER_NAMES:
            raise LLMTrainError(f"checkpoint tensor {name!r} has no Hugging Face Llama counterpart",
                                "only dense Llama-style checkpoints can be exported", path="model")
        t = t.detach()
        if parts[2] == "attention.wq.weight":
            t = interleaved_to_half(t, cfg.heads)
        elif parts[2] == "attention.wk.weight":
            t = interleaved_to_half(t, cfg.kv_heads)
        out[f"model.layers.{parts[1]}.{LAYER_NAMES[parts[2]]}"] = t.clone().contiguous()
    return out


def from_hf_state(hf: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """``LlamaForCausalLM`` state dict -> ours (``output.weight`` = the embedding when tied)."""
    require_dense(cfg)
    top = {v: k for k, v in TOP_NAMES.items()}
    layer = {v: k for k, v in LAYER_NAMES.items()}
    out: dict[str, torch.Tensor] = {}
    for name, t in hf.items():
        if name in top:
            out[top[name]] = t
            continue
        parts = name.split(".", 3)  # model, layers, N, suffix
        if len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[3] in layer:
            ours = layer[parts[3]]
            if ours == "attention.wq.weight":
                t = half_to_interleaved(t, cfg.heads)
            elif ours == "attention.wk.weight":
                t = half_to_interleaved(t, cfg.kv_heads)
            out[f"layers.{parts[2]}.{ours}"] = t
        elif name.endswith("rotary_emb.inv_freq"):
            continue  # a buffer some old exports carry; recomputed from rope_theta
        else:
            raise LLMTrainError(f"Hugging Face tensor {name!r} has no counterpart in our Llama model",
                                "only dense LlamaForCausalLM weights can be loaded", path="--init-from-hf")
    if cfg.tie_embeddings and "tok_embeddings.weight" in out:
        out.setdefault("output.weight", out["tok_embeddings.weight"])
    return out


# -- config.json --------------------------------------------------------------------------------

def hf_config(cfg: ModelConfig) -> dict:
    """``config.json`` of a ``LlamaForCausalLM`` equal to our dense model ``cfg`` (fp32)."""
    require_dense(cfg)
    theta = float(cfg.rope_theta)
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden, "intermediate_size": cfg.ffn_hidden,
        "num_hidden_layers": cfg.layers, "num_attention_heads": cfg.heads, "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_dim, "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": float(cfg.norm_eps),
        "rope_theta": theta, "rope_parameters": {"rope_type": "default", "rope_theta": theta},
        "tie_word_embeddings": bool(cfg.tie_embeddings), "hidden_act": "silu", "attention_bias": False,
        "mlp_bias": False, "attention_dropout": 0.0, "initializer_range": 0.02, "pretraining_tp": 1,
        "bos_token_id": None, "eos_token_id": None, "pad_token_id": None, "use_cache": True,
        "torch_dtype": "float32", "dtype": "float32",
    }


def _hf_theta(conf: dict) -> float | None:
    params = conf.get("rope_parameters") or conf.get("rope_scaling") or {}
    if isinstance(params, dict) and params.get("rope_theta") is not None:
        return float(params["rope_theta"])
    return float(conf["rope_theta"]) if conf.get("rope_theta") is not None else None


INT_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size",
            "vocab_size", "head_dim")
FLOAT_KEYS = ("rms_norm_eps", "rope_theta")


def _type_problems(conf: dict, where: str) -> list[Problem]:
    """``config.json`` values of the wrong type (an untrusted file: checked before arithmetic)."""
    problems = []
    for key in INT_KEYS:
        v = conf.get(key)
        if v is not None and (type(v) is not int or v <= 0):
            problems.append(Problem(where, f"config.json {key}={printable(repr(v), 60)} is not a positive integer",
                                    "use a Hugging Face Llama config.json"))
    for params in (conf, conf.get("rope_parameters"), conf.get("rope_scaling")):
        if params is not None and not isinstance(params, dict):
            problems.append(Problem(where, "config.json rope_parameters/rope_scaling is not an object",
                                    "use a Hugging Face Llama config.json"))
            continue
        for key in FLOAT_KEYS:
            v = (params or {}).get(key)
            if v is not None and (type(v) not in (int, float) or not 0 < v < float("inf")):
                problems.append(Problem(where, f"config.json {key}={printable(repr(v), 60)} is not a positive number",
                                        "use a Hugging Face Llama config.json"))
    return problems


def config_problems(conf: dict, cfg: ModelConfig, where: str = "--init-from-hf") -> list[Problem]:
    """Every way an HF ``config.json`` differs from the recipe's model (empty: it loads exactly)."""
    wrong_types = _type_problems(conf, where)
    if wrong_types:
        return wrong_types
    heads = conf.get("num_attention_heads")
    hidden = conf.get("hidden_size")
    fields = [("model.hidden", cfg.hidden, hidden, "hidden_size"),
              ("model.layers", cfg.layers, conf.get("num_hidden_layers"), "num_hidden_layers"),
              ("model.heads", cfg.heads, heads, "num_attention_heads"),
              ("model.kv_heads", cfg.kv_heads, conf.get("num_key_value_heads", heads), "num_key_value_heads"),
              ("model.ffn_hidden", cfg.ffn_hidden, conf.get("intermediate_size"), "intermediate_size"),
              ("model.vocab_size", cfg.vocab_size, conf.get("vocab_size"), "vocab_size"),
              ("model.tie_embeddings", bool(cfg.tie_embeddings), bool(conf.get("tie_word_embeddings", False)),
               "tie_word_embeddings"),
              ("model.norm_eps", float(cfg.norm_eps), conf.get("rms_norm_eps"), "rms_norm_eps"),
              ("model.rope_theta", float(cfg.rope_theta), _hf_theta(conf), "rope_theta")]
    head_dim = conf.get("head_dim") or (hidden // heads if hidden and heads else None)
    problems = []
    for path, ours, theirs, key in fields:
        if theirs is None or (float(ours) != float(theirs) if isinstance(ours, float) else ours != theirs):
            problems.append(Problem(path, f"recipe has {ours}, {where} config.json has {key}={theirs}",
                                    f"set {path}={theirs} with --set, or use matching weights"))
    if head_dim != cfg.head_dim:  # our head_dim is always hidden / heads
        problems.append(Problem("model.heads", f"head_dim {cfg.head_dim} (hidden / heads), {where} config.json "
                                f"has head_dim={head_dim}", "our model needs head_dim = hidden_size / num_attention_heads"))
    if conf.get("model_type", "llama") != "llama":
        problems.append(Problem(where, f"config.json model_type={conf.get('model_type')!r}", "need a Llama model"))
    for key, want in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False)):
        if conf.get(key, want) != want:
            problems.append(Problem(where, f"config.json {key}={conf.get(key)!r} (our model has {key}={want!r})",
                                    "only standard Llama blocks are supported"))
    rope = conf.get("rope_parameters") or conf.get("rope_scaling")
    if isinstance(rope, dict) and rope.get("rope_type", rope.get("type", "default")) != "default":
        problems.append(Problem(where, f"config.json rope type {rope.get('rope_type', rope.get('type'))!r}",
                                "only plain RoPE (rope_type default) is supported"))
    return problems


