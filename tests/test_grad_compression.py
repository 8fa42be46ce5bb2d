"""Gradient compression for zero 0/1 (engine/parallel/compression.py): PowerSGD and top-k.

The math in one process (a gloo group of one rank: the "mean" is the gradient itself), the
planner's bytes against what the reducers send, validation, and ONE 2-rank torchrun job
(tests/compression_check.py) on the debug recipe: loss falls, top-k at ratio 1.0 equals the
plain all-reduce, bytes sent per step equal the planner's. The 200-step quality comparison is
benchmarks/grad_compression.py, not the suite.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from llmtrain.engine.parallel.compression import PowerSGDReducer, TopKReducer, powersgd_plan
from llmtrain.plan.comm import compressed_grad_bytes, powersgd_rank_of
from tests.distrun import run_cases


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    if not dist.is_initialized():
        store = dist.FileStore(str(tmp_path_factory.mktemp("pg") / "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield dist.group.WORLD


def _params(*shapes: tuple[int, ...], seed: int = 0) -> list[nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for s in shapes:
        p = nn.Parameter(torch.zeros(s))
        p.grad = torch.randn(s, generator=gen)
        out.append(p)
    return out


def _low_rank(n: int, m: int, r: int, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, r, generator=gen) @ torch.randn(r, m, generator=gen)


def test_powersgd_full_rank_reproduces_the_mean(group):
    """Rank = min(n, m) spans the gradient's column space: P Q^T is the mean (here the gradient),
    up to fp32 QR round-off (1e-4 absolute on entries of size ~1-10: a few ulps times the
    condition of a random 12 x 8 matrix). Also a 3-D tensor (reshaped (shape[0], -1))."""
    params = _params((12, 8), (3, 4, 5), (7,))
    want = [p.grad.clone() for p in params]
    red = PowerSGDReducer(params, group, 1, rank=8, min_rate=0.0)
    red()
    for p, w in zip(params, want):
        torch.testing.assert_close(p.grad, w, atol=1e-4, rtol=0)
    assert max(e.abs().max().item() for e in red.errors.values()) < 1e-4


def test_powersgd_error_feedback_accumulates_the_residual(group):
    """Same gradient G (rank 3) every step, approximation rank 1. With error feedback the residual
    is carried: e_t = t G - sum of what was applied (exact up to fp32 sums, 1e-3 on entries of
    size ~10 summed over 30 steps), so the applied average approaches G; without it every step
    applies the same rank-1 part and the average stays a rank-1 matrix away from G (relative
    error: the residual stays bounded, so with feedback it decays as ||e|| / t). The test
    fails if the error is dropped (the averages would be equal) or mis-signed."""
    g = _low_rank(16, 12, 3)
    runs = {}
    for ef in (True, False):
        p = nn.Parameter(torch.zeros(16, 12))
        red = PowerSGDReducer([p], group, 1, rank=1, error_feedback=ef, min_rate=0.0)
        applied = torch.zeros_like(g)
        steps = 30
        for _ in range(steps):
            p.grad = g.clone()
            red()
            applied += p.grad
        if ef:
            torch.testing.assert_close(red.errors[0], steps * g - applied, atol=1e-3, rtol=0)
        runs[ef] = ((applied / steps - g).norm() / g.norm()).item()
    assert runs[True] < 0.25 and runs[False] > 0.5, runs  # measured 0.105 and 0.694


def test_powersgd_leaves_vectors_and_small_matrices_uncompressed(group):
    """torch's rule (_should_compress, rate 2): 1-D and matrices that would not shrink 2x are sent
    whole, so they come back bitwise equal (divided by a group of one)."""
    params = _params((5,), (4, 4), (64, 64))
    want = [p.grad.clone() for p in params]
    assert [powersgd_plan(tuple(p.shape), 4) for p in params] == [0, 0, 4]
    PowerSGDReducer(params, group, 1, rank=4)()
    assert torch.equal(params[0].grad, want[0]) and torch.equal(params[1].grad, want[1])
    assert not torch.equal(params[2].grad, want[2])  # rank 4 of a random 64 x 64: an approximation


def test_topk_ratio_one_is_the_plain_mean(group):
    """Every entry sent: the result is bitwise the gradient (a group of one), nothing left over."""
    params = _params((6, 5), (9,))
    want = [p.grad.clone() for p in params]
    red = TopKReducer(params, group, 1, ratio=1.0)
    red()
    assert all(torch.equal(p.grad, w) for p, w in zip(params, want))
    assert torch.count_nonzero(red.error) == 0


def test_topk_error_feedback_sends_the_rest_later(group):
    """k = 1 of 4 entries: the step sends the largest |g + e|, keeps the rest exactly (bitwise:
    no arithmetic on them but one add), and over the steps every entry is sent; without error
    feedback the small entries are never applied."""
    g = torch.tensor([4.0, -3.0, 2.0, 1.0])
    for ef in (True, False):
        p = nn.Parameter(torch.zeros(4))
        red = TopKReducer([p], group, 1, ratio=0.25, error_feedback=ef)
        applied = torch.zeros(4)
        for step in range(8):
            p.grad = g.clone()
            red()
            assert torch.count_nonzero(p.grad) == 1
            applied += p.grad
            if ef:
                assert torch.equal(red.error + applied, (step + 1) * g)
        assert (torch.count_nonzero(applied) == 4) == ef


def test_planner_bytes_equal_what_the_reducers_send(group):
    """plan/comm.py's compressed_grad_bytes (no torch) against the reducers' sent_bytes, exact,
    on shapes that hit every PowerSGD branch (1-D, small, 2-D, 3-D, rank capped by a side)."""
    shapes = [(7,), (4, 4), (64, 32), (3, 16, 8), (200, 3), (128, 128)]
    assert [powersgd_rank_of(s, 4) for s in shapes] == [powersgd_plan(s, 4) for s in shapes]
    params = _params(*shapes)
    red = PowerSGDReducer(params, group, 1, rank=4)
    red()
    assert red.sent_bytes == sum(b for *_, b in compressed_grad_bytes("powersgd", tuple(shapes), 4, 0.01, 1))
    params = _params(*shapes)
    red = TopKReducer(params, group, 1, ratio=0.01)
    red()
    assert red.sent_bytes == sum(b for *_, b in compressed_grad_bytes("topk", tuple(shapes), 4, 0.01, 1))


def test_validation_refuses_fsdp_and_bf16_reduction():
    """One line naming the field: FSDP has no whole gradient to compress; bf16 does not apply."""
    from llmtrain.plan.api import plan_recipe
    from llmtrain.recipe.load import load_recipe

    base = ["parallel.tp=1", "parallel.dp_shard=2", "cluster.gpus_per_node=2", "parallel.grad_compression=topk"]
    lines = plan_recipe(load_recipe("recipes/debug.yaml", base + ["parallel.zero=3"])).validation.errors
    assert [e.path for e in lines] == ["parallel.grad_compression"] and "zero 0 or 1" in lines[0].line()
    lines = plan_recipe(load_recipe("recipes/debug.yaml", base + ["parallel.zero=0", "parallel.reduce_dtype=bf16"])
                        ).validation.errors
    assert [e.path for e in lines] == ["parallel.reduce_dtype"]
    assert plan_recipe(load_recipe("recipes/debug.yaml", base + ["parallel.zero=1"])).valid


def test_two_ranks_loss_falls_and_bytes_equal_the_plan(tmp_path):
    """ONE torchrun job, 2 ranks, dp 2 (zero 0; PowerSGD also zero 1), 6 steps of the debug recipe.
    - top-k at ratio 1.0 sends everything: losses equal the plain all-reduce's within 1e-6
      (two ranks: index_add_ into zeros computes 0 + a + b = a + b, the same sum; 1e-6 allows
      the last-digit differences of a different kernel).
    - PowerSGD (rank 2) and top-k (5 %): the loss falls over the 6 steps by > 0.05 (as the
      parity tests ask of every layout); how close it gets to the plain run is the benchmark's
      200-step question (6 steps of rank-2 PowerSGD fall slower: 6.26 -> 6.16 vs 5.83 plain).
    - bytes sent per step (every call, in the planner's convention) equal the planner's
      bytes_per_step of the DP reduction, exactly."""
    res = run_cases(tmp_path, 2, "recipes/debug.yaml", [{"name": "gc", "check": "tests.compression_check:run"}],
                    steps=1)["gc"]
    plain = res["none"]["losses"]
    assert plain[-1] < plain[0] - 0.05
    assert max(abs(a - b) for a, b in zip(res["topk_full"]["losses"], plain)) <= 1e-6
    for name in ("powersgd", "topk", "powersgd_zero1", "topk_full"):
        case = res[name]
        losses = case["losses"]
        assert losses[-1] < losses[0] - 0.05, (name, losses)
        assert len(case["sent"]) == len(losses) and set(case["sent"]) == {case["planned"]}, (name, case)
    assert res["powersgd"]["planned"] < res["topk_full"]["planned"] / 10  # it compresses


def test_powersgd_zero_gradient_stays_finite(group):
    """A zero gradient (LoRA's A while B is 0) must average to zeros, not NaN: Gram-Schmidt
    (rank <= 2) divides by the column norm; without the epsilon this is 0 / 0."""
    p = nn.Parameter(torch.zeros(32, 16))
    p.grad = torch.zeros(32, 16)
    PowerSGDReducer([p], group, 1, rank=2)()
    assert torch.equal(p.grad, torch.zeros(32, 16))
