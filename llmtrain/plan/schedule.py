"""Pipeline schedules as timelines: which micro batch's F / B / W runs on which rank, and when.

Pure Python, no torch: :func:`rank_orders` generates each rank's order of operations and
:func:`simulate` plays them against the dependencies (F of stage ``s`` needs F of ``s - 1``; B of
``s`` needs B of ``s + 1``, the last stage's B its own F; W needs its B) with unit costs
(F = 1, B = 2; zero-bubble splits B into B = 1 for the input gradient and W = 1 for the weight
gradient). The simulated bubble reproduces the closed forms of :mod:`llmtrain.plan.bubble`.

Orders (stage ``s`` on pipeline rank ``s % p``; looped placement):

- GPipe (Huang et al. 2019, arXiv:1811.06965): all forwards, then all backwards.
- 1F1B (PipeDream-Flush; Narayanan et al. 2021, arXiv:2104.04473, Fig. 4): ``p - r - 1`` warm-up
  forwards on rank ``r``, then one forward / one backward, then the remaining backwards.
- Interleaved 1F1B (same paper, sec. 2.2): ``v`` chunks per rank; forwards walk the chunks in
  groups of ``p`` micro batches; warm-up ``(v - 1) p + 2 (p - r - 1)`` (as Megatron-LM and
  torch ``ScheduleInterleaved1F1B``).
- Zero bubble (Qi et al. 2023, arXiv:2401.10241, sec. 3): the 1F1B order of F and B with the
  weight-gradient passes W deferred: a rank runs its oldest pending W whenever its next F/B
  would wait. This greedy order leaves ``(p - 1)(F + B - W)`` idle instead of
  ``(p - 1)(F + B + W)`` -- exactly ZB-H1's bubble, a third of 1F1B's with unit times -- but it
  defers more W passes than the hand-made ZB-H1 order does, so it draws ZB-H1's bubble, not
  its (1F1B-sized) memory. With ``v > 1`` the interleaved order is used with warm-up
  ``(v - 1) p + (p - r - 1)`` (torch ``ScheduleInterleavedZeroBubble``).

ZBV and DualPipeV (V-shaped placement) are not drawn.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

DRAWN = ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble")


@dataclass(frozen=True)
class Op:
    kind: str  # "F", "B" (full backward, or input-gradient only when split) or "W"
    mb: int
    stage: int


@dataclass(frozen=True)
class Slot:
    rank: int
    start: float
    end: float
    op: Op


@dataclass
class Timeline:
    schedule: str
    pp: int
    virtual: int
    microbatches: int
    slots: list[Slot]
    makespan: float
    busy: float  # per rank

    @property
    def bubble_fraction(self) -> float:
        """Idle time over compute time (the convention of :func:`llmtrain.plan.bubble.bubble_fraction`)."""
        return (self.makespan - self.busy) / self.busy


def _sequence(p: int, v: int, m: int, r: int, backward: bool) -> list[tuple[int, int]]:
    """(micro batch, stage) of rank ``r``'s forwards (or backwards) in interleaved order."""
    out = []
    for k in range(m * v):
        group = k // p
        chunk = group % v
        if backward:
            chunk = v - 1 - chunk
        mb = (k // (p * v)) * p + k % p
        out.append((mb, r + chunk * p))
    return out


def rank_orders(schedule: str, pp: int, virtual: int, microbatches: int) -> list[list[Op]]:
    if schedule not in DRAWN:
        raise ValueError(f"the timeline of {schedule} is not drawn; supported: {', '.join(DRAWN)}")
    p, m = pp, microbatches
    v = virtual if schedule in ("interleaved-1f1b", "zero-bubble") else 1
    if v > 1 and m % p:
        raise ValueError(f"{schedule} needs micro batches ({m}) divisible by pp ({p})")
    orders = []
    for r in range(p):
        fwd = [Op("F", mb, s) for mb, s in _sequence(p, v, m, r, False)] if v > 1 else [Op("F", mb, r) for mb in range(m)]
        bwd = [Op("B", mb, s) for mb, s in _sequence(p, v, m, r, True)] if v > 1 else [Op("B", mb, r) for mb in range(m)]
        if schedule == "gpipe":
            orders.append(fwd + bwd)
            continue
        factor = 2 if schedule == "interleaved-1f1b" else 1
        warmup = min((v - 1) * p + factor * (p - r - 1), m * v) if v > 1 else min(p - r - 1, m)
        order = fwd[:warmup]
        for i in range(len(fwd) - warmup):
            order += [fwd[warmup + i], bwd[i]]
        order += bwd[len(fwd) - warmup:]
        orders.append(order)
    return orders


def simulate(schedule: str, pp: int, virtual: int, microbatches: int, t_f: float = 1.0, t_b: float = 2.0) -> Timeline:
    """Play the orders with unit costs; zero-bubble splits ``t_b`` evenly into B and W."""
    orders = rank_orders(schedule, pp, virtual, microbatches)
    split = schedule == "zero-bubble"
    dur = {"F": t_f, "B": t_b / 2 if split else t_b, "W": t_b / 2}
    n_stages = pp * (virtual if schedule in ("interleaved-1f1b", "zero-bubble") else 1)
    done: dict[tuple[str, int, int], float] = {}
    ptr = [0] * pp
    clock = [0.0] * pp
    pending: list[deque[Op]] = [deque() for _ in range(pp)]
    slots: list[Slot] = []

    def ready(op: Op) -> float | None:
        if op.kind == "F":
            return 0.0 if op.stage == 0 else done.get(("F", op.mb, op.stage - 1))
        if op.stage == n_stages - 1:
            return done.get(("F", op.mb, op.stage))
        return done.get(("B", op.mb, op.stage + 1))

    while True:
        best: tuple[float, int, Op] | None = None
        for r in range(pp):
            choice = None
            if ptr[r] < len(orders[r]):
                op = orders[r][ptr[r]]
                t = ready(op)
                start = None if t is None else max(clock[r], t)
                if pending[r] and (start is None or start - clock[r] >= dur["W"]):
                    choice = (clock[r], r, pending[r][0])  # fill the wait with a deferred W
                elif start is not None:
                    choice = (start, r, op)
            elif pending[r]:
                choice = (clock[r], r, pending[r][0])
            if choice and (best is None or choice[:2] < best[:2]):
                best = choice
        if best is None:
            break
        start, r, op = best
        if op.kind == "W":
            pending[r].popleft()
        else:
            ptr[r] += 1
        end = start + dur[op.kind]
        clock[r] = end
        done[(op.kind, op.mb, op.stage)] = end
        slots.append(Slot(r, start, end, op))
        if split and op.kind == "B":
            pending[r].append(Op("W", op.mb, op.stage))
    stages_per_rank = n_stages // pp
    busy = microbatches * stages_per_rank * (t_f + t_b)
    return Timeline(schedule, pp, virtual, microbatches, slots, max(s.end for s in slots), busy)
