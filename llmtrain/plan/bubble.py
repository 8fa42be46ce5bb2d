"""Pipeline bubble fraction per schedule (idle time / ideal compute time).

- GPipe and 1F1B: (p - 1) / m (Huang et al. 2019; Narayanan et al. 2021).
- Interleaved 1F1B with v chunks per rank: (p - 1) / (v m) (Narayanan et al. 2021, sec. 2.2).
- Zero-bubble (ZB-H1-like, looped) and ZBV: backward is split into input- and weight-gradient
  passes that fill the bubble; Qi et al. 2023 ("Zero Bubble Pipeline Parallelism",
  arXiv:2401.10241) report ZB-H1 at about 1/3 of 1F1B's bubble and ZB-V near zero when
  m >= 2p. We use (p - 1) / (3 v m) for zero-bubble and (p - 1) / (6 m) for zbv.
- DualPipeV (DeepSeek-V3, arXiv:2412.19437, Table 2): bubble (p/2 - 1)(F&B + B - 3W) over
  m (F + B) units; with F = W = B/2 (a B of two units) this is (p/2 - 1) / (3 m), floored at 0.
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
        return max(0.0, (pp / 2 - 1) / (3 * m))
    raise ValueError(f"unknown schedule {schedule}")
