"""Hugging Face model directories on disk: checking one against the model (untrusted), reading and writing
its safetensors. The torch-free directory check is :mod:`llmtrain.recipe.hf_dir` (re-exported here)."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from llmtrain.errors import LLMTrainError
from llmtrain.safeio import printable
from llmtrain.recipe.schema import ModelConfig

if TYPE_CHECKING:
    import torch

from llmtrain.engine.hf.families import hf_config, to_hf_state
from llmtrain.recipe.hf_gemma import is_multimodal, text_tensor_name

from llmtrain.recipe.hf_dir import CONFIG, CONFIG_CAP, WEIGHTS, _check_file, _inside_model_dir, check_hf_dir  # noqa: F401,E501


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
    if is_multimodal(conf):  # Gemma 3 4B+: the language model's tensors, by the text model's names
        renamed: dict = {}
        for name, h in tensors.items():
            text = text_tensor_name(name)
            if text is not None and text in renamed:  # two spellings of one tensor: which is meant is unknown
                raise LLMTrainError(f"{printable(d)}: tensors {printable(renamed[text].key, 80)} and "
                                    f"{printable(name, 80)} are both the language model's {text}",
                                    "the weights are damaged or crafted; use the released files", path=flag)
            if text is not None:
                renamed[text] = replace(h, key=name)
        tensors = renamed
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

