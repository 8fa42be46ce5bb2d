"""Hugging Face model families: our state dict <-> theirs, per family (config.json: :mod:`.config_json`).

Families: ``llama`` (Llama 2/3/3.1/3.2), ``mistral``, ``qwen2`` (Qwen2/2.5), ``qwen3``, ``mixtral``,
``qwen3_moe``, ``phi3`` (Phi-3, Phi-3.5, Phi-4, Phi-4-mini), ``granitemoe`` and the others of
:data:`FAMILIES`. One engine model with switches
(:mod:`llmtrain.engine.models.llama`) stands for all of them; this module says, per family, which
switches it has and which HF tensor is which of ours.
No ``transformers`` import: the files are plain safetensors + JSON.

Decisions:

* **RoPE convention.** Our RoPE rotates interleaved pairs ``(2i, 2i+1)`` of each head
  (:mod:`llmtrain.engine.models.rope`); HF rotates half-split pairs ``(i, i + d/2)``
  (``rotate_half``) with the same frequencies. Rather than a second RoPE, everything that lives
  in the rotated head space is permuted per head on export -- the rows of ``wq``/``wk``, the
  q/k biases (Qwen2) and the q/k norm weights (Qwen3, one head): HF row ``j < d/2`` is our row
  ``2j`` and HF row ``d/2 + j`` our row ``2j + 1`` (the classic Meta -> HF permutation), so q·k
  dot products, and thus logits, are unchanged; import applies the inverse. RMSNorm over a head
  is invariant under the permutation of its input, so only its weight moves. ``wv``/``wo`` and
  the v bias need nothing.
* **Names** (under ``model.layers.N.``): ``attention.{wq,wk,wv,wo}`` -> ``self_attn.{q,k,v,o}_proj``
  (``.bias`` for q/k/v with ``qkv_bias``), ``attention.{q,k}_norm`` -> ``self_attn.{q,k}_norm``,
  ``feed_forward.{w1,w3,w2}`` -> ``mlp.{gate,up,down}_proj``, ``attention_norm`` ->
  ``input_layernorm``, ``ffn_norm`` -> ``post_attention_layernorm``; top level
  ``tok_embeddings``/``norm``/``output`` -> ``model.embed_tokens``/``model.norm``/``lm_head``
  (``lm_head`` left out when tied: HF ties it). MoE layers: ``moe.router.weight`` ->
  ``block_sparse_moe.gate.weight`` (Mixtral) / ``mlp.gate.weight`` (Qwen3-MoE); our stacked
  ``moe.experts.{w1,w3,w2}`` [E, ...] are the per-expert tensors transformers writes on disk
  (``block_sparse_moe.experts.{e}.{w1,w3,w2}.weight``, ``mlp.experts.{e}.{gate,up,down}_proj.weight``).
  Dense layers of an MoE model (Qwen3-MoE ``mlp_only_layers``) use the dense names.
* **Fused projections** (Phi-3, ``Family.fused``): HF keeps q, k and v as row blocks of one
  ``self_attn.qkv_proj.weight`` ``[(heads + 2 kv_heads) * head_dim, hidden]`` (q, then k, then v)
  and gate and up as the two halves of ``mlp.gate_up_proj.weight`` ``[2 ffn, hidden]`` (gate
  first: transformers' ``chunk(2)``). Our model keeps its separate ``wq``/``wk``/``wv`` and
  ``w1``/``w3`` (TP, FSDP, LoRA and the planner see one model for every family): each is a row
  range of the fused tensor (``Source.rows``). The q/k blocks start at whole heads, so the RoPE
  permutation applies within the block as for separate tensors. Export concatenates the blocks
  back in row order (:func:`hf_tensors`).
* **Gemma 3** (``gemma3_text``, ``model.post_norms``): ``ffn_norm`` -> ``pre_feedforward_layernorm``,
  ``attention_post_norm`` -> ``post_attention_layernorm`` (the attention output's norm, not the
  MLP's input norm as in Llama), ``ffn_post_norm`` -> ``post_feedforward_layernorm``. Its norm
  weights are stored as they are (our ``OffsetRMSNorm`` is the same ``1 + w`` form).
* **GraniteMoE** (``granitemoe``, ``Family.fused_experts``): every layer's experts are two 3D tensors on
  disk, ``block_sparse_moe.input_linear.weight`` ``[E, 2 F, H]`` (per expert the gate rows, then the up
  rows: transformers' ``chunk(2)``) and ``output_linear.weight`` ``[E, H, F]`` (our ``w2`` as it is); our
  ``w1`` / ``w3`` are the two row halves along dim 1 (``Source.rows_dim``), the router is
  ``block_sparse_moe.router.layer.weight``. Its routing is Mixtral's (softmax over the top-k logits).
* **OLMo 2** (``olmo2``, ``model.pre_norms`` false): no input norms; ``attention_post_norm`` ->
  ``post_attention_layernorm``, ``ffn_post_norm`` -> ``post_feedforward_layernorm``; its q/k norms span
  all heads (``[heads x head_dim]``), permuted per head like wq's rows.
* **What no family has is refused**, naming the recipe field (:func:`family_problems`): shared
  experts, the sigmoid router, bias balancing (``expert_bias``), a dense-only family with experts,
  Mixtral without renormalized top-k or with dense layers, q/k norm outside Qwen3, q/k/v biases
  outside Qwen2 (HF's ``attention_bias`` also puts a bias on ``o_proj``, which we do not have).
* **Loading into a sharded model** is :mod:`.load`; this module works on full tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from llmtrain.errors import LLMTrainError
from llmtrain.recipe.schema import ModelConfig

if TYPE_CHECKING:  # torch is imported by the functions that read or write tensors, so that
    import torch   # `llmtrain launch --init-from-hf` can check a directory without importing it


from llmtrain.recipe.hf_families import (  # noqa: F401 - the family facts live with the recipe (torch-free)
    FAMILIES, SUPPORTED, Family, family_of, family_problems, require_dense, require_hf_compatible,
)

# our per-layer suffix -> HF per-layer suffix (under model.layers.N.), attention and dense MLP
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
BIAS_NAMES = {"attention.wq.bias": "self_attn.q_proj.bias", "attention.wk.bias": "self_attn.k_proj.bias",
              "attention.wv.bias": "self_attn.v_proj.bias"}
QK_NORM_NAMES = {"attention.q_norm.weight": "self_attn.q_norm.weight", "attention.k_norm.weight": "self_attn.k_norm.weight"}
POST_NORM_NAMES = {"ffn_norm.weight": "pre_feedforward_layernorm.weight",
                   "attention_post_norm.weight": "post_attention_layernorm.weight",
                   "ffn_post_norm.weight": "post_feedforward_layernorm.weight"}
ROTATED = ("attention.wq.weight", "attention.wk.weight", "attention.wq.bias", "attention.wk.bias",
           "attention.q_norm.weight", "attention.k_norm.weight")
FUSED_NAMES = {"attention.wq.weight": "self_attn.qkv_proj.weight", "attention.wk.weight": "self_attn.qkv_proj.weight",
               "attention.wv.weight": "self_attn.qkv_proj.weight", "feed_forward.w1.weight": "mlp.gate_up_proj.weight",
               "feed_forward.w3.weight": "mlp.gate_up_proj.weight"}
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

    * ``rotary``: with ``head_dim``, the rows of each head that RoPE rotates (partial rotary,
      ``model.rotary_dim``): only they are permuted, the others pass; None: all ``head_dim``.
    * ``rows``: ``(start, stop, total)``: our tensor is rows ``start:stop`` of the one HF tensor
      (of ``total`` rows), a block of a fused projection (Phi-3's ``qkv_proj``, ``gate_up_proj``).
    * ``rows_dim``: the dim those rows run along: 0, or 1 for every expert's block of a stacked
      fused tensor (GraniteMoE's ``input_linear`` ``[E, 2 F, H]``: gate rows, then up rows).

    Readers that want only a slice of our tensor: dim 0 of ours maps to experts (stacked) or to
    rows of the HF tensor (offset by ``rows[0]``; a row slice needs whole heads when
    ``head_dim`` is set: read the covering heads, permute, cut); every other dim maps 1:1.
    """

    hf: tuple[str, ...]
    stacked: bool = False
    head_dim: int | None = None
    rows: tuple[int, int, int] | None = None
    rotary: int | None = None  # partial rotary: only the first ``rotary`` rows of each head are permuted
    rows_dim: int = 0  # the dim ``rows`` cut: 1 for GraniteMoE's experts (gate / up halves per expert)


def tensor_map(cfg: ModelConfig) -> dict[str, Source]:
    """Every key of ``Transformer(cfg).state_dict()`` (no ``model.`` prefix) -> its :class:`Source`.

    ``output.weight`` is absent when embeddings are tied (HF stores only the embedding)."""
    require_hf_compatible(cfg)
    f = family_of(cfg)
    out: dict[str, Source] = {}
    for ours, theirs in TOP_NAMES.items():
        if ours == "output.weight" and cfg.tie_embeddings:
            continue
        out[ours] = Source((theirs,))
    for i in range(cfg.layers):
        p, hp = f"layers.{i}.", f"model.layers.{i}."
        names = dict(LAYER_NAMES)
        if cfg.is_moe_layer(i):
            for k in ("feed_forward.w1.weight", "feed_forward.w3.weight", "feed_forward.w2.weight"):
                del names[k]
        if cfg.qkv_bias:
            names.update(BIAS_NAMES)
        if cfg.qk_norm:
            names.update(QK_NORM_NAMES)
        if cfg.post_norms:  # Gemma: post_attention_layernorm is the attention's post norm, the MLP has its own pair
            names.update(POST_NORM_NAMES)
        if not cfg.pre_norms:  # OLMo 2: only the post norms (post_attention_layernorm, post_feedforward_layernorm)
            for name in ("attention_norm.weight", "ffn_norm.weight"):
                names.pop(name, None)
        blocks = fused_rows(cfg) if f.fused else {}
        for ours, theirs in names.items():
            theirs = FUSED_NAMES.get(ours, theirs) if f.fused else theirs
            rotated = ours in ROTATED
            out[p + ours] = Source((hp + theirs,), head_dim=cfg.head_dim if rotated else None, rows=blocks.get(ours),
                                   rotary=cfg.rope_dim if rotated and cfg.rope_dim != cfg.head_dim else None)
        if cfg.is_moe_layer(i) and f.fused_experts:  # GraniteMoE: every expert's w1 / w3 in one 3D tensor
            moe, e2 = f"{hp}{f.moe_prefix}.", 2 * cfg.expert_ffn
            out[p + "moe.router.weight"] = Source((moe + "router.layer.weight",))
            out[p + "moe.experts.w1"] = Source((moe + "input_linear.weight",), rows=(0, e2 // 2, e2), rows_dim=1)
            out[p + "moe.experts.w3"] = Source((moe + "input_linear.weight",), rows=(e2 // 2, e2, e2), rows_dim=1)
            out[p + "moe.experts.w2"] = Source((moe + "output_linear.weight",))
        elif cfg.is_moe_layer(i):
            moe = f"{hp}{f.moe_prefix}."
            out[p + "moe.router.weight"] = Source((moe + "gate.weight",))
            for ours, theirs in zip(("w1", "w3", "w2"), f.expert_names):
                out[f"{p}moe.experts.{ours}"] = Source(
                    tuple(f"{moe}experts.{e}.{theirs}.weight" for e in range(cfg.moe.num_experts)), stacked=True)
    return out


def fused_rows(cfg: ModelConfig) -> dict[str, tuple[int, int, int]]:
    """Our per-layer suffix -> ``(start, stop, total)`` rows of the fused HF tensor (``Family.fused``)."""
    q, kv, ffn = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim, cfg.ffn_hidden
    qkv = q + 2 * kv
    return {"attention.wq.weight": (0, q, qkv), "attention.wk.weight": (q, q + kv, qkv),
            "attention.wv.weight": (q + kv, qkv, qkv), "feed_forward.w1.weight": (0, ffn, 2 * ffn),
            "feed_forward.w3.weight": (ffn, 2 * ffn, 2 * ffn)}


def hf_shape(src: Source, ours: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of each HF tensor of ``src``, given our tensor's shape."""
    if src.rows is not None:
        shape = list(ours)
        shape[src.rows_dim] = src.rows[2]
        return tuple(shape)
    return tuple(ours[1:]) if src.stacked else tuple(ours)


def to_ours(src: Source, tensors: list[torch.Tensor]) -> torch.Tensor:
    """Our tensor from the HF tensors ``src.hf`` names (in that order; a fused one whole)."""
    import torch

    if src.rows is not None:
        start, stop, total = src.rows
        t, d = tensors[0], src.rows_dim
        if t.dim() <= d or t.shape[d] != total:
            raise LLMTrainError(f"{src.hf[0]}: shape {list(t.shape)} does not have the {total} rows of the fused "
                                "projection", "the weights do not match the model's heads, kv_heads, head_dim and "
                                "ffn_hidden (expert_ffn_hidden)", path="model")
        tensors = [t.narrow(d, start, stop - start)]
    if src.head_dim is not None:
        for name, t in zip(src.hf, tensors):
            if t.dim() == 0 or t.shape[0] % src.head_dim:
                raise LLMTrainError(f"{name}: shape {list(t.shape)} is not a whole number of heads of {src.head_dim}",
                                    "the weights do not match the model's head_dim", path="model.head_dim")
        tensors = [half_to_interleaved(t, t.shape[0] // src.head_dim, src.rotary) for t in tensors]
    if src.stacked:
        shapes = {tuple(t.shape) for t in tensors}
        if len(shapes) > 1:
            raise LLMTrainError(f"{src.hf[0]}: experts of different shapes {sorted(shapes)[:2]}",
                                "the safetensors are damaged or of another model", path="model.moe")
        return torch.stack(tensors)
    return tensors[0]


def to_hf(src: Source, ours: torch.Tensor) -> list[torch.Tensor]:
    """The HF tensors (in ``src.hf`` order) of our tensor (new, contiguous tensors); with ``src.rows``,
    its block of the fused tensor (:func:`hf_tensors` joins the blocks)."""
    parts = list(ours.detach().unbind(0)) if src.stacked else [ours.detach()]
    if src.head_dim is not None:
        return [interleaved_to_half(t, t.shape[0] // src.head_dim, src.rotary) for t in parts]
    return [t.clone().contiguous() for t in parts]


# -- the RoPE row permutation ------------------------------------------------------------------

def interleaved_to_half(w: torch.Tensor, n_heads: int, rotary: int | None = None) -> torch.Tensor:
    """Rows of a q/k projection ``[n_heads * d, ...]`` (or a bias / norm weight ``[n_heads * d]``):
    per head ``[0, 2, 4, ..., 1, 3, 5, ...]`` over its first ``rotary`` rows (default all ``d``),
    the rest unchanged (partial rotary)."""
    d = w.shape[0] // n_heads
    r = rotary or d
    heads = w.reshape(n_heads, d, -1)
    turned = heads[:, :r].reshape(n_heads, r // 2, 2, -1).transpose(1, 2).reshape(n_heads, r, -1)
    return _join_rest(turned, heads[:, r:]).reshape(w.shape).contiguous()


def half_to_interleaved(w: torch.Tensor, n_heads: int, rotary: int | None = None) -> torch.Tensor:
    """The inverse of :func:`interleaved_to_half`."""
    d = w.shape[0] // n_heads
    r = rotary or d
    heads = w.reshape(n_heads, d, -1)
    turned = heads[:, :r].reshape(n_heads, 2, r // 2, -1).transpose(1, 2).reshape(n_heads, r, -1)
    return _join_rest(turned, heads[:, r:]).reshape(w.shape).contiguous()


def _join_rest(turned: torch.Tensor, rest: torch.Tensor) -> torch.Tensor:
    """``turned`` with the pass-through rows ``rest`` after it (per head, dim 1); ``turned`` when none."""
    import torch

    return turned if rest.shape[1] == 0 else torch.cat((turned, rest), dim=1)


# -- whole state dicts (via the tensor map) ------------------------------------------------------

def hf_tensors(pairs) -> dict[str, torch.Tensor]:
    """HF name -> tensor for ``(Source, our tensor)`` pairs; the blocks of a fused tensor are
    joined in row order (every block of it must be among the pairs)."""
    import torch

    out: dict[str, torch.Tensor] = {}
    blocks: dict[str, list] = {}
    for src, ours in pairs:
        if src.rows is None:
            out.update(zip(src.hf, to_hf(src, ours)))
        else:
            blocks.setdefault(src.hf[0], []).append((src.rows, to_hf(src, ours)[0], src.rows_dim))
    for name, parts in blocks.items():
        parts.sort(key=lambda p: p[0][0])
        edges = [0] + [r[1] for r, _, _ in parts]
        if [r[0] for r, _, _ in parts] != edges[:-1] or edges[-1] != parts[0][0][2]:  # never from tensor_map
            raise LLMTrainError(f"{name}: blocks {[r for r, _, _ in parts]} do not tile the fused tensor")
        out[name] = torch.cat([t for _, t, _ in parts], dim=parts[0][2])
    return out


def to_hf_state(ours: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Our full (unsharded) model state dict -> the family's ``*ForCausalLM`` state dict (new tensors,
    per-expert names as transformers writes them on disk)."""
    sources = tensor_map(cfg)
    unknown = sorted(k for k in ours if k not in sources and not (k == "output.weight" and cfg.tie_embeddings))
    if unknown:
        raise LLMTrainError(f"checkpoint tensor {unknown[0]!r} has no Hugging Face {cfg.hf_family} counterpart"
                            + (f" (+{len(unknown) - 1} more)" if len(unknown) > 1 else ""),
                            "the checkpoint's model does not match its recipe.model", path="model")
    return hf_tensors((src, ours[name]) for name, src in sources.items() if name in ours)


def from_hf_state(hf: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The family's ``*ForCausalLM`` state dict (on-disk names) -> ours (``output.weight`` = the
    embedding when tied). Raises on an HF tensor we have no place for and on a missing one."""
    sources = tensor_map(cfg)
    where = {name: ours for ours, src in sources.items() for name in src.hf}
    unknown = sorted(k for k in hf if k not in where and not k.endswith("rotary_emb.inv_freq")
                     and not (k == "lm_head.weight" and cfg.tie_embeddings))
    if unknown:  # inv_freq: a buffer some old exports carry (recomputed); a tied lm_head copy is redundant
        raise LLMTrainError(f"Hugging Face tensor {unknown[0]!r} has no counterpart in our {cfg.hf_family} model"
                            + (f" (+{len(unknown) - 1} more)" if len(unknown) > 1 else ""),
                            "the weights are not of the recipe's model (check model.family and the moe settings)",
                            path="checkpoint.init_from_hf")
    missing = sorted({n for src in sources.values() for n in src.hf if n not in hf})
    if missing:
        raise LLMTrainError(f"no Hugging Face tensor {missing[0]!r}" + (f" (+{len(missing) - 1} more)" if len(missing) > 1 else ""),
                            "the safetensors do not hold the whole model", path="checkpoint.init_from_hf")
    out = {ours: to_ours(src, [hf[n] for n in src.hf]) for ours, src in sources.items()}
    if cfg.tie_embeddings:
        out["output.weight"] = out["tok_embeddings.weight"]
    return out


CONFIG_NAMES = ("config_problems", "hf_config", "model_from_hf_config", "unsupported_problems")


def __getattr__(name: str):
    """config.json functions live in :mod:`.config_json` (which imports this module); they are
    re-exported here lazily so that ``from llmtrain.engine.hf.families import hf_config`` keeps working."""
    if name in CONFIG_NAMES:
        from llmtrain.recipe import hf_config

        return getattr(hf_config, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
