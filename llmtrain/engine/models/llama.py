"""Llama-style decoder (dense or MoE) built from a :class:`~llmtrain.recipe.schema.ModelConfig`.

Pre-norm blocks ``h = x + attn(norm(x)); out = h + mlp(norm(h))`` with RMSNorm, RoPE
(:mod:`.rope`, interleaved pairs, optional Llama 3.1 frequency scaling), grouped-query attention
and SwiGLU MLPs; block ``i`` uses the MoE block (:mod:`.moe`) when ``cfg.is_moe_layer(i)``
(``first_dense_layers``, ``sparse_step``, ``dense_layers``), else a dense MLP of ``ffn_hidden``.
The parameter count equals :func:`llmtrain.plan.params.count_params`.

One definition covers the Hugging Face families (llama, mistral, qwen2, qwen3, mixtral,
qwen3_moe, phi3: its fused projections are a matter of the tensor map) through switches rather than per-family copies, so every parallel layout works for
every family by construction:

* ``qkv_bias`` (Qwen2/2.5): biases on ``wq``/``wk``/``wv`` only (``wo`` and the MLPs have none).
* ``qk_norm`` (Qwen3): ``attention.q_norm`` / ``attention.k_norm``, RMSNorm over ``head_dim``
  (eps ``norm_eps``) applied to every query / key head after the projection and before RoPE.
  The weight is shared by all heads, so it works unchanged on TP shards (heads / tp per rank;
  the TP plan makes it a replicated DTensor so its gradient is summed over the heads of all
  ranks) and under context parallelism (it acts before ``attn_fn``).
* ``head_dim`` may differ from ``hidden / heads`` (Qwen3): q/k/v widths are ``heads * head_dim``
  and ``kv_heads * head_dim``, ``wo`` takes ``heads * head_dim``.
* ``sliding_window`` (Mistral v0.1, Phi-3-mini-4k, Qwen2 with ``use_sliding_window``): query ``i``
  sees keys ``i - window < j <= i``, transformers' rule (``masking_utils.sliding_window_overlay``).
  Where the sequence is longer than the window, :meth:`Transformer.forward` builds one additive
  band mask (:func:`attention_bias`) per forward, shared by every layer (without CP a windowed layer runs
  only the score boxes it sees, on views of it: :mod:`.window_attention`); under Ulysses context
  parallelism it spans the whole sequence, which Ulysses' attention holds, under all-gather CP this
  rank's rows of it, under ring CP the same rows with the keys in ring order (:mod:`.masks`).
* ``nope_layers`` (SmolLM3): layers whose attention applies no RoPE to q and k.
* ``pre_norms`` false (OLMo 2): no norm on the branch inputs (``attention_norm`` / ``ffn_norm`` do not
  exist), only the post norms on their outputs; ``qk_norm_width: all``: q's norm over all its heads
  (weight ``heads x head_dim``) and k's over all of k's, before the split into heads.
* ``embed_multiplier`` / ``residual_multiplier`` / ``logit_divisor`` (Granite's muP scalars): the
  embeddings times a constant, each branch's output times a constant before its residual add, the
  logits divided by a constant (applied to the final norm's output, the head's input, so the
  chunked loss sees it); with ``attention_scale`` as the softmax scale.
* ``attention_softcap`` / ``logit_softcap`` (Gemma 2): attention scores and final logits bounded by
  ``cap * tanh(x / cap)``; the scores need our own kernel (:mod:`.softcap`), which Ulysses and
  all-gather context parallelism run after their exchange and ring CP as its blocks.

Names are a contract with the parallel code (TP plans, PP splitting, FSDP wrapping,
checkpoints, init), so they are fixed and layout-independent:

* ``tok_embeddings``, ``layers["<global layer index>"]``, ``norm``, ``output``;
* per block ``attention_norm``, ``attention.{wq,wk,wv,wo}``, ``ffn_norm`` and either
  ``feed_forward.{w1,w3,w2}`` (dense) or ``moe`` (router, w1/w2/w3, shared, buffers) — only
  the one in use exists, test with ``getattr(block, "moe", None)``.

Pipeline parallelism deletes ``layers`` entries and sets ``tok_embeddings`` / ``norm`` /
``output`` to None; :meth:`Transformer.forward` skips whatever is None, so a stage takes
token ids or hidden states and returns hidden states or logits. ``layers`` is a ModuleDict
keyed by the global index (not a ModuleList) so that a stage's parameter names, and thus
checkpoints, do not depend on the pipeline split.

Attention derives the number of *local* heads from the projection outputs
(``view(b, s, -1, head_dim)``), so column-wise tensor parallelism of wq/wk/wv (heads / tp
per rank) needs no change here. KV heads are repeated ``local_q / local_kv`` times
(``repeat_interleave``: query head ``j`` uses KV head ``j // n_rep``, which also holds on
each TP shard) before the core attention ``self.attn_fn(q, k, v)`` ([b, heads, s, head_dim],
causal, equal head counts). ``attn_fn`` is a plain attribute so context parallelism can swap
in ring/Ulysses/all-gather attention. An ``attn_fn`` with a true ``takes_kv_heads`` attribute
(the ring and all-gather CP attention, ``engine/parallel/context.py``) receives K/V with their local
``kv_heads`` only and repeats them itself after its exchange, so context parallelism moves
``heads / kv_heads`` times fewer K/V bytes (as Megatron-Core and Llama 3 do, Dubey et al. 2024,
arXiv:2407.21783, sec. 3.3.2); the result, and the gradients, are the same.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from llmtrain.engine.models.masks import (attention_bias, forward_masks, longest_sample, masked_sdpa,  # noqa: F401
                                          packed_mask, ring_keys, window_mask, zigzag_rows)  # (re-exported: tests)
from llmtrain.engine.models.moe import MoE, FeedForward
from llmtrain.engine.models.norm import RMSNorm, SplitRMSNorm, make_norm  # noqa: F401 (RMSNorm re-exported)
from llmtrain.engine.models.rope import apply_rope, rope_cos_sin
from llmtrain.engine.models.softcap import softcap_attention, softcap_logits
from llmtrain.engine.models.window_attention import local_window_attention, runs_local
from llmtrain.recipe.schema import ModelConfig


def gqa_native(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether SDPA's flash kernel takes K/V with fewer heads than q (``enable_gqa``) on these inputs.

    On CPU torch's flash kernel does (torch >= 2.5; checked on 2.13: it saves K/V at their own
    ``kv_heads``, outputs equal to repeating). On CUDA only the flash backend honours ``enable_gqa``:
    any other backend (fp32, head_dim > 256, pre-Ampere, flash disabled) would fall back to the math
    kernel, which materializes the scores, so the caller repeats K/V instead wherever torch's own
    flash-eligibility predicate says no."""
    if q.device.type == "cpu":
        return True
    if q.device.type != "cuda":
        return False
    if torch.compiler.is_compiling():  # no graph break per block: FlashAttention's own limits (16-bit, head_dim
        return q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= 256  # <= 256; the catalog's GPUs are sm80+)
    from torch.backends.cuda import SDPAParams, can_use_flash_attention  # noqa: PLC0415 (CUDA only)

    try:
        return bool(can_use_flash_attention(SDPAParams(q, k, v, None, 0.0, True, True), False))
    except (RuntimeError, TypeError):  # a torch whose SDPAParams has no enable_gqa field: repeat
        return False


def causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Default core attention: causal SDPA on [b, heads, s, head_dim] (flash/memory-efficient kernels).

    K and V may carry fewer heads (GQA; ``takes_kv_heads``): where the flash kernel takes them as
    they are (:func:`gqa_native`) it saves K/V at ``kv_heads`` for backward and no repeated copy is
    written or summed back, otherwise they are repeated to the query heads here (query head ``j``
    uses KV head ``j // n_rep``, as ``enable_gqa`` does)."""
    if k.shape[1] != q.shape[1]:
        if gqa_native(q, k, v):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        n_rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


causal_sdpa.takes_kv_heads = True


class Attention(nn.Module):
    """Grouped-query self-attention with RoPE; heads per rank follow the projection widths."""

    def __init__(self, cfg: ModelConfig, rope: bool = True):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.rope = rope  # False: a NoPE layer (model.nope_layers, SmolLM3)
        bias = cfg.qkv_bias
        self.wq = nn.Linear(cfg.hidden, cfg.heads * self.head_dim, bias=bias)
        self.wk = nn.Linear(cfg.hidden, cfg.kv_heads * self.head_dim, bias=bias)
        self.wv = nn.Linear(cfg.hidden, cfg.kv_heads * self.head_dim, bias=bias)
        self.wo = nn.Linear(cfg.heads * self.head_dim, cfg.hidden, bias=False)
        self.qk_norm_all = cfg.qk_norm and cfg.qk_norm_width == "all"  # OLMo 2: over all heads, before the split
        if cfg.qk_norm and self.qk_norm_all:  # over all heads: TP splits them (engine/models/norm.py SplitRMSNorm)
            self.q_norm = SplitRMSNorm(cfg.heads * self.head_dim, eps=cfg.norm_eps)
            self.k_norm = SplitRMSNorm(cfg.kv_heads * self.head_dim, eps=cfg.norm_eps)
        elif cfg.qk_norm:  # only existing modules get parameters (names are a checkpoint contract)
            self.q_norm = make_norm(self.head_dim, cfg.norm_eps, cfg.norm_offset)
            self.k_norm = make_norm(self.head_dim, cfg.norm_eps, cfg.norm_offset)
        # model.attention_scale (Gemma 3's query_pre_attn_scalar ** -0.5): folded into q after RoPE, so
        # every attention path (SDPA, the CP kernel blocks) keeps its default 1 / sqrt(head_dim)
        self.q_scale = None if cfg.attention_scale is None else cfg.attention_scale * self.head_dim**0.5
        self.softcap = cfg.attention_softcap  # Gemma 2: scores capped, our kernel instead of SDPA (models/softcap.py)
        self.window = None  # a windowed layer's (set by its block): without CP, the boxes it sees (window_attention.py)
        self.attn_fn = causal_sdpa
        self.rope_fn = apply_rope  # a plain attribute like attn_fn (the benchmarks swap in the old form)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        b, s, _ = x.shape
        q, k = self.wq(x), self.wk(x)
        if self.qk_norm_all:  # OLMo 2: over all of q's and all of k's features (under TP: SplitRMSNorm)
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.view(b, s, -1, self.head_dim), k.view(b, s, -1, self.head_dim)
        if hasattr(self, "q_norm") and not self.qk_norm_all:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope:
            q, k = self.rope_fn(q, cos, sin), self.rope_fn(k, cos, sin)
        if self.q_scale is not None and self.q_scale != 1.0:
            q = q * self.q_scale
        v = self.wv(x).view(b, s, -1, self.head_dim)
        n_rep = q.shape[2] // k.shape[2]
        # K/V with their own heads where the core attention takes them: causal SDPA's GQA kernel and ring CP
        # without a mask or the soft-cap, Ulysses and all-gather CP (takes_mask) with either; repeated otherwise
        takes_kv = getattr(self.attn_fn, "takes_kv_heads", False) and (
            mask is None and self.softcap is None or getattr(self.attn_fn, "takes_mask", False))
        if n_rep > 1 and not takes_kv:
            k = k.repeat_interleave(n_rep, dim=2)
            v = v.repeat_interleave(n_rep, dim=2)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if self.softcap is not None:
            out = self._softcapped(q, k, v, mask)
        elif mask is None:
            out = self.attn_fn(q, k, v)
        elif self.attn_fn is causal_sdpa:  # a window: only its boxes where the row's chunks fit (window_attention.py)
            out = (local_window_attention(q, k, v, mask, self.window) if runs_local(q.shape[2], self.window)
                   else masked_sdpa(q, k, v, mask))
        elif getattr(self.attn_fn, "takes_mask", False):  # Ulysses (the whole row), all-gather / ring CP (its rows)
            out = self.attn_fn(q, k, v, mask)
        else:
            raise ValueError("an attention mask (data.packing, a sliding window) cannot run with this attn_fn")
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))

    def _softcapped(self, q, k, v, mask):
        """Soft-capped attention (``model.attention_softcap``): our kernel, alone, inside Ulysses' or
        all-gather CP's exchange, or as ring CP's blocks (``takes_softcap``)."""
        if self.attn_fn is causal_sdpa:
            if mask is not None and runs_local(q.shape[2], self.window):  # a window: its boxes' soft-capped calls
                return local_window_attention(q, k, v, mask, self.window, self.softcap)
            return softcap_attention(q, k, v, mask, self.softcap)
        if getattr(self.attn_fn, "takes_softcap", False):
            return self.attn_fn(q, k, v, mask, softcap=self.softcap)
        raise ValueError("attention soft-capping (model.attention_softcap) cannot run with this attn_fn")


class TransformerBlock(nn.Module):
    """Pre-norm block: attention, then a dense gated MLP (``feed_forward``) or an MoE (``moe``).

    ``post_norms`` (Gemma 2/3) adds ``attention_post_norm`` and ``ffn_post_norm`` on the two branch
    outputs before their residual adds: ``h = x + post(attn(norm(x)))``. ``windowed``: whether this
    block's attention uses the sliding window (``cfg.is_windowed``); the model hands each block its
    mask and RoPE tables accordingly."""

    def __init__(self, layer_id: int, cfg: ModelConfig):
        super().__init__()
        self.layer_id = layer_id
        self.windowed = cfg.is_windowed(layer_id)
        self.residual_multiplier = cfg.residual_multiplier  # Granite: each branch scaled before its residual add
        if cfg.pre_norms:  # OLMo 2 has none (only the post norms)
            self.attention_norm = make_norm(cfg.hidden, cfg.norm_eps, cfg.norm_offset)
        self.attention = Attention(cfg, rope=cfg.uses_rope(layer_id))
        self.attention.window = cfg.sliding_window if self.windowed else None  # its boxes only (window_attention.py)
        if cfg.pre_norms:
            self.ffn_norm = make_norm(cfg.hidden, cfg.norm_eps, cfg.norm_offset)
        if cfg.post_norms:
            self.attention_post_norm = make_norm(cfg.hidden, cfg.norm_eps, cfg.norm_offset)
            self.ffn_post_norm = make_norm(cfg.hidden, cfg.norm_eps, cfg.norm_offset)
        if cfg.is_moe_layer(layer_id):
            self.moe = MoE(cfg)
        else:
            self.feed_forward = FeedForward(cfg.hidden, cfg.ffn_hidden, cfg.mlp_activation)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        pre = getattr(self, "attention_norm", None)
        a = self.attention(x if pre is None else pre(x), cos, sin, mask=mask)  # kwarg: TP input layouts list 3 args
        post = getattr(self, "attention_post_norm", None)
        a = a if post is None else post(a)
        h = x + (a if self.residual_multiplier is None else a * self.residual_multiplier)
        mlp = self.moe if hasattr(self, "moe") else self.feed_forward
        pre = getattr(self, "ffn_norm", None)
        m = mlp(h if pre is None else pre(h))
        post = getattr(self, "ffn_post_norm", None)
        m = m if post is None else post(m)
        return h + (m if self.residual_multiplier is None else m * self.residual_multiplier)


class Transformer(nn.Module):
    """The decoder: ``tok_embeddings`` -> ``layers`` -> ``norm`` -> ``output`` (each may be None)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.head_dim = cfg.head_dim
        self.rope_theta = cfg.rope_theta
        self.rope_scaling = cfg.rope_scaling
        self.tie_embeddings = cfg.tie_embeddings
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(i, cfg) for i in range(cfg.layers)})
        self.norm: nn.Module | None = make_norm(cfg.hidden, cfg.norm_eps, cfg.norm_offset)
        self.output: nn.Linear | None = nn.Linear(cfg.hidden, cfg.vocab_size, bias=False)
        # Positions used when forward() gets none: set by the trainer for pipeline stages that
        # receive (possibly sequence-sharded) hidden states and for context parallelism.
        self.positions: torch.Tensor | None = None
        # Context parallelism sets ``seq_shards`` to cp: a row is then cp times the local tokens, which
        # the sliding window (one band mask per forward, shared by the layers; Ulysses' attention sees
        # the whole row) and longrope's regime (by the row's length, rope.py) need.
        self.window: int | None = cfg.sliding_window
        self.seq_shards = 1
        # All-gather and ring CP set ``cp_rows`` to (cp, cp rank): masks (packed rows, a window, the soft-capped
        # kernel's causal one) then span this rank's zigzag rows only; ring CP sets ``cp_ring_keys`` too: the
        # masks' columns in ring order (models/masks.py ``ring_keys``)
        self.cp_rows: tuple[int, int] | None = None
        self.cp_ring_keys = False
        # Return the final norm's output instead of logits (the loss applies ``output`` itself,
        # chunked: engine/parallel/loss.py). The default of forward's ``return_hidden``; the trainer
        # sets it on a pipeline's last stage, whose forward the schedule calls without our kwargs.
        self.return_hidden = False
        self.tie_weights()

    def tie_weights(self) -> None:
        """Make ``output.weight`` the embedding matrix when ``tie_embeddings`` (and both exist)."""
        if self.tie_embeddings and self.tok_embeddings is not None and self.output is not None:
            self.output.weight = self.tok_embeddings.weight

    def _apply(self, fn, recurse=True):
        # Module._apply (used by to_empty, to, cuda, ...) may replace each Parameter with a new
        # object, which silently unties shared weights (it does for meta -> cpu to_empty).
        # Re-tie afterwards; this runs even when an outer wrapper's _apply recurses into us.
        result = super()._apply(fn, recurse)
        self.tie_weights()
        return result

    def forward(self, tokens_or_hidden: torch.Tensor, positions: torch.Tensor | None = None,
                segments: torch.Tensor | None = None, return_hidden: bool | None = None) -> torch.Tensor:
        """Token ids [b, s] (or hidden states [b, s, hidden] without embeddings) -> logits or hidden.

        ``return_hidden`` (default: the ``return_hidden`` attribute, False): stop after the final
        norm and return its output [b, s, hidden] for the chunked loss, which applies ``output``
        one token chunk at a time. A keyword of forward rather than a separate method so that the
        call still goes through ``forward``, where FSDP2 gathers the parameters; ``model(tokens)``
        keeps returning logits for eval, interop and tests.

        ``positions``: global positions [s] or [b, s] (default ``arange(s)``), used by RoPE;
        context parallelism passes the positions of the local, possibly non-contiguous chunks,
        packed rows their per-sample positions [b, s] (restarting at 0 for each sample).
        ``segments`` [b, s]: the sample number of each token of a packed row; attention is then
        block-diagonal causal (:func:`packed_mask`), and banded where a sliding window is shorter
        than the sequence (:func:`window_mask`). Under (Ulysses) context parallelism ``positions``
        are this rank's shard and ``segments`` the whole row's, which the mask spans as Ulysses'
        attention does. Pipeline stages get both per microbatch
        as keyword arguments of the schedule (torch passes a step's kwargs to every stage).
        """
        if positions is None:
            positions = self.positions
        if positions is None:  # from the input ids (with sequence parallelism h is a sequence shard)
            positions = torch.arange(tokens_or_hidden.shape[1], device=tokens_or_hidden.device)
        h = tokens_or_hidden if self.tok_embeddings is None else self.tok_embeddings(tokens_or_hidden)
        if self.tok_embeddings is not None and self.cfg.embed_scale:  # Gemma: sqrt(hidden) in the embedding's dtype
            h = h * torch.tensor(self.cfg.hidden**0.5, dtype=torch.float32).to(h.dtype).item()
        if self.tok_embeddings is not None and self.cfg.embed_multiplier is not None:  # Granite: a plain multiplier
            h = h * self.cfg.embed_multiplier
        if torch.is_autocast_enabled(h.device.type) and h.dtype != torch.get_autocast_dtype(h.device.type):
            # zero 0/1 in bf16 run under autocast with fp32 parameters: the embedding returns fp32,
            # and every residual add would then stay fp32. Cast once here so the residual stream,
            # the norms' outputs and the pipeline's sends are bf16, as under FSDP's bf16 parameters
            # (and in Megatron-LM and torchtitan): half the bytes of every block input, one bf16
            # input saved for q/k/v (w1/w3) instead of autocast's cast per projection.
            h = h.to(torch.get_autocast_dtype(h.device.type))
        full = positions.shape[-1] * self.seq_shards  # tokens of a whole row
        longest = None  # longrope's regime: without CP from the positions (rope.py)
        if self.seq_shards > 1:  # CP: a rank holds a shard of each row; packed rows (Ulysses) their whole sample ids
            longest = full if segments is None else longest_sample(segments)
        rope = rope_cos_sin(positions, self.cfg.rope_dim, self.rope_theta, self.rope_scaling, longest=longest)
        windowed = any(layer.windowed for layer in self.layers.values())  # this stage's layers
        local_rope = rope  # the windowed layers' (model.local_rope_theta: own base, no scaling)
        if self.cfg.local_rope_theta is not None and windowed:
            local_rope = rope_cos_sin(positions, self.cfg.rope_dim, self.cfg.local_rope_theta, None)
        window = self.window if self.window is not None and full > self.window and windowed else None
        rows = keys = None  # all-gather / ring CP: masks of this rank's zigzag rows against the whole row (masks.py)
        if self.cp_rows is not None and (segments is not None or window is not None
                                       or self.cfg.attention_softcap is not None):
            rows = zigzag_rows(full, *self.cp_rows, device=h.device)
            keys = ring_keys(full, self.cp_rows[0], device=h.device) if self.cp_ring_keys else None
        # one additive mask per kind per forward, shared by the layers of that kind (attention_bias)
        mask, windowed_mask = forward_masks(positions, segments, window, full, self.seq_shards, rows,
                                            self.cfg.attention_softcap is not None, h.dtype, keys)
        for layer in self.layers.values():
            cos, sin = local_rope if layer.windowed else rope
            m = windowed_mask if layer.windowed else mask
            h = layer(h, cos, sin) if m is None else layer(h, cos, sin, mask=m)
        if self.norm is not None:
            h = self.norm(h)
            if self.cfg.logit_divisor is not None:  # Granite's logits / logits_scaling, as the head's input (linear):
                h = h / self.cfg.logit_divisor  # the chunked loss, which takes this output, sees it too
        if self.output is not None and not (self.return_hidden if return_hidden is None else return_hidden):
            h = softcap_logits(self.output(h), self.cfg.logit_softcap)  # the chunked loss caps its own chunks
        return h
