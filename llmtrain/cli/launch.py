"""``llmtrain launch``: run a recipe (on this machine for now) and stream its progress.

Examples::

    llmtrain launch recipes/debug.yaml                       # 4 ranks on localhost, runs/debug/<run id>/
    llmtrain launch recipes/debug.yaml --set train.steps=10 --runs /tmp/runs

The command exits with the run's exit code (torchrun's; 130/143 after Ctrl-C/SIGTERM); a
recipe that does not validate exits 2 before anything is created or started.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from llmtrain.cli.app import app, report_errors
from llmtrain.errors import LLMTrainError

SET_HELP = "Override a recipe key: --set parallel.tp=2 (repeatable; the value is parsed as YAML)."


@app.command()
@report_errors
def launch(
    recipe: Path = typer.Argument(..., help="Recipe YAML file."),
    set_: list[str] = typer.Option([], "--set", help=SET_HELP),
    runs: Path = typer.Option(Path("runs"), "--runs", help="Root of the run directories (runs/<name>/<run id>/)."),
    hosts: Optional[Path] = typer.Option(None, "--hosts", help="Hostfile for a multi-node run (not implemented yet)."),
) -> None:
    """Validate a recipe, then train it with torchrun on this machine, showing one progress bar."""
    if hosts is not None:
        raise LLMTrainError("multi-node launch over SSH is not implemented yet",
                            "omit --hosts to run every rank on this machine", path="--hosts")
    from llmtrain.launch.local import launch_local

    code = launch_local(recipe, set_, runs_root=runs)
    raise typer.Exit(code)
