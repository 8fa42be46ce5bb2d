"""``plan --search --keep KEY[=VALUE]``: search only the layouts that have these values.

A user whose stack lacks a feature (no ZeRO, a fixed TP degree inside the node, no interleaved
schedule) or who has already chosen part of the layout wants the ranking among the layouts they can
run, not a winner they cannot use. ``--keep parallel.zero=0`` searches DDP layouts only;
``--keep parallel.zero`` (no value) keeps the recipe's own value; the flag repeats. Only the keys the
search chooses can be kept (:data:`KEYS`); any other key, a value of the wrong type or outside the
schema's choices is a one-line error naming ``--keep``. ``--keep parallel.pp_layers_per_stage`` (or
``=even``) keeps pipelines whose stages hold equal layer counts (layers divisible by pp x virtual
stages), for stacks that cannot split unevenly: Megatron-LM before 2024's
``--decoder-first-pipeline-num-layers`` asserted ``num_layers % pipeline_model_parallel_size == 0``
(``megatron/model/transformer.py`` at aed2f75, 2021) and the same per virtual stage
(``arguments.py``); the search otherwise spreads leftover layers over the middle stages. A list
cannot be kept: the search picks pp and v, and a list fixes both. The constrained search is the same search
(same bounds: they are lower bounds over any subset of the layouts), so what it returns is exactly the
unconstrained search's order restricted to the kept layouts.
"""

from __future__ import annotations

from typing import Any, get_args

import yaml

from llmtrain.errors import LLMTrainError
from llmtrain.recipe.schema import Recipe

# searched key -> (kind, minimum): "int" (>= the minimum; zero also <= 3), "choice" (the schema's Literal
# values) or "bool" (sequence_parallel: false for a stack without SP; true keeps only tp > 1 layouts it divides)
KEYS: dict[str, tuple[str, int]] = {
    "parallel.tp": ("int", 1), "parallel.cp": ("int", 1), "parallel.pp": ("int", 1), "parallel.ep": ("int", 1),
    "parallel.zero": ("int", 0), "parallel.dp_replicate": ("int", 1), "parallel.pp_schedule": ("choice", 0),
    "parallel.pp_virtual_stages": ("int", 1), "train.micro_batch_size": ("int", 1),
    "train.activation_checkpointing": ("choice", 0), "parallel.sequence_parallel": ("bool", 0),
    "parallel.pp_layers_per_stage": ("even", 0),
}
EVEN = None  # the kept value of parallel.pp_layers_per_stage: the recipe's "no list", i.e. equal stages


def _choices(key: str) -> tuple[str, ...]:
    section, name = key.split(".", 1)
    model = Recipe.model_fields[section].annotation
    return get_args(model.model_fields[name].annotation)


def parse_keep(items: list[str], recipe: Recipe) -> dict[str, Any]:
    """``--keep`` items -> {dotted key: value}; ``KEY`` alone takes the recipe's value."""
    keep: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if key not in KEYS:
            raise LLMTrainError(f"{key!r} is not a key the search chooses", f"keep one of {', '.join(KEYS)}",
                                path="--keep")
        section, name = key.split(".", 1)
        if sep:
            try:
                value = yaml.safe_load(raw) if raw.strip() else raw
            except yaml.YAMLError:
                value = raw
        else:
            value = getattr(getattr(recipe, section), name)
        kind, low = KEYS[key]
        if kind == "int":
            if isinstance(value, bool) or not isinstance(value, int) or value < low or (key == "parallel.zero" and value > 3):
                top = " and 3" if key == "parallel.zero" else ""
                shown = raw.strip() if sep else value
                raise LLMTrainError(f"{key}={shown} is not an integer {'between ' + str(low) + top if top else f'>= {low}'}",
                                    f"e.g. --keep {key}={max(low, 1) if key != 'parallel.zero' else 0}", path="--keep")
        elif kind == "even":
            if value not in (None, "even"):
                raise LLMTrainError(f"{key}={raw.strip() if sep else value} cannot be kept: only equal stages can",
                                    f"keep those with --keep {key}=even", path="--keep")
            value = EVEN
        elif kind == "bool":
            if not isinstance(value, bool):
                raise LLMTrainError(f"{key}={raw.strip() if sep else value} is not true or false",
                                    f"e.g. --keep {key}=false", path="--keep")
        elif value not in _choices(key):
            raise LLMTrainError(f"{key}={value} is not one of {', '.join(_choices(key))}",
                                f"e.g. --keep {key}={_choices(key)[1]}", path="--keep")
        if key in keep and keep[key] != value:
            raise LLMTrainError(f"{key} is kept twice, as {keep[key]!r} and {value!r}", "keep it once", path="--keep")
        keep[key] = value
    return keep


def allowed(keep: dict[str, Any] | None, key: str, value: Any) -> bool:
    """Whether a layout with ``key = value`` is among the kept ones."""
    return not keep or key not in keep or keep[key] == value


def keep_text(keep: dict[str, Any] | None) -> str:
    return " ".join(f"{k}={'even' if v is EVEN else v}" for k, v in (keep or {}).items())
