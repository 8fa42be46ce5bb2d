"""``parallel.pp_virtual_stages`` left out of a V-shaped schedule's recipe defaults to 2 (its only
valid value); set explicitly to anything else it stays an error with the fix (plan/validate.py)."""

from __future__ import annotations

import pytest

from llmtrain.plan.api import plan_recipe
from llmtrain.recipe.load import load_recipe
from tests.helpers_plan import REPO

BASE = ["parallel.pp=2", "parallel.tp=1", "parallel.dp_shard=-1", "train.global_batch_size=32", "model.layers=12"]


def _plan(overrides):
    return plan_recipe(load_recipe(REPO / "recipes/debug.yaml", BASE + overrides), None, 1, 4)


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
def test_v_shaped_schedule_defaults_to_two_virtual_stages(schedule):
    plan = _plan([f"parallel.pp_schedule={schedule}"])
    assert plan.recipe.parallel.pp_virtual_stages == 2
    assert plan.valid, plan.validation.errors


@pytest.mark.parametrize("schedule, v", [("zbv", 1), ("dualpipev", 3)])
def test_explicit_other_value_is_still_an_error(schedule, v):
    plan = _plan([f"parallel.pp_schedule={schedule}", f"parallel.pp_virtual_stages={v}"])
    assert not plan.valid
    msgs = [str(e) for e in plan.validation.errors]
    assert any("parallel.pp_virtual_stages" in m and f"exactly 2 stages per rank, got {v}" in m for m in msgs), msgs


@pytest.mark.parametrize("overrides, expected", [
    (["parallel.pp_schedule=interleaved-1f1b"], 1),  # looped: any v >= 2 is valid, no silent choice (an error)
    (["parallel.pp_schedule=zbv", "parallel.pp=1"], 1),  # pp 1: no pipeline, nothing to fill in (no warning)
    (["parallel.pp_schedule=1f1b"], 1),
])
def test_no_default_elsewhere(overrides, expected):
    assert load_recipe(REPO / "recipes/debug.yaml", BASE + overrides).parallel.pp_virtual_stages == expected
