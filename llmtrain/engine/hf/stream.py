"""Streaming HF weights into a sharded model: each rank reads only the slices it owns.

For every local parameter (a plain tensor, or a DTensor on its mesh with ``Shard`` /
``Replicate`` / ``_StridedShard`` placements from TP, FSDP2, EP or their combinations; a
pipeline rank's chunks hold only their stages' tensors), :func:`owned_indices` computes which
global indices of each dim this rank holds; the box they span is mapped through the family's
:class:`~llmtrain.engine.hf.families.Source` onto the HF tensors and read with safetensors'
``safe_open(...).get_slice(name)[box]``, then copied into the local shard. Peak host memory
per rank is its shard plus one tensor's slice (the file's pages this rank touches, through
safetensors' mmap, count too while the file is open; files are opened one at a time).

Mapping a box of our tensor onto HF tensors:

* dims 1:1 (same shape) for a single-name Source;
* a stacked Source (routed experts, ours ``[E, ...]``): our dim 0 selects the experts
  ``hf[e0:e1]``, our dims 1.. are theirs;
* ``head_dim`` (q/k rows, biases, q/k-norm weights in HF's half-split RoPE order): a row range
  of ours needs whole heads of theirs, so the covering heads' rows are read, permuted by the
  family's :func:`~llmtrain.engine.hf.families.to_ours` and cut to the range;
* ``rows`` (a block of a fused projection, Phi-3's ``qkv_proj``/``gate_up_proj``; GraniteMoE's
  experts along dim 1, ``rows_dim``): the row range is shifted by the block's start, so a TP or
  FSDP rank reads only its rows of the block.

Why not ``torch.distributed.checkpoint``'s ``HuggingFaceStorageReader`` (torch 2.13,
``torch/distributed/checkpoint/hf_storage.py``)? It does the same slice reads (``get_slice``
per planned chunk), but only for a state dict keyed by the HF names with the HF shapes: it
cannot rename, stack E expert tensors into one of ours, or permute rows within heads (a
contiguous row range of ours is a non-contiguous row set of theirs). It also takes every
``*.safetensors`` file it finds (``fs.ls``, symlinks followed, index ignored) and fails with
``AssertionError`` tracebacks, where the directory is untrusted and must fail in one line.
So we plan the boxes ourselves with the same primitive, after :func:`check_hf_model` checked
every header.

dtype: the slice is read in the file's dtype and cast into the parameter's by ``copy_``:
bf16/fp16 files into fp32 parameters are exact; fp32 files into bf16 parameters round to
nearest even, as any bf16 load does.
"""

from __future__ import annotations

import time
from contextlib import ExitStack
from dataclasses import dataclass, field

import torch
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from llmtrain.engine.hf.families import Source, tensor_map, to_ours
from llmtrain.engine.hf.files import HFModel
from llmtrain.errors import LLMTrainError
from llmtrain.recipe.schema import ModelConfig


@dataclass
class LoadStats:
    """What one rank read: HF tensor slices, their elements and bytes (as stored), seconds."""

    slices: int = 0
    elements: int = 0
    bytes: int = 0
    local_elements: int = 0  # elements of this rank's parameter shards that were filled
    seconds: float = 0.0
    files: set = field(default_factory=set)


def owned_indices(t: torch.Tensor) -> list[torch.Tensor | None]:
    """Per dim of ``t``'s global shape: the global indices this rank holds (None: all of them),
    computed with DTensor's own shard arithmetic (left to right over the mesh dims, the
    ``_StridedShard`` order included), so they agree with ``t.to_local()`` by construction."""
    if not isinstance(t, DTensor):
        return [None] * t.dim()
    from torch.distributed.tensor._utils import _get_shard_size_and_offsets

    shape = list(t.shape)
    local = list(shape)
    mesh = t.device_mesh
    coord = mesh.get_coordinate()
    offsets: dict[int, torch.Tensor] = {}
    for mesh_dim, placement in enumerate(t.placements):
        # torch 2.13's _StridedShard (FSDP2's dim-0 shard of a TP-sharded weight) is no Shard and its
        # is_shard() is False: test the types, as DTensor's own arithmetic does (TP 2 x FSDP 2 loads
        # failed with "local shard shape (4, 32) ... is not the computed (8, 32)" before)
        if not isinstance(placement, (Shard, _StridedShard)):
            continue
        d = placement.dim
        size, idx = _get_shard_size_and_offsets(local[d], mesh.size(mesh_dim), coord[mesh_dim], placement,
                                                offsets.get(d), shape[d], False)
        local[d] = size
        offsets[d] = idx[:size] if size else idx[:0]
    want = tuple(t.to_local().shape)
    if tuple(local) != want:  # never: the same arithmetic as DTensor's
        raise LLMTrainError(f"local shard shape {want} of a {tuple(shape)} DTensor is not the computed {tuple(local)}")
    return [offsets.get(d) for d in range(t.dim())]


def _span(idx: torch.Tensor | None, size: int) -> tuple[int, int, torch.Tensor | None]:
    """``(start, stop, positions within [start, stop) or None when the run is contiguous)``."""
    if idx is None:
        return 0, size, None
    if idx.numel() == 0:
        return 0, 0, None
    start, stop = int(idx.min()), int(idx.max()) + 1
    contiguous = stop - start == idx.numel() and bool((idx[1:] > idx[:-1]).all())
    return start, stop, None if contiguous else idx - start


class SliceReader:
    """Reads boxes of HF tensors, one open file at a time, and counts what it read."""

    def __init__(self, model: HFModel, stats: LoadStats):
        self.model, self.stats = model, stats
        self._stack = ExitStack()
        self._file = None
        self._handle = None

    def read(self, name: str, box: tuple[slice, ...]) -> torch.Tensor:
        from safetensors import safe_open

        h = self.model.tensors[name]
        if self._file != h.file:
            self._stack.close()
            self._stack = ExitStack()
            self._handle = self._stack.enter_context(safe_open(str(h.file), framework="pt"))
            self._file = h.file
        key = h.key or name  # the file's own name for it (a multimodal Gemma 3's language_model.model...)
        out = self._handle.get_slice(key)[box] if box else self._handle.get_tensor(key)
        self.stats.slices += 1
        self.stats.elements += out.numel()
        self.stats.bytes += out.numel() * out.element_size()
        self.stats.files.add(h.file.name)
        return out

    def close(self) -> None:
        self._stack.close()


def read_box(reader: SliceReader, src: Source, spans: list[tuple[int, int, torch.Tensor | None]]) -> torch.Tensor:
    """Our tensor's box ``spans`` (per dim: start, stop, positions) built from the HF tensors."""
    names = src.hf
    dims = spans
    if src.stacked:
        e0, e1, _ = spans[0]
        names, dims = src.hf[e0:e1], spans[1:]
    box = [slice(a, b) for a, b, _ in dims]
    cut = None
    if src.head_dim is not None and dims:
        h = src.head_dim
        a, b, _ = dims[0]
        h0, h1 = a // h, -(-b // h)
        box[0] = slice(h0 * h, h1 * h)
        cut = (a - h0 * h, b - h0 * h)
    if src.rows is not None:  # a block of a fused tensor (it starts at a whole head): shift the rows
        start, d = src.rows[0], src.rows_dim
        box[d] = slice(box[d].start + start, box[d].stop + start)
    parts = [reader.read(n, tuple(box)) for n in names]
    value = to_ours(Source(tuple(names), src.stacked, src.head_dim, rotary=src.rotary), parts)
    if cut is not None:
        value = value.narrow(1 if src.stacked else 0, cut[0], cut[1] - cut[0])
    for d, (_, _, pos) in enumerate(spans):
        if pos is not None:
            value = value.index_select(d, pos)
    return value


def sources_for(cfg: ModelConfig) -> dict[str, Source]:
    """The tensor map, with ``output.weight`` read from the embedding when tied."""
    tmap = dict(tensor_map(cfg))
    if cfg.tie_embeddings and "output.weight" not in tmap and "tok_embeddings.weight" in tmap:
        tmap["output.weight"] = tmap["tok_embeddings.weight"]
    return tmap


def stream_into(modules, model: HFModel, cfg: ModelConfig, skip=None) -> LoadStats:
    """Fill every parameter/buffer of ``modules`` (pipeline chunks) with this rank's slices;
    ``skip(key)`` true: a tensor HF files do not hold (LoRA adapters), left as initialized."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    stats = LoadStats()
    t0 = time.perf_counter()
    tmap = sources_for(cfg)
    work = []
    for module in modules:
        for key, value in get_model_state_dict(module).items():  # clean names, sharded values
            if skip is not None and skip(key):
                continue
            src = tmap.get(key)
            if src is None:
                raise LLMTrainError(f"our tensor {key} has no Hugging Face counterpart",
                                    "this model family cannot be loaded from Hugging Face weights",
                                    path="checkpoint.init_from_hf")
            work.append((model.tensors[src.hf[0]].file.name, key, src, value))
    reader = SliceReader(model, stats)
    filled: set[tuple] = set()
    try:
        with torch.no_grad():
            for _, key, src, value in sorted(work, key=lambda w: (w[0], w[1])):  # one file open at a time
                local = value.to_local() if isinstance(value, DTensor) else value
                where = (local.data_ptr(), tuple(local.shape), tuple(local.stride()))
                if local.numel() == 0 or where in filled:  # empty shard; a tied weight already read
                    continue
                filled.add(where)
                spans = [_span(idx, n) for idx, n in zip(owned_indices(value), value.shape)]
                part = read_box(reader, src, spans)
                if tuple(part.shape) != tuple(local.shape):  # never after check_hf_model
                    raise LLMTrainError(f"{key}: read {tuple(part.shape)} for a local shard of {tuple(local.shape)}")
                local.copy_(part)
                stats.local_elements += local.numel()
                del part
    finally:
        reader.close()
    stats.seconds = time.perf_counter() - t0
    return stats
