"""``llmtrain eval``: held-out loss and perplexity of a run, a checkpoint or a Hugging Face model.

Examples::

    llmtrain eval runs/debug/<run id> --data heldout.txt            # the run's latest complete checkpoint
    llmtrain eval runs/debug/<run id>/checkpoints/step-20 --data data/prepared --json
    llmtrain eval out/hf --data heldout.jsonl --tokenizer out/hf/tokenizer.json --seq-len 512
    llmtrain eval runs/debug/<run id> --data heldout.txt --set parallel.tp=2 --set parallel.dp_shard=2

Decisions (docs/eval.md; the definition of the number is in :mod:`llmtrain.engine.evaluate`):

* **SOURCE.** A directory with ``config.json`` and ``*.safetensors`` is an HF model (its
  architecture from config.json, its tokenizer from its ``tokenizer.json`` unless
  ``--tokenizer``); anything else is found as ``ckpt`` finds it (a run directory, a checkpoint
  root or one ``step-N/``) and verified as ``ckpt export`` verifies it (checksums, DCP's index
  through the allow-list; ``latest`` falls back to the newest intact one with a warning). A
  checkpoint's model and tokenizer come from its ``metadata.json`` recipe (``data.tokenizer``;
  a trained ``bpe:VOCAB`` means the one saved in ``data.path``).
* **--seq-len** defaults to the run's ``train.seq_len``; for an HF model to
  ``min(max_position_embeddings, 2048)`` (long contexts are slow on a laptop; say so explicitly).
* **Layout.** Without ``--set`` the job runs in this process (one rank). ``--set parallel.*``
  gives a layout (tp, dp_shard, dp_replicate, zero, pp, cp, ...): it is checked like ``plan``
  checks a recipe, then run with a local ``torchrun`` of that many ranks. The answer equals the
  one-process answer up to fp32 reduction order (tests: 1e-5 relative). With pp each forward is
  ``--batch`` pipeline microbatches of one window, in the schedule's own stage placement (V-shaped
  ones included: :mod:`llmtrain.engine.eval_pipeline`).
* **LoRA.** A LoRA run's checkpoint is evaluated as its merged model (``W + scale B A``, the
  weights ``ckpt export --hf`` writes); an adapters-only checkpoint (``checkpoint.init_from_hf``)
  reads its base from that directory after the fingerprint check of ``resume`` and ``export``.
* **Fine-tuning runs.** A checkpoint whose recipe has ``data.source`` chat or instruction
  evaluates a ``.jsonl`` ``--data`` (or a directory of them) as that run reads ``data.path``: its
  template, fields and ``data.overlong``, one unpacked sample per row of ``--seq-len``, loss over
  the target tokens only (the replies, the completion), token-weighted: the number its periodic
  eval logs for the same samples. ``tokens`` are then those targets, ``windows`` the samples.
  ``.txt`` and prepared directories are read as text, as for any run.
* Every input is checked here before any rank starts; a mistake is one line, exit 2.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import typer

from llmtrain.cli.app import app, report_errors
from llmtrain.errors import LLMTrainError, Problem
from llmtrain.safeio import printable

HF_SEQ_CAP = 2048


def hf_source(source: Path, tokenizer: str | None):
    """``(model cfg, tokenizer, default seq_len)`` of an HF model directory."""
    from llmtrain.engine.data.tokenizer import load_tokenizer
    from llmtrain.engine.hf import check_hf_dir

    conf, _ = check_hf_dir(source, "SOURCE")
    cfg = hf_model_config(conf, source)
    if tokenizer is None:
        if not (source / "tokenizer.json").is_file():
            raise LLMTrainError(f"{printable(source)}: no tokenizer.json", "pass --tokenizer PATH/tokenizer.json "
                                "(or byte)", path="--tokenizer")
        tokenizer = str(source / "tokenizer.json")
    return cfg, load_tokenizer(tokenizer), min(cfg.max_seq_len or HF_SEQ_CAP, HF_SEQ_CAP)


def hf_model_config(conf: dict, source: Path):
    """Our model of an HF ``config.json`` (the mapping is :func:`llmtrain.engine.hf.model_from_hf_config`)."""
    from pydantic import ValidationError

    from llmtrain.engine.checkpoint_meta import validation_line
    from llmtrain.engine.hf import model_from_hf_config
    from llmtrain.recipe.schema import ModelConfig

    try:
        return ModelConfig.model_validate(model_from_hf_config(conf, "SOURCE"))
    except ValidationError as exc:
        raise LLMTrainError(f"{printable(source / 'config.json')}: model.{validation_line(exc)}",
                            "use a Hugging Face model directory of a supported family", path="SOURCE") from None


def checkpoint_source(source: Path, tokenizer: str | None):
    """``(verified checkpoint dir, model cfg, tokenizer, default seq_len)`` of a run / checkpoint."""
    from pydantic import ValidationError

    from llmtrain.cli.ckpt import checkpoint_root
    from llmtrain.engine.checkpoint_meta import validation_line
    from llmtrain.engine.checkpoint_store import resolve
    from llmtrain.engine.evaluate import recipe_tokenizer
    from llmtrain.recipe.schema import DataConfig, ModelConfig, TrainConfig

    root, named = checkpoint_root(source)
    spec = str(named.resolve()) if named is not None else "latest"
    path, meta, warnings = resolve(root, spec, require=("recipe",), check_index=True)
    for w in warnings:
        typer.echo(f"warning: {w}", err=True)
    recipe = meta["recipe"]
    where = printable(path / "metadata.json")
    try:
        cfg = ModelConfig.model_validate(recipe.get("model") or {})
        data = DataConfig.model_validate(recipe.get("data") or {})
        train = TrainConfig.model_validate(recipe.get("train") or {})
    except ValidationError as exc:
        raise LLMTrainError(f"{where}: recipe.{validation_line(exc)}", "the checkpoint's recipe is damaged",
                            path="SOURCE") from None
    return path, cfg, recipe_tokenizer(data, tokenizer), train.seq_len, lora_source(path, meta), data


def lora_source(path: Path, meta: dict) -> dict | None:
    """SPEC's ``lora`` of a LoRA checkpoint (None otherwise): its ``train.lora`` and, for an
    adapters-only one, the base directory ``checkpoint.init_from_hf`` of its recipe, refused in
    one line unless its fingerprint is the one ``metadata.json`` recorded (adapters on another
    base would evaluate without error and be silently wrong)."""
    from llmtrain.engine.finetune.base import check_base
    from llmtrain.engine.finetune.lora_export import checkpoint_lora

    lora_cfg = checkpoint_lora(path, meta)
    if lora_cfg is None:
        return None
    recorded, base_dir = meta.get("lora_base"), None
    if recorded is not None:
        base_dir = ((meta.get("recipe") or {}).get("checkpoint") or {}).get("init_from_hf")
        base_dir = base_dir if isinstance(base_dir, str) else None
        check_base(base_dir, recorded, path)
    return {"lora": lora_cfg.model_dump(mode="json"), "lora_base": base_dir}


def sft_file(data: Path) -> bool:
    """Fine-tuning rows: a ``.jsonl`` file, or a directory that is not a prepared one (no meta.json)."""
    return data.suffix.lower() == ".jsonl" if not data.is_dir() else not (data / "meta.json").exists()


def launch(spec: dict, world: int, tmp: Path) -> dict:
    """Run the job: in this process for one rank, else a local torchrun of ``world`` ranks."""
    spec_path = tmp / "spec.json"
    spec_path.write_text(json.dumps(spec))
    if world == 1:
        from llmtrain.engine.eval_main import run_job, single_process_group

        with single_process_group() as device:
            return run_job(spec, device).as_dict()
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
           "-m", "llmtrain.engine.eval_main", str(spec_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    errors = [line[len("error: "):] for line in proc.stderr.splitlines() if line.startswith("error: ")]
    if proc.returncode != 0 or not Path(spec["out"]).is_file():
        if errors:
            raise LLMTrainError([Problem("--set", e, "") for e in errors[:5]])
        tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
        sys.stderr.write(tail + "\n")
        raise LLMTrainError(f"the eval job of {world} ranks failed (torchrun exit {proc.returncode}; its last "
                            "lines are above)", "run with fewer ranks, or LLMTRAIN_DEBUG=1 for details", path="--set")
    return json.loads(Path(spec["out"]).read_text())


@app.command("eval")
@report_errors
def eval_cmd(source: Path = typer.Argument(..., help="Run directory, checkpoint directory (step-N/ or a root), or "
                                           "a Hugging Face model directory (config.json + *.safetensors)."),
             data: Path = typer.Option(..., "--data", help="Held-out text: .txt (one document), .jsonl (field text) "
                                       "or a `llmtrain data prepare` directory; a chat / instruction run's .jsonl is "
                                       "read as its training data is (loss on the targets)."),
             seq_len: int | None = typer.Option(None, "--seq-len", help="Tokens per window (default: the run's "
                                                   "train.seq_len; HF: min(max_position_embeddings, 2048))."),
             batch: int = typer.Option(8, "--batch", help="Windows per forward pass (per data-parallel rank)."),
             tokenizer: str | None = typer.Option(None, "--tokenizer", help="Tokenizer spec (byte, PATH/"
                                                     "tokenizer.json, DIR); default: the source's own."),
             sets: list[str] = typer.Option([], "--set", help="Layout: --set parallel.tp=2 (repeatable; parallel.* "
                                            "only); runs a local torchrun of that many ranks."),
             as_json: bool = typer.Option(False, "--json", help='Print exactly {"loss", "perplexity", "tokens", '
                                          '"windows"}.')) -> None:
    """Mean next-token loss and perplexity of SOURCE on a held-out file (non-overlapping windows)."""
    import numpy as np

    from llmtrain.engine.eval_main import (
        check_layout,
        eval_recipe,
        model_dict,
        world_size,
    )
    from llmtrain.engine.evaluate import make_windows, read_token_stream

    if batch < 1:
        raise LLMTrainError(f"--batch {batch}: must be >= 1", "use --batch 8", path="--batch")
    if seq_len is not None and seq_len < 2:
        raise LLMTrainError(f"--seq-len {seq_len}: a window needs at least 2 tokens", "use --seq-len >= 2",
                            path="--seq-len")
    if not source.is_dir():
        raise LLMTrainError(f"{printable(source)}: no such directory", "pass a run, checkpoint or HF model directory",
                            path="SOURCE")
    run_data = None
    if (source / "config.json").exists() and any(source.glob("*.safetensors")):
        kind, (cfg, tok, default_len), weights, lora = "hf", hf_source(source, tokenizer), source, None
    else:
        kind = "checkpoint"
        weights, cfg, tok, default_len, lora, run_data = checkpoint_source(source, tokenizer)
    n = seq_len or default_len
    labels = None
    if run_data is not None and run_data.source in ("chat", "instruction") and sft_file(data):
        from llmtrain.engine.data.sft import build_unpacked_at  # the run's own reader; problems name --data

        windows, labels = build_unpacked_at(run_data, str(data), n, cfg.vocab_size, "--data", tokenizer).rows()
    else:
        tokens = read_token_stream(data, None if data.is_dir() else tok)
        windows = make_windows(tokens, n, cfg.vocab_size, str(data))
    recipe = eval_recipe(cfg, n, batch, sets)
    check_layout(recipe)
    with tempfile.TemporaryDirectory(prefix="llmtrain-eval-") as tmp:
        np.save(Path(tmp) / "windows.npy", windows)
        spec = {"recipe": {**recipe.model_dump(mode="json", by_alias=True), "model": model_dict(cfg)},
                "kind": kind, "source": str(weights), "batch": batch, "lora": lora, "windows": str(Path(tmp) / "windows.npy"),
                "out": str(Path(tmp) / "result.json")}
        if labels is not None:
            np.save(Path(tmp) / "labels.npy", labels)
            spec["labels"] = str(Path(tmp) / "labels.npy")
        result = launch(spec, world_size(recipe), Path(tmp))
    if as_json:
        typer.echo(json.dumps({k: result[k] for k in ("loss", "perplexity", "tokens", "windows")}))
    else:
        what = (f"{result['windows']} samples in rows of {n} tokens, {result['tokens']} target tokens" if labels is not None
                else f"{result['windows']} windows of {n} tokens, {result['tokens']} tokens")
        typer.echo(f"{printable(source)} on {printable(data)}: loss {result['loss']:.6f}, perplexity "
                   f"{result['perplexity']:.4f} ({what})")
