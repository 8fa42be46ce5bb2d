"""Micro batches in flight per pipeline schedule: how many micro batches' activations a pipeline
rank holds at its peak (the activation-memory multiplier of :mod:`llmtrain.plan.costmodel`)."""

from __future__ import annotations


def inflight(schedule: str, pp: int, virtual: int, microbatches: int, pp_rank: int) -> list[int]:
    """Micro batches whose activations pipeline rank ``pp_rank`` holds at its peak, per local chunk
    (chunks in :func:`llmtrain.plan.shards.rank_stages` order).

    - pp = 1: one (gradient accumulation runs micro batches one after another);
    - GPipe (Huang et al. 2019): all ``m`` forwards run before any backward;
    - 1F1B (Narayanan et al. 2021): stage ``r`` warms up with ``p - r`` forwards;
    - interleaved 1F1B: ``(v-1) p + 2 (p - 1 - r)`` warm-up forwards plus one (Megatron-LM and
      torch ``ScheduleInterleaved1F1B``), so rank 0 holds ``L (1 + (p-1)/(p v))`` layers' worth
      (Korthikanti et al. 2022, sec. 4.2.3);
    - the split-backward schedules free a micro batch's activations at its weight pass (W), not
      its input-gradient pass (I: torch's ``stage_backward_input`` keeps the graph,
      ``retain_graph=True``, for W), so what counts is each chunk's forwards not yet followed by
      their W in torch's own order (``pipeline_order``, tests/test_pipeline_inflight.py checks
      these counts against it): zero-bubble (looped ZB1P, ``ScheduleInterleavedZeroBubble``)
      holds ``p`` on every chunk of every rank (before the twentieth session: the warm-up count
      ``(v-1) p + (p - 1 - r)`` spread over the chunks, which lets the later chunks of the later
      ranks run fewer; measured 40 % over that on pp rank 1, benchmarks/planner_fidelity.py's
      engine check); ZBV (Qi et al. 2023, sec. 6; ``ScheduleZBVZeroBubble``) ``2p - r - 1`` on
      chunk 0 and ``r + 1`` on chunk 1 (before: ``p``, which is rank p-1's; 23 % less measured on
      rank 0);
    - DualPipeV (torch ``ScheduleDualPipeV`` after deepseek-ai/DualPipe): chunk 0 ``2p - r - 1``
      forwards plus the one overlapped with the first backward, chunk 1 ``r + 1``: ``2p + 1``
      chunks in all, the "PP + 1" of DeepSeek-V3's Table 2 with PP = 2p stages.
    """
    m, p, r = microbatches, pp, pp_rank
    if p <= 1:
        return [1]
    if schedule == "gpipe":
        return [m]
    if schedule == "1f1b":
        return [min(p - r, m)]
    if schedule == "zero-bubble":
        return [min(p, m)] * virtual
    if schedule == "interleaved-1f1b":
        n = min((virtual - 1) * p + 2 * (p - 1 - r) + 1, m * virtual)
        counts = [0] * virtual
        for k in range(n):
            counts[(k // p) % virtual] += 1
        return counts
    if schedule == "zbv":
        return [min(2 * p - r - 1, m), min(r + 1, m)]
    if schedule == "dualpipev":
        return [min(2 * p - r, m), min(r + 1, m)]
    raise ValueError(f"unknown schedule {schedule}")


def split_backwards(schedule: str, pp: int, stage: int, microbatches: int) -> int:
    """Micro batches whose backward on pipeline ``stage`` runs as an input-gradient pass and a later
    weight pass (torch's ``BACKWARD_INPUT`` then ``BACKWARD_WEIGHT``), per step. Full recomputation
    recomputes a checkpointed block in each of the two (:func:`llmtrain.plan.costmodel.recompute_again`).

    zero-bubble and ZBV split every micro batch's backward. DualPipeV runs most of them whole
    (inside its ``OVERLAP_F_B`` pairs and as ``FULL_BACKWARD``) and splits a fixed few, whatever the
    micro-batch count: ``p - ceil(s / 2)`` on stage ``s < p``, ``p - 1 - floor(r / 2)`` on stage
    ``2p - 1 - r`` (rank ``r``'s second stage), read from torch's ``pipeline_order`` and checked
    against it (tests/test_pipeline_inflight.py). The other schedules never split."""
    if pp <= 1:
        return 0
    if schedule in ("zero-bubble", "zbv"):
        return microbatches
    if schedule == "dualpipev":
        return min(microbatches, pp - (stage + 1) // 2 if stage < pp else pp - 1 - (2 * pp - 1 - stage) // 2)
    return 0
