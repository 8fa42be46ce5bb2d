"""Activation terms of a block's MLP: the dense SwiGLU MLP, the MoE block, the MoE block whose router
and experts are frozen (LoRA), and what adapters on its routed experts add; split out of
:mod:`llmtrain.plan.activations` (one concept: what the MLP half of a block keeps for backward), which
re-exports them."""

from __future__ import annotations

from typing import TYPE_CHECKING

from llmtrain.plan.norm_activations import _norm

if TYPE_CHECKING:
    from llmtrain.plan.activations import ActShape


def mlp_terms(x: ActShape, recompute: str) -> dict[str, int]:
    bs, e = x.b * x.s, x.e
    f = bs * x.ffn // x.tp
    if recompute in ("selective", "selective_mm"):  # outputs of w1, w3 (w2's output, the block's last op,
        return {"mlp_proj_out": e * (2 if recompute == "selective" else 1) * f}  # is discarded; selective_mm: w3's too
    out = _norm(x) if x.pre_norms else {}
    out["mlp_input"] = bs * x.h * e
    out["swiglu"] = 3 * e * f  # w1's and w3's outputs (engine/models/swiglu.py) and w2's input
    return out


def moe_terms(x: ActShape, recompute: str) -> dict[str, int]:
    """MoE block (``engine/models/moe.py``): T tokens, k copies each, E experts of width F."""
    # the full sequence on every TP rank (gathered under SP); expert-TP: each expert's (and the
    # shared experts') F / tp slice (engine/parallel/expert.py)
    t_tok, k, e, h = x.b * x.s, x.top_k, x.e, x.h
    f, sf = x.expert_ffn // x.tp, x.shared_ffn // x.tp
    slots = t_tok * k
    if recompute in ("selective", "selective_mm"):  # outputs of router, each expert's gate/up/down, shared
        # w1/w3/w2 (selective_mm too: an MoE block has no feed_forward.w3, engine/parallel/checkpointing.py)
        return {"moe_proj_out": e * (t_tok * x.experts + slots * (2 * f + h)
                                     + t_tok * (2 * sf + h) * (1 if sf else 0))}
    out = _norm(x) if x.pre_norms else {}
    out["moe_input"] = t_tok * h * e  # router (+ shared experts') input
    out["moe_dispatch"] = slots * h * e  # tokens gathered per expert
    out["moe_experts"] = 3 * slots * f * e  # gate, up (engine/models/swiglu.py) and w2's input, per slot
    out["moe_combine"] = 2 * slots * h * e  # expert outputs, weighted outputs
    out["moe_routing"] = t_tok * x.experts * 4 + slots * (8 + 4 + 8 + 8 + 4) + t_tok * 8
    if sf:
        out["moe_shared"] = 3 * t_tok * sf * e
    return out


def frozen_moe_terms(x: ActShape) -> dict[str, int]:
    """An MoE block whose router and experts are frozen (LoRA) but whose input needs a gradient: autograd keeps
    what the input gradient needs, not what only the weight gradients would: the routing (softmax, top-k,
    weights: the gates still depend on the input), the w1 / w3 outputs of every routed slot and of the
    shared experts (the SwiGLU's backward), the combine's expert outputs and weighted outputs; not the
    router's or the shared experts' input, the dispatched tokens or w2's inputs (:func:`moe_terms` has them).
    Measured: tests/test_costmodel.py ``lora_moe_*``."""
    t_tok, k, e, h = x.b * x.s, x.top_k, x.e, x.h
    f, sf = x.expert_ffn // x.tp, x.shared_ffn // x.tp
    slots = t_tok * k
    out = {"moe_experts": 2 * slots * f * e, "moe_combine": 2 * slots * h * e,
           "moe_routing": t_tok * x.experts * 4 + slots * (8 + 4 + 8 + 8 + 4) + t_tok * 8}
    if sf:
        out["moe_shared"] = 2 * t_tok * sf * e
    return out


def expert_lora_terms(x: ActShape, names: tuple[str, ...], recompute: str) -> dict[str, int]:
    """What LoRA on the routed experts (``train.lora.experts``, engine/finetune/lora_experts.py) adds to
    :func:`frozen_moe_terms`: each adapter's ``A x`` per routed slot ``[slots, r]`` (kept for ``B``'s weight
    gradient), the dispatched tokens when ``w1`` or ``w3`` is adapted (``A``'s weight gradient) and w2's
    input when ``w2`` is (the frozen GEMMs keep neither). Under selective recomputation the policy keeps
    the adapters' matmul outputs instead: ``A x`` and ``B A x`` (``[slots, out]``). ``names``: the adapted
    experts' projections, ``w1 w2 w3`` (plan/shards.py ``block_targets``)."""
    if not names:
        return {}
    slots, e, h, rank = x.b * x.s * x.top_k, x.e, x.h, x.lora[0]
    f = x.expert_ffn // x.tp
    ax = slots * rank * e * len(names)
    if recompute in ("selective", "selective_mm"):
        return {"lora_expert_outputs": ax + slots * e * sum(h if n == "w2" else f for n in names)}
    out = {"lora_expert_ax": ax}
    if "w1" in names or "w3" in names:
        out["moe_dispatch"] = slots * h * e
    if "w2" in names:
        out["lora_expert_w2_input"] = slots * f * e
    return out
