"""Time model v2 (``cluster.time_model: v2``): compute seconds per operation of a block.

v1 divides a rank's hardware FLOPs by ``peak x COMPUTE_EFFICIENCY[gpu]`` (one constant fitted
on A100-era Megatron runs). v2 prices each operation of a micro batch on one pipeline rank:

- **GEMMs** (``gemmtime.py``) from their per-rank shapes after the TP / CP / EP splits (``m`` tokens, ``k`` in,
  ``n`` out; the backward's data and weight gradients are two more GEMMs of the same FLOPs,
  ``(m, k) <- (m, n) x (n, k)`` and ``(k, n) <- (k, m) x (m, n)``) at
  ``min(peak x MAMF x wave efficiency, intensity x HBM)``: :data:`MAMF` is the best measured
  bf16 matmul fraction of the peak per GPU (S. Bekman, ml-engineering, "Maximum Achievable
  Matmul FLOPS comparison table"); the roofline caps small-``k`` / thin GEMMs at the bytes they
  move (``e (mk + kn + mn)``); the size curve is NVIDIA's tile and wave quantization (Matrix
  Multiplication Background User's Guide): output tiles (:data:`TILES`) over the GPU's SMs,
  efficiency ``useful tile area / (waves x SMs x tile area)``; on H100 / H200 times the rate this
  project's GPU check measured at the published rows' shapes, on A100 the rate a published per-layer
  measurement gives (``gemmtime.GEMM_FIT``). No constant is fitted to a published run's throughput.
- **Attention** (``attentiontime.py``) from the flash kernel's FLOPs at its published rate for the length of one call
  (:data:`ATTENTION_MEASURED`: the kernels' own benchmark figures, FA2 / FA1 on A100 and H100,
  FA3 and cuDNN on H100, 512 to 16k tokens; the engine's SDPA on Hopper / Blackwell at the GPU check's
  measured rate, :data:`SDPA_MEASURED`), forward ``4 s_q s_kv d`` per head, backward 2.5x the
  forward (the kernels recompute the scores: the papers' own FLOP convention for the backward
  rate), halved when the part the kernels execute (``flops.attention_executed``: 1/2 for causal
  SDPA, Ulysses and the zigzag ring and all-gather).
- **Memory-bound ops** (RMSNorm: fused, or ``planner.norm: unfused``: ``plan/elementwise.py``, RoPE, SwiGLU, residual adds, the cross-entropy as ``planner.loss``'s stack runs it (``losstime.py``), FSDP2's copy-in/out of
  gathered weights and gradients) from the bytes they move at :data:`HBM_EFFICIENCY` of the
  datasheet bandwidth. Under ``train.compile`` the block's element-wise ops are the kernels Inductor
  generates for it (``plan/elementwise.py``; ``planner.rope: complex`` for a RoPE it cannot
  fuse). The optimizer step stays v1's (already bytes / HBM).
- **Recomputation**: ``full`` re-runs the block's forward (GEMMs but the last one, attention and
  element-wise ops, as flops.py counts it); ``selective`` re-runs only the element-wise ops;
  ``selective_mm`` (torchtitan's op policy) those and the forward GEMMs of wk, the dense MLP's
  w3 and, without TP, wo (engine/parallel/checkpointing.py).

Beside the kernels (docs/planner.md section 9): compute slowed while NCCL's CTAs hold SMs
(:func:`overlap_slowdown`), eager launches bounding small passes (:func:`launch_seconds`), and
the attention kernel of the stack (``planner.attention_kernel``: the engine's SDPA is cuDNN's on
Hopper / Blackwell, FA2 elsewhere and in its ring / all-gather CP blocks).

``train.precision: fp8`` runs the blocks' nn.Linear GEMMs at the FP8 peak times the measured FP8
matmul fraction (:data:`MAMF_FP8`). LoRA (``train.lora``): frozen bases and adapters as
``loratime.py`` prices them (v1's compute only for LoRA under fp8).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

from llmtrain.plan.attentiontime import (  # noqa: F401 (re-exported: ops is the v2 time model's entry)
    ATTENTION, ATTENTION_FAMILY, ATTENTION_LENGTHS, ATTENTION_MEASURED, ATTENTION_SPLIT, MATERIALIZED_BYTES,
    attention_fractions, attention_seconds)
from llmtrain.plan.cpmerge import cp_attention_bytes
from llmtrain.plan.elementwise import _compiled_elementwise, _elementwise, _with_dispatch, norm_bytes  # noqa: F401
from llmtrain.plan.attnshare import allgather_masked, softcap_call_keys
from llmtrain.plan.gqa import native_gqa, repeating_layers
from llmtrain.plan.gemmtime import (  # noqa: F401 (re-exported)
    HBM_EFFICIENCY, MAMF, MAMF_FP8, SMS, TILES, gemm_fwd_bwd, gemm_seconds, mamf, membound_seconds, wave_efficiency)
from llmtrain.plan.launchtime import KERNELS, LAUNCH_S, launch_seconds  # noqa: F401 (re-exported)
from llmtrain.plan.loratime import lora_pass_seconds
from llmtrain.plan.losstime import head_loss_seconds
from llmtrain.plan.shards import lora_key
from llmtrain.recipe.gpus import GPUSpec

# SMs an NCCL collective holds while it overlaps compute: one CTA per channel. Measured: an H100
# all-gather launched 24 CTAs beside a 132-CTA GEMM, whose time nearly doubled (a second wave;
# NVIDIA developer forum, "Compute-Communication Overlap Causes Severe GEMM Performance Degradation
# because of Tail Effect"); NCCL caps channels at NCCL_MAX_CTAS (32 by default).
NCCL_CTAS = 24


@dataclass(frozen=True)
class BlockShape:
    """What one pipeline rank's micro batch looks like to the kernels."""

    b: int  # micro batch
    s: int  # tokens per CP rank
    seq: int  # the full sequence (attention's keys)
    h: int
    heads: int
    kv_heads: int
    hd: int
    ffn: int
    vocab: int
    tp: int
    sp: bool
    e: int  # activation bytes
    cp: int = 1
    attn_executed: float = 0.5  # share of the full score blocks the kernels run (flops.attention_executed)
    experts: int = 0  # MoE: routed experts, top-k, shared experts, their width, EP degree
    top_k: int = 0
    shared: int = 0
    expert_ffn: int = 0
    ep: int = 1
    recompute: str = "none"
    fp8_peak: float = 0.0  # > 0: the blocks' nn.Linear GEMMs run at this peak (train.precision fp8)
    attention: str = "engine"  # planner.attention_kernel: engine (SDPA), fa2, fa3, cudnn, fa1, materialized; softcap
    norm_unfused: bool = False  # planner.norm unfused (eager composite RMSNorm) and not train.compile
    recompute_whole: bool = False  # planner.full_recompute whole_block: full AC re-runs the block's last GEMM too
    recompute_attention: bool = False  # planner.selective_recompute core_attention: selective re-runs the attention
    kv_len: int = 0  # keys of one attention kernel call: ring / all-gather CP's blocks (s), else the sequence (0)
    cp_method: str = ""  # ring / allgather (the engine's) or torch: CP's merges and accumulators (plan/cpmerge.py)
    cp_kv_repeated: bool = False  # planner.cp_kv repeated: K/V arrive with the query heads (no GQA repeat)
    lora: tuple | None = None  # train.lora: (rank, target names, dropout on) (plan/loratime.py)
    lora_first: bool = False  # under LoRA, block 0: its input needs no gradient
    loss: str = "engine"  # planner.loss: the cross-entropy's kernels (plan/losstime.py)
    kernels: str = "engine"  # planner.block_kernels: the block's element-wise kernels (_elementwise)
    compiled: bool = False  # train.compile: Inductor's kernels for the engine's element-wise ops (_compiled_elementwise)
    rope: str = "engine"  # planner.rope: complex (a complex multiply Inductor does not fuse)
    norms: int = 2  # RMSNorms per block: 4 with model.post_norms (Gemma), priced like the others
    offset_norm: bool = False  # model.norm_offset (Gemma): eager OffsetRMSNorm ops unless compiled (norm_bytes)
    gqa_native: bool = False  # K/V handed to the kernel with their own heads: nothing repeated (plan/gqa.py)
    softcap_keys: int = 0  # the soft-capped calls' keys per query, layers averaged (attnshare.softcap_call_keys)


def layer_attention_seconds(x: BlockShape, gpu: GPUSpec, sms: int | None = None) -> tuple[float, float]:
    """(forward, backward) seconds of one block's attention on one rank, one micro batch: its kernels,
    and under ring / all-gather CP the merges, copies and accumulators between them (plan/cpmerge.py)."""
    heads = max(1, x.heads // x.tp)
    keys = x.seq  # the soft-capped kernel runs every score of its calls: the ring's blocks are (cp + 1) / (2 cp) of
    if x.attention == "softcap" and x.cp_method == "ring":  # [s, S], a windowed layer's boxes fewer
        keys = x.softcap_keys or x.seq * (x.cp + 1) // (2 * x.cp)
    elif x.attention == "softcap" and x.softcap_keys:  # without CP: a windowed layer's boxes (attnshare.runs_local)
        keys = x.softcap_keys
    f, b = attention_seconds(x.b, x.s, keys, heads, x.hd, x.attn_executed, gpu, sms, x.attention, x.e, x.kv_len)
    if x.cp_method:
        kv = heads if x.cp_kv_repeated else max(1, x.kv_heads // x.tp)
        mf, mb = cp_attention_bytes(x.cp_method, x.cp, x.b, heads, kv, x.s, x.hd, x.e)
        f, b = f + membound_seconds(mf, gpu), b + membound_seconds(mb, gpu)
    return f, b


def block_gemms(x: BlockShape, moe: bool) -> list[tuple[float, float, float, float | None, int, bool]]:
    """The GEMMs of one block on one rank (no LoRA): ``(m, n, k, peak, count, recomputed under full
    AC)`` for wq, wk, wv, wo, then the dense MLP or the router, the routed experts (balanced routing)
    and the shared experts."""
    tok, t = x.b * x.s, x.tp
    lin = x.fp8_peak or None  # nn.Linear GEMMs under fp8 (MoE experts and the router stay bf16)
    q, kv = x.heads * x.hd / t, x.kv_heads * x.hd / t
    gemms = [(tok, q, x.h, lin, 1, True), (tok, kv, x.h, lin, 1, True), (tok, kv, x.h, lin, 1, True),
             (tok, x.h, q, lin, 1, True)]
    if moe:
        local = max(1, x.experts // max(1, x.ep))
        per = tok * x.top_k / local  # routed tokens per local expert (balanced routing)
        ef = x.expert_ffn / t
        gemms += [(tok, x.experts, x.h, None, 1, True), (per, ef, x.h, None, 2 * local, True),
                  (per, x.h, ef, None, local, True)]
        if x.shared:  # the shared experts' w2 is the block's last GEMM (flops.py: not recomputed)
            sf = x.shared * x.expert_ffn / t
            gemms += [(tok, sf, x.h, None, 2, True), (tok, x.h, sf, None, 1, False)]
    else:
        gemms += [(tok, x.ffn / t, x.h, lin, 2, True), (tok, x.h, x.ffn / t, lin, 1, False)]
    return gemms


def block_parts(x: BlockShape, gpu: GPUSpec, moe: bool, sms: int | None = None) -> dict[str, tuple[float, float]]:
    """(forward, backward) seconds of one block's GEMMs, attention kernels and element-wise ops on one
    rank, one micro batch, without recomputation (no LoRA): :func:`block_seconds`'s parts, which the
    GPU check sets beside a profiled step's kernel time by category."""
    gemm_f, gemm_b, _ = _gemm_pass_seconds(x, gpu, moe, sms)
    ef_s, eb_s = (membound_seconds(v, gpu) for v in _elementwise(x, moe))
    return {"gemm": (gemm_f, gemm_b), "attention": layer_attention_seconds(x, gpu, sms), "elementwise": (ef_s, eb_s)}


def _gemm_pass_seconds(x: BlockShape, gpu: GPUSpec, moe: bool, sms: int | None) -> tuple[float, float, float]:
    """(forward, backward, forward again under full AC) seconds of :func:`block_gemms`."""
    fwd = bwd = again = 0.0
    for m, n, k, peak, count, recomputed in block_gemms(x, moe):
        f, b_ = gemm_fwd_bwd(m, n, k, gpu, peak, sms)
        fwd, bwd = fwd + count * f, bwd + count * b_
        again += count * f if recomputed or x.recompute_whole else 0.0
    return fwd, bwd, again


@lru_cache(maxsize=4096)  # pure in hashable arguments; plan --search prices the same shapes many times
def block_seconds(x: BlockShape, gpu: GPUSpec, moe: bool, sms: int | None = None) -> tuple[float, float]:
    """(forward, backward incl. recomputation) seconds of one block on one rank, one micro batch."""
    tok, t = x.b * x.s, x.tp
    lin = x.fp8_peak or None  # nn.Linear GEMMs under fp8 (MoE experts and the router stay bf16)
    q, kv = x.heads * x.hd / t, x.kv_heads * x.hd / t
    af, ab = layer_attention_seconds(x, gpu, sms)
    ef_s, eb_s = (membound_seconds(v, gpu) for v in _elementwise(x, moe))
    # selective_mm re-runs these forward GEMMs: wk, wo without TP (under TP its reduced output is
    # saved), the dense MLP's w3 (an MoE block has none); under LoRA the frozen bases' (the same shapes)
    again_mm = (gemm_seconds(tok, kv, x.h, gpu, lin, sms=sms) + (gemm_seconds(tok, x.h, q, gpu, lin, sms=sms) if t == 1 else 0.0)
                + (0.0 if moe else gemm_seconds(tok, x.ffn / t, x.h, gpu, lin, sms=sms)))
    if x.lora is not None:  # frozen bases and adapters (plan/loratime.py; an MoE block's router and experts frozen)
        fwd, bwd, again = lora_pass_seconds(x, gpu, x.lora_first, (af, ab), (ef_s, eb_s), sms, moe)
    else:
        fwd, bwd, again = _gemm_pass_seconds(x, gpu, moe, sms)
        fwd, bwd, again = fwd + af + ef_s, bwd + ab + eb_s, again + af + ef_s
    if x.recompute == "full":
        bwd += again
    elif x.recompute == "selective":  # the element-wise ops, or (core_attention) the attention kernel's forward
        bwd += af if x.recompute_attention else ef_s
    elif x.recompute == "selective_mm":
        bwd += ef_s + again_mm
    return fwd, bwd


def recompute_seconds(x: BlockShape, gpu: GPUSpec, dense_layers: int, moe_layers: int) -> float:
    """Seconds of one more recomputation of the given blocks (the backward's extra over no recomputation)."""
    plain = replace(x, recompute="none")
    return sum(n * (block_seconds(x, gpu, moe)[1] - block_seconds(plain, gpu, moe)[1])
               for n, moe in ((dense_layers, False), (moe_layers, True)) if n)


@lru_cache(maxsize=4096)  # pure in hashable arguments; plan --search prices the same shapes many times
def head_seconds(x: BlockShape, gpu: GPUSpec, sms: int | None = None) -> tuple[float, float]:
    """Final norm, the output layer (vocabulary split over TP) and the cross-entropy as
    ``planner.loss``'s stack runs them (plan/losstime.py; a frozen output layer under LoRA: its
    input's gradient only)."""
    tok = x.b * x.s
    f, b_ = head_loss_seconds(x.loss, tok, x.vocab / x.tp, x.h, x.e, gpu, weight_trains=x.lora is None, sms=sms)
    nf, nb = norm_bytes(x.e, x.norm_unfused)
    return f + membound_seconds(nf * x.h * tok, gpu), b_ + membound_seconds(nb * x.h * tok, gpu)


def shape_of(recipe, dims, gpu: GPUSpec, attn_executed: float) -> BlockShape:
    """The :class:`BlockShape` of a validated recipe's micro batch on one rank."""
    from llmtrain.plan.memory import compute_bytes  # noqa: PLC0415  (memory imports the schema)

    m, p, t = recipe.model, recipe.parallel, recipe.train
    fp8 = gpu.peak_flops_fp8 if t.precision == "fp8" and gpu.peak_flops_fp8 > 0 else 0.0
    # ring / all-gather CP: kernel calls over seq / cp keys; all-gather with a mask or the soft-cap in every
    # layer one masked call of the rank's rows against the whole row, priced as the masked attention without CP
    # (flops.allgather_masked; a model mixing such layers with unmasked ones is priced as its kernel blocks)
    masked_calls = p.cp_method == "allgather" and allgather_masked(recipe) == 1.0
    blocks = dims.cp > 1 and p.cp_method != "ulysses" and not masked_calls
    attention = recipe.planner.attention_kernel
    if attention == "engine" and m.attention_softcap is not None:  # Gemma 2: the engine's own kernel (softcap.py),
        attention = "softcap"  # also as ring CP's blocks
    if attention == "engine" and blocks:  # the engine's CP blocks call FA2's op themselves (context_blocks.py)
        attention = "fa2"
    return BlockShape(b=t.micro_batch_size, s=t.seq_len // dims.cp, seq=t.seq_len, h=m.hidden, heads=m.heads,
                      kv_heads=m.kv_heads, hd=m.head_dim, ffn=m.ffn_hidden, vocab=m.vocab_size, tp=dims.tp,
                      sp=p.sequence_parallel and dims.tp > 1, e=compute_bytes(t.precision), cp=dims.cp,
                      attn_executed=attn_executed, experts=m.moe.num_experts if m.is_moe else 0, top_k=m.moe.top_k,
                      shared=m.moe.shared_experts, expert_ffn=m.expert_ffn if m.is_moe else 0, ep=dims.ep,
                      recompute=t.activation_checkpointing, fp8_peak=fp8, attention=attention,
                      norm_unfused=recipe.planner.norm == "unfused" and not t.compile,
                      recompute_whole=recipe.planner.full_recompute == "whole_block",
                      recompute_attention=recipe.planner.selective_recompute == "core_attention",
                      kv_len=t.seq_len // dims.cp if blocks else 0,
                      cp_method=({"engine": p.cp_method, "torch": "torch"}.get(recipe.planner.cp_merge, "")
                                 if blocks else ""),
                      cp_kv_repeated=recipe.planner.cp_kv == "repeated",
                      lora=None if t.lora is None else (*lora_key(t.lora), t.lora.dropout > 0),
                      loss=recipe.planner.loss, kernels=recipe.planner.block_kernels, compiled=t.compile,
                      rope=recipe.planner.rope, norms=2 * m.pre_norms + 2 * m.post_norms, offset_norm=m.norm_offset,
                      # the whole block priced as its layers without a window band (plan/gqa.py)
                      gqa_native=native_gqa(recipe, gpu.name, dims.cp, dims.tp) and not repeating_layers(recipe),
                      softcap_keys=(softcap_call_keys(recipe, dims.cp) if attention == "softcap" and (
                          blocks and p.cp_method == "ring" or dims.cp == 1 or p.cp_method == "ulysses") else 0))


def rank_seconds(x: BlockShape, gpu: GPUSpec, dense_layers: int, moe_layers: int, last: bool,
                 sms: int | None = None, first_block: str | None = None) -> tuple[float, float]:
    """(forward, backward) compute seconds of one micro batch on a pipeline rank holding
    ``dense_layers`` + ``moe_layers`` blocks (and the output head when ``last``); ``sms``: on
    only that many SMs (:func:`overlap_slowdown`); ``first_block``: under LoRA, one of the
    ``"dense"`` or ``"moe"`` blocks is block 0 (its input needs no gradient)."""
    fwd = bwd = 0.0
    first_moe = first_block == "moe"
    if first_block and x.lora is not None and (moe_layers if first_moe else dense_layers):
        fwd, bwd = block_seconds(replace(x, lora_first=True), gpu, first_moe, sms)
        dense_layers, moe_layers = (dense_layers, moe_layers - 1) if first_moe else (dense_layers - 1, moe_layers)
    for n, moe in ((dense_layers, False), (moe_layers, True)):
        if n:
            f, b = block_seconds(x, gpu, moe, sms)
            fwd, bwd = fwd + n * f, bwd + n * b
    if last:
        f, b = head_seconds(x, gpu, sms)
        fwd, bwd = fwd + f, bwd + b
    return fwd, bwd


@lru_cache(maxsize=4096)  # pure in hashable arguments; plan --search prices the same shapes many times
def overlap_slowdown(x: BlockShape, gpu: GPUSpec, dense_layers: int, moe_layers: int, last: bool,
                     first_block: str | None = None) -> float:
    """Share of compute throughput lost while an NCCL collective runs beside it (issue 18, 9.1 (a)).

    NCCL's kernels are ordinary CTAs, one per channel, resident for the whole collective, so the
    compute kernels that overlap it get only ``SMs - NCCL_CTAS`` SMs: the GEMMs lose peak in
    proportion and re-quantize their waves on fewer SMs (the tail effect), attention loses peak
    in proportion, memory-bound ops are taken as unaffected (HBM, not SMs, bounds them; NCCL's
    own HBM traffic is not charged: an under-estimate). Returns ``1 - t(all SMs) / t(fewer)``:
    a hidden collective of ``T`` seconds costs ``T x`` this much extra compute time."""
    full = SMS.get(gpu.rates_key, 108)
    if full <= NCCL_CTAS:
        return 0.0
    f0, b0 = rank_seconds(x, gpu, dense_layers, moe_layers, last, first_block=first_block)
    f1, b1 = rank_seconds(x, gpu, dense_layers, moe_layers, last, sms=full - NCCL_CTAS, first_block=first_block)
    return max(0.0, 1.0 - (f0 + b0) / (f1 + b1)) if f1 + b1 > 0 else 0.0


def clear_caches() -> None:
    """Forget the memoized block, head and overlap prices: for code that changes a rate constant
    (``gemmtime.GEMM_FIT``, ...) within one process and replans (benchmarks/layer_fit.py)."""
    for cached in (block_seconds, head_seconds, overlap_slowdown):
        cached.cache_clear()
