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
    """``model.<name> -> shape`` of every tensor our model with ``cfg`` has (built on the meta
    device: nothing is allocated)."""
    import torch

    from llmtrain.engine.models.llama import Transformer

    with torch.device("meta"):
        model = Transformer(cfg)
    return {f"model.{k}": tuple(v.shape) for k, v in model.state_dict().items()}


def read_checkpoint_model(path: str | Path, files=None, cfg: ModelConfig | None = None) -> dict[str, torch.Tensor]:
    """The full (unsharded) ``model.*`` tensors of a DCP checkpoint saved from any layout, read in
    this one process without a process group (DCP assembles every shard from its global offsets).

    Read through :class:`~llmtrain.engine.safe_reader.SafeReader` (DCP's index via the allow-list,
    only shards ``metadata.json`` lists: ``files``, read from it when None). With ``cfg`` the
    index's ``model.*`` entries must be exactly that model's names and shapes, so nothing else
    is allocated or read."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

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


def _check_model_entries(index, cfg: ModelConfig, path: Path) -> None:
    have = {k: tuple(v.size) for k, v in index.state_dict_metadata.items() if k.startswith("model.")}
    layers = {k.split(".")[2] for k in have if k.startswith("model.layers.")}
    embed = have.get("model.tok_embeddings.weight")
    if len(layers) != cfg.layers or embed != (cfg.vocab_size, cfg.hidden):  # before building anything from cfg
        raise LLMTrainError(f"{printable(path / '.metadata')}: the index holds {len(layers)} layers and embeddings "
                            f"{list(embed) if embed else None}, metadata.json's recipe.model has {cfg.layers} layers "
                            f"and [{cfg.vocab_size}, {cfg.hidden}]",
                            "the checkpoint is damaged or crafted; use another one (--ckpt step-N)", path="--ckpt")
    want = expected_model_shapes(cfg)
    extra, absent = sorted(set(have) - set(want)), sorted(set(want) - set(have))
    wrong = sorted(k for k in set(have) & set(want) if have[k] != want[k])
    if extra or absent or wrong:
        what = (f"unexpected {printable(extra[0], 80)}" if extra else f"no {absent[0]}" if absent
                else f"{wrong[0]} is {list(have[wrong[0]])}, the recipe's model has {list(want[wrong[0]])}")
        raise LLMTrainError(f"{printable(path / '.metadata')}: model tensors do not match metadata.json's "
                            f"recipe.model ({what}; {len(extra) + len(absent) + len(wrong)} differences)",
                            "the checkpoint is damaged or crafted; use another one (--ckpt step-N)", path="--ckpt")


