"""Hugging Face model directories on disk: checking one (untrusted), reading and writing its safetensors."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from llmtrain.errors import LLMTrainError, Problem
from llmtrain.recipe.schema import ModelConfig
from llmtrain.safeio import MIB, inside, open_regular, printable, read_regular

if TYPE_CHECKING:
    import torch

from llmtrain.engine.hf.families import hf_config, to_hf_state

WEIGHTS = "model.safetensors"
CONFIG = "config.json"

CONFIG_CAP = 16 * MIB


def _inside_model_dir(d: Path, f: Path) -> bool:
    """``f`` resolves inside ``d`` — or, for a Hugging Face cache snapshot
    (``models--X/snapshots/<rev>/``, whose files link to ``../../blobs/``), inside its blobs."""
    return inside(d, f) or (d.parent.name == "snapshots" and inside(d.parent.parent / "blobs", f))


def check_hf_dir(directory: str | Path, flag: str = "--init-from-hf") -> tuple[dict, list[Path]]:
    """``(config, weight files)`` of an HF model directory; :class:`LLMTrainError` naming ``flag``.

    The directory is untrusted: ``config.json`` is read as a regular file of at most
    :data:`CONFIG_CAP` bytes, every file must be a regular file that resolves inside it (symlinks
    out of it are refused, except a Hugging Face cache snapshot's links to its blobs), and the
    weights are safetensors only (a format that holds no code). With
    ``model.safetensors.index.json`` the weight files are the ones its ``weight_map`` names
    (each must exist); without one, every ``*.safetensors`` file (a split set
    ``NAME-0000i-of-0000N`` must be complete). Headers are checked by :func:`check_hf_model`."""
    from llmtrain.engine.hf.index import INDEX, missing_shards, read_weight_map

    d = Path(directory)
    if not d.is_dir():
        raise LLMTrainError(f"{printable(d)}: no such directory", "pass a directory made by `llmtrain ckpt export --hf`",
                            path=flag)
    has_index = os.path.lexists(d / INDEX)
    files = sorted(d.glob("*.safetensors"))
    if not os.path.lexists(d / CONFIG) or not (files or has_index):  # a FIFO or link named config.json is refused below
        names = ", ".join(printable(n, 60) for n in sorted(p.name for p in d.iterdir())[:20]) or "nothing"
        raise LLMTrainError(f"{printable(d)}: needs {CONFIG} and *.safetensors (has {names})",
                            "pass a directory made by `llmtrain ckpt export --hf` or a Hugging Face model",
                            path=flag)
    for f in (d / CONFIG, *([d / INDEX] if has_index else [])):
        _check_file(d, f, flag)
    weight_map, problems = read_weight_map(d, flag)
    if problems:
        raise LLMTrainError(problems)
    if weight_map is not None:
        first: dict[str, str] = {}
        for tensor, fname in weight_map.items():
            first.setdefault(fname, tensor)
        files = [d / n for n in sorted(first)]
        absent = [f for f in files if not os.path.lexists(f)]
        if absent:
            raise LLMTrainError([Problem(flag, f"{printable(d / INDEX)}: weight_map names {printable(f.name, 80)} "
                                         f"(for {printable(first[f.name], 80)}), which is missing",
                                         "the download is incomplete; fetch every shard file") for f in absent])
    else:
        absent = missing_shards([f.name for f in files])
        if absent:
            raise LLMTrainError([Problem(flag, f"{printable(d)}: missing shard file {printable(n, 80)}",
                                         "the download is incomplete; fetch every shard file") for n in absent])
    for f in files:
        _check_file(d, f, flag)
    raw = read_regular(d / CONFIG, CONFIG, CONFIG_CAP, field=flag)
    try:
        conf = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise LLMTrainError(f"{printable(d / CONFIG)}: unreadable ({printable(exc, 120)})", "", path=flag) from None
    if not isinstance(conf, dict):
        raise LLMTrainError(f"{printable(d / CONFIG)}: not a JSON object", "", path=flag)
    return conf, files


def _check_file(d: Path, f: Path, flag: str) -> None:
    if not _inside_model_dir(d, f):
        raise LLMTrainError(f"{printable(f)}: resolves outside {printable(d)} (symlink)",
                            "copy the model into the directory instead of linking out of it", path=flag)
    fobj, _ = open_regular(f, "model file", field=flag)
    fobj.close()


@dataclass(frozen=True)
class HFModel:
    """A checked HF model directory: its ``config.json`` and every tensor's header."""

    directory: Path
    config: dict
    tensors: dict  # HF name -> llmtrain.engine.hf.index.TensorHeader


def check_hf_model(directory: str | Path, cfg: ModelConfig, flag: str = "--init-from-hf") -> HFModel:
    """Everything that can be known about loading ``directory`` into ``cfg``'s model without
    reading tensor data: the directory and files (:func:`check_hf_dir`), ``config.json`` against
    the recipe (families' :func:`config_problems`), every safetensors header and the index, and
    each tensor's name, shape and dtype against the tensor map. All problems at once, one
    :class:`LLMTrainError`. Builds the model on the meta device for its shapes (imports torch)."""
    from llmtrain.engine.hf.checkpoint_read import expected_model_shapes
    from llmtrain.engine.hf.families import config_problems, tensor_map
    from llmtrain.engine.hf.index import hf_tensors, model_problems, read_weight_map

    d = Path(directory)
    conf, files = check_hf_dir(d, flag)
    problems = config_problems(conf, cfg, flag)
    if problems:
        raise LLMTrainError(problems)
    weight_map, _ = read_weight_map(d, flag)
    tensors, problems = hf_tensors(d, files, weight_map, flag)
    if problems:
        raise LLMTrainError(problems)
    shapes = {k.removeprefix("model."): v for k, v in expected_model_shapes(cfg).items()}
    problems = model_problems(tensors, tensor_map(cfg), shapes, bool(cfg.tie_embeddings), d, flag)
    if problems:
        raise LLMTrainError(problems)
    return HFModel(d, conf, tensors)


def read_hf_state(files: list[Path]) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    return state


def save_hf(directory: str | Path, ours: dict[str, torch.Tensor], cfg: ModelConfig) -> list[Path]:
    """Write ``model.safetensors`` + ``config.json`` (+ ``generation_config.json``) of ``ours``."""
    from safetensors.torch import save_file

    out = Path(directory)
    state = to_hf_state(ours, cfg)
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / WEIGHTS), metadata={"format": "pt"})
    (out / CONFIG).write_text(json.dumps(hf_config(cfg), indent=2, sort_keys=True) + "\n")
    (out / "generation_config.json").write_text(json.dumps({"_from_model_config": True}, indent=2) + "\n")
    return [out / WEIGHTS, out / CONFIG, out / "generation_config.json"]

