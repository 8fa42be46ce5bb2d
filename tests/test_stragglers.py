"""Stragglers (plan/stragglers.py, ``cluster.gpu_variability``): a step runs at its slowest GPU's pace.

Pure and fast. The order statistic is checked against the exact expected maximum of n standard
normal draws, integrated here on a fine grid (Blom's approximation is within 0.03 of it; the
grid's own error is below 1e-4); the plan-level checks are identities of the breakdown.
"""

from __future__ import annotations

import math

import pytest

from llmtrain.plan import stragglers
from llmtrain.plan.api import plan_recipe
from llmtrain.plan.costmodel import estimate
from llmtrain.recipe.load import validate_recipe_dict
from llmtrain.recipe.schema import ClusterConfig


def _exact_expected_max(n: int) -> float:
    """E[max of n iid N(0, 1)] = integral of x n phi(x) Phi(x)^(n-1), trapezoid rule on [-8, 9]."""
    step, total = 1e-3, 0.0
    for i in range(17001):
        x = -8.0 + i * step
        weight = 0.5 if i in (0, 17000) else 1.0
        phi = math.exp(-x * x / 2) / math.sqrt(2 * math.pi)
        total += weight * x * n * phi * (0.5 * (1 + math.erf(x / math.sqrt(2)))) ** (n - 1)
    return total * step


@pytest.mark.parametrize("n", [2, 8, 64, 512, 16384])
def test_blom_is_within_003_of_the_exact_order_statistic(n):
    assert stragglers.expected_max_normal(n) == pytest.approx(_exact_expected_max(n), abs=0.03)


def test_default_spread_is_the_8_gpu_node_reading_and_the_schema_default():
    """5 % between the fastest and slowest of 8 GPUs = 2 c_8 sd; the recipe default is that number."""
    assert stragglers.DEFAULT_SD == pytest.approx(0.05 / (2 * stragglers.expected_max_normal(8)), abs=5e-5)
    assert ClusterConfig().gpu_variability == stragglers.DEFAULT_SD


def test_factor_is_one_for_one_gpu_or_no_spread_and_grows_with_the_job():
    sd = stragglers.DEFAULT_SD
    assert stragglers.straggler_factor(1, sd) == 1.0
    assert stragglers.straggler_factor(4096, 0.0) == 1.0
    factors = [stragglers.straggler_factor(n, sd) for n in (2, 8, 64, 512, 16384)]
    assert factors == sorted(factors) and factors[0] > 1.0
    assert factors[1] == pytest.approx(1 / (1 - stragglers.expected_max_normal(8) * sd), rel=1e-12)
    # the figures docs/planner.md 9 (h) and the schema's description quote
    assert [round(100 * (f - 1), 1) for f in factors[1:]] == [2.6, 4.2, 5.6, 7.4]


def _estimate(variability: float | None, time_model: str = "v2", nodes: int = 4):
    cluster = dict(nodes=nodes, gpus_per_node=8, gpu="h100-sxm", time_model=time_model)
    if variability is not None:
        cluster["gpu_variability"] = variability
    recipe = validate_recipe_dict(dict(
        model=dict(preset="llama3-8b"), parallel=dict(zero=3, dp_shard=-1),
        train=dict(seq_len=4096, micro_batch_size=1, global_batch_size=8 * nodes * 2, activation_checkpointing="full"),
        cluster=cluster))
    plan = plan_recipe(recipe)
    v = plan.validation
    return estimate(recipe, v.dims, v.batch, plan.placement, hints=False)


def test_plan_charges_the_slowest_gpu_as_its_own_term():
    """v2 on 32 GPUs: the same compute, and ``stragglers`` = compute x (factor - 1); the step is the
    breakdown's sum; with ``gpu_variability: 0`` no term and a shorter step; v1 never has the term."""
    off, on = _estimate(0.0), _estimate(None)
    k = stragglers.straggler_factor(32, stragglers.DEFAULT_SD)
    assert "stragglers" not in off.time.breakdown
    assert on.time.breakdown["compute"] == pytest.approx(off.time.breakdown["compute"], rel=1e-12)
    assert on.time.breakdown["stragglers"] == pytest.approx(on.time.breakdown["compute"] * (k - 1), rel=1e-9)
    assert on.time.step_s == pytest.approx(sum(on.time.breakdown.values()), rel=1e-12)
    assert on.time.step_s > off.time.step_s
    assert on.flops == off.flops and on.worst.peak == off.worst.peak
    assert "stragglers" not in _estimate(None, "v1").time.breakdown


def test_one_gpu_has_no_stragglers():
    one = validate_recipe_dict(dict(
        model=dict(preset="llama3-8b"), train=dict(seq_len=2048, micro_batch_size=1, global_batch_size=1),
        cluster=dict(nodes=1, gpus_per_node=1, gpu="h100-sxm")))
    plan = plan_recipe(one)
    est = estimate(one, plan.validation.dims, plan.validation.batch, plan.placement, hints=False)
    assert "stragglers" not in est.time.breakdown


def test_plan_text_names_the_slowest_gpu_wait():
    """``plan``'s Time line says what the stragglers term is (how many GPUs the ranks wait on, the
    setting); with ``gpu_variability: 0`` it says nothing of it."""
    from llmtrain.plan.report import plan_to_dict
    from tests.helpers_plan import debug, plan_of, render_text

    on = render_text(plan_to_dict(plan_of(debug(), nodes=1, gpus=4)))
    assert "stragglers: every rank waits for the slowest of 4 GPUs (cluster.gpu_variability)" in on
    off = render_text(plan_to_dict(plan_of(debug({"cluster": {"gpu_variability": 0}}), nodes=1, gpus=4)))
    assert "stragglers" not in off and "Time" in off
