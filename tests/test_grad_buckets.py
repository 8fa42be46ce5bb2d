"""The bucketed DP reducer really overlaps: buckets start inside the last backward, in order.

One process, a real 1-rank gloo group (no torchrun: the parity tests in tests/test_engine_parity.py
check the multi-rank numerics). The reducer is told the group has ``SIZE = 2`` ranks so that it
arms its hooks; a 1-rank all-reduce returns the local gradient, so every gradient must come back
as exactly ``local / 2`` (fp32: division by 2 is exact) — that checks the flatten, the write-back
and the bucket offsets. A recorder (the reducer's ``on_launch`` callback, plus a post-accumulate
hook on the FIRST layer's weight, whose gradient is the last one autograd produces) shows that
bucket 0 (the output layer's) started before backward reached the first layer: overlap, seen as
event order rather than timing.
"""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
from torch import nn

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
    """Not armed (PP's path): everything starts at sync. A parameter without a gradient (here:
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


def test_frozen_parameters_are_not_bucketed_and_dtype_splits():
    a, b = nn.Parameter(torch.zeros(4)), nn.Parameter(torch.zeros(4, dtype=torch.float64))
    c = nn.Parameter(torch.zeros(4), requires_grad=False)
    assert [len(x) for x in plan_buckets([a, b], 1 << 20)] == [1, 1]
    reducer = BucketedGradReducer([a, c], None, 1, bucket_bytes=1 << 20)
    assert [p for bk in reducer.buckets for p in bk.params] == [a]
