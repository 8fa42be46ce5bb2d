"""``llmtrain resume``: continue a run from one of its checkpoints, on this machine.

Examples::

    llmtrain resume                                   # newest run under ./runs, its latest checkpoint
    llmtrain resume --run runs/debug/20260101-120000-ab12 --ckpt step-20
    llmtrain resume --ckpt latest --set parallel.tp=1 # same run, a different layout (resharded)
    llmtrain resume --run RUN --hosts hostfile        # continue on a cluster over SSH (shared storage)
    llmtrain resume --run RUN --launcher slurm        # continue as one Slurm batch job (shared storage)

The run's locked recipe (``recipe.lock.yaml``, plus ``--set`` overrides) is validated like
``llmtrain launch``, the checkpoint is verified (:func:`pick_checkpoint`: metadata shape, files
inside the checkpoint, checksums, DCP's index read without executing code; ``latest`` falls back
to the newest intact one with a warning), and the run is relaunched in its own directory with the local
launcher (or, with ``--hosts``, over SSH like ``llmtrain launch --hosts``: preflight, one
torchrun per node; the run directory and checkpoint must be at the same path on the nodes);
the engine loads the checkpoint into the new layout and continues at its step.

The lock holds no ``launch.env`` / env file value (secrets never reach disk), only their names
and sources (``launch.env_sources``): each value is taken again from this shell's environment
(``recipe``) or the env file (``env_file``, else the environment). A missing one is an error
naming the variable (exit 2) before anything is started or changed in the run directory.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from llmtrain.cli.app import app, report_errors
from llmtrain.errors import LLMTrainError
from llmtrain.launch.secrets import masked_errors

SET_HELP = "Override a recipe key of the locked recipe: --set parallel.tp=1 (repeatable; parsed as YAML)."


def find_run(run: Path | None, runs: Path) -> Path:
    from llmtrain.launch.rundir import latest_run

    if run is not None:
        if not (run / "recipe.lock.yaml").is_file():
            raise LLMTrainError(f"{run} is not a run directory (no recipe.lock.yaml)",
                                "pass a directory made by `llmtrain launch`", path="--run")
        return run
    found = latest_run(runs)
    if found is None:
        raise LLMTrainError(f"no run under {runs}", "pass --run RUN_DIR or --runs ROOT", path="--run")
    return found


def pick_checkpoint(recipe, run_path: Path, ckpt: str) -> tuple[Path, dict, list[str]]:
    """The verified checkpoint ``--ckpt`` names: ``metadata.json``'s shape (with the fields a
    resume needs), every file inside the checkpoint with its size and sha256, DCP's index through
    the allow-list unpickler; ``latest`` falls back past damaged ones with warnings
    (:func:`llmtrain.engine.checkpoint_store.resolve`)."""
    from llmtrain.engine.checkpoint_meta import RESUME_FIELDS
    from llmtrain.engine.checkpoint_store import STEP_RE, resolve

    root = Path(recipe.checkpoint.dir) if recipe.checkpoint.dir else run_path / "checkpoints"
    spec = ckpt if ckpt == "latest" or STEP_RE.match(ckpt) else str(Path(ckpt).resolve())
    return resolve(root, spec, require=RESUME_FIELDS, check_index=True)


def check_same_adapters(recipe, meta: dict, path: Path) -> None:
    """The checkpoint's adapters are the recipe's: ``train.lora``'s presence, rank, targets and ``experts``
    as the checkpoint was trained. Loading takes the keys the new model has, so a narrower ``train.lora``
    would silently drop trained adapters (measured: ``experts: false`` on a run with expert adapters
    resumed and trained on without them) and another rank could not load; alpha and dropout may change."""
    from llmtrain.engine.finetune.lora_export import checkpoint_lora

    old, new = checkpoint_lora(path, meta), recipe.train.lora  # (a damaged recipe.train.lora: one line there)

    def says(lora) -> str:
        if lora is None:
            return "no adapters (every weight trained)"
        return f"rank {lora.rank} on {' '.join(lora.target_names)}{' and the routed experts' if lora.experts else ''}"

    key = lambda lora: None if lora is None else (lora.rank, tuple(lora.target_names), lora.experts)  # noqa: E731
    if key(old) != key(new):
        raise LLMTrainError(f"train.lora: {path} holds {says(old)}, the recipe asks for {says(new)}",
                            "resume with the checkpoint's train.lora (rank, targets, experts); other adapters "
                            "are a new run (checkpoint.init_from_hf)", path="--set")


@app.command()
@report_errors
@masked_errors
def resume(
    ckpt: str = typer.Option("latest", "--ckpt", help="Checkpoint: latest | step-N | PATH."),
    run: Optional[Path] = typer.Option(None, "--run", help="Run directory (default: the newest under --runs)."),
    runs: Path = typer.Option(Path("runs"), "--runs", help="Root of the run directories."),
    set_: list[str] = typer.Option([], "--set", help=SET_HELP),
    hosts: Optional[Path] = typer.Option(None, "--hosts", help="Continue on these hosts over SSH (the checkpoint "
                                         "must be at the same path on them: shared storage)."),
    skip_preflight: bool = typer.Option(False, "--skip-preflight", help="With --hosts: do not run `hosts check` first."),
    accept_new_host_keys: bool = typer.Option(False, "--accept-new-host-keys", help="With --hosts: trust unknown host keys."),
    launcher: Optional[str] = typer.Option(None, "--launcher", help="slurm: continue as one Slurm batch job (sbatch, "
                                           "Slurm's default partition; the run directory on shared storage)."),
) -> None:
    """Relaunch a run from a checkpoint (optionally with a new layout) and continue exactly where it stopped."""
    from llmtrain.launch.envpolicy import restore_env
    from llmtrain.launch.backends.local import relaunch_local
    from llmtrain.recipe.load import load_recipe

    if launcher not in (None, "slurm") or (launcher == "slurm" and hosts is not None):
        raise LLMTrainError(f"--launcher {launcher} does not apply to resume" if launcher != "slurm" else
                            "--hosts does not apply to --launcher slurm (Slurm picks the nodes)",
                            "use --launcher slurm, --hosts HOSTFILE, or neither (this machine)", path="--launcher")
    run_path = find_run(run, runs).resolve()
    # secret values again from the caller (never stored); a missing one stops here, exit 2
    recipe = restore_env(load_recipe(run_path / "recipe.lock.yaml", set_), base_dir=Path.cwd())
    saved_states = load_recipe(run_path / "recipe.lock.yaml").train.optimizer.states
    if recipe.train.optimizer.states != saved_states:  # the moments' format is part of the checkpoint
        raise LLMTrainError(f"train.optimizer.states: the run's checkpoints hold {saved_states} AdamW moments, "
                            f"--set asks for {recipe.train.optimizer.states}",
                            f"resume with states {saved_states} (moments are not converted between formats)",
                            path="--set")
    path, meta, warnings = pick_checkpoint(recipe, run_path, ckpt)
    for w in warnings:
        typer.echo(f"warning: {w}", err=True)
    check_same_adapters(recipe, meta, path)
    if meta["step"] >= recipe.train.steps:
        raise LLMTrainError(f"checkpoint {path} is at step {meta['step']}, the run has {recipe.train.steps} steps",
                            "nothing to do; raise train.steps with --set to train further", path="--ckpt")
    typer.echo(f"resuming {run_path} from {path} (step {meta['step']} of {recipe.train.steps})")
    env = {"LLMTRAIN_RESUME": str(path.resolve())}
    if launcher == "slurm":  # the launch path of `launch --launcher slurm`, in the run's own directory
        from llmtrain.launch.backends.slurm import launch_slurm

        code = launch_slurm(recipe, resume_run=run_path, extra_env=env)
    elif hosts is not None:
        from llmtrain.launch.backends.sshlaunch import launch_ssh

        code = launch_ssh(recipe, hosts, skip_preflight=skip_preflight, accept_new_host_keys=accept_new_host_keys,
                          resume_run=run_path, extra_env=env)
    else:
        for flag, value in (("--skip-preflight", skip_preflight), ("--accept-new-host-keys", accept_new_host_keys)):
            if value:
                raise LLMTrainError(f"{flag} needs --hosts", "pass a hostfile, or drop the flag", path=flag)
        code = relaunch_local(run_path, recipe, extra_env=env)
    raise typer.Exit(code)
