"""``llmtrain hosts check``: preflight every host of a hostfile in parallel, print one table.

Examples::

    llmtrain hosts check --hosts hostfiles/two-nodes
    llmtrain hosts check --hosts hosts.yaml --recipe recipes/llama3-8b.yaml   # its launch: paths, port, timeouts
    llmtrain hosts check --hosts hosts.yaml --json

Exit code 0 when every host is ready (warnings allowed), 1 when a check failed, 2 for a bad
hostfile or recipe.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer

from llmtrain.cli.app import app, report_errors

hosts_app = typer.Typer(no_args_is_help=True, help="Check the hosts of a hostfile before a launch.")
app.add_typer(hosts_app, name="hosts")

DEFAULT_RECIPE = "model: {preset: debug-dense}\nname: hosts-check\n"


@hosts_app.command("check")
@report_errors
def check(
    hosts: Path = typer.Option(..., "--hosts", help="Hostfile to check."),
    recipe: Optional[Path] = typer.Option(None, "--recipe", help="Recipe whose launch: section (python, workdir, "
                                          "rdzv_port, timeouts) applies; default: the defaults."),
    set_: list[str] = typer.Option([], "--set", help="Override a recipe key, e.g. --set launch.rdzv_port=29600."),
    runs: Path = typer.Option(Path("runs"), "--runs", help="Run root whose free disk space is checked."),
    include: Optional[str] = typer.Option(None, "--include", help="Only these hosts/GPUs: host1@host2:0,2."),
    exclude: Optional[str] = typer.Option(None, "--exclude", help="All but these hosts/GPUs."),
    accept_new_host_keys: bool = typer.Option(False, "--accept-new-host-keys", help="Trust unknown host keys on first use (warns)."),
    as_json: bool = typer.Option(False, "--json", help="Print the results as JSON."),
) -> None:
    """SSH, python, torch/CUDA/NCCL, llmtrain version, GPUs vs slots, disk, rendezvous port, clock skew."""
    from rich.console import Console
    from rich.text import Text

    from llmtrain.launch import preflight, ssh
    from llmtrain.launch.commands import build_spec
    from llmtrain.launch.filters import select_hosts
    from llmtrain.launch.hostfile import load_hostfile
    from llmtrain.launch.local import engine_module
    from llmtrain.launch.rundir import new_run_id
    from llmtrain.launch.sshconfig import resolve_targets
    from llmtrain.launch.sshlaunch import ssh_options
    from llmtrain.recipe.load import load_recipe, load_recipe_text

    console = Console(highlight=False, soft_wrap=True, stderr=as_json)
    loaded = load_recipe(recipe, set_) if recipe else load_recipe_text(DEFAULT_RECIPE, set_)
    selection = select_hosts(load_hostfile(hosts), include, exclude)
    targets = resolve_targets(selection.hostfile, check_identities=True)  # a bad key file: exit 2, nothing connected
    spec = build_spec(loaded, selection.hostfile, targets, new_run_id(), runs, engine_module(), selection.visible_devices)
    opts = ssh_options(selection.hostfile, loaded, accept_new_host_keys, lambda m: console.print(Text(m), style="yellow"))
    reports = preflight.run_preflight(spec, opts)
    for report in reports:
        ssh.close(report.conn)
    if as_json:
        sys.stdout.write(json.dumps(preflight.to_json(reports), indent=2) + "\n")
    else:
        preflight.render(reports, console)
    raise typer.Exit(1 if any(r.failed for r in reports) else 0)
