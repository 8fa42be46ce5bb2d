"""``make_plan``: the single code path behind ``llmtrain plan`` (and the launcher's pre-check).

Loads the recipe (with ``--set`` overrides), takes the world size and node placement from a
hostfile, from ``--nodes/--gpus-per-node``, or from the recipe's ``cluster`` section, then
validates every rule. Bad input raises :class:`~llmtrain.errors.LLMTrainError`; an
inconsistent layout returns a :class:`Plan` whose ``valid`` is false and whose errors list
every problem, so the caller can still show what was understood.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from llmtrain.errors import LLMTrainError
from llmtrain.cluster.hostfile import Hostfile, load_hostfile
from llmtrain.cluster.placement import Placement
from llmtrain.plan.validate import Validation, validate
from llmtrain.recipe.load import load_recipe
from llmtrain.recipe.schema import Recipe

# Largest world the planner lays out rank by rank (5x the largest GPU clusters of 2025); beyond
# it a typo such as `nodes: 10000000` would spend minutes and gigabytes building the layout.
MAX_WORLD = 1 << 20


@dataclass
class Plan:
    recipe: Recipe
    placement: Placement
    validation: Validation
    hostfile: Hostfile | None = None

    @property
    def valid(self) -> bool:
        return self.validation.valid


def resolve_placement(recipe: Recipe, hostfile: Hostfile | None = None, nodes: int | None = None,
                      gpus_per_node: int | None = None) -> Placement:
    if hostfile is not None:
        if nodes is not None or gpus_per_node is not None:
            raise LLMTrainError("--hosts and --nodes/--gpus-per-node both given", "pass one of them", path="--hosts")
        if hostfile.world_size > MAX_WORLD:
            raise LLMTrainError(f"the hostfile gives {hostfile.world_size} ranks, more than the {MAX_WORLD} llmtrain plans for",
                                "check the slots", path=hostfile.source)
        return hostfile.placement
    for flag, value in (("--nodes", nodes), ("--gpus-per-node", gpus_per_node)):
        if value is not None and not 1 <= value <= (1 << 24):
            raise LLMTrainError(f"{flag} {value} is out of range", "use a positive whole number", path=flag)
    n, g = nodes or recipe.cluster.nodes, gpus_per_node or recipe.cluster.gpus_per_node
    if n * g > MAX_WORLD:
        where = "--nodes" if nodes else "cluster.nodes"
        raise LLMTrainError(f"{n} nodes x {g} GPUs = {n * g} ranks, more than the {MAX_WORLD} llmtrain plans for",
                            f"use at most {MAX_WORLD // g} nodes of {g} GPUs", path=where)
    return Placement.uniform(n, g)


def make_plan(recipe_path: str | Path, hosts: str | Path | None = None, nodes: int | None = None,
              gpus_per_node: int | None = None, overrides: list[str] | None = None) -> Plan:
    recipe = load_recipe(recipe_path, overrides)
    hostfile = load_hostfile(hosts) if hosts is not None else None
    return plan_recipe(recipe, hostfile, nodes, gpus_per_node)


def plan_recipe(recipe: Recipe, hostfile: Hostfile | None = None, nodes: int | None = None,
                gpus_per_node: int | None = None) -> Plan:
    placement = resolve_placement(recipe, hostfile, nodes, gpus_per_node)
    return Plan(recipe, placement, validate(recipe, placement), hostfile)
