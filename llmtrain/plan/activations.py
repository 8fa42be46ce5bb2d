"""Activation memory: Korthikanti et al.'s formula, and the engine's real per-layer bytes.

Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models"
(arXiv:2205.05198), sec. 4 and Table 2, count the bytes one GPT layer keeps for backward with
16-bit activations, sequence ``s``, micro batch ``b``, hidden ``h``, ``a`` heads, TP degree ``t``:
``sbh(34 + 5as/h)`` without parallelism; ``sbh(10 + 24/t + 5as/(ht))`` with TP;
``sbh/t (34 + 5as/h)`` with TP + sequence parallelism; the ``5as/h`` term (the s x s softmax,
its dropout mask and output) disappears with selective recomputation; full recomputation keeps
only the layer input, ``2sbh``. :func:`korthikanti_layer_bytes` is that formula.

The engine's block differs (``engine/models/llama.py``), so :func:`layer_terms` counts what it
really saves, term by term (each verified with ``saved_tensors_hooks`` on CPU, see
tests/test_costmodel.py). Notation: ``e`` = bytes of a compute tensor (2 bf16, 4 fp32),
the residual stream has ``e`` bytes too (under autocast as well: the engine casts the embedding's
output, ``engine/models/llama.py``), ``n`` =
``t`` with sequence parallelism else 1, ``s`` = the sequence per context-parallel rank
(``seq_len / cp``: every per-token tensor is divided by CP):

- no dropout (no masks), no biases;
- RMSNorm instead of LayerNorm: its input ``bsh e / n`` and the fp32 ``rstd`` ``4bs/n``. On CUDA
  the fused kernel saves nothing else; on CPU the composite op computes in fp32 and saves the fp32
  upcast of its input and the normalized input (``4bsh / n`` each, whatever ``e``);
- the input of the q/k/v (and w1/w3) projections, ``bsh e``, gathered to the full sequence
  even with SP (DTensor saves the all-gathered input; Megatron re-gathers in backward instead),
  one tensor for q/k/v (and one for w1/w3): under autocast the norm's output is already bf16, so
  no projection saves a cast of its own (3 and 2 copies while the autocast stream was fp32);
- SDPA flash/efficient kernels save q, k, v, the output and the fp32 log-sum-exp ``[b, a, s]``,
  never the s x s scores (``planner.attention_kernel: materialized``, a stack's attention before
  FlashAttention: Megatron-LM's core attention keeps per score its softmax output, its dropout mask
  and the dropped output, Korthikanti's ``5as^2b`` bytes, instead of the log-sum-exp;
  ``ActShape.materialized``). The flash kernel takes GQA's K/V with their kv_heads where it can
  (plan/gqa.py: no mask, no soft-capping, a 16-bit GPU or the CPU), which it then keeps:
  ``2 bsh e / t + 2 bs kv d e / t + 4 bas / t``; elsewhere K/V are repeated to the query heads
  first and cost as much as Q (``4 bsh e / t + 4 bas / t``, every layer before the thirty-eighth
  session). Context
  parallelism (:func:`core_attention_terms`): ring and all-gather save K/V with their kv_heads
  (the all-gather: of the whole sequence) and repeat each kernel block's K/V after the exchange;
  ``planner.cp_kv`` changes only the priced exchange (plan/comm.py), never this memory;
- SwiGLU with ``ffn_hidden`` f: w1 and w3 outputs, silu output, product: ``4 bsf e / t``;
- MoE (the full sequence on every TP rank, experts' F / tp: expert-TP): router input, the ``k`` token
  copies gathered per expert, each expert's SwiGLU, the weighted outputs, shared experts and
  the fp32 routing tensors (:func:`moe_terms`);
- selective recomputation (``engine/parallel/checkpointing.py``) keeps the block input and the
  outputs of the matmuls and of SDPA, except the row-parallel ones: ``wo``'s output is kept
  reduced under TP (``bsh e / n``; the partial sum is discarded) and ``w2``'s not at all (the
  block output feeds only the next block, which keeps it as its input); full recomputation keeps
  the block input. ``selective_mm`` (torchtitan's op policy) keeps selective's terms less the
  outputs of wk (``bs kv e / t``), w3 (``bsf e / t``) and, without TP, wo (``bsh e``): they are
  recomputed from what is saved anyway (wk's and w3's inputs are the recomputed norms of the
  saved block input and residual, wo's input the saved SDPA output). MoE blocks lose only wk's
  (and wo's); under LoRA the adapters' outputs stay.
- LoRA (:func:`lora_layer_terms`): autograd saves a tensor only for a gradient it computes. A
  frozen projection saves nothing (its input gradient needs only the weight); a frozen norm weight
  drops the normalized input (kept only for the weight gradient); each adapter saves its input
  (``lora_a``, the same tensor as the base's: counted once per input) and ``A x`` (``[b, s, rank]``, for ``lora_b``). The frozen embedding
  makes block 0's input gradient-free: its attention norm saves nothing, and a branch with no
  target saves nothing there. The frozen output layer does not save its input, nor the
  embedding its token ids. Selective recomputation also keeps the adapters' matmul outputs.
  Adapter dropout (``train.lora.dropout > 0``) gives each adapter its own dropped input and mask.
  An MoE block has adapters on its attention only; its frozen router and experts keep what the
  input gradient needs (:func:`frozen_moe_terms`).
- the loss: :mod:`llmtrain.plan.loss_activations` (re-exported here).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from llmtrain.plan.cp_transient import cp_transient_bytes, ring_transient_bytes  # noqa: F401 (re-exported)
from llmtrain.plan.norm_activations import LSE, _norm, _norm_bytes, post_norm_terms, qk_norm_terms
from llmtrain.plan.rope_activations import layer_rope_terms, stage_rope_terms
from llmtrain.plan.loss_activations import last_stage_terms, logits_bytes, loss_backward_bytes  # noqa: F401
from llmtrain.plan.losschunk import loss_chunk_tokens
from llmtrain.plan.localwindow import local_window_work
from llmtrain.plan.ringwindow import ring_window_work
from llmtrain.plan.mlp_activations import expert_lora_terms, frozen_moe_terms, mlp_terms, moe_terms  # noqa: F401 (re-exported)
from llmtrain.plan.shards import block_targets


def korthikanti_layer_bytes(s: int, b: int, h: int, a: int, t: int = 1, sp: bool = False,
                            recompute: str = "none") -> float:
    """Activation bytes per transformer layer, Korthikanti et al. 2022, Table 2 (16-bit activations)."""
    if recompute == "full":
        return 2.0 * s * b * h
    attn = 0.0 if recompute in ("selective", "selective_mm") else 5.0 * a * s / h
    if sp:
        return s * b * h / t * (34.0 + attn)
    return s * b * h * (10.0 + 24.0 / t + attn / t)


@dataclass(frozen=True)
class ActShape:
    """Everything the per-layer activation count needs, for one micro batch on one rank."""

    b: int  # micro batch (sequences)
    s: int  # tokens per sequence on this rank (seq_len / cp)
    h: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    tp: int = 1
    sp: bool = False
    e: int = 2  # compute dtype bytes
    fused_norm: bool = True
    experts: int = 1
    top_k: int = 1
    expert_ffn: int = 0
    shared_ffn: int = 0  # shared_experts x expert_ffn
    cp: int = 1
    cp_method: str = "ring"
    hd: int = 0  # head_dim when given explicitly (Qwen3); 0 = h / heads
    lora: tuple | None = None  # (rank, target names, dropout > 0) of train.lora; None: full training
    chunked_loss: bool = True  # the engine's chunked cross-entropy; False: F.cross_entropy over full logits
    compiled_loss: bool = False  # with chunked_loss False: that loss under torch.compile (no fp32 [b, s, V] tensors)
    # with chunked_loss False: Megatron's vocab_parallel_cross_entropy (planner.loss megatron, megatron_fused):
    # its fp32 softmax saved like the log-probabilities, the low-precision logits freed after the upcast,
    # the backward turning the softmax into the gradient in place and casting it
    megatron_loss: bool = False
    materialized: bool = False  # planner.attention_kernel materialized: the s x s scores kept (core_attention_terms)
    window: int = 0  # model.sliding_window (0: none); shorter than the sequence, a band mask (stage_terms)
    full_layers: bool = False  # with a window: some layers attend to the whole prefix (model.full_attention_layers)
    packed: bool = False  # data.packing: a [b, 1, S, S] sample mask per kind of layer (stage_terms)
    post_norms: bool = False  # model.post_norms (Gemma): norms on the attention's and the MLP's outputs
    qk_norm: bool = False  # model.qk_norm (Qwen3, Gemma 3): RMSNorm over each query and key head
    offset_norm: bool = False  # model.norm_offset (Gemma): engine/models/norm.py OffsetRMSNorm on every device
    logit_softcap: bool = False  # model.logit_softcap (Gemma 2): the chunked loss keeps the cap's slope per chunk
    pre_norms: bool = True  # model.pre_norms false (OLMo 2): no norms on the attention's and the MLP's inputs
    qk_norm_all: bool = False  # model.qk_norm_width all (OLMo 2): q/k norms over all heads, one rstd per token
    rope_dim: int = 0  # features RoPE rotates per head (model.rotary_dim); 0: head_dim
    rope_eager: bool = True  # the engine's complex-multiply RoPE (not train.compile): plan/rope_activations.py
    rope_sets: int = 1  # cos/sin sets per forward: 2 with Gemma's local_rope_theta
    gqa_native: bool = False  # SDPA takes K/V with their kv_heads and saves them so (plan/gqa.py)
    # the attention takes an explicit mask or runs the soft-capped kernel (packed rows, Gemma 2's soft-cap; a
    # window's band per layer: rankmem): all-gather CP then runs one masked call over the gathered K/V
    masked: bool = False
    softcap: bool = False  # model.attention_softcap: under all-gather CP a causal mask of the rank's rows (stage_terms)
    ring_window: int = 0  # a windowed layer under ring CP: its sliding window, the chunk pairs inside it run (rankmem)
    local_window: int = 0  # a windowed layer without CP running its score boxes: its window (plan/localwindow.py)

    def __hash__(self) -> int:  # computed once: the per-layer caches below are keyed on it
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash(tuple(self.__dict__[k] for k in self.__dataclass_fields__))
            object.__setattr__(self, "_hash", h)
        return h

    @property
    def head_dim(self) -> int:
        return self.hd or self.h // self.heads

    @property
    def rope_pairs(self) -> int:
        return (self.rope_dim or self.head_dim) // 2

    @property
    def n(self) -> int:
        return self.tp if self.sp and self.tp > 1 else 1

    @property
    def loss_chunk(self) -> int:
        """Tokens per chunk of the chunked loss (one micro batch: ``b x s`` tokens on each TP rank)."""
        return loss_chunk_tokens(self.b * self.s, self.vocab // self.tp, self.h)


def _add(total: dict[str, int], part: dict[str, int]) -> dict[str, int]:
    for k, v in part.items():
        total[k] = total.get(k, 0) + v
    return total


def attention_terms(x: ActShape, recompute: str, cp_index: int | None = None) -> dict[str, int]:
    """What attention keeps; ``cp_index``: the rank's CP coordinate (None: the most loaded rank),
    which decides how many context-parallel kernel blocks the selective policy keeps."""
    bs, t, e = x.b * x.s, x.tp, x.e
    q = bs * x.heads * x.head_dim // t
    kv = bs * x.kv_heads * x.head_dim // t
    lse = LSE * x.b * (x.heads // t) * x.s
    if recompute in ("selective", "selective_mm"):  # outputs of wq, wk, wv, SDPA (out + lse), and wo's: under
        # TP its reduced output ([b, s/t, h] with SP), not the partial sum (discarded: engine/parallel/checkpointing.py)
        out = {"qkv_proj_out": e * (q + 2 * kv), "attn_out": e * q + lse, "wo_out": e * bs * x.h // x.n}
        if recompute == "selective_mm":  # wk's output recomputed; wo's too without TP (under TP: selective's rule)
            out["qkv_proj_out"] -= e * kv
            if t == 1:
                del out["wo_out"]
        if x.cp > 1 and x.cp_method == "ring":  # the policy keeps every kernel block's output + lse: rank i
            # runs its diagonal block, i blocks of all its queries (K/V from ranks before it) and cp - 1 - i
            # of half of them (after it): (cp + 1 + i) / 2 blocks' worth, cp on rank cp - 1, the most
            # loaded (engine/parallel/context_ring.py; measured rank 0 at cp 2: benchmarks/planner_fidelity.py)
            del out["attn_out"]
            i = x.cp - 1 if cp_index is None else cp_index
            blocks = (x.cp + 1 + i) / 2
            if x.ring_window:  # a windowed layer: only the rows of the chunk pairs' boxes (plan/ringwindow.py)
                saved = ring_window_work(x.cp, x.s * x.cp, x.ring_window)[2]
                blocks = max(saved) if cp_index is None else saved[cp_index]
            out["ring_saved_blocks"] = round(blocks * (e * q + lse))
        elif x.local_window:  # without CP or under Ulysses (whole rows), a windowed layer's score boxes: each
            # call's output and lse kept, each box's rows (plan/localwindow.py; engine/models/window_attention.py)
            out["attn_out"] = round(local_window_work(x.s * x.cp, x.local_window)[1] * (e * q + lse))
        elif x.cp > 1 and x.cp_method == "allgather" and not x.masked:  # each zigzag chunk (half the
            # queries): two kernel blocks, before it and the diagonal; rank 0's first chunk has no prefix: 3 of 4
            out["attn_out"] = (3 if cp_index == 0 else 4) * (e * q + lse) // 2
        return out
    out = _norm(x) if x.pre_norms else {}  # OLMo 2: wq / wk / wv keep the block's input itself
    out["attn_input"] = bs * x.h * e
    out.update(core_attention_terms(x))
    out.update(layer_rope_terms(x, recompute))
    return out


def core_attention_terms(x: ActShape) -> dict[str, int]:
    """What the core attention keeps: SDPA, or the engine's context-parallel attention
    (``engine/parallel/context.py``). SDPA's flash kernel takes K and V with their kv_heads where it can
    (``x.gqa_native``, plan/gqa.py); elsewhere, and for Ulysses, they are repeated to the query heads
    first; ring and all-gather take them with their kv_heads and repeat after the exchange."""
    bs, t, e = x.b * x.s, x.tp, x.e
    q = bs * x.heads * x.head_dim // t  # one of q, k, v or the output, local
    kv = bs * x.kv_heads * x.head_dim // t  # one of k, v with the local kv_heads
    lse = LSE * x.b * (x.heads // t) * x.s
    if x.cp <= 1 and x.materialized:  # Megatron-LM's CoreAttention: q, k, v, the context, and per score the
        # fused softmax's output (e), attention dropout's mask (1 byte) and output (e), Megatron's default 0.1
        return {"qkv_attn_out": 4 * e * q, "attn_scores": (2 * e + 1) * x.b * (x.heads // t) * x.s * x.s}
    if x.cp <= 1:  # q, k, v (with their kv_heads where the kernel takes them: plan/gqa.py), SDPA output, fp32 lse
        return {"qkv_attn_out": 2 * e * q + 2 * e * (kv if x.gqa_native else q), "attn_lse": lse}
    if x.cp_method == "ring":  # RingAttention saves q, k and v (kv_heads), its output (the model's, wo's input a
        return {"qkv_attn_out": 2 * e * q + 2 * e * kv, "attn_lse": lse}  # view) and lse
    if x.cp_method == "ulysses":  # SDPA on (heads / cp, full sequence): same sizes; wo's input is a fresh copy;
        # K/V exchanged and kept with their kv_heads where they split over cp and the kernel takes them (plan/gqa.py)
        return {"qkv_attn_out": 3 * e * q + 2 * e * (kv if x.gqa_native else q), "attn_lse": lse}
    if x.masked:  # allgather with a mask or the soft-cap: one masked call over the gathered K/V repeated to the
        # query heads (engine/parallel/context.py), which it keeps: q, the output, K/V of the whole sequence
        return {"qkv_attn_out": 2 * e * q + 2 * e * q * x.cp, "attn_lse": lse}
    # allgather: q, the output and K/V (kv_heads) of the whole sequence (one PrefixCausalAttention call
    # for both zigzag chunks: K/V saved once, the copies reordered into global order; the gathered
    # rank-order buffers are freed), kernel blocks (each repeats its keys for GQA), no mask tensor
    return {"qkv_attn_out": 2 * e * q + 2 * e * kv * x.cp, "attn_lse": lse}


def layer_terms(x: ActShape, moe: bool, recompute: str, first: bool = False,
                cp_index: int | None = None) -> dict[str, int]:
    """Bytes one transformer block keeps for backward for one micro batch, by term (``first``:
    block 0, whose input needs no gradient under LoRA; ``cp_index``: the rank's CP coordinate,
    None for the most loaded)."""
    return dict(_layer_terms(x, moe, recompute, first and x.lora is not None, cp_index))


def lora_layer_terms(x: ActShape, recompute: str, first: bool, cp_index: int | None = None,
                     moe: bool = False) -> dict[str, int]:
    """A block's saved tensors under LoRA (module docstring), following ``requires_grad``; an MoE block
    (``moe``) has adapters on its attention only, its router and experts frozen (:func:`frozen_moe_terms`)."""
    rank, targets, dropout = x.lora
    targets, experts = block_targets(targets, moe)  # experts: train.lora.experts's adapted w1 / w2 / w3
    bs, e, t = x.b * x.s, x.e, x.tp
    q, kv, f = bs * x.heads * x.head_dim // t, bs * x.kv_heads * x.head_dim // t, bs * x.ffn // t
    ax = e * bs * rank * len(targets)  # A x of every adapter, saved for lora_b's weight gradient
    if recompute in ("selective", "selective_mm"):  # + the adapters' own matmul outputs (A x and B A x;
        # selective_mm recomputes only the frozen bases' mm of wk, w3, wo: the adapters' outputs stay)
        base = dict(_layer_terms(_without_lora(x), moe, recompute, False, cp_index))
        # lora_b's output on a row-parallel projection is a partial sum, discarded like the base's
        # (wo without TP: kept, it is part of the attention output); on w2 always discarded
        out_sizes = {"wq": q, "wk": kv, "wv": kv, "wo": 0 if t > 1 else bs * x.h, "w1": f, "w3": f, "w2": 0}
        base["lora_outputs"] = ax + e * sum(out_sizes[name] for name in targets)
        _add(base, expert_lora_terms(x, experts, recompute))
        return base
    out: dict[str, int] = {}
    rows = x.b * x.s // x.n
    norm = {"norm_input": rows * x.h * _norm_bytes(x), "norm_rstd": rows * LSE}  # the normalized input: weight gradient only
    norm = norm if x.pre_norms else {}  # OLMo 2: no input norms
    x_grad = not first
    attn_t = [name for name in targets if name in ("wq", "wk", "wv")]
    if x_grad:
        _add(out, norm)
    if attn_t and not dropout:
        out["attn_input"] = bs * x.h * e
    if x_grad or attn_t:
        _add(out, core_attention_terms(x))
        _add(out, layer_rope_terms(x, recompute, x_grad or "wq" in targets, x_grad or "wk" in targets))
    elif "wo" in targets and not dropout:  # only wo's lora_a needs the (gradient-free) attention output
        out["attn_out"] = e * q
    r_grad = x_grad or bool(attn_t) or "wo" in targets
    if r_grad:
        _add(out, norm)
    if moe:
        # adapted experts: their outputs need gradients whatever the block's input needs (approximation for
        # an MoE block 0 without attention adapters: its routing is kept as if the input needed one)
        _add(out, frozen_moe_terms(x) if r_grad or experts else {})
        _add(out, expert_lora_terms(x, experts, recompute))
        if dropout:
            out["lora_dropout"] = _dropout_bytes(x, targets, {"wq": x_grad, "wk": x_grad, "wv": x_grad,
                                                              "wo": x_grad or bool(attn_t)})
        out["lora_ax"] = ax
        return out
    mlp_t = [name for name in targets if name in ("w1", "w3")]
    if mlp_t and not dropout:
        out["mlp_input"] = bs * x.h * e
    gate, up = r_grad or "w1" in targets, r_grad or "w3" in targets
    # engine/models/swiglu.py keeps the w1 output when either needs a gradient and the w3 output
    # when the w1 output does; w2's lora_a keeps the product
    out["swiglu"] = e * f * ((gate or up) + gate + ("w2" in targets and not dropout))
    if dropout:
        out["lora_dropout"] = _dropout_bytes(x, targets, {"wq": x_grad, "wk": x_grad, "wv": x_grad,
                                                          "wo": x_grad or bool(attn_t), "w1": r_grad, "w3": r_grad,
                                                          "w2": gate or up})
    out["lora_ax"] = ax
    return out


def _dropout_bytes(x: ActShape, targets, input_grad: dict[str, bool]) -> int:
    """Each adapter has its own dropout: lora_a saves the dropped input (e bytes per element), and where
    that input needs a gradient (``input_grad``) the dropout keeps its mask: CUDA's fused kernel a bool
    (1 byte), the CPU composite a scaled noise tensor of the input's dtype (``fused_norm`` is the
    planner's "not on CPU" flag)."""
    bs, e = x.b * x.s, x.e
    q, f = bs * x.heads * x.head_dim // x.tp, bs * x.ffn // x.tp
    width = {"wq": bs * x.h, "wk": bs * x.h, "wv": bs * x.h, "wo": q, "w1": bs * x.h, "w3": bs * x.h, "w2": f}
    mask = 1 if x.fused_norm else e
    return sum(width[name] * (e + mask * input_grad[name]) for name in targets)


def _without_lora(x: ActShape) -> ActShape:
    return ActShape(**{k: getattr(x, k) for k in x.__dataclass_fields__ if k != "lora"})


@lru_cache(maxsize=8192)
def _layer_terms(x: ActShape, moe: bool, recompute: str, first: bool = False,
                 cp_index: int | None = None) -> tuple[tuple[str, int], ...]:
    if recompute == "full":
        return (("block_input", x.b * x.s * x.h * x.e // x.n),)
    if x.lora is not None:  # post norms with frozen weights keep what they need for dx: input, rstd
        post = {k: v for k, v in {**post_norm_terms(x, recompute), **qk_norm_terms(x, recompute)}.items()
                if not k.endswith("_normalized")}  # frozen norm weights: no normalized input kept for them
        return tuple(_add(dict(lora_layer_terms(x, recompute, first, cp_index, moe)), post).items())
    out: dict[str, int] = {}
    if recompute in ("selective", "selective_mm"):
        out["block_input"] = x.b * x.s * x.h * x.e // x.n
    _add(out, attention_terms(x, recompute, cp_index))
    _add(out, moe_terms(x, recompute) if moe else mlp_terms(x, recompute))
    _add(out, post_norm_terms(x, recompute))
    _add(out, qk_norm_terms(x, recompute))
    return tuple(out.items())


def layer_bytes(x: ActShape, moe: bool, recompute: str) -> int:
    return sum(layer_terms(x, moe, recompute).values())


@lru_cache(maxsize=4096)
def recompute_working_bytes(x: ActShape, moe: bool, recompute: str) -> int:
    """Extra bytes while one block is recomputed in backward (its activations exist again)."""
    if recompute == "none":
        return 0
    return max(0, layer_bytes(x, moe, "none") - layer_bytes(x, moe, recompute))


def first_stage_terms(x: ActShape) -> dict[str, int]:
    """Per micro batch on the stage holding the embedding: the token ids (int64) the lookup keeps
    (none for a frozen embedding, LoRA)."""
    return {"token_ids": 8 * x.b * x.s} if x.lora is None else {}


def stage_terms(x: ActShape, recompute: str = "none") -> dict[str, int]:
    """Per micro batch on every stage: RoPE cos/sin where they are held (plan/rope_activations.py)
    and, when a sliding window is shorter than the sequence ``S`` (``s x cp``: Ulysses' attention
    holds the whole sequence), the additive band mask
    ``[S, S]`` in the compute dtype that every layer's attention saves (models/llama.py
    ``attention_bias``: one tensor per forward, not one per layer). Packed rows (``data.packing``)
    hold their block-diagonal sample mask ``[b, 1, S, S]`` instead, one per kind of layer in use:
    the windowed layers' (samples and band) and the full-attention layers'. All-gather and ring CP hold
    the rank's rows of each, ``[s, S]`` (models/masks.py; the ring's keys in ring order), and with Gemma
    2's soft-cap a causal mask of those rows for the layers without a band (its kernel's implicit one is
    square)."""
    out = stage_rope_terms(x, recompute)
    full = x.s * x.cp
    rows = x.s if x.cp > 1 and x.cp_method in ("allgather", "ring") else full
    band = bool(x.window) and full > x.window
    unbanded = not band or x.full_layers  # some layers attend to the whole prefix
    if x.packed:
        out["packed_mask"] = (int(band) + int(unbanded)) * x.e * x.b * rows * full
        return out
    if band:
        out["window_mask"] = x.e * rows * full
    if x.softcap and rows < full and unbanded:
        out["causal_mask"] = x.e * rows * full
    return out
