"""``llmtrain hosts check``: preflight every host of a hostfile in parallel, print one table.

Examples::

    llmtrain hosts check --hosts hostfiles/two-nodes
    llmtrain hosts check --hosts hosts.yaml --recipe recipes/llama3-8b.yaml   # its launch: paths, port, timeouts
    llmtrain hosts check --hosts hosts.yaml --json
    llmtrain hosts check --launcher slurm --partition gpu --nodes 2 --gpus-per-node 8   # as one srun step
    salloc -N 4 llmtrain hosts check                   # inside an allocation: its nodes, --launcher slurm implied

Exit code 0 when every host is ready (warnings allowed), 1 when a check failed, 2 for a bad
hostfile, recipe or option (also what Slurm refuses before the check runs: an unknown partition,
an account it rejects, more nodes than the partition has).

``--launcher slurm`` (:mod:`llmtrain.launch.backends.slurm_preflight`) takes the nodes and ranks per node
as ``launch --launcher slurm`` does: ``--nodes`` / ``--gpus-per-node``, else the allocation's,
else the recipe's ``cluster``; GPUs are expected unless the recipe's ``cluster.gpu`` is ``cpu``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer

from llmtrain.cli.app import app, report_errors

hosts_app = typer.Typer(no_args_is_help=True, help="Check the hosts of a hostfile (SSH) or Slurm nodes before a launch.")
app.add_typer(hosts_app, name="hosts")

DEFAULT_RECIPE = "model: {preset: debug-dense}\nname: hosts-check\n"


@hosts_app.command("check")
@report_errors
def check(
    hosts: Optional[Path] = typer.Option(None, "--hosts", help="Hostfile to check (over SSH)."),
    launcher: Optional[str] = typer.Option(None, "--launcher", help="ssh | slurm (default: ssh with --hosts, slurm "
                                           "inside a Slurm allocation). slurm: the checks as one srun step."),
    partition: Optional[str] = typer.Option(None, "--partition", help="Slurm partition (default: Slurm's default)."),
    account: Optional[str] = typer.Option(None, "--account", help="Slurm account to charge."),
    time_limit: Optional[str] = typer.Option(None, "--time", help="Slurm time limit of the check's job (default 5 min)."),
    nodes: Optional[int] = typer.Option(None, "--nodes", min=1, help="Slurm nodes to check (default: the allocation's, "
                                        "else cluster.nodes)."),
    gpus_per_node: Optional[int] = typer.Option(None, "--gpus-per-node", min=1, help="Ranks (GPUs) per Slurm node "
                                                "(default: SLURM_GPUS_ON_NODE, else cluster.gpus_per_node)."),
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

    from llmtrain.launch import preflight
    from llmtrain.launch.backends import ssh
    from llmtrain.launch.commands import build_spec
    from llmtrain.cluster.filters import select_hosts
    from llmtrain.cluster.hostfile import load_hostfile
    from llmtrain.launch.launchplan import engine_module
    from llmtrain.launch.rundir import new_run_id
    from llmtrain.launch.sshconfig import resolve_targets
    from llmtrain.launch.backends.sshlaunch import ssh_options
    from llmtrain.recipe.load import load_recipe, load_recipe_text

    console = Console(highlight=False, soft_wrap=True, stderr=as_json)
    launcher = pick_launcher(launcher, hosts, {"--partition": partition, "--account": account, "--time": time_limit,
                                               "--nodes": nodes, "--gpus-per-node": gpus_per_node},
                             {"--include": include, "--exclude": exclude, "--accept-new-host-keys": accept_new_host_keys})
    loaded = load_recipe(recipe, set_) if recipe else load_recipe_text(DEFAULT_RECIPE, set_)
    if launcher == "slurm":
        from llmtrain.launch.backends.slurm_preflight import SLURM_CHECKS, run_slurm_preflight

        reports = run_slurm_preflight(loaded, runs, nodes, gpus_per_node, partition, account, time_limit,
                                      say=lambda m: console.print(Text(m), style="dim"))
        if as_json:
            sys.stdout.write(json.dumps(preflight.to_json(reports), indent=2) + "\n")
        else:
            preflight.render(reports, console, SLURM_CHECKS)
        raise typer.Exit(1 if any(r.failed for r in reports) else 0)
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


def pick_launcher(launcher: str | None, hosts: Path | None, slurm_opts: dict, ssh_opts: dict) -> str:
    """``ssh`` or ``slurm``, as ``llmtrain launch`` picks it; a flag of the other one is an error."""
    from llmtrain.errors import LLMTrainError
    from llmtrain.launch.backends.slurm_alloc import allocation_from_env

    if launcher not in (None, "ssh", "slurm"):
        raise LLMTrainError(f"unknown launcher {launcher!r} for hosts check", "use ssh (with --hosts) or slurm",
                            path="--launcher")
    if launcher is None:
        launcher = "ssh" if hosts is not None else "slurm" if allocation_from_env() is not None else None
    if launcher is None:
        raise LLMTrainError("nothing to check", "pass --hosts HOSTFILE (SSH), or --launcher slurm", path="--hosts")
    if launcher == "slurm":
        given = [flag for flag, value in {"--hosts": hosts, **ssh_opts}.items() if value]
        if given:
            raise LLMTrainError(f"{given[0]} does not apply to --launcher slurm (Slurm picks the nodes)",
                                "drop it, or check a hostfile over SSH", path=given[0])
    else:
        given = [flag for flag, value in slurm_opts.items() if value]
        if given:
            raise LLMTrainError(f"{given[0]} needs --launcher slurm", "add --launcher slurm, or drop the flag",
                                path=given[0])
        if hosts is None:
            raise LLMTrainError("--launcher ssh needs --hosts", "pass a hostfile", path="--hosts")
    return launcher
