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

V-shaped placement (ZBV, Qi et al. 2023 sec. 6; DualPipeV, DeepSeek-V3 / deepseek-ai/DualPipe):
pipeline rank ``r`` holds stages ``r`` and ``2 p - 1 - r``; each micro batch goes forward through
stages ``0 .. 2p - 1`` (down the ranks and back up) and backward in reverse, with the backward
split into B (input gradient) and W (weight gradient). :func:`simulate_v` does not replay
torch's hand-made orders (``ScheduleZBVZeroBubble``, ``ScheduleDualPipeV``): it is a greedy,
dependency-respecting list scheduling (see its docstring), and the same simulation draws both
names -- the F&B overlap of DualPipe (computation/communication overlap of two micro batches)
is not modelled, each rank runs one op at a time. With unit costs the simulated idle time is
``(p - 1)`` units, i.e. a bubble of ``(p - 1) / (6 m)``: exactly
:func:`llmtrain.plan.bubble.bubble_fraction`'s zbv value, and half its dualpipev value
``(p - 1) / (3 m)`` (that formula charges the overlapped F&B pair as in DeepSeek-V3's Table 2,
which this picture does not reproduce). Memory: a rank holds at most ``2 p`` chunk activations.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

DRAWN = ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble", "zbv", "dualpipev")
V_SHAPED = ("zbv", "dualpipev")


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
    if schedule in V_SHAPED:
        raise ValueError(f"{schedule} has no fixed per-rank order here; use simulate_v")
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
    """Play the orders with unit costs; zero-bubble splits ``t_b`` evenly into B and W.

    ``zbv`` and ``dualpipev`` go to :func:`simulate_v` (``virtual`` is ignored: always 2 chunks).
    """
    if schedule in V_SHAPED:
        return simulate_v(schedule, pp, microbatches, t_f, t_b)
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


def v_stage_rank(stage: int, pp: int) -> int:
    """Pipeline rank of ``stage`` under V-shaped placement (rank ``r`` holds ``r`` and ``2 pp - 1 - r``)."""
    return stage if stage < pp else 2 * pp - 1 - stage


def simulate_v(schedule: str, pp: int, microbatches: int, t_f: float = 1.0, t_b: float = 2.0,
               max_in_flight: int | None = None) -> Timeline:
    """Greedy list-scheduling simulation of a V-shaped schedule (``zbv``, ``dualpipev``).

    Each rank, whenever it is free, starts the op that can start earliest (ties: B, then F of the
    second chunk, then F of the first chunk, then W, older micro batches first); W passes are
    only picked when nothing else can start sooner, so they fill what would be bubbles. A rank
    starts a new first-chunk forward only while it holds fewer than ``max_in_flight`` (default
    ``2 pp``) chunk activations (forwards whose B has not run), which bounds memory like ZBV's
    warm-up. The global choice is always the earliest possible start, so every op starts as soon
    as its dependencies and its rank allow under this order.
    """
    p, m = pp, microbatches
    n = 2 * p
    limit = max_in_flight if max_in_flight is not None else 2 * p
    dur = {"F": t_f, "B": t_b / 2, "W": t_b / 2}
    done: dict[tuple[str, int, int], float] = {}
    clock = [0.0] * p
    in_flight = [0] * p
    next_f = [[0, 0] for _ in range(p)]  # next micro batch to forward, per rank and chunk
    todo_w: list[deque[Op]] = [deque() for _ in range(p)]
    slots: list[Slot] = []

    def stage_of(r: int, chunk: int) -> int:
        return r if chunk == 0 else n - 1 - r

    while True:
        best = None  # (start, priority, mb, rank, op)
        for r in range(p):
            cands = []
            for chunk in (1, 0):
                mb = next_f[r][chunk]
                if mb >= m or (chunk == 0 and in_flight[r] >= limit):
                    continue
                s = stage_of(r, chunk)
                t = 0.0 if s == 0 else done.get(("F", mb, s - 1))
                if t is not None:
                    cands.append((max(clock[r], t), 1 if chunk else 2, mb, r, Op("F", mb, s)))
            for chunk in (1, 0):
                s = stage_of(r, chunk)
                for mb in range(m):
                    if ("F", mb, s) not in done or ("B", mb, s) in done:
                        continue
                    t = done[("F", mb, s)] if s == n - 1 else done.get(("B", mb, s + 1))
                    if t is not None:
                        cands.append((max(clock[r], t), 0, mb, r, Op("B", mb, s)))
                        break
            if todo_w[r]:
                w = todo_w[r][0]
                cands.append((clock[r], 3, w.mb, r, w))
            if not cands:
                continue
            start = min(c[0] for c in cands)
            choice = min(c for c in cands if c[0] == start)
            if best is None or choice[:1] + (choice[3],) < best[:1] + (best[3],):
                best = choice
        if best is None:
            break
        start, _, mb, r, op = best
        end = start + dur[op.kind]
        clock[r] = end
        done[(op.kind, op.mb, op.stage)] = end
        slots.append(Slot(r, start, end, op))
        if op.kind == "F":
            next_f[r][0 if op.stage < p else 1] += 1
            in_flight[r] += 1
        elif op.kind == "B":
            in_flight[r] -= 1
            todo_w[r].append(Op("W", op.mb, op.stage))
        else:
            todo_w[r].popleft()
    busy = m * 2 * (t_f + t_b)
    return Timeline(schedule, p, 2, m, slots, max(s.end for s in slots), busy)


HOOKED = ("gpipe", "1f1b", "interleaved-1f1b")  # full backward: the engine's bucket hooks see every gradient


def gradient_ready(schedule: str | None, pp: int, rank: int, virtual: int) -> tuple[tuple[float, bool], ...]:
    """When each chunk of pipeline rank ``rank`` has its final gradients, for the DP buckets.

    Returns ``((lead, hooked), ...)`` in the order the chunks finish: ``lead`` = how long before
    the rank's last op that chunk's last backward-like op (B; W when split) ends, in units of one
    chunk's full backward of one micro batch; ``hooked`` = whether the engine's bucket hooks see
    those gradients during that op (engine/parallel/grad_buckets.py: full backward, and
    zero-bubble's stage 0, whose weight pass is a full backward) -- else the chunk's buckets start
    at its ``REDUCE_GRAD``, after the op. Closed forms of :func:`simulate` (checked there by
    tests/test_costmodel.py): interleaved-1f1b walks the chunks' backwards in groups of ``pp``
    micro batches, so chunk ``k`` (stage ``rank + k pp``) finishes ``k pp`` backwards before the
    end; zero-bubble defers the weight passes, ``k pp / 2``; V-shaped (zbv, dualpipev): stage
    ``2 pp - 1 - rank`` finishes ``(pp - rank) / 2`` before stage ``rank``.
    """
    if schedule is None or pp == 1 or schedule in ("gpipe", "1f1b"):
        return ((0.0, True),)
    if schedule in V_SHAPED:
        return ((float(pp - rank) / 2, False), (0.0, rank == 0))
    v = virtual
    per = pp if schedule == "interleaved-1f1b" else pp / 2
    return tuple((float(k * per), schedule in HOOKED or rank + k * pp == 0) for k in reversed(range(v)))


def cooldown_lead(schedule: str | None, pp: int, rank: int) -> int:
    """How many single-chunk micro-batch backwards run on the pipeline ranks before ``rank``
    after ``rank``'s last op: ``rank``'s end-of-step data-parallel reduction runs beside them.

    In GPipe, 1F1B and interleaved 1F1B the last micro batch's backward walks back from the last
    stage to stage 0, so rank ``r`` finishes ``r`` backwards (of stages ``r - 1 .. 0``; of their
    chunk 0 when interleaved) before rank 0, whose end is the pipeline's; the step waits for the
    last rank's reduction (the gradient-norm all-reduce and the optimizer step follow it on every
    rank), not for each rank's as if it had ended with rank 0. The zero-bubble family fills that
    cooldown with deferred weight passes: with the F = B = W units of plan/bubble.py every looped
    zero-bubble rank ends together (0). V-shaped schedules (zbv, dualpipev) get 0 too, a lower bound:
    in their greedy simulation the last rank, not the first, ends last, by an amount that depends on
    the micro-batch count. Closed form of :func:`simulate` at its default units
    (tests/test_costmodel_formulas.py).
    """
    if schedule in ("gpipe", "1f1b", "interleaved-1f1b") and pp > 1:
        return rank
    return 0
