"""Exporting a DCP checkpoint to a Hugging Face directory, in parallel, never gathering the model.

``llmtrain ckpt export RUN --hf OUT [--dtype bf16|fp32] [--max-shard-size 5GB] [--workers N]``
(:mod:`llmtrain.cli.ckpt`) verifies the checkpoint, then calls :func:`export_hf`:

1. **Plan** (:func:`plan_export`, from DCP's index alone: names, shapes, dtypes). Our tensors
   are taken in the tensor map's order (embeddings, layers in order, final norm, output) and
   turned into their HF tensors (:func:`~llmtrain.engine.hf.families.tensor_map`: stacked
   experts become E tensors); they are packed greedily into shards of at most
   ``max_shard_size`` bytes in the output dtype, as transformers' ``save_pretrained`` does (a
   tensor larger than the limit gets a shard of its own; the HF tensors of one of ours stay in
   one shard, so each of ours is read exactly once, and so do the blocks of a fused HF tensor,
   Phi-3's ``qkv_proj`` from our wq/wk/wv). Same checkpoint and options, same files.
2. **Write**: shards are split over ``workers`` processes (largest first onto the least
   loaded); each reads from the checkpoint only the tensors of its own shards, one shard at a
   time, through :class:`~llmtrain.engine.safe_reader.SafeReader` (DCP's index via the
   allow-list unpickler, only listed shard files: the security boundary stays) with DCP's
   key-subset load, which assembles each tensor from whichever saved layout it was written in
   (DCP reshards). A worker's peak memory is about one output shard (its tensors as saved,
   plus the converted copy). Workers are forked from a fork server that imported torch, DCP and
   this module once (no worker inherits the CLI's threads or state, as a plain fork would; spawn
   would import torch once per worker). As with any ``multiprocessing`` code, a script that
   calls :func:`export_hf` needs the ``if __name__ == "__main__":`` guard (the CLI has it).
   One shard or ``workers=1`` runs in this process. Each file is written to ``NAME.tmp`` and
   renamed, so no half-written shard carries a final name.
3. **Names** as transformers writes them: one shard is ``model.safetensors`` (no index, like
   ``save_pretrained``); more are ``model-0000i-of-0000N.safetensors`` with
   ``model.safetensors.index.json`` (``metadata.total_size`` = tensor bytes, ``weight_map``).
   ``config.json`` is the family's :func:`~llmtrain.engine.hf.families.hf_config` (its dtype set
   to the output dtype), ``generation_config.json`` carries the tokenizer's bos/eos ids when
   it has them, and the run's tokenizer files are copied (:mod:`.tokenizer_files`).
4. **LoRA** checkpoints (``train.lora``): the adapters are merged into the base per tensor
   (``W + scale * B @ A``) by the worker that writes it; the base is read from the checkpoint or,
   for an adapters-only checkpoint, from the HF base directory whose fingerprint the caller
   checked (:mod:`llmtrain.engine.finetune.lora_export`). The result is a plain model of the family.
"""

from __future__ import annotations

import json
import math
import multiprocessing as mp
import os
import re
import warnings
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from llmtrain.engine.hf.families import Source, hf_shape, tensor_map
from llmtrain.errors import LLMTrainError, Problem
from llmtrain.recipe.schema import ModelConfig
from llmtrain.safeio import printable

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
DTYPES = {"fp32": ("float32", 4), "bf16": ("bfloat16", 2)}
SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(B|KB|MB|GB|TB|KIB|MIB|GIB|TIB)?\s*$", re.IGNORECASE)
UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30,
         "TIB": 2**40}
OUR_FILES = re.compile(r"^model(-\d{5}-of-\d{5})?\.safetensors(\.tmp)?$|^model\.safetensors\.index\.json$")


def parse_size(text: str, flag: str = "--max-shard-size") -> int:
    """``5GB`` (10^9, as transformers), ``500MiB`` (2^20), ``123`` (bytes) -> bytes."""
    m = SIZE_RE.match(str(text))
    if not m or float(m.group(1)) <= 0:
        raise LLMTrainError(f"{printable(text, 40)} is not a size", "write e.g. 5GB, 500MB or 2GiB", path=flag)
    return max(1, int(float(m.group(1)) * UNITS[(m.group(2) or "B").upper()]))


@dataclass(frozen=True)
class Entry:
    """One tensor of ours and the HF tensors it becomes."""

    key: str                    # DCP key, ``model.<our name>``
    src: Source
    shape: tuple[int, ...]      # of each HF tensor (a fused one whole)
    nbytes: int                 # all its HF tensors, in the output dtype


@dataclass(frozen=True)
class ExportPlan:
    dtype: str                  # fp32 | bf16
    files: list[str]            # output shard file names
    shards: list[list[Entry]]   # entries per file

    @property
    def total_size(self) -> int:
        return sum(e.nbytes for s in self.shards for e in s)

    def weight_map(self) -> dict[str, str]:
        return {n: f for f, s in zip(self.files, self.shards) for e in s for n in e.src.hf}


def plan_export(index_sizes: dict[str, tuple[int, ...]], cfg: ModelConfig, dtype: str, max_bytes: int) -> ExportPlan:
    """The deterministic shard plan (see the module docstring). ``index_sizes``: DCP key -> shape."""
    item = DTYPES[dtype][1]
    entries = []
    for ours, src in tensor_map(cfg).items():
        key = f"model.{ours}"
        if key not in index_sizes:
            raise LLMTrainError(f"the checkpoint has no {key}", "the checkpoint is damaged or of another model",
                                path="--ckpt")
        shape = tuple(index_sizes[key])
        each = shape[1:] if src.stacked else shape  # a fused block: its own rows (the blocks sum to the tensor)
        entries.append(Entry(key, src, hf_shape(src, shape), len(src.hf) * math.prod(each) * item))
    groups: list[list[Entry]] = []  # the blocks of one fused HF tensor (adjacent in the map) stay together
    for e in entries:
        if groups and e.src.rows is not None and groups[-1][-1].src.hf == e.src.hf:
            groups[-1].append(e)
        else:
            groups.append([e])
    shards: list[list[Entry]] = [[]]
    size = 0
    for g in groups:
        nbytes = sum(e.nbytes for e in g)
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].extend(g)
        size += nbytes
    n = len(shards)
    files = [SINGLE] if n == 1 else [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    return ExportPlan(dtype, files, shards)


def assign(plan: ExportPlan, workers: int) -> list[list[int]]:
    """Shard indices per worker: largest first onto the least-loaded worker (ties: lowest index)."""
    loads = [0] * workers
    out: list[list[int]] = [[] for _ in range(workers)]
    sizes = [sum(e.nbytes for e in s) for s in plan.shards]
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        w = min(range(workers), key=lambda w: (loads[w], w))
        out[w].append(i)
        loads[w] += sizes[i]
    return [sorted(s) for s in out if s]


def write_shards(ckpt: str, files: dict, plan: ExportPlan, shard_ids: list[int], out: str,
                 lora=None) -> list[Problem] | None:
    """Worker body: read and write the shards ``shard_ids`` (None: done; else the problems).
    ``lora``: a :class:`~llmtrain.engine.finetune.lora_export.LoRAExport` (base source, merge)."""
    import torch
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    from llmtrain.engine.finetune.lora_export import HFTensorReader, base_tensor, checkpoint_keys
    from llmtrain.engine.hf.families import hf_tensors
    from llmtrain.engine.safe_reader import SafeReader, dcp_guard

    dtype = getattr(torch, DTYPES[plan.dtype][0])
    try:
        for i in shard_ids:
            entries = plan.shards[i]
            keys = {e.key for e in entries} if lora is None else checkpoint_keys(entries, lora)
            state = {}
            if keys:
                with dcp_guard(ckpt), warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # "assuming the intent is to load in a single process": it is
                    reader = SafeReader(ckpt, files)
                    state = _load_state_dict_from_keys(keys, storage_reader=reader)["model"]
            tensors, blocks = {}, []
            with HFTensorReader(lora.hf_files if lora is not None else {}) as base:
                for e in entries:
                    ours = state.pop(e.key.removeprefix("model.")) if lora is None else base_tensor(e, state, lora, base)
                    if e.src.rows is None:
                        tensors.update((n, t.to(dtype).contiguous()) for n, t in hf_tensors([(e.src, ours)]).items())
                    else:  # a block of a fused tensor (its blocks share this shard): joined below
                        blocks.append((e.src, ours.to(dtype)))
                    del ours
            tensors.update(hf_tensors(blocks))
            del blocks
            target = Path(out) / plan.files[i]
            tmp = target.with_name(target.name + ".tmp")
            save_file(tensors, str(tmp), metadata={"format": "pt"})
            os.replace(tmp, target)
            del tensors, state
    except LLMTrainError as exc:
        return exc.problems
    return None


def _init_worker() -> None:
    import torch

    torch.set_num_threads(1)  # N workers on N cores; conversion is memory-bound anyway


def _context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed.checkpoint.state_dict_loader", "safetensors.torch",
                                "llmtrain.engine.safe_reader", "llmtrain.engine.hf.export"])
    return ctx


def default_workers() -> int:
    return max(1, min(4, os.cpu_count() or 1))


def export_hf(ckpt: Path, files: dict, cfg: ModelConfig, out: Path, dtype: str = "fp32",
              max_shard_bytes: int = 5 * 10**9, workers: int | None = None,
              tokenizer: tuple[str, str | None] | None = None, lora=None) -> list[Path]:
    """Write ``out`` (see the module docstring); returns the files written. ``files``: the
    verified ``metadata.json`` file entries; ``tokenizer``: ``(data.tokenizer, data.path)``;
    ``lora``: ``(LoRAConfig, LoRAExport)`` of a LoRA checkpoint (:mod:`llmtrain.engine.finetune.lora_export`)."""
    from llmtrain.engine.hf.checkpoint_read import _check_model_entries
    from llmtrain.engine.hf.families import hf_config
    from llmtrain.engine.hf.tokenizer_files import copy_tokenizer, special_ids
    from llmtrain.engine.safe_reader import SafeReader

    if dtype not in DTYPES:
        raise LLMTrainError(f"--dtype {printable(dtype, 20)}", f"use one of {', '.join(DTYPES)}", path="--dtype")
    reader = SafeReader(ckpt, files)
    spec = None
    if lora is None:
        _check_model_entries(reader.index, cfg, Path(ckpt))
        sizes = {k: tuple(v.size) for k, v in reader.index.state_dict_metadata.items() if k.startswith("model.")}
    else:
        from llmtrain.engine.finetune.lora_export import lora_entries

        lora_cfg, spec = lora
        sizes = lora_entries(reader.index, cfg, lora_cfg, spec, Path(ckpt))
    plan = plan_export(sizes, cfg, dtype, max_shard_bytes)
    out.mkdir(parents=True, exist_ok=True)
    for stale in sorted(out.iterdir()):  # a previous export's shards (--force) would mislead loaders
        if OUR_FILES.match(stale.name) and stale.is_file() and not stale.is_symlink():
            stale.unlink()
    jobs = assign(plan, min(workers or default_workers(), len(plan.files)))
    if len(jobs) == 1:
        results = [write_shards(str(ckpt), files, plan, jobs[0], str(out), spec)]
    else:
        with ProcessPoolExecutor(max_workers=len(jobs), mp_context=_context(), initializer=_init_worker) as pool:
            results = list(pool.map(write_shards, *zip(*[(str(ckpt), files, plan, j, str(out), spec) for j in jobs])))
    problems = [p for r in results if r for p in r]
    if problems:
        raise LLMTrainError(problems)
    written = [out / f for f in plan.files]
    if len(plan.files) > 1:
        index = {"metadata": {"total_size": plan.total_size}, "weight_map": dict(sorted(plan.weight_map().items()))}
        (out / INDEX).write_text(json.dumps(index, indent=2) + "\n")
        written.append(out / INDEX)
    copied = copy_tokenizer(tokenizer, out) if tokenizer else []
    ids = special_ids(out) if copied else {}
    conf = hf_config(cfg)
    conf["torch_dtype"] = conf["dtype"] = DTYPES[dtype][0]
    conf.update({k: v for k, v in ids.items() if v is not None})
    (out / "config.json").write_text(json.dumps(conf, indent=2, sort_keys=True) + "\n")
    gen = {"_from_model_config": True, **{k: v for k, v in ids.items() if v is not None}}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2, sort_keys=True) + "\n")
    return [*written, out / "config.json", out / "generation_config.json", *copied]
