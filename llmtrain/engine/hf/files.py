"""Hugging Face model directories on disk: checking one (untrusted), reading and writing its safetensors."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

from llmtrain.errors import LLMTrainError
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
    weights are safetensors only (a format that holds no code)."""
    d = Path(directory)
    if not d.is_dir():
        raise LLMTrainError(f"{printable(d)}: no such directory", "pass a directory made by `llmtrain ckpt export --hf`",
                            path=flag)
    files = sorted(d.glob("*.safetensors"))
    if not os.path.lexists(d / CONFIG) or not files:  # a FIFO or link named config.json is refused below
        names = ", ".join(printable(n, 60) for n in sorted(p.name for p in d.iterdir())[:20]) or "nothing"
        raise LLMTrainError(f"{printable(d)}: needs {CONFIG} and *.safetensors (has {names})",
                            "pass a directory made by `llmtrain ckpt export --hf` or a Hugging Face Llama model",
                            path=flag)
    for f in (d / CONFIG, *files):
        if not _inside_model_dir(d, f):
            raise LLMTrainError(f"{printable(f)}: resolves outside {printable(d)} (symlink)",
                                "copy the model into the directory instead of linking out of it", path=flag)
        fobj, _ = open_regular(f, "model file", field=flag)
        fobj.close()
    raw = read_regular(d / CONFIG, CONFIG, CONFIG_CAP, field=flag)
    try:
        conf = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise LLMTrainError(f"{printable(d / CONFIG)}: unreadable ({printable(exc, 120)})", "", path=flag) from None
    if not isinstance(conf, dict):
        raise LLMTrainError(f"{printable(d / CONFIG)}: not a JSON object", "", path=flag)
    return conf, files


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

