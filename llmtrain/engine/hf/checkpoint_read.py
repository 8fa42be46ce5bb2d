"""The full model tensors of a DCP checkpoint, read in one process through the restricted reader."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import TYPE_CHECKING

from llmtrain.errors import LLMTrainError
from llmtrain.recipe.schema import ModelConfig
from llmtrain.safeio import printable

if TYPE_CHECKING:
    import torch

def expected_model_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """``model.<name> -> shape`` of every tensor a checkpoint of our model with ``cfg`` holds (built
    on the meta device: nothing is allocated). Tied embeddings have one key, ``tok_embeddings.weight``:
    ``output.weight`` is the same tensor and is never saved (engine/checkpoint_state.py), so it is not
    expected (a tied model's ``ckpt export`` was refused as "no model.output.weight" before)."""
    import torch

    from llmtrain.engine.models.llama import Transformer

    with torch.device("meta"):
        model = Transformer(cfg)
    return {f"model.{k}": tuple(v.shape) for k, v in model.state_dict().items()
            if not (cfg.tie_embeddings and k == "output.weight")}


def read_checkpoint_model(path: str | Path, files=None, cfg: ModelConfig | None = None) -> dict[str, torch.Tensor]:
    """The full (unsharded) ``model.*`` tensors of a DCP checkpoint saved from any layout, read in
    this one process without a process group (DCP assembles every shard from its global offsets).

    Read through :class:`~llmtrain.engine.safe_reader.SafeReader` (DCP's index via the allow-list,
    only shards ``metadata.json`` lists: ``files``, read from it when None). With ``cfg`` the
    index's ``model.*`` entries must be exactly that model's names and shapes, so nothing else
    is allocated or read."""
    from torch.distributed.checkpoint.state_dict_loader import (
        _load_state_dict_from_keys,
    )

    from llmtrain.engine.checkpoint_meta import load_meta
    from llmtrain.engine.safe_reader import SafeReader, dcp_guard

    if files is None:
        files = load_meta(path).files
    with dcp_guard(path):
        reader = SafeReader(path, files)
        if cfg is not None:
            _check_model_entries(reader.index, cfg, Path(path))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "assuming the intent is to load in a single process": it is
            state = _load_state_dict_from_keys({"model"}, storage_reader=reader)
    return dict(state["model"])


def shape_mismatch(have: dict, want: dict, expected: str = "expected") -> str | None:
    """The first difference between tensor shapes found (``have``) and expected (``want``) and how
    many there are, or None when they agree (key sets and every shape)."""
    extra, absent = sorted(set(have) - set(want)), sorted(set(want) - set(have))
    wrong = sorted(k for k in set(have) & set(want) if have[k] != want[k])
    if not (extra or absent or wrong):
        return None
    what = (f"unexpected {printable(extra[0], 80)}" if extra else f"no {absent[0]}" if absent
            else f"{wrong[0]} is {list(have[wrong[0]])}, {expected} {list(want[wrong[0]])}")
    return f"{what}; {len(extra) + len(absent) + len(wrong)} differences"

def _check_model_entries(index, cfg: ModelConfig, path: Path) -> None:
    have = {k: tuple(v.size) for k, v in index.state_dict_metadata.items() if k.startswith("model.")}
    if cfg.tie_embeddings:  # older non-PP checkpoints of a tied model also hold the output copy: not read
        have.pop("model.output.weight", None)
    layers = {k.split(".")[2] for k in have if k.startswith("model.layers.")}
    embed = have.get("model.tok_embeddings.weight")
    if len(layers) != cfg.layers or embed != (cfg.vocab_size, cfg.hidden):  # before building anything from cfg
        raise LLMTrainError(f"{printable(path / '.metadata')}: the index holds {len(layers)} layers and embeddings "
                            f"{list(embed) if embed else None}, metadata.json's recipe.model has {cfg.layers} layers "
                            f"and [{cfg.vocab_size}, {cfg.hidden}]",
                            "the checkpoint is damaged or crafted; use another one (--ckpt step-N)", path="--ckpt")
    what = shape_mismatch(have, expected_model_shapes(cfg), "the recipe's model has")
    if what is not None:
        raise LLMTrainError(f"{printable(path / '.metadata')}: model tensors do not match metadata.json's "
                            f"recipe.model ({what})",
                            "the checkpoint is damaged or crafted; use another one (--ckpt step-N)", path="--ckpt")




def read_lora_checkpoint_model(path: str | Path, cfg: ModelConfig, lora_cfg, base_dir: str | Path | None = None,
                               files=None) -> dict[str, torch.Tensor]:
    """The MERGED full model (``W + scale B A`` per adapted weight, no adapter keys) of a LoRA
    checkpoint, in fp32, as :func:`read_checkpoint_model` returns a plain one.

    The base comes from the checkpoint (a run without ``checkpoint.init_from_hf`` saved it) or,
    for an adapters-only checkpoint, from ``base_dir`` (the caller checked its fingerprint
    against ``metadata.json``'s ``lora_base`` first: :func:`llmtrain.engine.finetune.base.check_base`),
    read by HF name and converted to ours as ``ckpt export --hf`` does. The index must hold
    exactly the adapters (+ the base when it is in the checkpoint) of ``cfg`` and ``lora_cfg``.
    Merging is :func:`~llmtrain.engine.finetune.lora.merge_lora` (fp64 sum), the export's own
    arithmetic, so the result equals the weights ``ckpt export --hf --dtype fp32`` writes."""
    import torch
    from torch.distributed.checkpoint.state_dict_loader import (
        _load_state_dict_from_keys,
    )

    from llmtrain.engine.checkpoint_meta import load_meta
    from llmtrain.engine.finetune.lora import merge_lora
    from llmtrain.engine.finetune.lora_export import (
        HFTensorReader,
        LoRAExport,
        hf_files_of,
        lora_entries,
    )
    from llmtrain.engine.hf.families import to_ours
    from llmtrain.engine.hf.stream import sources_for
    from llmtrain.engine.safe_reader import SafeReader, dcp_guard

    if files is None:
        files = load_meta(path).files
    hf_files = hf_files_of(base_dir, cfg) if base_dir is not None else {}
    spec = LoRAExport(scale=lora_cfg.scale, merge=True, hf_files=hf_files)
    with dcp_guard(path):
        reader = SafeReader(path, files)
        base_shapes = lora_entries(reader.index, cfg, lora_cfg, spec, Path(path))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "assuming the intent is to load in a single process": it is
            state = dict(_load_state_dict_from_keys({"model"}, storage_reader=reader)["model"])
    if not spec.base_in_checkpoint:
        tmap = sources_for(cfg)
        with HFTensorReader(hf_files) as hf:
            for key in base_shapes:
                name = key.removeprefix("model.")
                state[name] = to_ours(tmap[name], [hf.get(n) for n in tmap[name].hf])
    return {k: v.to(torch.float32) for k, v in merge_lora(state, lora_cfg).items()}
