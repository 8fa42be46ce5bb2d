"""``llmtrain plan`` and ``llmtrain schema``."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer

from llmtrain.cli.app import app, report_errors
from llmtrain.errors import EXIT_USER_ERROR

SET_HELP = "Override a recipe key: --set parallel.tp=2 (repeatable; the value is parsed as YAML)."


@app.command()
@report_errors
def plan(
    recipe: Path = typer.Argument(..., help="Recipe YAML file."),
    hosts: Optional[Path] = typer.Option(None, "--hosts", help="Hostfile: world size and node placement come from it."),
    nodes: Optional[int] = typer.Option(None, "--nodes", help="Plan for this many nodes (instead of cluster.nodes)."),
    gpus_per_node: Optional[int] = typer.Option(None, "--gpus-per-node", help="GPUs per node (instead of cluster.gpus_per_node)."),
    set_: list[str] = typer.Option([], "--set", help=SET_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print the plan as a JSON object (see docs/plan-json.md)."),
) -> None:
    """Validate a recipe and show layout, batch math and model size, before anything starts."""
    from llmtrain.plan.api import make_plan
    from llmtrain.plan.report import plan_to_dict

    result = make_plan(recipe, hosts, nodes, gpus_per_node, set_)
    data = plan_to_dict(result)
    if as_json:
        # dumps + one write: json.dump streams one tiny write per token (~3x slower at 16,384 ranks)
        sys.stdout.write(json.dumps(data, separators=(",", ":") if data["world_size"] > 4096 else (", ", ": ")) + "\n")
    else:
        from rich.console import Console

        from llmtrain.plan.render import render_plan

        render_plan(data, Console(highlight=False, soft_wrap=True))
    if not data["valid"]:
        raise typer.Exit(EXIT_USER_ERROR)


@app.command()
@report_errors
def schema(out: Optional[Path] = typer.Option(None, "--out", help="Write to this file instead of stdout.")) -> None:
    """Write the recipe's JSON Schema (for editor completion)."""
    from llmtrain.recipe.schema import Recipe

    text = json.dumps(Recipe.model_json_schema(by_alias=True), indent=2)
    if out is None:
        print(text)
    else:
        out.write_text(text + "\n")
        print(f"wrote {out}", file=sys.stderr)
