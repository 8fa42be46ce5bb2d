"""Time model v2 under LoRA (``train.lora``): a block's GEMMs as the engine's ``LoRALinear`` runs them.

``LoRALinear`` (engine/finetune/lora.py) computes ``W x + scale * B(A(dropout(x)))`` with ``W``
frozen. Per projection of per-rank shape ``(m tokens, n out, k in)`` (TP-split as the base: a
column-wise base (wq wk wv w1 w3) keeps ``A`` (r x k) replicated and splits ``B``; a row-wise one
(wo w2) splits ``A`` and replicates ``B``), following autograd's ``requires_grad`` propagation as
plan/flops.py counts it (a test keeps the two equal, GEMM by GEMM):

- forward: the base ``(m, n, k)``; with an adapter ``A (m, r, k)`` and ``B (m, n, r)``;
- backward: the base's input gradient ``(m, k, n)`` only when its input needs one (never a weight
  gradient: frozen); the adapter's ``B`` weight gradient ``(n, r) <- (n, m)(m, r)``, its input
  gradient ``(m, r) <- (m, n)(n, r)``, ``A``'s weight gradient, and ``A``'s input gradient when the
  input needs one. Block 0's input needs none (the frozen embedding), so with targets that leave
  a branch frozen, block 0's branch runs no backward GEMM; a projection's output needs a gradient
  when its input does or it has an adapter.

Thin adapter GEMMs (``r`` of 8-64) are memory-bound and the roofline in :func:`gemm_seconds`
prices them by their bytes. Beside the GEMMs, per adapted projection: the scale (``2e`` bytes per
output element each way), the add (``3e`` forward; its backward passes the gradient through) and,
with ``dropout > 0``, the dropout on the input (``2e + 1`` forward, ``2e + 1`` backward when the
input needs a gradient). The attention kernel's backward runs whole when any of q, k, v needs a
gradient (the flash kernels compute dQ, dK, dV together), not at all otherwise; the norms,
RoPE and SwiGLU as a full block (``ops._elementwise``; block 0's norm backward, which it skips, is
counted: one block's share). Recomputation: ``full`` re-runs the forward up to what backward needs
(the engine's early stop: without an adapter on w2 all but w2's base GEMM, with one all but its
``B``), ``selective`` the element-wise ops, ``selective_mm`` the frozen bases of wk, w3 and (no TP)
wo (the adapters' outputs stay saved). ``train.precision: fp8`` with LoRA is not priced here
(costmodel falls back to v1's compute).
"""

from __future__ import annotations

from typing import NamedTuple

from llmtrain.recipe.gpus import GPUSpec

from llmtrain.plan.gemmtime import gemm_seconds, membound_seconds
from llmtrain.plan.shards import block_targets

# Kernels one adapted projection launches (forward: A, B, the scale, the add; backward: B's and A's
# weight and input gradients, the scale's gradient); dropout adds one each way
LORA_KERNELS = (4, 5)


def lora_projection(m: float, n: float, k: float, rank: int, adapted: bool,
                    input_grad: bool) -> tuple[list[tuple], list[tuple]]:
    """(forward, backward) GEMMs ``(m, n, k)`` of one projection (``n``, ``k``: the per-rank base
    shape; the adapter's split follows the base's, see the module docstring)."""
    fwd, bwd = [(m, n, k)], [(m, k, n)] if input_grad else []
    if adapted:
        fwd += [(m, rank, k), (m, n, rank)]
        bwd += [(n, rank, m), (m, rank, n), (rank, k, m)] + ([(m, k, rank)] if input_grad else [])
    return fwd, bwd


class BlockGemms(NamedTuple):
    """A dense block's GEMMs ``(m, n, k)`` per rank under LoRA, and what autograd computes."""

    fwd: list[tuple]
    bwd: list[tuple]
    attention_grad: bool  # whether any of q, k, v needs a gradient (the attention kernel's backward runs)
    again: tuple  # the GEMMs full recomputation re-runs
    input_grad: dict[str, bool]  # per projection: whether its input needs a gradient


def block_gemms(x, first: bool, moe: bool = False) -> BlockGemms:
    """A block's GEMMs under LoRA for :class:`~llmtrain.plan.ops.BlockShape` ``x``; the first block's
    input needs no gradient. An MoE block (``moe``) has adapters on its attention, and on its routed
    experts with ``train.lora.experts`` (``e1 e2 e3`` in the key); its router and shared experts are
    frozen: their forward GEMMs (as ops.block_gemms, balanced routing) and, where the MLP input needs
    a gradient, their input gradients; each routed expert's three as the dense MLP's, per local expert."""
    rank, targets, _ = x.lora
    targets, adapted = block_targets(targets, moe)
    experts = {name: name in adapted for name in ("w1", "w2", "w3")}
    tok, t = x.b * x.s, x.tp
    q, kv, f = x.heads * x.hd / t, x.kv_heads * x.hd / t, x.ffn / t
    fwd: list[tuple] = []
    bwd: list[tuple] = []
    needs: dict[str, bool] = {}

    def proj(name: str, n: float, k: float, input_grad: bool) -> bool:
        pf, pb = lora_projection(tok, n, k, rank, name in targets, input_grad)
        fwd.extend(pf)
        bwd.extend(pb)
        needs[name] = input_grad
        return input_grad or name in targets

    x_grad = not first
    gq, gk, gv = proj("wq", q, x.h, x_grad), proj("wk", kv, x.h, x_grad), proj("wv", kv, x.h, x_grad)
    attn = gq or gk or gv
    o = proj("wo", x.h, q, attn)
    r_grad = x_grad or o
    if moe:
        local = max(1, x.experts // max(1, x.ep))
        per, ef = tok * x.top_k / local, x.expert_ffn / t  # routed tokens per local expert, its width per rank
        frozen = [(tok, x.experts, x.h, 1)]
        if x.shared:
            sf = x.shared * x.expert_ffn / t
            frozen += [(tok, sf, x.h, 2), (tok, x.h, sf, 1)]
        for m, n, k, count in frozen:
            fwd.extend([(m, n, k)] * count)
            bwd.extend([(m, k, n)] * count if r_grad else [])
        for _ in range(local):  # the routed experts, adapted or frozen
            for name, n, k, grad in (("w1", ef, x.h, r_grad), ("w3", ef, x.h, r_grad),
                                     ("w2", x.h, ef, r_grad or experts["w1"] or experts["w3"])):
                pf, pb = lora_projection(per, n, k, rank, experts[name], grad)
                fwd.extend(pf)
                bwd.extend(pb)
        # full recomputation runs an MoE block's forward again whole (flops.recompute_flops_per_token)
        return BlockGemms(fwd, bwd, attn, tuple(fwd), needs)
    g, u = proj("w1", f, x.h, r_grad), proj("w3", f, x.h, r_grad)
    proj("w2", x.h, f, g or u)
    # full recomputation stops before the block's last GEMM: w2's B with an adapter, else w2's
    # base; either is the last of the forward list
    return BlockGemms(fwd, bwd, attn, tuple(fwd[:-1]), needs)


def adapter_bytes(x, input_grad: dict[str, bool], moe: bool = False) -> tuple[float, float]:
    """(forward, backward) HBM bytes of the adapters' element-wise ops (scale, add, dropout) per rank
    and micro batch (``input_grad``: :attr:`BlockGemms.input_grad`: the projections the block has;
    ``moe``: an MoE block, whose routed experts' adapters act per routed slot)."""
    rank, targets, dropout = x.lora
    targets = tuple(name for name in targets if name in input_grad)
    tok, t, e = x.b * x.s, x.tp, x.e
    shapes = {"wq": (x.heads * x.hd / t, x.h), "wk": (x.kv_heads * x.hd / t, x.h), "wv": (x.kv_heads * x.hd / t, x.h),
              "wo": (x.h, x.heads * x.hd / t), "w1": (x.ffn / t, x.h), "w3": (x.ffn / t, x.h), "w2": (x.h, x.ffn / t)}
    fwd = bwd = 0.0
    for name in targets:
        n, k = shapes[name]
        fwd += tok * n * (2 * e + 3 * e)  # scale, add
        bwd += tok * n * 2 * e  # scale's backward (the add passes its gradient through)
        if dropout:
            fwd += tok * k * (2 * e + 1)
            bwd += tok * k * (2 * e + 1) if input_grad[name] else 0.0
    if moe:  # the routed experts' adapters (train.lora.experts, no dropout): scale and add per routed slot
        n = sum(x.h if name == "w2" else x.expert_ffn / t for name in block_targets(x.lora[1], True)[1])
        fwd += tok * x.top_k * n * 5 * e
        bwd += tok * x.top_k * n * 2 * e
    return fwd, bwd


def gemm_list_seconds(gemms, gpu: GPUSpec, sms: int | None = None) -> float:
    return sum(gemm_seconds(m, n, k, gpu, sms=sms) for m, n, k in gemms)


def lora_pass_seconds(x, gpu: GPUSpec, first: bool, attention: tuple[float, float], elementwise: tuple[float, float],
                      sms: int | None = None, moe: bool = False) -> tuple[float, float, float]:
    """(forward, backward, what full recomputation re-runs) seconds of one block under LoRA
    (``attention``, ``elementwise``: the block's attention and element-wise (forward, backward)
    seconds as ops.py prices them without LoRA); ops.block_seconds adds the recomputation."""
    fwd_g, bwd_g, attn_grad, again, input_grad = block_gemms(x, first, moe)
    af, ab = attention
    ef, eb = elementwise
    lf, lb = (membound_seconds(v, gpu) for v in adapter_bytes(x, input_grad, moe))
    fwd = gemm_list_seconds(fwd_g, gpu, sms) + af + ef + lf
    bwd = gemm_list_seconds(bwd_g, gpu, sms) + (ab if attn_grad else 0.0) + eb + lb
    return fwd, bwd, gemm_list_seconds(again, gpu, sms) + af + ef + lf
