"""``llmtrain ckpt export``: a verified checkpoint to a Hugging Face directory (and a LoRA run's PEFT adapter).

The decisions are in :mod:`llmtrain.cli.ckpt`'s docstring (the ``export --hf`` / LoRA bullets);
this module holds the command and the checkpoint-recipe reading it needs.
"""

from __future__ import annotations

from pathlib import Path

import typer

from llmtrain.cli.app import report_errors
from llmtrain.cli.ckpt import CKPT_HELP, RUN_HELP, checkpoint_root, ckpt_app, human, layout
from llmtrain.errors import LLMTrainError, Problem
from llmtrain.safeio import printable


@ckpt_app.command("export")
@report_errors
def export_cmd(run_dir: Path = typer.Argument(..., help=RUN_HELP),
               ckpt: str = typer.Option("latest", "--ckpt", help=CKPT_HELP),
               hf: Path | None = typer.Option(None, "--hf", help="Output directory (missing or empty): config.json, "
                                              "generation_config.json, safetensors shards (+ index), tokenizer files; "
                                              "a LoRA run's adapters are merged into the base."),
               peft: Path | None = typer.Option(None, "--peft", help="LoRA runs: output directory for a PEFT adapter "
                                                "(adapter_config.json, adapter_model.safetensors; plus base/ when the "
                                                "run has no checkpoint.init_from_hf)."),
               base: Path | None = typer.Option(None, "--base", help="LoRA runs from checkpoint.init_from_hf: the base "
                                                "model directory, if it moved (its fingerprint must match)."),
               dtype: str = typer.Option("fp32", "--dtype", help="Tensor dtype of the export: fp32 (as trained) "
                                         "or bf16."),
               max_shard_size: str = typer.Option("5GB", "--max-shard-size", help="Largest shard file (5GB = 5e9 "
                                                  "bytes, 2GiB = 2^31); one shard is model.safetensors."),
               workers: int = typer.Option(0, "--workers", min=0, max=256, help="Processes writing shards in "
                                           "parallel (0: min(4, CPUs)); each reads only its shards' tensors."),
               force: bool = typer.Option(False, "--force", help="Write into a non-empty --hf directory (a previous "
                                          "export's shards, index, config and tokenizer files are replaced).")
               ) -> None:
    """Export a (verified) checkpoint's model to a Hugging Face directory of its family (llama, mistral, qwen2,
    qwen3, mixtral, qwen3_moe, phi3, gemma, gemma2, gemma3_text, granite, smollm3, olmo2), loadable by transformers' AutoModelForCausalLM."""
    from llmtrain.engine.checkpoint_store import STEP_RE, resolve
    from llmtrain.engine.hf.export import DTYPES, parse_size
    from llmtrain.safeio import output_dir

    if dtype not in DTYPES:
        raise LLMTrainError(f"--dtype {printable(dtype, 20)} is not supported", f"use one of {', '.join(DTYPES)}",
                            path="--dtype")
    if hf is None and peft is None:
        raise LLMTrainError("nothing to write", "give --hf OUT (a model) and/or --peft OUT (LoRA adapters)", path="--hf")
    max_bytes = parse_size(max_shard_size)
    # before reading anything: a non-empty directory needs --force
    hf = output_dir(hf, "--hf", force) if hf is not None else None
    peft = output_dir(peft, "--peft", force) if peft is not None else None

    root, named = checkpoint_root(run_dir)
    spec = str(named) if named is not None and ckpt == "latest" else ckpt
    spec = spec if spec == "latest" or STEP_RE.match(spec) else str(Path(spec).resolve())
    path, meta, warnings = resolve(root, spec, require=("recipe",), check_index=True)
    for w in warnings:
        typer.echo(f"warning: {w}", err=True)
    cfg = checkpoint_model(path, meta)
    from llmtrain.engine.checkpoint_meta import CheckpointMeta
    from llmtrain.engine.hf.export import export_hf

    data = (meta.get("recipe") or {}).get("data") or {}
    tokenizer = (data.get("tokenizer") if isinstance(data.get("tokenizer"), str) else None,
                 data.get("path") if isinstance(data.get("path"), str) else None)
    from llmtrain.engine.finetune.lora_export import checkpoint_lora, export_lora

    files = CheckpointMeta.model_validate(meta).files
    lora_cfg = checkpoint_lora(path, meta)
    if lora_cfg is None:
        if peft is not None:
            raise LLMTrainError(f"{printable(path)} is not a LoRA run (its recipe has no train.lora)",
                                "export the model with --hf", path="--peft")
        outputs = [(hf, export_hf(path, files, cfg, hf, dtype, max_bytes, workers or None, tokenizer))]
    else:
        outputs = export_lora(path, meta, files, cfg, lora_cfg, hf, peft, base, dtype, max_bytes, workers, tokenizer)
    for out, written in outputs:
        total = sum(f.stat().st_size for f in written)
        typer.echo(f"exported {path} (step {meta['step']}, saved as {layout(meta.get('dims'))}) -> {out} "
                   f"({', '.join(f.name for f in written)}; {human(total)})")


def checkpoint_model(path: Path, meta: dict):
    """The (Hugging Face expressible) :class:`ModelConfig` of ``metadata.json``'s ``recipe.model``; a problem names the file."""
    from pydantic import ValidationError

    from llmtrain.engine.checkpoint_meta import validation_line
    from llmtrain.engine.hf.families import require_hf_compatible
    from llmtrain.recipe.schema import ModelConfig

    where = printable(path / "metadata.json")
    model = (meta.get("recipe") or {}).get("model")
    if not model:
        raise LLMTrainError(f"{where}: no recipe.model", "re-save the checkpoint", path="--ckpt")
    try:
        cfg = ModelConfig.model_validate(model)
        require_hf_compatible(cfg)
    except ValidationError as exc:
        raise LLMTrainError(f"{where}: recipe.model.{validation_line(exc)}", "the checkpoint's recipe is damaged",
                            path="--ckpt") from None
    except LLMTrainError as exc:
        raise LLMTrainError([Problem(p.path, f"{where}: {p.message}", p.hint) for p in exc.problems]) from None
    return cfg
