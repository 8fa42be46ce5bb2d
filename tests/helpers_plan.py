"""Shared helpers for the planning tests: build recipes from dicts and run the plan code path.

``plan_of`` validates a recipe dict in memory (fast: no file, no YAML); ``plan_file`` goes
through the same entry point as ``llmtrain plan`` (``make_plan`` on a real file).
"""

from __future__ import annotations

import copy
import io
import re
import sys
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console

from llmtrain.errors import Problem
from llmtrain.plan.api import Plan, make_plan, plan_recipe
from llmtrain.plan.costmodel import estimate
from llmtrain.cluster.placement import Node, Placement
from llmtrain.plan.render import render_plan
from llmtrain.plan.report import plan_to_dict
from llmtrain.plan.validate import validate
from llmtrain.recipe.load import validate_recipe_dict

REPO = Path(__file__).resolve().parents[1]
RECIPES = REPO / "recipes"
HOSTFILES = REPO / "hostfiles"
SHIPPED_RECIPES = sorted(RECIPES.glob("*.yaml"))
CLI = [sys.executable, "-m", "llmtrain.cli.app"]


def recipe_dict(path: Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text())


def merge(base: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    """Deep-merge ``patch`` into a copy of ``base`` (a ``None`` value deletes the key)."""
    out = copy.deepcopy(base)
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def plan_of(data: dict[str, Any], nodes: int = 1, gpus: int = 8,
            placement: Placement | None = None) -> Plan:
    """Validate a recipe dict for ``nodes x gpus`` (or an explicit placement)."""
    recipe = validate_recipe_dict(copy.deepcopy(data))
    if placement is None:
        return plan_recipe(recipe, None, nodes, gpus)
    return Plan(recipe, placement, validate(recipe, placement))


def nodes_of(*slots: int) -> Placement:
    return Placement(tuple(Node(f"n{i}", s) for i, s in enumerate(slots)))


def debug(patch: dict[str, Any] | None = None, preset: str = "debug-dense") -> dict[str, Any]:
    """A small valid recipe on the debug preset, patched."""
    base = {"model": {"preset": preset}, "train": {"seq_len": 128}, "parallel": {"zero": 0}}
    return merge(base, patch or {})


def find(problems: list[Problem], path: str, *fragments: str) -> Problem:
    """The one problem at ``path`` whose message contains every fragment (fails otherwise)."""
    hits = [p for p in problems if p.path == path and all(f in p.message for f in fragments)]
    assert hits, f"no problem at {path!r} with {fragments}; got:\n" + "\n".join(p.line() for p in problems)
    return hits[0]


def paths(problems: list[Problem]) -> list[str]:
    return [p.path for p in problems]


def render_text(data: dict[str, Any]) -> str:
    console = Console(file=io.StringIO(), width=200, highlight=False, soft_wrap=True)
    render_plan(data, console)
    return console.file.getvalue()


def run_plan_path(recipe_path: Path, hosts: Path | None = None, nodes: int | None = None,
                  gpus: int | None = None, overrides: list[str] | None = None) -> tuple[dict[str, Any], str]:
    """The CLI's code path in-process: make_plan -> plan_to_dict -> render_plan."""
    data = plan_to_dict(make_plan(recipe_path, hosts, nodes, gpus, overrides))
    return data, render_text(data)


FILE_LINE = re.compile(r":[1-9]\d*$")
SECTIONS = ("name", "model", "parallel", "train", "data", "checkpoint", "cluster", "recipe")


def assert_good_problem(problem: Problem, files: tuple[str, ...] = (), data_keys=()) -> None:
    """Every problem names where and how to fix it.

    Where: ``file:LINE`` for problems in a file, ``--set``/``--nodes``/... for flags, else a
    dotted recipe path whose first part is a recipe section or a key the file really has.
    """
    assert problem.path.strip(), problem
    assert problem.hint.strip(), problem
    assert problem.message.strip(), problem
    if any(problem.path.startswith(f) for f in files):
        assert FILE_LINE.search(problem.path), problem
    elif not problem.path.startswith("--"):
        assert "\n" not in problem.path, problem
        path = problem.path
        if path.split(".", 1)[0] in SECTIONS:
            return
        keys = [str(k) for k in data_keys if str(k)] + [repr(str(k)) for k in data_keys]
        assert any(path == k or path.startswith(k + ".") for k in keys), problem


def stack_recipe(**over) -> dict[str, Any]:
    """Llama 3 8B on one node of H100 (fp8, zero 3, selective AC, 16 x 8,192 tokens, time model v2), with
    ``section__key=value`` overrides: the recipe the planner-only stack settings are tested on."""
    base = {"model": {"preset": "llama3-8b"}, "parallel": {"zero": 3},
            "train": {"seq_len": 8192, "micro_batch_size": 2, "global_batch_size": 16, "activation_checkpointing": "selective",
                      "precision": "fp8"},
            "cluster": {"nodes": 1, "gpus_per_node": 8, "gpu": "h100-sxm", "time_model": "v2"}}
    for key, value in over.items():
        section, name = key.split("__")
        base.setdefault(section, {})[name] = value
    return base


def stack_cost(data: dict[str, Any]):
    """The cost model's estimate (``costmodel.estimate``) of a recipe dict, without hints."""
    recipe = validate_recipe_dict(data)
    p = plan_recipe(recipe)
    return estimate(recipe, p.validation.dims, p.validation.batch, p.placement, hints=False)
