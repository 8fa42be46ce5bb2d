"""The pipeline rules of llmtrain.plan.validate (split from tests/test_validate.py, same conventions:
one test per rule, the path, the numbers in the message, the fix; recipes on the debug presets)."""

from __future__ import annotations

import pytest

from tests.helpers_plan import debug, find, plan_of


def errors(data, **kw):
    return plan_of(data, **kw).validation.errors


def warnings(data, **kw):
    return plan_of(data, **kw).validation.warnings


# -- pipeline --------------------------------------------------------------------------------------

def pp_recipe(schedule: str, v: int, **parallel):
    return debug({"model": {"layers": 12},
                  "parallel": {"pp": 2, "pp_schedule": schedule, "pp_virtual_stages": v, **parallel},
                  "train": {"global_batch_size": 32}})


@pytest.mark.parametrize("schedule, v, fragment, hint", [
    ("interleaved-1f1b", 1, "interleaved-1f1b needs >= 2 stages per rank, got 1", "set pp_virtual_stages: 2 (or more)"),
    ("zero-bubble", 1, "zero-bubble needs >= 2 stages per rank, got 1", "set pp_virtual_stages: 2 (or more)"),
    ("zbv", 1, "zbv is V-shaped: exactly 2 stages per rank, got 1", "set pp_virtual_stages: 2"),
    ("zbv", 3, "zbv is V-shaped: exactly 2 stages per rank, got 3", "set pp_virtual_stages: 2"),
    ("dualpipev", 3, "dualpipev is V-shaped: exactly 2 stages per rank, got 3", "set pp_virtual_stages: 2"),
    ("gpipe", 2, "gpipe runs one stage per rank, got 2", "set pp_virtual_stages: 1, or pp_schedule: interleaved-1f1b"),
    ("1f1b", 3, "1f1b runs one stage per rank, got 3", "set pp_virtual_stages: 1, or pp_schedule: interleaved-1f1b"),
])
def test_pp_virtual_stages_per_schedule(schedule, v, fragment, hint):
    p = find(errors(pp_recipe(schedule, v)), "parallel.pp_virtual_stages", fragment)
    assert p.hint == hint


@pytest.mark.parametrize("schedule, v", [("interleaved-1f1b", 2), ("interleaved-1f1b", 3), ("zero-bubble", 2),
                                         ("zbv", 2), ("dualpipev", 2), ("gpipe", 1), ("1f1b", 1)])
def test_pp_virtual_stages_valid(schedule, v):
    plan = plan_of(pp_recipe(schedule, v))
    assert plan.valid, plan.validation.errors


@pytest.mark.parametrize("schedule", ["zero-bubble", "zbv", "dualpipev"])
@pytest.mark.parametrize("mode", ["selective", "selective_mm"])
def test_selective_recomputation_refused_under_a_split_backward(schedule, mode):
    """torch's selective checkpoint replays its cache into one recomputed forward; the split backward's
    weight pass recomputes the block a second time ("Trying to backward an extra time", measured on
    all three schedules): refused before launch, full and none stay valid."""
    data = pp_recipe(schedule, 2)
    data["train"]["activation_checkpointing"] = mode
    p = find(errors(data), "train.activation_checkpointing", f"{mode} recomputation cannot run under {schedule}")
    assert p.hint == "use activation_checkpointing none or full, or pp_schedule 1f1b / interleaved-1f1b"
    for ok in ("none", "full"):
        data["train"]["activation_checkpointing"] = ok
        assert plan_of(data).valid
    data["train"]["activation_checkpointing"] = mode
    data["parallel"]["pp_schedule"] = "interleaved-1f1b"
    assert plan_of(data).valid


def test_virtual_stages_without_pp_warns():
    p = find(warnings(debug({"parallel": {"pp_virtual_stages": 2}})), "parallel.pp_virtual_stages",
             "2 virtual stages have no effect with pp = 1")
    assert p.hint == "remove it"


@pytest.mark.parametrize("split", [[12], [5, 6], [13, -1], [4, 4, 4]])
def test_pp_layers_per_stage_length_and_sum(split):
    p = find(errors(pp_recipe("1f1b", 1, pp_layers_per_stage=split)), "parallel.pp_layers_per_stage",
             f"{split} must have pp x pp_virtual_stages = 2 non-negative entries summing to model.layers (12)")
    assert p.hint == "e.g. [6, 6]"


def test_pp_layers_per_stage_allows_uneven_split():
    data = pp_recipe("1f1b", 1, pp_layers_per_stage=[6, 7])
    data["model"]["layers"] = 13
    plan = plan_of(data)
    assert plan.valid, plan.validation.errors


def test_layers_divisible_by_pp_times_virtual_stages():
    data = debug({"parallel": {"pp": 3}, "train": {"global_batch_size": 6}})
    p = find(errors(data, gpus=6), "model.layers", "layers (4) not divisible by pp x pp_virtual_stages = 3x1 = 3")
    assert "use pp x virtual stages in {1, 2, 4}" in p.hint
    assert "parallel.pp_layers_per_stage, e.g. [2, 1, 1]" in p.hint
    p = find(errors(pp_recipe("interleaved-1f1b", 4)), "model.layers", "layers (12) not divisible by pp x pp_virtual_stages = 2x4 = 8")
    assert "e.g. [2, 2, 2, 2, 1, 1, 1, 1]" in p.hint
