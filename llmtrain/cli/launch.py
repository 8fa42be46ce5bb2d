"""``llmtrain launch``: run a recipe on this machine, or on a cluster over SSH, and stream its progress.

Examples::

    llmtrain launch recipes/debug.yaml                       # 4 ranks on localhost, runs/debug/<run id>/
    llmtrain launch recipes/debug.yaml --set train.steps=10 --runs /tmp/runs
    llmtrain launch recipes/debug.yaml --dry-run             # print the torchrun command; start nothing
    llmtrain launch recipes/llama3-8b.yaml --hosts hostfiles/two-nodes --dry-run     # print each node's command
    llmtrain launch recipes/llama3-8b.yaml --hosts hostfiles/two-nodes               # preflight, then run
    llmtrain launch recipes/llama3-8b.yaml --hosts hosts --include 'worker-1@worker-2:0,1'
    llmtrain launch recipes/llama3-8b.yaml --launcher slurm --partition gpu --nodes 2 --time 04:00:00 --dry-run

The command exits with the run's exit code (torchrun's; 130/143 after Ctrl-C/SIGTERM; over
SSH also 124 for a hang and 255 for a lost node; with --launcher slurm the job's ExitCode); a recipe that does not validate, or a host
that fails preflight, exits 2 before anything is created or started.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from llmtrain.cli.app import app, report_errors
from llmtrain.errors import LLMTrainError
from llmtrain.launch.secrets import masked_errors

SET_HELP = "Override a recipe key: --set parallel.tp=2 (repeatable; the value is parsed as YAML)."


@app.command()
@report_errors
@masked_errors
def launch(
    recipe: Path = typer.Argument(..., help="Recipe YAML file."),
    set_: list[str] = typer.Option([], "--set", help=SET_HELP),
    runs: Path = typer.Option(Path("runs"), "--runs", help="Root of the run directories (runs/<name>/<run id>/)."),
    hosts: Optional[Path] = typer.Option(None, "--hosts", help="Hostfile: run on these hosts over SSH (docs/launch.md)."),
    include: Optional[str] = typer.Option(None, "--include", help="Only these hosts/GPUs: host1@host2:0,2 (with --hosts)."),
    exclude: Optional[str] = typer.Option(None, "--exclude", help="All but these hosts/GPUs: host1@host2:0,2 (with --hosts)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print every node's exact command (secrets masked); start nothing."),
    skip_preflight: bool = typer.Option(False, "--skip-preflight", help="Do not run `llmtrain hosts check` first."),
    max_restarts: Optional[int] = typer.Option(
        None, "--max-restarts", min=0, max=1000,
        help="Restart the workers up to K times after a failure; they resume from the latest checkpoint "
             "(= --set launch.max_restarts=K)."),
    accept_new_host_keys: bool = typer.Option(
        False, "--accept-new-host-keys", help="Trust unknown SSH host keys on first use (warns; changed keys are still refused)."),
    init_from_hf: Optional[Path] = typer.Option(
        None, "--init-from-hf", help="Start from Hugging Face Llama weights in DIR (config.json + *.safetensors; "
                                     "= --set checkpoint.init_from_hf=DIR)."),
    launcher: Optional[str] = typer.Option(
        None, "--launcher", help="local | ssh | slurm (default: ssh with --hosts, slurm inside a Slurm allocation, else "
                                 "local). slurm: one sbatch job, or one srun step inside an allocation (docs/launch.md, Slurm)."),
    partition: Optional[str] = typer.Option(None, "--partition", help="Slurm partition (default: the cluster's default)."),
    account: Optional[str] = typer.Option(None, "--account", help="Slurm account to charge."),
    time_limit: Optional[str] = typer.Option(None, "--time", help="Slurm time limit, HH:MM:SS (or D-HH:MM:SS)."),
    nodes: Optional[int] = typer.Option(None, "--nodes", min=1, max=100000,
                                        help="Slurm nodes (default: the recipe's cluster.nodes)."),
    gpus_per_node: Optional[int] = typer.Option(
        None, "--gpus-per-node", min=1, max=1024, help="Ranks (GPUs) per Slurm node (default: cluster.gpus_per_node)."),
    slurm_arg: list[str] = typer.Option([], "--slurm-arg", help="One more sbatch option, e.g. --slurm-arg=--qos=high "
                                                                "(repeatable; one #SBATCH line each)."),
    requeue: bool = typer.Option(
        False, "--requeue", help="Let Slurm requeue the job (preemption, node failure); it then resumes from the latest "
                                 "checkpoint by itself (sbatch --requeue; with --launcher slurm)."),
) -> None:
    """Validate a recipe, then train it with torchrun: on this machine, on every host of --hosts over SSH,
    or as one Slurm job (--launcher slurm)."""
    slurm_opts = {"--partition": partition, "--account": account, "--time": time_limit, "--nodes": nodes,
                  "--gpus-per-node": gpus_per_node, "--slurm-arg": slurm_arg, "--requeue": requeue}
    if launcher not in (None, "local", "ssh", "slurm"):
        raise LLMTrainError(f"unknown launcher {launcher!r}", "use local, ssh or slurm", path="--launcher")
    # inside a Slurm allocation (SLURM_JOB_ID set) the default is one srun step on it; explicit wins
    from llmtrain.launch.backends.slurm_alloc import allocation_from_env

    alloc = allocation_from_env() if launcher in (None, "slurm") and hosts is None else None
    if alloc is not None:
        launcher = "slurm"
        for flag in ("--partition", "--account", "--time", "--slurm-arg", "--requeue"):
            if slurm_opts[flag]:
                raise LLMTrainError(f"{flag} does not apply inside Slurm allocation {alloc.job_id} (it is already "
                                    "allocated)", "drop the flag, or run llmtrain outside the allocation",
                                    path=flag)
    if launcher != "slurm":
        given = [flag for flag, value in slurm_opts.items() if value]
        if given:
            raise LLMTrainError(f"{given[0]} needs --launcher slurm", "add --launcher slurm, or drop the flag", path=given[0])
    if launcher == "ssh" and hosts is None:
        raise LLMTrainError("--launcher ssh needs --hosts", "pass a hostfile", path="--launcher")
    if launcher == "local" and hosts is not None:
        raise LLMTrainError("--launcher local runs on this machine only", "drop --hosts, or use --launcher ssh",
                            path="--launcher")
    if max_restarts is not None:
        set_ = [*set_, f"launch.max_restarts={max_restarts}"]
    if init_from_hf is not None:
        set_ = [*set_, *check_init_from_hf(recipe, set_, init_from_hf)]
    set_ = check_data(recipe, set_, local=hosts is None and launcher != "slurm", show=dry_run)
    if launcher == "slurm":
        for flag, value in (("--hosts", hosts), ("--include", include), ("--exclude", exclude),
                            ("--skip-preflight", skip_preflight), ("--accept-new-host-keys", accept_new_host_keys)):
            if value or value == "":
                raise LLMTrainError(f"{flag} does not apply to --launcher slurm (Slurm picks the nodes)",
                                    "drop the flag; use --nodes / --partition", path=flag)
        if alloc is not None:
            from llmtrain.launch.backends.slurm_alloc import launch_in_allocation

            raise typer.Exit(launch_in_allocation(alloc, recipe, set_, runs_root=runs, nodes=nodes,
                                                  gpus_per_node=gpus_per_node, dry_run=dry_run))
        from llmtrain.launch.backends.slurm import launch_slurm

        code = launch_slurm(recipe, set_, runs_root=runs, nodes=nodes, gpus_per_node=gpus_per_node, partition=partition,
                            account=account, time_limit=time_limit, slurm_args=tuple(slurm_arg), dry_run=dry_run,
                            requeue=requeue)
        raise typer.Exit(code)
    if hosts is None:
        for flag, value in (("--include", include), ("--exclude", exclude),
                            ("--skip-preflight", skip_preflight), ("--accept-new-host-keys", accept_new_host_keys)):
            if value or value == "":  # --include '' too
                raise LLMTrainError(f"{flag} needs --hosts", "pass a hostfile, or drop the flag", path=flag)
        from llmtrain.launch.backends.local import launch_local

        code = launch_local(recipe, set_, runs_root=runs, dry_run=dry_run)
        raise typer.Exit(code)
    from llmtrain.launch.backends.sshlaunch import launch_ssh

    code = launch_ssh(recipe, hosts, set_, runs_root=runs, include=include, exclude=exclude, dry_run=dry_run,
                      skip_preflight=skip_preflight, accept_new_host_keys=accept_new_host_keys)
    raise typer.Exit(code)


def check_data(recipe: Path, set_: list[str], local: bool, show: bool = False) -> list[str]:
    """Fine-tuning data (chat / instruction / text) is read, rendered and tokenized here before
    anything starts, exactly as every rank will, so that a bad row is one line naming its
    file:line before any process starts. The counts (kept, truncated, dropped) are printed here
    only with ``show`` (``--dry-run``, where no rank runs): a launched run's rank 0 prints the same
    line in the run log, and printing it here too showed it twice. Over SSH the data
    lives on the hosts: it is checked here only if ``data.path`` exists on this machine too.
    Chat data without ``data.chat_date`` gets today's date (returned as one more ``--set``, so
    it lands in recipe.lock.yaml and a resume renders the same text)."""
    from datetime import date

    from llmtrain.engine.data.sft import check_finetune_data
    from llmtrain.recipe.load import load_recipe

    cfg = load_recipe(recipe, set_)
    if cfg.data.source == "chat" and cfg.data.chat_date is None:
        set_ = [*set_, f"data.chat_date={date.today().isoformat()}"]
        cfg = load_recipe(recipe, set_)
    if cfg.data.source in ("synthetic", "memmap") or (not local and not Path(cfg.data.path or "").exists()):
        return set_
    summary = check_finetune_data(cfg)
    if summary is not None and show:
        print(f"data: {summary.line()}", flush=True)
    return set_


def check_init_from_hf(recipe: Path, set_: list[str], directory: Path) -> list[str]:
    """The ``--set`` items for ``--init-from-hf DIR``, after checking DIR against the recipe's model
    before anything starts: the directory and its files (untrusted: regular, inside, capped) and
    config.json against the recipe are read torch-free with the recipe
    (:mod:`llmtrain.recipe.hf_dir`, :mod:`llmtrain.recipe.hf_config`); every safetensors header
    (names, shapes, dtypes, truncation) against the model's tensor map needs the model's shapes,
    built on the meta device by the engine (:func:`llmtrain.engine.hf.files.check_hf_model`),
    so torch is imported here, lazily, only with this flag.

    The architecture comes from config.json: a recipe whose ``model`` names no preset gets
    config.json's model (:func:`~llmtrain.recipe.hf_config.model_from_hf_config`) with the
    fields it does give on top, as one more ``--set model=...``; the fields the recipe (or a
    preset) states must agree with config.json, and every disagreement is listed in one error."""
    import json

    from llmtrain.recipe.hf_config import model_from_hf_config
    from llmtrain.recipe.hf_dir import check_hf_dir
    from llmtrain.recipe.load import MAX_RECIPE_BYTES, apply_override, load_recipe, parse_yaml_mapping
    from llmtrain.safeio import printable, read_text

    directory = directory.resolve()
    data = parse_yaml_mapping(read_text(recipe, "recipe", MAX_RECIPE_BYTES, field=printable(recipe)), printable(recipe))
    for item in set_:
        apply_override(data, item)
    given = data.get("model") if isinstance(data.get("model"), dict) else {}
    extra = []
    if given.get("preset") is None:
        conf, _ = check_hf_dir(directory, "--init-from-hf")
        model = model_from_hf_config(conf, "--init-from-hf")
        moe = {**model.get("moe", {}), **given["moe"]} if isinstance(given.get("moe"), dict) else model.get("moe")
        model = {**model, **{k: v for k, v in given.items() if k != "moe"}}
        if moe is not None:
            model["moe"] = moe
        extra.append(f"model={json.dumps(model)}")
    model_cfg = load_recipe(recipe, [*set_, *extra]).model
    from llmtrain.engine.hf.files import check_hf_model  # the model's shapes: meta device, torch

    check_hf_model(directory, model_cfg, "--init-from-hf")
    return [*extra, f"checkpoint.init_from_hf={json.dumps(str(directory))}"]  # JSON is YAML
