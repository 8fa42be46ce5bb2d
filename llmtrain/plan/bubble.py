"""Pipeline bubble fraction per schedule (idle time / ideal compute time).

``p`` pipeline ranks, ``m`` micro batches per step, ``v`` model chunks per rank; F, B and W are
the times of one chunk's forward, backward (or input-gradient) and weight-gradient passes.

- GPipe and 1F1B: ``(p - 1) / m``. Huang et al. 2019 (GPipe, arXiv:1811.06965) state the bubble
  as ``(p - 1) / (m + p - 1)`` of the *total* time, which is ``(p - 1) / m`` of the compute time;
  Narayanan et al. 2021 (arXiv:2104.04473, sec. 2.2.1) give ``(p - 1) / m`` for 1F1B (same
  bubble, less memory).
- Interleaved 1F1B: ``(p - 1) / (v m)`` (Narayanan et al. 2021, sec. 2.2.2).
- Zero bubble, looped (ZB-H1 / ZB1P; Qi et al. 2023, arXiv:2401.10241, sec. 3): the bubble
  shrinks from ``(p - 1)(F + B + W)`` to ``(p - 1)(F + B - W)``; with the paper's F = B = W
  (B here = input gradient only) that is a third: ``(p - 1) / (3 m)``, and ``(p - 1) / (3 v m)``
  with ``v`` chunks per rank (torch ``ScheduleInterleavedZeroBubble``).
- ZBV (Qi et al. 2023, sec. 6): ideally ``(p - 1)(F + B - 2W)`` = 0 when F = B = W; torch's
  ``ScheduleZBVZeroBubble`` notes that real models rarely have equal times, so we do not assume
  zero and use the looped zero-bubble value at v = 2: ``(p - 1) / (6 m)`` (a heuristic).
- DualPipeV (DeepSeek-V3, arXiv:2412.19437, Table 2; deepseek-ai/DualPipe): bubble
  ``(PP/2 - 1)(F&B + B - 3W)`` for PP stages. DualPipeV folds PP stages onto ``p = PP / 2``
  ranks (two chunks each), so ``PP / 2 - 1 = p - 1``; with F = 1, B = 2, W = 1 and an overlapped
  F&B pair costing F + B = 3, the idle time is ``2 (p - 1)`` against ``m x 2 x (F + B) = 6 m`` of
  compute: ``(p - 1) / (3 m)``. (The previous ``(p/2 - 1) / (3m)`` read PP as the rank count.)

:mod:`llmtrain.plan.schedule` generates the gpipe, 1f1b, interleaved and zero-bubble orders and
simulates them; its measured bubble equals these formulas (tests/test_costmodel.py). Its greedy
V-shaped simulation (zbv, dualpipev; one op at a time, no F&B overlap) idles ``(p - 1)`` units:
the zbv value above, half the dualpipev one.
"""

from __future__ import annotations


def bubble_fraction(schedule: str, pp: int, virtual: int, microbatches: int) -> float:
    if pp <= 1 or microbatches <= 0:
        return 0.0
    m = microbatches
    if schedule in ("gpipe", "1f1b"):
        return (pp - 1) / m
    if schedule == "interleaved-1f1b":
        return (pp - 1) / (virtual * m)
    if schedule == "zero-bubble":
        return (pp - 1) / (3 * virtual * m)
    if schedule == "zbv":
        return (pp - 1) / (6 * m)
    if schedule == "dualpipev":
        return (pp - 1) / (3 * m)
    raise ValueError(f"unknown schedule {schedule}")
