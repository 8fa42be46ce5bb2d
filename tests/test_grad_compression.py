"""Gradient compression for zero 0/1 (engine/parallel/compression.py): PowerSGD and top-k.

The math in one process (a gloo group of one rank: the "mean" is the gradient itself), PowerSGD's
warm-up, the reducers' state round trip, the planner's bytes against what the reducers send,
validation, and ONE 2-rank torchrun job (tests/compression_check.py) on the debug recipe: loss
falls, top-k at ratio 1.0 equals the plain all-reduce, bytes sent per step equal the planner's
(warm-up steps: the plain all-reduce's), a resume with compression is bitwise equal to the
uninterrupted run, another setting starts the state afresh with one line. The 200-step quality
comparison is benchmarks/grad_compression.py, not the suite.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from llmtrain.engine.parallel.compression import PowerSGDReducer, TopKReducer, powersgd_plan
from llmtrain.plan.comm import compressed_grad_bytes, powersgd_rank_of
from tests.distrun import run_cases


@pytest.fixture(scope="module")
def group(one_rank_gloo):
    return one_rank_gloo  # tests/conftest.py: this process as a 1-rank gloo group


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


def test_two_ranks_loss_falls_bytes_equal_the_plan_and_resume_is_exact(tmp_path):
    """ONE torchrun job, 2 ranks, dp 2 (zero 0; PowerSGD also zero 1), 6 steps of the debug recipe.
    - top-k at ratio 1.0 sends everything: losses equal the plain all-reduce's within 1e-6
      (two ranks: index_add_ into zeros computes 0 + a + b = a + b, the same sum; 1e-6 allows
      the last-digit differences of a different kernel).
    - PowerSGD (rank 2, warm-up ``powersgd_start_step`` 2) and top-k (5 %): the loss falls over
      the 6 steps by > 0.05 (as the parity tests ask of every layout); how close it gets to the
      plain run is the benchmark's 200-step question.
    - bytes sent per step (every call, in the planner's convention) equal the planner's
      bytes_per_step of the DP reduction, exactly; PowerSGD's 2 warm-up steps send the plain
      all-reduce's bytes (the planner's, for grad_compression none), then the compressed ones.
    - resume from step 3 (after the warm-up) in the same layout and setting: the losses of steps
      4-6 and the final weights are **bitwise** those of the uninterrupted run (error feedback,
      warm-start Q and the warm-up counter are restored; with them reset, both differ: e = 0
      changes step 4's gradient). Resuming with another powersgd_rank prints exactly one line
      naming the change, and trains on."""
    res = run_cases(tmp_path, 2, "recipes/debug.yaml", [{"name": "gc", "check": "tests.compression_check:run"}],
                    steps=1)["gc"]
    plain = res["none"]["losses"]
    assert plain[-1] < plain[0] - 0.05
    assert max(abs(a - b) for a, b in zip(res["topk_full"]["losses"], plain)) <= 1e-6
    for name in ("powersgd", "topk", "powersgd_zero1", "topk_full"):
        case = res[name]
        losses = case["losses"]
        assert losses[-1] < losses[0] - 0.05, (name, losses)
        warm = 2 if name == "powersgd" else 0
        assert len(case["sent"]) == len(losses), (name, case)
        assert case["sent"] == [case["full"]] * warm + [case["planned"]] * (len(losses) - warm), (name, case)
    assert res["powersgd"]["planned"] < res["topk_full"]["planned"] / 10  # it compresses
    for name in ("powersgd", "topk"):
        resumed = res[name]["resumed"]
        assert resumed["losses"] == res[name]["losses"][3:], (name, resumed, res[name]["losses"])
        assert resumed["weights_equal"], name
    lines = res["reset"]["printed"].strip().splitlines()
    assert len(lines) == 1 and "started afresh" in lines[0] and "powersgd_rank 2 -> 3" in lines[0], lines
    assert len(res["reset"]["losses"]) == 3 and res["reset"]["losses"] != res["powersgd"]["losses"][3:]


def test_powersgd_zero_gradient_stays_finite(group):
    """A zero gradient (LoRA's A while B is 0) must average to zeros, not NaN: Gram-Schmidt
    (rank <= 2) divides by the column norm; without the epsilon this is 0 / 0."""
    p = nn.Parameter(torch.zeros(32, 16))
    p.grad = torch.zeros(32, 16)
    PowerSGDReducer([p], group, 1, rank=2)()
    assert torch.equal(p.grad, torch.zeros(32, 16))


@pytest.mark.parametrize("kind", ["powersgd", "topk"])
def test_state_dict_resumes_bitwise_and_a_fresh_state_does_not(group, kind):
    """A reducer rebuilt from another's ``state_dict`` after step 3 (of which 2 are PowerSGD's
    warm-up) continues bitwise like the original over steps 4-6; one rebuilt without it (what a
    reset does) does not: error feedback and warm start change the next averages."""
    def build():
        params = _params((24, 16), (16, 8), (5,))
        if kind == "powersgd":
            return params, PowerSGDReducer(params, group, 1, rank=2, start_step=2)
        return params, TopKReducer(params, group, 1, ratio=0.1)

    gen = torch.Generator().manual_seed(3)
    grads = [[torch.randn(s, generator=gen) for s in ((24, 16), (16, 8), (5,))] for _ in range(6)]

    def steps(params, red, todo):
        out = []
        for gs in todo:
            for p, g in zip(params, gs):
                p.grad = g.clone()
            red()
            out.append([p.grad.clone() for p in params])
        return out

    params, red = build()
    steps(params, red, grads[:3])
    saved = {k: v.clone() for k, v in red.state_dict().items()}
    want = steps(params, red, grads[3:])
    params, fresh = build()
    fresh.load_state_dict(saved)
    got = steps(params, fresh, grads[3:])
    assert all(torch.equal(a, b) for x, y in zip(got, want) for a, b in zip(x, y))
    params, reset = build()
    reset.load_state_dict({**saved, **{k: torch.zeros_like(v) for k, v in saved.items() if k != "calls"}})
    other = steps(params, reset, grads[3:])
    assert not all(torch.equal(a, b) for x, y in zip(other, want) for a, b in zip(x, y))


def test_saved_sizes_are_taken_within_bounds_and_checked_at_the_next_call(group):
    """Issue 17 (compression under TP): a residual has the shape of the local *gradient* (TP's
    embedding gradient came back replicated until the twentieth session, larger than the
    parameter's shard, and checkpoints of those runs hold that size), so the load
    template takes the checkpoint's sizes (compression_state.fit_to_saved), but only up to the
    parameters' full element count (an untrusted checkpoint); a size that fits the bound but not
    the gradient is a one-line error at the next call, not a traceback."""
    from types import SimpleNamespace

    from llmtrain.engine.parallel import compression_state
    from llmtrain.errors import LLMTrainError

    params = _params((24, 16), (5,))  # 389 entries
    red = TopKReducer(params, group, 1, ratio=0.1)
    opt = SimpleNamespace()
    compression_state.attach(opt, [red])
    template = compression_state.state(opt, 0)
    meta = {"grad_compression.rank0.set0.e": SimpleNamespace(size=(300,))}
    compression_state.fit_to_saved(template, opt, meta)
    assert template["rank0"]["set0.e"].shape == (300,)
    meta = {"grad_compression.rank0.set0.e": SimpleNamespace(size=(10**12,))}  # beyond the bound: kept
    template = compression_state.state(opt, 0)
    compression_state.fit_to_saved(template, opt, meta)
    assert template["rank0"]["set0.e"].shape == (389,)
    red.load_state_dict({"calls": torch.tensor([1]), "e": torch.zeros(300)})
    with pytest.raises(LLMTrainError, match=r"^--ckpt: the checkpoint's top-k residual has 300 entries, this rank's gradient 389"):
        red()


def test_powersgd_warm_up_is_the_plain_average_and_sends_full_bytes(group):
    """The first ``start_step`` calls average exactly (a group of one: the gradient itself,
    bitwise) and send 4 bytes per element; then PowerSGD approximates and sends P and Q."""
    params = _params((64, 32), (7,))
    red = PowerSGDReducer(params, group, 1, rank=2, start_step=2)
    for call in range(3):
        want = [p.grad.clone() for p in params]
        red()
        exact = all(torch.equal(p.grad, w) for p, w in zip(params, want))
        assert exact == (call < 2) and red.calls == call + 1
        assert red.sent_bytes == (4 * (64 * 32 + 7) if call < 2 else 4 * (7 + 64 * 2 + 32 * 2))
        for p in params:
            p.grad = torch.randn(p.shape)


def test_compression_state_is_reset_on_another_layout_or_setting():
    """compression_state.reset_reason: None in the same layout and setting, else a reason naming
    the change; a checkpoint without the part is also started afresh."""
    from llmtrain.engine.parallel.compression_state import reset_reason
    from llmtrain.recipe.load import load_recipe
    from llmtrain.recipe.lock import secret_free_dict

    sets = ["parallel.tp=1", "parallel.dp_shard=2", "parallel.zero=0", "cluster.gpus_per_node=2",
            "parallel.grad_compression=powersgd"]
    recipe = load_recipe("recipes/debug.yaml", sets)
    dims = {"pp": 1, "dp_replicate": 1, "dp_shard": 2, "cp": 1, "tp": 1, "ep": 1}
    meta = {"recipe": secret_free_dict(recipe), "world_size": 2, "dims": dims}
    keys = ["model.x", "grad_compression.rank0.set0.calls"]
    assert reset_reason(meta, recipe, dims, 2, keys) is None
    other = load_recipe("recipes/debug.yaml", sets + ["parallel.powersgd_rank=8"])
    assert "powersgd_rank 4 -> 8" in reset_reason(meta, other, dims, 2, keys)
    assert "layout changed" in reset_reason(meta, recipe, {**dims, "dp_shard": 4}, 4, keys)
    assert "holds no compression state" in reset_reason(meta, recipe, dims, 2, ["model.x"])
    longer = load_recipe("recipes/debug.yaml", sets + ["train.steps=600"])  # the default warm-up 6 -> 60
    assert "powersgd_start_step 6 -> 60" in reset_reason(meta, longer, dims, 2, keys)
    assert reset_reason(meta, load_recipe("recipes/debug.yaml", sets + ["parallel.powersgd_start_step=6"]), dims, 2,
                        keys) is None  # the same resolved warm-up


def test_planner_prices_the_steady_state_and_names_the_warm_up():
    """Default powersgd_start_step = torch's advice, max(lr warm-up, ceil(10 % of the steps)):
    debug.yaml has 60 steps and 5 warm-up steps -> 6. The bytes are the steady state's (the same
    as with no warm-up), and the first compressed collective's note says the warm-up steps send
    the whole fp32 gradient; a warm-up at or past train.steps is warned about."""
    from llmtrain.plan.api import plan_recipe
    from llmtrain.plan.comm import powersgd_start
    from llmtrain.plan.costmodel import estimate
    from llmtrain.recipe.load import load_recipe

    base = ["parallel.tp=1", "parallel.dp_shard=2", "parallel.zero=0", "cluster.gpus_per_node=2",
            "parallel.grad_compression=powersgd"]

    def dp_comms(extra):
        recipe = load_recipe("recipes/debug.yaml", base + extra)
        plan = plan_recipe(recipe)
        cm = estimate(recipe, plan.validation.dims, plan.validation.batch, plan.placement, hints=False)
        return recipe, plan, [c for c in cm.comms if c.dim == "dp"]

    recipe, _, warm = dp_comms([])
    assert powersgd_start(recipe) == 6
    _, _, cold = dp_comms(["parallel.powersgd_start_step=0"])
    assert [c.message_bytes for c in warm] == [c.message_bytes for c in cold]
    assert "the first 6 steps (powersgd_start_step) all-reduce the whole fp32 gradient" in warm[0].note
    assert not any("powersgd_start_step" in c.note for c in cold + warm[1:])
    _, plan, _ = dp_comms(["parallel.powersgd_start_step=60"])
    assert [w.path for w in plan.validation.warnings] == ["parallel.powersgd_start_step"]
