"""From the recipe's ``data`` section to per-rank micro-batches of torch tensors.

``build_data`` picks the dataset; ``microbatches`` turns a :class:`BatchSampler` step into
``grad_accum`` pairs ``(inputs, labels)``, each ``LongTensor[micro, seq_len]`` with ``labels =
inputs shifted by one`` (both slices of the same ``seq_len + 1`` token sample), or, for the
fine-tuning sources (chat / instruction / text, :mod:`llmtrain.engine.data.sft`, whose samples
are dicts), ``(inputs, labels)`` with ``-100`` where there is no loss, and ``(inputs, labels,
positions, segments)`` when packed. A trainer step::

    data = build_data(recipe.data, seq_len, vocab_size, seed)
    sampler = BatchSampler(data.length, global_batch, micro, dp_rank, dp_size, seed)
    for inputs, labels in microbatches(data, sampler):   # does NOT advance the sampler
        ...forward/backward...
    optimizer.step(); sampler.advance()                  # checkpoint sampler.state_dict()

Every dataset offers ``sample(i)``, ``length`` (``None`` for the infinite synthetic stream),
``seq_len`` and ``vocab_size``; ``sample(i)`` is ``np.ndarray[int64] (seq_len + 1)`` (synthetic,
memmap) or a dict of ``seq_len`` arrays (fine-tuning). :func:`step_target_count` gives the number
of loss targets of a whole global step (all DP ranks): the trainer divides the summed token loss
by it, so the loss does not depend on how the step is split over ranks and micro-batches. Tensors are built on the
CPU (move them with ``.to(device, non_blocking=True)``; pin memory if that matters).
``torch`` is imported inside ``microbatches`` so that the rest of the data package (used by
``llmtrain data prepare``) does not pay for it.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from llmtrain.engine.data.memmap import MemmapDataset
from llmtrain.engine.data.sampler import BatchSampler
from llmtrain.engine.data.sft import build_sft_data
from llmtrain.engine.data.sft_sources import FINETUNE_SOURCES
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
    if source in FINETUNE_SOURCES:
        return build_sft_data(data_cfg, seq_len, vocab_size)
    raise LLMTrainError(f"unknown data.source {source!r}", "use synthetic, memmap, chat, instruction or text", path="data.source")


ROW_KEYS = ("inputs", "labels", "positions", "segments")


def microbatches(dataset: Dataset, sampler: BatchSampler) -> list[tuple["torch.Tensor", ...]]:  # noqa: F821
    """This rank's micro-batches for the sampler's next step (the sampler is not advanced)."""
    import torch

    out = []
    for indices in sampler.step_indices():
        samples = [dataset.sample(i) for i in indices]
        if isinstance(samples[0], dict):  # fine-tuning rows: labels carry -100, packed rows add positions/segments
            keys = ROW_KEYS if "positions" in samples[0] else ROW_KEYS[:2]
            out.append(tuple(torch.from_numpy(np.stack([s[k] for s in samples])) for k in keys))
            continue
        tokens = torch.from_numpy(np.stack(samples))  # (micro, seq_len + 1) int64
        out.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
    return out


def step_target_count(dataset: Dataset, sampler: BatchSampler) -> int | None:
    """Labels != -100 over every global position of the sampler's next step (all DP ranks), or
    ``None`` for datasets without label masks (every label is a target there)."""
    counts = getattr(dataset, "target_counts", None)  # SFTDataset: per-row counts, one vectorized sum
    if counts is None and not hasattr(dataset, "target_count"):
        return None
    start = sampler.consumed_samples
    indices = sampler.indices_of(np.arange(start, start + sampler.global_batch, dtype=np.int64))
    if counts is not None:
        return int(np.asarray(counts)[indices].sum())
    return int(sum(dataset.target_count(i) for i in indices))

