"""``llmtrain plan`` and ``llmtrain schema``."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer

from llmtrain.cli.app import app, report_errors
from llmtrain.errors import EXIT_USER_ERROR
from llmtrain.launch.secrets import masked_errors

SET_HELP = "Override a recipe key: --set parallel.tp=2 (repeatable; the value is parsed as YAML)."


@app.command()
@report_errors
@masked_errors
def plan(
    recipe: Path = typer.Argument(..., help="Recipe YAML file."),
    hosts: Optional[Path] = typer.Option(None, "--hosts", help="Hostfile: world size and node placement come from it."),
    nodes: Optional[int] = typer.Option(None, "--nodes", help="Plan for this many nodes (instead of cluster.nodes)."),
    gpus_per_node: Optional[int] = typer.Option(None, "--gpus-per-node", help="GPUs per node (instead of cluster.gpus_per_node)."),
    set_: list[str] = typer.Option([], "--set", help=SET_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print the plan as a JSON object (see docs/plan-json.md)."),
    search: bool = typer.Option(False, "--search", help="Search every valid layout for this cluster and rank those that fit "
                                "by modeled throughput (docs/planner.md)."),
    top: int = typer.Option(5, "--top", min=1, max=100, help="With --search: how many layouts to show."),
    keep: list[str] = typer.Option([], "--keep", help="With --search: only layouts with this value, e.g. --keep "
                                   "parallel.zero=0 (repeatable; KEY alone keeps the recipe's value)."),
    schedule: bool = typer.Option(False, "--schedule", help="Draw the pipeline schedule's timeline in the terminal."),
    schedule_png: Optional[Path] = typer.Option(None, "--schedule-png", help="Write the pipeline schedule's timeline as a PNG."),
    layout_png: Optional[Path] = typer.Option(None, "--layout-png", help="Write the rank layout over nodes and GPUs as a PNG."),
    force: bool = typer.Option(False, "--force", help="Let --schedule-png / --layout-png replace an existing file that "
                               "is not a PNG."),
) -> None:
    """Validate a recipe and show layout, batch math, memory, step time and MFU, before anything starts."""
    from llmtrain.plan.api import make_plan

    schedule_png, layout_png = _png_targets(schedule_png, layout_png, force)
    if hosts is None:  # inside a Slurm allocation: plan for it (a hostfile or --nodes/--gpus-per-node win)
        from llmtrain.launch.backends.slurm_alloc import plan_placement

        nodes, gpus_per_node, line = plan_placement(nodes, gpus_per_node, recipe, set_)
        if line:
            print(line, file=sys.stderr, flush=True)  # stderr: --json stays one JSON object
    result = make_plan(recipe, hosts, nodes, gpus_per_node, set_)
    if keep and not search:
        from llmtrain.errors import LLMTrainError

        raise LLMTrainError("only applies to a layout search", "add --search, or use --set to plan one layout",
                            path="--keep")
    if search:
        _search(result, top, as_json, keep)
        return
    from llmtrain.plan.report import plan_to_dict

    data = plan_to_dict(result)
    _pictures(result, schedule_png, layout_png)
    if as_json:
        # dumps + one write: json.dump streams one tiny write per token (~3x slower at 16,384 ranks)
        sys.stdout.write(json.dumps(data, separators=(",", ":") if data["world_size"] > 4096 else (", ", ": ")) + "\n")
    else:
        from rich.console import Console

        from llmtrain.plan.render import render_plan

        render_plan(data, Console(highlight=False, soft_wrap=True))
        if schedule:
            print(_schedule_text(result))
    if not data["valid"]:
        raise typer.Exit(EXIT_USER_ERROR)


def _timeline(result):
    from llmtrain.errors import LLMTrainError
    from llmtrain.plan.schedule import DRAWN, simulate

    p, v = result.recipe.parallel, result.validation
    if v.batch is None or v.dims is None:
        raise LLMTrainError("the layout is invalid, so there is no schedule to draw", "fix the errors first", path="--schedule")
    if p.pp == 1:
        return None
    if p.pp_schedule not in DRAWN:
        raise LLMTrainError(f"the {p.pp_schedule} timeline is not drawn", f"use one of {', '.join(DRAWN)}",
                            path="parallel.pp_schedule")
    return simulate(p.pp_schedule, p.pp, p.pp_virtual_stages, v.batch.microbatches)


def _schedule_text(result) -> str:
    from llmtrain.plan.pictures import schedule_text

    timeline = _timeline(result)
    if timeline is None:
        return "Schedule: pp = 1, no pipeline (micro batches run one after another with gradient accumulation)"
    return "Schedule " + schedule_text(timeline)


def _png_targets(schedule_png: Optional[Path], layout_png: Optional[Path], force: bool):
    """Check both picture paths before planning (a directory means a default name inside it)."""
    from llmtrain.safeio import PNG_MAGIC, output_file

    if schedule_png is not None:
        schedule_png = output_file(schedule_png, "--schedule-png", "schedule.png", force, PNG_MAGIC)
    if layout_png is not None:
        layout_png = output_file(layout_png, "--layout-png", "layout.png", force, PNG_MAGIC)
    return schedule_png, layout_png


def _pictures(result, schedule_png: Optional[Path], layout_png: Optional[Path]) -> None:
    if schedule_png is not None:
        from llmtrain.plan.pictures import schedule_png as draw

        timeline = _timeline(result)
        if timeline is None:
            from llmtrain.errors import LLMTrainError

            raise LLMTrainError("pp = 1: there is no pipeline schedule to draw", "set parallel.pp > 1", path="--schedule-png")
        print(f"wrote {draw(timeline, schedule_png)}", file=sys.stderr)
    if layout_png is not None:
        from llmtrain.errors import LLMTrainError
        from llmtrain.plan.pictures import layout_png as draw

        if result.validation.dims is None:
            raise LLMTrainError("the layout is invalid, so there is no rank layout to draw", "fix the errors first",
                                path="--layout-png")
        print(f"wrote {draw(result.validation.dims, result.placement, layout_png)}", file=sys.stderr)


def _search(result, top: int, as_json: bool, keep_items: list[str]) -> None:
    from llmtrain.plan.search import search
    from llmtrain.plan.search_keep import parse_keep

    found = search(result.recipe, result.placement, top=top, keep=parse_keep(keep_items, result.recipe))
    if as_json:
        sys.stdout.write(json.dumps(found.to_dict()) + "\n")
    else:
        from llmtrain.plan.search import format_result

        print(format_result(found, result.recipe, result.placement))
    if not found.top:
        raise typer.Exit(EXIT_USER_ERROR)


@app.command()
@report_errors
def schema(out: Optional[Path] = typer.Option(None, "--out", help="Write to this file (or recipe.schema.json in this "
                                              "directory) instead of stdout."),
           force: bool = typer.Option(False, "--force", help="Replace an existing --out file that is not an "
                                      "earlier schema.")) -> None:
    """Write the recipe's JSON Schema (for editor completion)."""
    from llmtrain.recipe.schema import Recipe
    from llmtrain.safeio import output_file, printable, write_file

    text = json.dumps(Recipe.model_json_schema(by_alias=True), indent=2)
    if out is None:
        print(text)
    else:
        # An earlier schema starts with the same bytes as this one (its first key): replaceable.
        target = output_file(out, "--out", "recipe.schema.json", force, magic=text[:40].encode())
        write_file(target, text + "\n", "--out")
        print(f"wrote {printable(target)}", file=sys.stderr)
