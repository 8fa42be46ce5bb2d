"""Distributed checkpoints of a training run: save (async), commit, verify, restore and reshard.

:class:`Checkpointer` is used by :func:`llmtrain.engine.trainer.train`:

* ``save(step, ...)`` every ``checkpoint.interval`` steps and at the end. All ranks write one
  ``torch.distributed.checkpoint`` (DCP) state dict (model chunks + AdamW state, by global
  parameter name: see :mod:`checkpoint_state`) into ``step-N.tmp/``, plus their RNG state. With
  ``checkpoint.async`` (default) the write runs in a background thread (``async_save``, thread
  mode; DCP's stager first copies the tensors, so training may go on); a new save waits for
  the previous one. DCP's collectives use a dedicated gloo group, never the training group.
* Commit (:func:`checkpoint_store.commit`): once every rank's write finished — checked at each
  step boundary by a 1-element MIN all-reduce (on a group of its own, never the one DCP's
  background thread uses) while a save is pending, or forced by the next
  save / the end of training — rank 0 writes ``metadata.json`` (sha256 of every file),
  renames ``step-N.tmp`` to ``step-N`` and atomically moves ``latest``; then prunes to ``keep``.
* ``restore(spec, ...)``: rank 0 verifies the checkpoint (``metadata.json``'s shape, every file
  inside the directory with its size and sha256, DCP's index through the allow-list unpickler;
  ``latest`` falls back to the previous complete checkpoint with a warning), every rank
  DCP-loads into its own layout's shapes through :class:`~llmtrain.engine.safe_reader.SafeReader`
  (no pickle beyond the allow-list, only listed shards), so a checkpoint from any layout loads
  into any other. The data position is the global sample
  index (``consumed_samples``); the step's grad accumulation follows the new layout.
* LoRA with ``checkpoint.init_from_hf``: only the adapters are saved and restored (the trainer
  loads the base from that directory first); ``metadata.json``'s ``lora_base`` fingerprint must
  match the directory, or restore refuses in one line (:mod:`llmtrain.engine.finetune.base`).
"""

from __future__ import annotations

import platform
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from llmtrain.engine import checkpoint_state as cs
from llmtrain.engine import checkpoint_store as store
from llmtrain.engine.checkpoint_meta import RESUME_FIELDS, CheckpointMeta, load_meta
from llmtrain.engine.finetune.base import adapters_only, check_base, fingerprint
from llmtrain.engine.parallel import compression_state
from llmtrain.engine.safe_reader import SafeReader, dcp_guard, load_rng
from llmtrain.errors import LLMTrainError
from llmtrain.recipe.lock import secret_free_dict

DIMS_FIELDS = ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep")


def dims_dict(dims) -> dict:
    return {k: int(getattr(dims, k)) for k in DIMS_FIELDS if hasattr(dims, k)}


def layout_diff(meta: dict, dims, world: int, grad_accum: int, zero: int | None = None) -> str:
    """One line: the layout the checkpoint was saved in and the one it is loaded into."""
    saved = meta.get("dims", {})
    now = dims_dict(dims)
    saved_zero = meta.get("recipe", {}).get("parallel", {}).get("zero")
    fmt = lambda d: " ".join(f"{k}{v}" for k, v in d.items() if v != 1) or "1 process"  # noqa: E731
    head = f"saved as {fmt(saved)} zero{saved_zero} on {meta.get('world_size')} ranks (grad_accum {meta.get('grad_accum')})"
    tail = f"now {fmt(now)} zero{zero} on {world} ranks (grad_accum {grad_accum})"
    same = saved == now and meta.get("world_size") == world and saved_zero == zero
    return f"{head} / {tail}" + ("" if same else " — resharded")


class Checkpointer:
    def __init__(self, recipe, root: str | Path, dims, grad_accum: int, verbose: bool = True):
        self.cfg = recipe.checkpoint
        self.recipe = recipe
        self.root = Path(root)
        self.dims = dims
        self.grad_accum = grad_accum
        self.verbose = verbose
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        # DCP's collectives (also from the async thread) must not interleave with training's
        self.group = dist.new_group(backend="gloo")
        # The "my write finished" flag of poll() has a group of its own: the async save's
        # background thread may still be running DCP's collectives on self.group, and two
        # threads issuing collectives on one gloo group in different orders can deadlock
        # (seen: main thread in poll's all_reduce, the writer in DCP's final broadcast).
        self.flag_group = dist.new_group(backend="gloo")
        self.pending: tuple | None = None  # (step, meta, future or None)
        # LoRA from checkpoint.init_from_hf: save the adapters only, and record which base they
        # belong to (rank 0 writes metadata.json; the fingerprint reads headers and a few blocks)
        self.adapters_only = adapters_only(recipe)
        self.lora_base = fingerprint(recipe.checkpoint.init_from_hf) if self.adapters_only and self.rank == 0 else None
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)

    # -- saving -------------------------------------------------------------------------------

    def due(self, step: int, total: int) -> bool:
        return step == total or (self.cfg.interval > 0 and step % self.cfg.interval == 0)

    def save(self, step: int, parts, optimizer, sampler, seq_len: int) -> None:
        self.wait()
        tmp = store.tmp_dir(self.root, step)
        if self.rank == 0:
            store.remove_stale_tmp(self.root)
            (tmp / "rng").mkdir(parents=True)
        dist.barrier(group=self.group)
        rng = {"torch": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state()
        torch.save(rng, tmp / "rng" / f"rank-{self.rank}.pt")
        consumed = int(sampler.state_dict()["consumed_samples"])
        meta = {"tokens_seen": consumed * seq_len, "sampler": sampler.state_dict(), "consumed_samples": consumed,
                "world_size": self.world, "dims": dims_dict(self.dims), "grad_accum": self.grad_accum,
                "recipe": secret_free_dict(self.recipe),  # no launch.env value ever reaches disk
                "versions": {"torch": torch.__version__, "python": platform.python_version(),
                             "llmtrain": _llmtrain_version()},
                "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        if self.lora_base is not None:
            meta["lora_base"] = self.lora_base
        state = cs.full_state(parts, optimizer, self.adapters_only)
        if self.cfg.async_:
            from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

            future = dcp.async_save(state, checkpoint_id=str(tmp), process_group=self.group,
                                    async_checkpointer_type=AsyncCheckpointerType.THREAD)
            self.pending = (step, meta, future)
        else:
            dcp.save(state, checkpoint_id=str(tmp), process_group=self.group)
            self.pending = (step, meta, None)
            self._commit()

    def poll(self) -> None:
        """At a step boundary: commit the pending save if every rank's write has finished."""
        if self.pending is None:
            return
        future = self.pending[2]
        flag = torch.tensor([1 if future is None or future.done() else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.flag_group)
        if int(flag.item()) == 1:
            self._commit()

    def wait(self) -> None:
        """Block until the pending save is written everywhere, then commit it."""
        if self.pending is not None:
            self._commit()

    def _commit(self) -> None:
        step, meta, future = self.pending
        self.pending = None
        if future is not None:
            future.result()  # raises if this rank's write failed
        dist.barrier(group=self.group)
        if self.rank == 0:
            final = store.commit(self.root, step, meta)
            store.prune(self.root, self.cfg.keep)
            if self.verbose:
                print(f"checkpoint: committed {final}", flush=True)

    # -- restoring ----------------------------------------------------------------------------

    def restore(self, spec: str, parts, optimizer, sampler, missing_ok: bool = False) -> int | None:
        """Load checkpoint ``spec`` (latest | step-N | PATH) into this layout; return its step.
        With ``missing_ok`` and ``latest``, return None when nothing has been committed yet."""
        found = [None]
        if self.rank == 0:  # rank 0 verifies (files, sizes, sha256, the DCP index); the others wait
            try:
                if missing_ok and spec == "latest" and not store.committed(self.root):
                    found[0] = ("missing", None, None, [])
                else:
                    path, meta, warnings = store.resolve(self.root, spec, require=RESUME_FIELDS, check_index=True)
                    self._check_lora(path, meta)
                    found[0] = ("ok", str(path), meta, warnings)
            except LLMTrainError as exc:
                found[0] = ("error", exc.problems, None, [])
        dist.broadcast_object_list(found, src=0, group=self.group)
        status, path, meta, warnings = found[0]
        if status == "missing":
            return None
        if status == "error":
            raise LLMTrainError(path or "checkpoint error")
        if self.rank == 0:
            for w in warnings:
                print(f"warning: {w}", file=sys.stderr, flush=True)
        files = CheckpointMeta.model_validate(meta).files
        state = cs.template_state(parts, optimizer, self.adapters_only)
        with dcp_guard(path):  # every rank reads .metadata through the allow-list, shards by name
            reader = SafeReader(path, files)
            self._compression_template(state, optimizer, meta, reader.index.state_dict_metadata)
            dcp.load(state, storage_reader=reader, process_group=self.group)
        cs.apply_state(parts, optimizer, state, self.adapters_only)
        sampler.load_state_dict(meta["sampler"])
        same_layout = meta.get("world_size") == self.world and meta.get("dims") == dims_dict(self.dims)
        rng = load_rng(path, f"rng/rank-{self.rank}.pt", files) if same_layout else None
        if rng is not None:
            try:
                torch.set_rng_state(rng["torch"])
                if "cuda" in rng and torch.cuda.is_available():
                    torch.cuda.set_rng_state(rng["cuda"])
            except RuntimeError as exc:
                raise LLMTrainError(f"{Path(path) / 'rng' / f'rank-{self.rank}.pt'}: not a valid RNG state ({exc})",
                                    "resume from another checkpoint", path="--ckpt") from None
        if self.rank == 0 and self.verbose:
            print(f"checkpoint: resumed from {path} at step {meta['step']} "
                  f"(sample {meta['consumed_samples']}, {meta['tokens_seen']} tokens); "
                  + layout_diff(meta, self.dims, self.world, self.grad_accum, self.recipe.parallel.zero), flush=True)
        return int(meta["step"])


    def _compression_template(self, state: dict, optimizer, meta: dict, saved_keys) -> None:
        """Ask for this rank's gradient-compression state when it can be used here; else say in one
        line that it starts afresh (parallel/compression_state.py: why not refused)."""
        template = compression_state.state(optimizer, self.rank)
        if template is None:
            return
        reason = compression_state.reset_reason(meta, self.recipe, dims_dict(self.dims), self.world, saved_keys)
        if reason is None:
            compression_state.fit_to_saved(template, optimizer, saved_keys)  # TP: replicated gradients
            state[compression_state.KEY] = template
        elif self.rank == 0:
            print(f"checkpoint: {self.recipe.parallel.grad_compression} state (error feedback, warm start) "
                  f"started afresh: {reason}", flush=True)

    def _check_lora(self, path, meta: dict) -> None:
        """An adapters-only checkpoint needs the base it was trained on (one-line refusal otherwise)."""
        recorded = meta.get("lora_base")
        if self.adapters_only or recorded is not None:
            directory = self.recipe.checkpoint.init_from_hf if self.recipe.train.lora is not None else None
            check_base(directory, recorded, path)


def _llmtrain_version() -> str:
    try:
        from llmtrain import __version__

        return __version__
    except ImportError:  # pragma: no cover
        return "unknown"


def checkpoint_root(recipe, run_dir: str | Path | None) -> Path | None:
    if recipe.checkpoint.dir:
        return Path(recipe.checkpoint.dir)
    return Path(run_dir) / "checkpoints" if run_dir else None


def load_meta_json(path: Path) -> dict:
    """The validated ``metadata.json`` of a checkpoint (:class:`LLMTrainError` naming it if not)."""
    return load_meta(path).as_dict()


