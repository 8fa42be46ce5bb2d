"""The bucketed DP reducer really overlaps: buckets start inside the last backward, in order.

One process, a real 1-rank gloo group (no torchrun: the parity tests in tests/test_engine_parity.py
check the multi-rank numerics). The reducer is told the group has ``SIZE = 2`` ranks so that it
arms its hooks; a 1-rank all-reduce returns the local gradient, so every gradient must come back
as exactly ``local / 2`` (fp32: division by 2 is exact) — that checks the flatten, the write-back
and the bucket offsets. A recorder (the reducer's ``on_launch`` callback, plus a post-accumulate
hook on the FIRST layer's weight, whose gradient is the last one autograd produces) shows that
bucket 0 (the output layer's) started before backward reached the first layer: overlap, seen as
event order rather than timing.

The pipeline cases run torch's multi-stage schedules (interleaved-1f1b, zero-bubble, zbv,
dualpipev) in this one process: a 1-rank pipeline group holding both stages of a 2-stage model,
4 micro batches. The schedule divides each stage's gradients by 4 right after that stage's last
backward, at a different time per stage; the reducer must still return exactly
``reference / SIZE`` (powers of two: the x4 / /4 round trip of an already-scaled bucket is exact
in fp32, so the tolerance is 0), every bucket must start before the schedule returns, and at
least one bucket must be written back while the schedule still runs (the path that was wrong
for interleaved-1f1b: a bucket of the later stage written back after that stage's 1/4).
"""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
from torch import nn

from llmtrain.engine.dp_optimizer import GradSync
from llmtrain.engine.parallel.grad_buckets import BucketedGradReducer, plan_buckets

SIZE = 2


@pytest.fixture(scope="module")
def group():
    if dist.is_initialized():
        yield dist.group.WORLD
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 8))


def reference_grads(micro: int) -> dict:
    """The accumulated local gradients of the same model and inputs, without a reducer."""
    m = model()
    for k in range(micro):
        m(torch.randn(4, 16, generator=torch.Generator().manual_seed(k))).square().mean().backward()
    return {n: p.grad.clone() for n, p in m.named_parameters()}


def run(m: nn.Module, reducer: BucketedGradReducer, micro: int, events: list) -> dict:
    """Train ``micro`` backward passes with the reducer armed, sync; returns the reference grads."""
    first = m[0].weight
    first.register_post_accumulate_grad_hook(lambda p: events.append(("first-layer-grad", reducer._next)))
    reducer.on_launch = lambda i, in_bw: events.append(("launch", i, in_bw))
    reducer.expect_backwards(micro)
    for k in range(micro):
        events.append(("backward", k))
        m(torch.randn(4, 16, generator=torch.Generator().manual_seed(k))).square().mean().backward()
    events.append(("sync",))
    reducer()
    return reference_grads(micro)


def test_buckets_start_during_the_last_backward_in_order(group):
    m = model()
    params = list(m.parameters())
    reducer = BucketedGradReducer(params, group, SIZE, bucket_bytes=1024)  # a bucket closes after each weight: 3 buckets
    assert len(reducer.buckets) >= 3, "the test needs several buckets"
    assert reducer.buckets[0].params[0] is params[-1], "buckets take reverse registration order"
    events: list = []
    local = run(m, reducer, micro=2, events=events)
    launches = [e for e in events if e[0] == "launch"]
    assert [e[1] for e in launches] == list(range(len(reducer.buckets))), "buckets start in index order"
    assert all(e[2] for e in launches), "every bucket started inside backward (hooks), none at sync"
    second = events.index(("backward", 1))
    assert all(events.index(e) > second for e in launches), "the first micro batch only accumulates"
    first_grad = [i for i, e in enumerate(events) if e[0] == "first-layer-grad"][-1]
    assert events.index(launches[0]) < first_grad, "bucket 0 started before backward reached the first layer"
    for n, p in m.named_parameters():
        assert torch.equal(p.grad, local[n] / SIZE), n


def test_unarmed_step_and_missing_grads_fall_back_to_sync(group):
    """Not armed (a caller without ``expect_backwards``): everything starts at sync. A parameter without a gradient (here:
    unused in this step) contributes zeros and keeps ``grad is None``."""
    m = model()
    reducer = BucketedGradReducer(list(m.parameters()), group, SIZE, bucket_bytes=1 << 20)  # one bucket
    launches: list = []
    reducer.on_launch = lambda i, in_bw: launches.append(in_bw)
    m[0].weight.requires_grad_(True)
    x = torch.randn(4, 32)
    m[4](m[3](m[2](x))).sum().backward()  # layer 0 unused: no gradient
    before = m[4].weight.grad.clone()
    reducer()
    assert launches == [False]
    assert m[0].weight.grad is None and torch.equal(m[4].weight.grad, before / SIZE)


def test_bf16_reduction_rounds_and_returns_fp32(group):
    m = model()
    reducer = BucketedGradReducer(list(m.parameters()), group, SIZE, bucket_bytes=1 << 20,
                                  reduce_dtype=torch.bfloat16)
    local = run(m, reducer, micro=1, events=[])
    for n, p in m.named_parameters():
        assert p.grad.dtype == torch.float32
        assert torch.equal(p.grad, local[n].to(torch.bfloat16).float() / SIZE), n
    assert any(not torch.equal(p.grad, local[n] / SIZE) for n, p in m.named_parameters()), "no bf16 rounding seen"


def test_frozen_parameters_are_not_bucketed_and_dtype_and_stage_split():
    a, b = nn.Parameter(torch.zeros(4)), nn.Parameter(torch.zeros(4, dtype=torch.float64))
    c = nn.Parameter(torch.zeros(4), requires_grad=False)
    assert [len(x) for x in plan_buckets([a, b], 1 << 20)] == [1, 1]
    d = nn.Parameter(torch.zeros(4))
    assert [len(x) for x in plan_buckets([a, d, c], 1 << 20, stages=[1, 1, 0])] == [2, 1], "a bucket never spans stages"
    reducer = BucketedGradReducer([a, c], None, 1, bucket_bytes=1 << 20)
    assert [p for bk in reducer.buckets for p in bk.params] == [a]


# ---- pipeline schedules with several stages per rank ------------------------------------------------
MICRO = 4


def chunks() -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16)) for _ in range(2)]


def mse(out, y):
    return (out - y).square().mean()


@pytest.mark.parametrize("bucket_bytes", [256, 3000])  # 2 buckets per stage; 1 per stage (would straddle uncut)
@pytest.mark.parametrize("schedule", ["ScheduleInterleaved1F1B", "ScheduleInterleavedZeroBubble",
                                      "ScheduleZBVZeroBubble", "ScheduleDualPipeV"])
def test_multi_stage_schedules_overlap_with_exact_gradients(group, schedule, bucket_bytes):
    from torch.distributed.pipelining import PipelineStage, schedules

    x = torch.randn(2 * MICRO, 16, generator=torch.Generator().manual_seed(1))
    y = torch.randn(2 * MICRO, 16, generator=torch.Generator().manual_seed(2))
    ref = chunks()
    for k in range(MICRO):  # the mean over micro batches, as the schedule's 1/4 gives
        (mse(ref[1](ref[0](x[2 * k:2 * k + 2])), y[2 * k:2 * k + 2]) / MICRO).backward()
    parts = chunks()
    meta = dict(device="meta")
    stages = [PipelineStage(p, i, 2, torch.device("cpu"), group=group,
                            input_args=(torch.empty(2, 16, **meta, requires_grad=i > 0),),
                            output_args=(torch.empty(2, 16, **meta, requires_grad=True),)) for i, p in enumerate(parts)]
    sched = getattr(schedules, schedule)(stages, n_microbatches=MICRO, loss_fn=mse, scale_grads=True)
    params = [p for part in parts for p in part.parameters()]
    reducer = BucketedGradReducer(params, group, SIZE, bucket_bytes=bucket_bytes,  # a stage holds 2176 bytes
                                  stages=[i for i, part in enumerate(parts) for _ in part.parameters()])
    assert [b.stage for b in reducer.buckets] == [1, 1, 0, 0] if bucket_bytes == 256 else [1, 0]
    events, state = [], {"in_stage_done": None, "running": True}
    stage_done = reducer.stage_done

    def traced_stage_done(stage):
        state["in_stage_done"] = stage
        stage_done(stage)
        state["in_stage_done"] = None

    reducer.stage_done = traced_stage_done
    def traced_launch(i, in_bw):
        events.append(("launch", i, reducer.buckets[i].stage, state["in_stage_done"], state["running"] and in_bw))
        # let the all-reduce finish before the schedule goes on, so the next bucket's launch finds it
        # completed and writes it back (otherwise that write-back races gloo's thread on a loaded machine)
        reducer.buckets[i].work.wait()

    reducer.on_launch = traced_launch
    unflatten = reducer._unflatten
    reducer._unflatten = lambda b: (events.append(("written", state["running"])), unflatten(b))
    sync = GradSync([reducer])
    sync.expect_backwards(MICRO, sched)
    sched.step(x, target=y)
    state["running"] = False
    sync()
    launches = [e for e in events if e[0] == "launch"]
    assert [e[1] for e in launches] == list(range(len(reducer.buckets))), "buckets start in index order"
    assert all(e[4] for e in launches), f"a bucket started only after the schedule: {launches}"
    assert ("written", True) in events, "no bucket was written back while the schedule ran"
    for part, ref_part in zip(parts, ref):
        for p, r in zip(part.parameters(), ref_part.parameters()):
            assert torch.equal(p.grad, r.grad / SIZE), schedule
    if schedule == "ScheduleInterleaved1F1B":  # full backward: every bucket from a hook, inside its stage's backward
        assert all(e[3] is None for e in launches), launches
    elif schedule != "ScheduleDualPipeV":  # (dualpipev runs full backwards on one rank: hooks, either way is right)
        # weight passes assign stage 1's gradients without hooks: its buckets start at its REDUCE_GRAD
        assert all(e[3] == 1 for e in launches if e[2] == 1), launches
        assert all(e[3] is None for e in launches if e[2] == 0), "stage 0's weight pass is a full backward (hooks)"

