"""Async TP (``parallel.async_tp``) in the planner: which SP collectives torch's micro-pipeline pass
fuses with a matmul, and how much of their time stays exposed. Bytes and counts are plain SP's
(comm.py); only the phase and the exposed share change.

Which ones fuse (torch/_inductor/fx_passes/micro_pipeline_tp.py, torch 2.13): an all-gather with
the matmuls that consume it, a reduce-scatter with the ONE matmul that produces it
(``_find_producer_matmul``: mm, or reshape-mm-reshape). Per layer and micro batch every all-gather
qualifies (before wq/wk/wv and w1/w3 in the forward and the recomputed forward; in the backward the
gathers of the wo / w2 output gradients, consumed by their input-gradient matmuls), and so do the
forward's reduce-scatters after wo and w2. The backward's reduce-scatters of the attention and MLP
input gradients do not: each reduces the sum of the wq + wk + wv (w1 + w3) input gradients, an add,
not a matmul. So 2 of a layer's reduce-scatters stay plain (read from the pass, not
fitted; torchtitan's 70B / 256 H100 async TP gains, 1.09x bf16 and 1.16x Float8, are checked
against it in benchmarks/planner_vs_published.py rows 54-57). ``planner.tp_overlap`` (Megatron-Core's
overlap, priced by the same rule otherwise) hides those 2 beside the weight-gradient GEMMs:
:func:`megatron_bulk_reduces`.
"""

from __future__ import annotations

UNFUSED_REDUCE_SCATTERS = 2  # per layer and micro batch: the attention and MLP input gradients


def tp_overlap_kind(recipe) -> str:
    """Which overlap prices a recipe's TP collectives (where tp > 1): ``"async"`` (``parallel.async_tp``
    under sequence parallelism: the fused collectives, :func:`async_tp_fused_counts`), ``"megatron"``
    (another stack's ``planner.tp_overlap`` without ``parallel.async_tp``, under sequence parallelism:
    the same fused collectives, and :func:`megatron_bulk_reduces` beside the weight-gradient GEMMs), else
    ``"backward"`` (``planner.tp_backward_overlap``: :func:`tp_backward_async`), else ``"none"``. One rule
    for comm.py, the search's TP floor and ``plan``'s "assumes" line."""
    p, pl = recipe.parallel, recipe.planner
    if p.sequence_parallel and p.async_tp:
        return "async"
    if p.sequence_parallel and pl.tp_overlap:
        return "megatron"
    return "backward" if pl.tp_backward_overlap else "none"


def async_tp_fused_counts(micro_batches: int, gathers: int, reduces: int, layers: int) -> dict[str, int]:
    """How many all-gathers and reduce-scatters of one pipeline rank's step the pass fuses
    (``gathers`` / ``reduces``: SP all-gathers / reduce-scatters per layer and micro batch,
    recomputed ones included: comm.py's TP section)."""
    return {"all-gather": micro_batches * gathers * layers,
            "reduce-scatter": micro_batches * (reduces - UNFUSED_REDUCE_SCATTERS) * layers}


def megatron_bulk_reduces(micro_batches: int, layers: int, lora_first: int = 0) -> int:
    """How many of one pipeline rank's SP reduce-scatters ``planner.tp_overlap`` prices as Megatron-Core's
    bulk overlap hides them (phase ``tp-bwd-overlap``, the exposure rule of
    :func:`tp_backward_exposed_factor`): the :data:`UNFUSED_REDUCE_SCATTERS` block input gradients per layer
    and micro batch that torch's pass leaves plain. Megatron-Core's ``tp_comm_overlap`` runs Transformer
    Engine's userbuffers overlap with ``tp_comm_bulk_dgrad`` on by default ("allows Reduce-Scatter overlap
    with Bprop weight gradient GEMM", megatron/core/model_parallel_config.py, core_r0.8.0 and later): the
    column-parallel QKV and fc1 layers reduce-scatter their input gradient beside their own weight-gradient
    GEMM. ``lora_first``: block 0's attention input needs no gradient (comm_tp.py)."""
    return micro_batches * (UNFUSED_REDUCE_SCATTERS * layers - lora_first)


def async_tp_exposed_factor(overlapped_s: float, compute_s: float, group: int) -> float:
    """The exposed share of the collectives async TP fuses with matmuls (phase ``tp-overlap``).

    torch's micro-pipelined TP (engine/parallel/async_tp.py) splits each SP all-gather before a
    column-parallel matmul (wq/wk/wv, w1/w3, and in backward the row-parallel outputs' gradients)
    and each reduce-scatter after a row-parallel one (wo, w2) into ``group`` chunks moved while the
    matmul works on the chunks already there; the backward's reduce-scatters of the block input
    gradients are not fused (a sum of matmuls: module docstring) and are not priced here. Model:
    one chunk of every such collective stays exposed (the pipeline's fill / drain: ``1 / group``);
    the other ``1 - 1 / group`` hides behind the
    rank's compute of the same micro batches (``compute_s``, the same seconds the collectives
    run in; the matmuls are nearly all of it), and what exceeds that is exposed too. Only a time
    effect: bytes and counts are those of plain SP. One factor for all of them (each gets its
    share of the compute in proportion to its seconds)."""
    if overlapped_s <= 0:
        return 1.0
    return 1.0 / group + max(0.0, 1.0 - 1.0 / group - compute_s / overlapped_s)


def tp_backward_async(micro_batches: int, layers: int, gathers: int, sp: bool) -> dict[str, int]:
    """How many of one pipeline rank's TP collectives ``planner.tp_backward_overlap`` prices as running
    beside the backward's GEMMs (phase ``tp-bwd-overlap``): Megatron-LM's column-parallel linear since
    2021-09 (``LinearWithGradAccumulationAndAsyncCommunication`` in megatron/mpu/layers.py, read at
    NVIDIA/Megatron-LM d898a89, 2022-05-25; megatron/core/tensor_parallel/layers.py later) launches, per
    column-parallel input (the attention's and the MLP's: 2 per layer and micro batch), the input
    gradient's all-reduce (with SP: its reduce-scatter) with ``async_op=True`` before the
    weight-gradient GEMM, and with SP the re-gather of the saved input shard before the
    input-gradient GEMM. Counted against the engine's collectives (bytes unchanged, comm.py): the
    reduce sites' 2 (``"reduce-scatter"``, without SP the all-reduces) and, with SP, the re-gathers
    this recipe's recomputation already runs (``gathers``: selective and full re-gather both inputs;
    without recomputation the engine keeps the gathered input and re-gathers nothing, where Megatron
    would, hidden: not priced). The forward's collectives and the row-parallel outputs' backward
    ones stay in line, as in Megatron-LM."""
    return {"reduce-scatter": micro_batches * 2 * layers,
            "all-gather": micro_batches * min(2, gathers) * layers if sp else 0}


def tp_backward_exposed_factor(overlapped_s: float, backward_s: float) -> float:
    """The exposed share of the ``tp-bwd-overlap`` collectives (:func:`tp_backward_async`): each runs
    beside one gradient GEMM of its layer; at the shapes where TP is used that GEMM is the longer,
    so they hide up to the rank's backward compute of the same micro batches (``backward_s``) and
    what exceeds it is exposed. No chunking (one collective, one GEMM), unlike async TP."""
    if overlapped_s <= 0:
        return 1.0
    return max(0.0, 1.0 - backward_s / overlapped_s)
