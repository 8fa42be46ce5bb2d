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
- **Memory-bound ops** (RMSNorm: fused, or ``planner.norm: unfused`` by :func:`norm_bytes`, RoPE, SwiGLU, residual adds, the cross-entropy as ``planner.loss``'s stack runs it (``losstime.py``), FSDP2's copy-in/out of
  gathered weights and gradients) from the bytes they move at :data:`HBM_EFFICIENCY` of the
  datasheet bandwidth. Under ``train.compile`` the block's element-wise ops are the kernels Inductor
  generates for it (:func:`_compiled_elementwise`; ``planner.rope: complex`` for a RoPE it cannot
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
from llmtrain.plan.gemmtime import (  # noqa: F401 (re-exported)
    HBM_EFFICIENCY, MAMF, MAMF_FP8, SMS, TILES, gemm_fwd_bwd, gemm_seconds, mamf, membound_seconds, wave_efficiency)
from llmtrain.plan.launchtime import KERNELS, LAUNCH_S, launch_seconds  # noqa: F401 (re-exported)
from llmtrain.plan.loratime import lora_pass_seconds
from llmtrain.plan.losstime import head_loss_seconds
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


def norm_bytes(e: int, unfused: bool, offset: bool = False) -> tuple[int, int]:
    """(forward, backward) HBM bytes per normalized element of one RMSNorm (``e``: activation bytes).

    Fused (``nn.RMSNorm``'s kernel, the engine): read x and write y forward (``2e``); backward read
    x and dy, write dx (``3e``). Unfused (``planner.norm: unfused``: torchtitan 2024's
    ``norm_type = "rmsnorm"``, ``(x.float() * rsqrt(x.float().pow(2).mean(-1) + eps)).type_as(x) * w``
    in eager mode), counted kernel by kernel, reads and writes per element (per-row tensors free):
    forward ``float()`` e + 4, ``pow`` 8, ``mean`` 4, ``x * rsqrt`` 8, ``type_as`` 4 + e, ``* w``
    2e: ``4e + 28``; backward by autograd's formulas (torch ``derivatives.yaml``): ``* w`` 6e (the
    input gradient 2e, the weight's product 3e and its row sum e), ``type_as`` e + 4, ``* rsqrt`` 24
    (8 for the input, 16 for the per-row gradient's product and sum), ``mean`` 4 (the expanded
    gradient), ``pow`` 28 (``grad * 2 * x``: three kernels), the two gradients of ``x.float()``
    summed 12, ``float()`` 4 + e: ``8e + 76``. An estimate of the memory traffic, not a
    measurement (an allocator or kernel that fuses two of these would move less).

    ``offset`` (Gemma's ``model.norm_offset``, engine/models/norm.py ``OffsetRMSNorm``, an autograd
    Function of eager ops on every device unless compiled): forward ``float()`` e + 4, ``pow`` 8,
    ``mean`` 4, ``* rstd`` 8, ``* (1 + w)`` 8, the cast back 4 + e: ``2e + 36``; backward the
    normalized input again (e + 12), the gradient's upcast (e + 4), the weight's product and row sum
    (16), ``g (1 + w)`` 8, its product with the normalized input 12, their mean 4, the two products
    and the difference (28), the cast back (4 + e): ``3e + 88`` (tests/test_block_traffic.py counts
    the Function's ops)."""
    if offset:
        return 2 * e + 36, 3 * e + 88
    if unfused:
        return 4 * e + 28, 8 * e + 76
    return 2 * e, 3 * e


def _elementwise(x: BlockShape, moe: bool) -> tuple[float, float]:
    """(forward, backward) HBM bytes of a block's element-wise ops, per rank and micro batch."""
    if x.compiled and x.kernels == "engine":
        return _compiled_elementwise(x, moe)
    t, e, tok = x.tp, x.e, x.b * x.s
    rep = 1 if x.sp else t  # norms and residual adds run on all tokens on every TP rank without SP
    hdim = x.h * tok / t * rep
    qk = (x.heads + x.kv_heads) * x.hd * tok / t
    width = (x.top_k + x.shared) * x.expert_ffn if moe else x.ffn
    act = width * tok / t
    # 2 norms (fused, or planner.norm unfused: norm_bytes) and 2 residual adds (3e each way). The
    # engine (tests/test_block_traffic.py counts its ops): RoPE as engine/models/rope.py runs it (cast
    # to fp32, complex multiply, cast back: 2e + 16 bytes per element each way); SwiGLU as
    # engine/models/swiglu.py runs it (silu, then the product: 5e forward; backward grad * up,
    # silu_backward, silu again, grad * silu: 11e); with GQA the K/V heads repeated to the query heads
    # (repeat_interleave: read kv, write heads) and summed back in backward; in backward autograd's sums
    # of the input gradients of wq, wk and wv (2) and of the dense MLP's w1 and w3 (1), each on the
    # projections' full [tokens, hidden] input. planner.block_kernels fused: a fused RoPE (2e), a fused
    # activation (read gate and up, write the product: 3e; backward 5e), no repeat, one QKV and one fc1
    # GEMM (no sums).
    nf, nb = norm_bytes(e, x.norm_unfused, x.offset_norm)  # Gemma's post norms: x.norms 4; its offset norms
    # (engine/models/norm.py OffsetRMSNorm): eager fp32 ops
    base_f, base_b = x.norms * nf * hdim + 2 * 3 * e * hdim, x.norms * nb * hdim + 2 * 3 * e * hdim
    if x.kernels == "fused":
        fwd, bwd = base_f + 2 * e * qk + 3 * e * act, base_b + 2 * e * qk + 5 * e * act
    else:
        rope = (2 * e + 16) * qk
        repeat = 2 * e * (x.heads + x.kv_heads) * x.hd * tok / t if x.heads > x.kv_heads and not x.gqa_native else 0.0
        sums = (2 + (0 if moe else 1)) * 3 * e * x.h * tok
        fwd = base_f + rope + 5 * e * act + repeat
        bwd = base_b + rope + 11 * e * act + repeat + sums
    return _with_dispatch(x, moe, fwd, bwd)


def _with_dispatch(x: BlockShape, moe: bool, fwd: float, bwd: float) -> tuple[float, float]:
    """Adds an MoE block's dispatch gather and combine scatter of the routed copies (read + write each way)."""
    if moe:
        routed = 2 * 2 * x.e * x.top_k * x.h * x.b * x.s
        fwd, bwd = fwd + routed, bwd + routed
    return fwd, bwd


def _compiled_elementwise(x: BlockShape, moe: bool) -> tuple[float, float]:
    """(forward, backward) HBM bytes of the engine's block under ``train.compile``: Inductor's kernels.

    Counted kernel by kernel from what Inductor's scheduler generates for the engine's block
    (tests/test_block_traffic.py reads them back from a CPU compile with the GPU's pointwise ``cat``
    lowering, ``force_pointwise_cat``); the GEMMs, attention and, under TP, the collectives stay
    extern kernels that nothing fuses across. Per element of the residual stream (``hdim``):
    forward the first norm (read x, write its output: 2e), the attention's residual add fused into
    the second norm (read x and the attention output, write the norm's output: 3e; the sum itself is
    recomputed where it is read again) and the block's last add (read x, the attention and MLP
    outputs, write: 4e), 9e (eager: 10e). Backward each norm's input gradient in one kernel that
    also sums the projections' input gradients and adds the residual gradient (the MLP norm reads its
    n gradients, x, the attention output and the residual gradient, writes one: ``(n + 4)e``; the
    attention norm ``(n + 3)e``), and one kernel for both norms' weight gradients (a reduction over
    tokens: it reads the summed gradients' summands, x and the attention output again); with dense
    n = 2 (w1, w3) and 3 (wq, wk, wv): 19e (eager 21e). Under TP the input gradients are partial sums
    reduced by a collective: their sum is its own kernel (read n, write 1, on the full [tokens,
    hidden]) and the norms see one gradient each. RoPE (the engine's real formula under compile,
    engine/models/rope.py) fuses with the casts around it and with GQA's K/V repeat: q read and
    written once (2e), k read once and written repeated to the query heads, v's repeat a copy; the
    backward's sums over the repeats fuse with RoPE's backward the same way. ``planner.rope:
    complex`` (torchtitan's ``view_as_complex``): Inductor generates no complex code, so the cast,
    the complex multiply and the cast back stay three kernels (``2e + 16`` per element each way) and
    only k's repeat fuses into the cast back. SwiGLU one kernel each way (read gate and up, write
    the product: 3e; backward read the gradient, gate and up, write two: 5e). The MoE dispatch and
    combine are index kernels, priced as eager."""
    t, e, tok = x.tp, x.e, x.b * x.s
    rep = 1 if x.sp else t
    hdim = x.h * tok / t * rep
    q_el, kv_el = x.heads * x.hd * tok / t, x.kv_heads * x.hd * tok / t
    gqa = x.heads > x.kv_heads and not x.gqa_native  # repeated K/V (plan/gqa.py)
    act = ((x.top_k + x.shared) * x.expert_ffn if moe else x.ffn) * tok / t
    n_attn, n_mlp = 3, (1 if moe else 2)
    if t == 1:
        norms_b, sums = (2 * n_mlp + 2 * n_attn + 9) * e * hdim, 0.0
    else:
        norms_b = 13 * e * hdim
        sums = ((n_attn + 1) + (n_mlp + 1 if n_mlp > 1 else 0)) * e * x.h * tok
    if x.rope == "complex":
        per = 2 * e + 16
        rope = per * q_el + (per * kv_el + e * (q_el - kv_el) + e * (kv_el + q_el) if gqa else per * kv_el)
    else:
        rope = 2 * e * q_el + (2 * e * (kv_el + q_el) if gqa else 2 * e * kv_el)
    fwd = 9 * e * hdim + rope + 3 * e * act
    bwd = norms_b + sums + rope + 5 * e * act
    return _with_dispatch(x, moe, fwd, bwd)


def layer_attention_seconds(x: BlockShape, gpu: GPUSpec, sms: int | None = None) -> tuple[float, float]:
    """(forward, backward) seconds of one block's attention on one rank, one micro batch: its kernels,
    and under ring / all-gather CP the merges, copies and accumulators between them (plan/cpmerge.py)."""
    heads = max(1, x.heads // x.tp)
    f, b = attention_seconds(x.b, x.s, x.seq, heads, x.hd, x.attn_executed, gpu, sms, x.attention, x.e, x.kv_len)
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
    if x.lora is not None:  # frozen bases and adapters (plan/loratime.py; validate refuses LoRA on MoE)
        fwd, bwd, again = lora_pass_seconds(x, gpu, x.lora_first, (af, ab), (ef_s, eb_s), sms)
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
    from llmtrain.plan.gqa import native_gqa, repeating_layers  # noqa: PLC0415
    from llmtrain.plan.memory import compute_bytes  # noqa: PLC0415  (memory imports the schema)

    m, p, t = recipe.model, recipe.parallel, recipe.train
    fp8 = gpu.peak_flops_fp8 if t.precision == "fp8" and gpu.peak_flops_fp8 > 0 else 0.0
    blocks = dims.cp > 1 and p.cp_method != "ulysses"  # ring / all-gather CP: kernel calls over seq / cp keys
    attention = recipe.planner.attention_kernel
    if attention == "engine" and blocks:  # the engine's CP blocks call FA2's op themselves (context_blocks.py)
        attention = "fa2"
    if attention == "engine" and m.attention_softcap is not None:  # Gemma 2: the engine's own kernel (softcap.py)
        attention = "softcap"
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
                      lora=None if t.lora is None else (t.lora.rank, t.lora.target_names, t.lora.dropout > 0),
                      loss=recipe.planner.loss, kernels=recipe.planner.block_kernels, compiled=t.compile,
                      rope=recipe.planner.rope, norms=2 * m.pre_norms + 2 * m.post_norms, offset_norm=m.norm_offset,
                      # the whole block priced as its layers without a window band (plan/gqa.py)
                      gqa_native=native_gqa(recipe, gpu.name, dims.cp, dims.tp) and not repeating_layers(recipe))


def rank_seconds(x: BlockShape, gpu: GPUSpec, dense_layers: int, moe_layers: int, last: bool,
                 sms: int | None = None, first_block: bool = False) -> tuple[float, float]:
    """(forward, backward) compute seconds of one micro batch on a pipeline rank holding
    ``dense_layers`` + ``moe_layers`` blocks (and the output head when ``last``); ``sms``: on
    only that many SMs (:func:`overlap_slowdown`); ``first_block``: under LoRA, one of the dense
    blocks is block 0 (its input needs no gradient)."""
    fwd = bwd = 0.0
    if first_block and x.lora is not None and dense_layers:
        fwd, bwd = block_seconds(replace(x, lora_first=True), gpu, False, sms)
        dense_layers -= 1
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
                     first_block: bool = False) -> float:
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
