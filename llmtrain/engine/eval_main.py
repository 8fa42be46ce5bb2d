"""One ``llmtrain eval`` job: build the model in the requested layout, load its weights, evaluate.

Run in-process for one rank (a 1-rank process group, so both paths are the same code) or by
torchrun on every rank::

    python -m torch.distributed.run --standalone --nproc-per-node 4 -m llmtrain.engine.eval_main SPEC.json

``SPEC.json`` is written by :mod:`llmtrain.cli.eval` after every input was checked there (the
ranks see no user mistake but a layout error): ``recipe`` (the eval recipe: the source's model,
``train.seq_len`` = N, ``train.micro_batch_size`` = --batch, fp32, ``parallel`` from --set),
``kind`` (``checkpoint`` | ``hf``), ``batch`` (windows per forward per data-parallel rank; with pp
each window is one pipeline microbatch, :mod:`llmtrain.engine.eval_pipeline`), ``lora`` (a LoRA
checkpoint: its ``train.lora``, and ``lora_base``, the checked HF base of an adapters-only one), ``source`` (a verified checkpoint directory or an HF model
directory), ``windows`` (an ``.npy`` of [W, N] int64 token windows; ``labels``, optional, the
fine-tuning rows' labels, -100 ignored) and ``out`` (rank 0 writes
the result JSON there). Decisions:

* **Weights** come as full tensors on every rank and are placed on each parameter's mesh by
  ``set_model_state_dict(full_state_dict=True)``, as ``checkpoint.init_from_hf`` does; a
  checkpoint is read through the restricted reader (:func:`read_checkpoint_model`), an HF
  directory through :func:`llmtrain.engine.hf.load_hf_weights`.
* **fp32** always: eval numbers must not depend on the layout beyond reduction order.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import tempfile
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

from llmtrain.errors import LLMTrainError


def model_dict(cfg) -> dict:
    """``cfg`` as recipe data; a dense model's default MoE fields left out, as ``recipe.lock.yaml``
    does (``plan`` rejects MoE settings "set" on a dense model)."""
    data = cfg.model_dump(mode="json", by_alias=True)
    if not cfg.is_moe:
        data["moe"] = {"num_experts": cfg.moe.num_experts, **cfg.moe.model_dump(mode="json", exclude_defaults=True)}
    return data


def eval_recipe(model, seq_len: int, batch: int, sets: list[str]):
    """The recipe of an eval job: the ``model`` config with the layout of ``sets`` (``parallel.*`` only)."""
    from llmtrain.recipe.load import apply_override, validate_recipe_dict

    data = {"model": model_dict(model), "parallel": {"dp_shard": 1, "tp": 1, "zero": 0},
            "train": {"seq_len": seq_len, "micro_batch_size": batch, "precision": "fp32", "steps": 1},
            "cluster": {"gpu": "cpu"}}
    for item in sets:
        key = item.split("=", 1)[0].strip()
        if not key.startswith("parallel.") or "=" not in item:
            raise LLMTrainError(f"--set {item!r}: eval takes only parallel.KEY=VALUE overrides (the layout)",
                                "e.g. --set parallel.tp=2 --set parallel.dp_shard=2", path="--set")
        apply_override(data, item)
    recipe = validate_recipe_dict(data)
    p = recipe.parallel
    if p.dp_shard == -1:
        raise LLMTrainError("parallel.dp_shard=-1: eval needs explicit degrees (the world size is their product)",
                            "set parallel.dp_shard to a number", path="--set")
    if p.cp > 1:  # plan's own check names train.seq_len, which is --seq-len here
        need = 2 * p.cp if p.cp_method in ("ring", "allgather") else p.cp  # zigzag: 2 cp chunks
        if seq_len % need:
            raise LLMTrainError(f"--seq-len {seq_len}: parallel.cp={p.cp} ({p.cp_method}) shards each window in "
                                f"{need} equal chunks", f"use a --seq-len that is a multiple of {need}", path="--seq-len")
    if p.pp > 1:
        # The batch math of the recipe is not used by eval (its batch is SPEC's "batch", one window
        # per pipeline microbatch); it is set so that plan's microbatch rules hold for every schedule
        # (>= 2 pp microbatches for dualpipev, a multiple of pp for the interleaved ones).
        data["train"].update(micro_batch_size=1, global_batch_size=2 * p.pp * p.dp_replicate * p.dp_shard)
        recipe = validate_recipe_dict(data)
    return recipe


def world_size(recipe) -> int:
    p = recipe.parallel
    return p.pp * p.dp_replicate * p.dp_shard * p.cp * p.tp


def check_layout(recipe) -> None:
    """The layout's problems, as ``plan`` finds them, before any process starts."""
    from llmtrain.cluster.placement import Placement
    from llmtrain.plan.validate import validate

    world = world_size(recipe)
    result = validate(recipe, Placement.uniform(1, world))
    if not result.valid:
        raise LLMTrainError(result.errors)


def load_weights(parts, kind: str, source: str, cfg, lora: dict | None = None) -> None:
    """``lora``: SPEC's ``lora`` (a LoRA checkpoint): the merged model is loaded (base from the
    checkpoint or ``lora_base``, the HF directory whose fingerprint the CLI checked)."""
    if kind == "hf":
        from llmtrain.engine.hf import load_hf_weights

        load_hf_weights(parts, source, cfg)
        return
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
    )

    from llmtrain.engine.hf import read_checkpoint_model

    if lora is not None:
        from llmtrain.engine.hf.checkpoint_read import read_lora_checkpoint_model
        from llmtrain.recipe.schema import LoRAConfig

        state = read_lora_checkpoint_model(source, cfg, LoRAConfig.model_validate(lora["lora"]), lora.get("lora_base"))
    else:
        state = read_checkpoint_model(source, None, cfg)
    for part in parts.parts:
        keys = part.state_dict().keys()
        set_model_state_dict(part, {k: state[k] for k in keys}, options=StateDictOptions(full_state_dict=True))


def run_job(spec: dict, device):
    """Inside a process group: the :class:`EvalResult` of ``spec`` (every rank returns it)."""
    import numpy as np
    import torch

    from llmtrain.engine.evaluate import evaluate
    from llmtrain.engine.mesh import build_meshes
    from llmtrain.engine.parallelize import build_parts
    from llmtrain.engine.trainer import resolve_dims
    from llmtrain.recipe.schema import Recipe

    recipe = Recipe.model_validate(spec["recipe"])
    dims = resolve_dims(recipe, torch.distributed.get_world_size())
    meshes = build_meshes(dims, device.type)
    parts = build_parts(recipe, meshes, device)
    load_weights(parts, spec["kind"], spec["source"], recipe.model, spec.get("lora"))
    windows = np.load(spec["windows"], allow_pickle=False)
    labels = np.load(spec["labels"], allow_pickle=False) if spec.get("labels") else None  # fine-tuning rows
    batch = spec.get("batch", recipe.train.micro_batch_size)  # with pp: micro_batch_size is 1 (see eval_recipe)
    result = evaluate(parts, windows, batch, device, meshes, recipe, labels=labels)
    del parts
    gc.collect()
    return result


@contextmanager
def single_process_group():
    """A 1-rank process group in this process (gloo on CPU, NCCL on CUDA), torn down after."""
    import torch
    import torch.distributed as dist

    with tempfile.TemporaryDirectory(prefix="llmtrain-eval-pg-") as tmp:
        kwargs = dict(init_method=f"file://{tmp}/store", rank=0, world_size=1, timeout=timedelta(seconds=600))
        if torch.cuda.is_available():
            device = torch.device("cuda", 0)
            torch.cuda.set_device(device)
            dist.init_process_group("nccl", device_id=device, **kwargs)
        else:
            device = torch.device("cpu")
            dist.init_process_group("gloo", **kwargs)
        try:
            yield device
        finally:
            dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    from llmtrain.engine.main import init_distributed, shutdown

    argv = sys.argv[1:] if argv is None else argv
    spec = json.loads(Path(argv[0]).read_text())  # our own file, written by llmtrain.cli.eval
    device = init_distributed()
    try:
        result = run_job(spec, device)
    except LLMTrainError as exc:  # a layout problem found on the ranks: one line, exit 2
        if int(os.environ.get("RANK", "0")) == 0:
            for line in exc.lines():
                print(f"error: {line}", file=sys.stderr)
        return 2
    import torch.distributed as dist

    if dist.get_rank() == 0:
        Path(spec["out"]).write_text(json.dumps(result.as_dict()))
    shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
