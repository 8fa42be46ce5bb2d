"""From the recipe's ``data`` section to per-rank micro-batches of torch tensors.

``build_data`` picks the dataset; ``microbatches`` turns a :class:`BatchSampler` step into
``grad_accum`` pairs ``(inputs, labels)``, each ``LongTensor[micro, seq_len]`` with ``labels =
inputs shifted by one`` (both slices of the same ``seq_len + 1`` token sample). A trainer step::

    data = build_data(recipe.data, seq_len, vocab_size, seed)
    sampler = BatchSampler(data.length, global_batch, micro, dp_rank, dp_size, seed)
    for inputs, labels in microbatches(data, sampler):   # does NOT advance the sampler
        ...forward/backward...
    optimizer.step(); sampler.advance()                  # checkpoint sampler.state_dict()

Every dataset offers ``sample(i) -> np.ndarray[int64] (seq_len + 1)``, ``length`` (``None``
for the infinite synthetic stream), ``seq_len`` and ``vocab_size``. Tensors are built on the
CPU (move them with ``.to(device, non_blocking=True)``; pin memory if that matters).
``torch`` is imported inside ``microbatches`` so that the rest of the data package (used by
``llmtrain data prepare``) does not pay for it.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from llmtrain.engine.data.memmap import MemmapDataset
from llmtrain.engine.data.sampler import BatchSampler
from llmtrain.engine.data.synthetic import MarkovChain
from llmtrain.errors import LLMTrainError


class Dataset(Protocol):
    length: int | None
    seq_len: int
    vocab_size: int

    def sample(self, index: int) -> np.ndarray: ...


def build_data(data_cfg, seq_len: int, vocab_size: int, seed: int) -> Dataset:
    """The dataset named by a ``DataConfig`` (``source``, ``path``) for this model's vocab and seq_len."""
    source = getattr(data_cfg, "source", "synthetic")
    if source == "synthetic":
        return MarkovChain(vocab_size=vocab_size, seq_len=seq_len, seed=seed)
    if source == "memmap":
        if not getattr(data_cfg, "path", None):
            raise LLMTrainError("data.source is memmap but data.path is not set",
                                "set data.path to a directory written by `llmtrain data prepare`", path="data.path")
        dataset = MemmapDataset(data_cfg.path, seq_len)
        if dataset.vocab_size > vocab_size:
            raise LLMTrainError(
                f"the data in {dataset.path} was tokenized with vocab_size {dataset.vocab_size}, "
                f"larger than the model's vocab_size {vocab_size}",
                f"set model.vocab_size >= {dataset.vocab_size}, or prepare the data with a smaller tokenizer",
                path="model.vocab_size")
        return dataset
    raise LLMTrainError(f"unknown data.source {source!r}", "use synthetic or memmap", path="data.source")


def microbatches(dataset: Dataset, sampler: BatchSampler) -> list[tuple["torch.Tensor", "torch.Tensor"]]:  # noqa: F821
    """This rank's micro-batches for the sampler's next step (the sampler is not advanced)."""
    import torch

    out = []
    for indices in sampler.step_indices():
        tokens = torch.from_numpy(np.stack([dataset.sample(i) for i in indices]))  # (micro, seq_len + 1) int64
        out.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
    return out
