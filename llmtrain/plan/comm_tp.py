"""Tensor-parallel collectives per step (plan/comm.py's volumes, the TP bullet of its docstring): the
block's gather and reduce sites, what recomputation re-runs (plan/recompute_comm.py), and which of
them async TP, ``planner.tp_overlap`` or ``planner.tp_backward_overlap`` overlap (plan/asynctp.py).
Split out of comm.py by concept."""

from __future__ import annotations

from typing import TYPE_CHECKING

from llmtrain.plan.asynctp import async_tp_fused_counts, megatron_bulk_reduces, tp_backward_async
from llmtrain.plan.collective import Comm, make
from llmtrain.plan.links import Link
from llmtrain.plan.recompute_comm import recomputed_tp_sites

if TYPE_CHECKING:
    from llmtrain.plan.comm import CommSpec


def tp_comms(c: CommSpec, g: Link) -> list[Comm]:
    """One pipeline rank's TP collectives per step over link ``g`` (tp > 1)."""
    d, m = c.dims, c.microbatches
    out: list[Comm] = []
    act = c.e * c.tokens * c.hidden
    # per layer and micro batch: 2 gather sites (the attention and MLP inputs: SP all-gathers,
    # without SP nothing in the forward) and 2 reduce sites (wo and w2 outputs: SP
    # reduce-scatters, without SP all-reduces) forward, the transposes backward, and the sites
    # recomputation re-runs; one all-reduce equivalent for the vocabulary-parallel embedding
    # (forward only) and one for the output layer's input (backward only). With SP each
    # all-reduce equivalent is an all-gather plus a reduce-scatter (same bytes).
    gathers, reduces = recomputed_tp_sites(c.recompute, c.recompute_whole)
    ends = int(c.embedding) + int(c.output)
    # LoRA: block 0's input needs no gradient (frozen embedding): one all-reduce equivalent less
    # per micro batch (its attention input's gradient; with SP that reduce-scatter and the
    # embedding output gradient's all-gather)
    lora = int(c.lora_first and c.layers > 0)
    ag_layer, rs_layer = 4 + gathers, 4 + reduces
    counts = {"all-gather": m * (ag_layer * c.layers + ends - lora),
              "reduce-scatter": m * (rs_layer * c.layers + ends - lora)}
    if c.sp and c.async_tp:  # fused with their matmuls (asynctp.py), but not all of them
        fused = async_tp_fused_counts(m, ag_layer, rs_layer, c.layers)
        for op in ("all-gather", "reduce-scatter"):
            out.append(make("tp", op, d.tp, act, fused[op], g, "tp-overlap",
                            "sequence parallel, " + ("overlapped as Megatron-Core's TP overlap (planner.tp_overlap; "
                                                     "priced as the engine's async TP)" if c.overlap_by_planner else
                                                     "async TP: chunked under the column/row-parallel matmuls")))
            rest = counts[op] - fused[op]
            if op == "reduce-scatter" and c.overlap_by_planner:
                # Megatron-Core's userbuffers overlap also hides the block input gradients' reduce-scatters
                # (tp_comm_bulk_dgrad, on by default: each beside its layer's weight-gradient GEMM):
                # priced as planner.tp_backward_overlap prices them (asynctp.megatron_bulk_reduces)
                bulk = megatron_bulk_reduces(m, c.layers, lora)
                out.append(make("tp", op, d.tp, act, bulk, g, "tp-bwd-overlap",
                                "sequence parallel, block input gradients beside the weight-gradient GEMMs "
                                "(planner.tp_overlap: Megatron-Core's bulk overlap, tp_comm_bulk_dgrad)"))
                rest -= bulk
            if rest > 0:
                why = ("block input gradients (sums of matmuls), embedding / output: not fused"
                       if op == "reduce-scatter" and not c.overlap_by_planner else "embedding / output: not fused")
                out.append(make("tp", op, d.tp, act, rest, g, "microbatch", f"sequence parallel ({why})"))
    elif c.tp_bwd_overlap:  # planner.tp_backward_overlap (another stack's column-parallel linear): tp_backward_async
        ops = ("all-gather", "reduce-scatter") if c.sp else ("reduce-scatter",)
        hidden = tp_backward_async(m, c.layers, gathers, c.sp)
        for op in ops:
            name = op if c.sp else "all-reduce"
            if hidden[op]:  # (no re-gathers without recomputation: tp_backward_async)
                out.append(make("tp", name, d.tp, act, hidden[op], g, "tp-bwd-overlap",
                                ("sequence parallel, " if c.sp else "") + "backward, beside the gradient GEMMs "
                                "(planner.tp_backward_overlap)"))
            if counts[op] > hidden[op]:
                out.append(make("tp", name, d.tp, act, counts[op] - hidden[op], g, "microbatch",
                                "sequence parallel" if c.sp else ""))
    elif c.sp:
        out.append(make("tp", "all-gather", d.tp, act, counts["all-gather"], g, "microbatch", "sequence parallel"))
        out.append(make("tp", "reduce-scatter", d.tp, act, counts["reduce-scatter"], g, "microbatch",
                        "sequence parallel"))
    else:  # the gather sites are identities: only the reduce sites (and the ends) communicate
        out.append(make("tp", "all-reduce", d.tp, act, counts["reduce-scatter"], g, "microbatch"))
    if c.lora_replicated:
        out.append(make("tp", "all-reduce", d.tp, c.reduce_bytes * c.lora_replicated, 1, g, "step",
                        "LoRA: the gradients of the adapters replicated over TP (Partial), once per step"))
    factors, numel, nbytes = c.lora_expert_tp
    if factors and c.moe_layers:
        out.append(make("tp", "all-reduce", d.tp, nbytes * numel, m * c.moe_layers * factors, g, "microbatch",
                        "LoRA on the experts: the gradients of their factors replicated over TP, every backward"))
    return out
