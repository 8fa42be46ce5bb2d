"""An HF model directory on disk, checked before anything starts (torch-free; untrusted input).

:func:`check_hf_dir` reads ``config.json`` and lists the weight files (regular, inside the
directory, capped; safetensors only). The header-by-header check against the model's shapes is
:func:`llmtrain.engine.hf.files.check_hf_model` (it builds the model on the meta device).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from llmtrain.errors import LLMTrainError, Problem
from llmtrain.safeio import MIB, inside, open_regular, printable, read_regular

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
    from llmtrain.recipe.hf_index import INDEX, missing_shards, read_weight_map

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
