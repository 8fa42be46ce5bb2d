"""The planner's micro batches in flight (plan/inflight.py) against torch's own pipeline orders.

torch's runtime schedules compute every rank's action list (``pipeline_order``) in their
constructor, from the stage indices, the pipeline size and the micro batch count alone. Built
here with stand-in stages (no process group, no model), they give, per rank and local chunk,
how many micro batches have run their forward and not yet freed their activations at the
moment the rank holds the most: a full backward (B) frees them, and so does the weight pass (W)
of the split-backward schedules, whose input-gradient pass (I) keeps the graph for it
(``stage_backward_input``: ``retain_graph=True``). DualPipeV's overlapped F&B pairs count as
their forward, then their backward. The engine-measured bytes behind these counts are checked
in tests/test_costmodel.py (``test_pipelined_activation_peak_matches_the_plan``).
"""

from __future__ import annotations

import types

import pytest

from llmtrain.plan.inflight import inflight, split_backwards

S = pytest.importorskip("torch.distributed.pipelining.schedules")
T = S._ComputationType

CLASSES = {"interleaved-1f1b": "ScheduleInterleaved1F1B", "zero-bubble": "ScheduleInterleavedZeroBubble",
           "zbv": "ScheduleZBVZeroBubble", "dualpipev": "ScheduleDualPipeV"}
V_SHAPED = ("zbv", "dualpipev")


def torch_orders(schedule: str, p: int, v: int, m: int) -> dict:
    """Every rank's actions, from the schedule's constructor given rank 0's stand-in stages."""
    cls = getattr(S, CLASSES[schedule])
    v_shape = schedule in V_SHAPED
    stages = []
    for c in range(v):
        sid = (0 if c == 0 else 2 * p - 1) if v_shape else c * p
        stages.append(types.SimpleNamespace(group_size=p, group_rank=0, stage_index=sid, num_stages=p * v,
                                            is_first=sid == 0, is_last=sid == p * v - 1, submod=None,
                                            scale_grads=True))
    sched = cls.__new__(cls)
    cls.__init__(sched, stages, m, loss_fn=None)
    return sched.pipeline_order


def held_at_peak(actions, p: int, v: int, rank: int, v_shape: bool) -> list[int]:
    """Per local chunk, the micro batches alive when the rank's total is largest."""
    def chunk(stage: int) -> int:
        return (0 if stage == rank else 1) if v_shape else stage // p

    alive, best, snap = [0] * v, -1, None
    for action in actions:
        if action is None:
            continue
        for a in (action.sub_actions or (action,)):
            if a.computation_type == T.FORWARD:
                alive[chunk(a.stage_index)] += 1
            elif a.computation_type in (T.BACKWARD_WEIGHT, T.FULL_BACKWARD):
                alive[chunk(a.stage_index)] -= 1
            if sum(alive) > best:
                best, snap = sum(alive), list(alive)
    return snap


@pytest.mark.parametrize("schedule", list(CLASSES))
@pytest.mark.parametrize("p, m", [(2, 4), (2, 8), (4, 8), (4, 16), (8, 16), (8, 32)])
def test_inflight_is_torchs_schedule(schedule, p, m):
    v_shape = schedule in V_SHAPED
    for v in ((2,) if v_shape else (2, 3, 4)):
        orders = torch_orders(schedule, p, v, m)
        for r in range(p):
            assert inflight(schedule, p, v, m, r) == held_at_peak(orders[r], p, v, r, v_shape), (schedule, p, v, m, r)


@pytest.mark.parametrize("schedule", list(CLASSES))
@pytest.mark.parametrize("p, m", [(2, 4), (2, 8), (3, 6), (4, 8), (5, 10), (6, 12), (7, 14), (8, 16), (8, 40)])
def test_split_backwards_are_torchs(schedule, p, m):
    """How many micro batches each stage runs as an input pass then a weight pass (full recomputation
    recomputes in both: costmodel.recompute_again): torch's BACKWARD_INPUT actions per stage
    (DualPipeV: a fixed few, whatever m; zero-bubble and ZBV: all m; interleaved 1F1B: none)."""
    v = 2
    orders = torch_orders(schedule, p, v, m)
    got = [0] * (p * v)
    for actions in orders.values():
        for action in actions:
            for a in (() if action is None else (action.sub_actions or (action,))):
                if a.computation_type == T.BACKWARD_INPUT:
                    got[a.stage_index] += 1
    assert got == [split_backwards(schedule, p, s, m) for s in range(p * v)], (schedule, p, m)
