"""Gradient-compression state in checkpoints: error-feedback residuals, PowerSGD's warm-start Q.

The compressed reducers (:mod:`llmtrain.engine.parallel.compression`) carry state from step to
step that the update depends on: the error-feedback residual ``e`` (different on every rank:
each keeps what *its* gradient lost), PowerSGD's warm-start ``Q`` (equal on the ranks of a DP
group) and the number of calls (the warm-up counter, ``parallel.powersgd_start_step``). It is
saved with the optimizer state, as a third part of the DCP state dict::

    {"model": ..., "optimizer": ..., "grad_compression": {"rank<R>": {"set<k>.<key>": tensor}}}

keyed by the **global rank** ``R`` and the reducer's set ``k`` (0 dense, 1 routed experts):
residuals are per rank, so the key says whose they are (DCP de-duplicates plain tensors under
one key across ranks, which would keep one rank's residual for all). Every rank writes and
reads only its own entries, in DCP's files, verified and read through the same allow-list as
the rest of the checkpoint.

**Decision: the same layout and the same compression setting only; otherwise the state is
started afresh, with one printed line — not refused.** Why: a residual belongs to one rank's
local shard of the gradient in one DP group; on another DP size, TP/PP split or world size
there is no meaningful mapping (summing or splitting residuals would apply gradient mass that
the averaging already counted on other ranks). Refusing would block the resharded resumes
that the checkpoint format exists for (docs/checkpoint.md), while starting afresh costs what
compression costs at its start (``e = 0``, ``Q`` from the seed; no new warm-up: the step is
past it) and is what happened before this state was saved. "Same setting" is
``grad_compression``, ``powersgd_rank``, ``topk_ratio``, ``compression_error_feedback`` and the
resolved ``powersgd_start_step`` (its default follows ``train.steps``) of the checkpoint's recorded
recipe; "same layout" is its world size
and parallel dims. A checkpoint without the part (written without compression, or by an older
llmtrain) also starts afresh, said in the same way.
"""

from __future__ import annotations

from math import ceil, prod

import torch

from llmtrain.plan.comm import powersgd_start

KEY = "grad_compression"
SETTING = ("grad_compression", "powersgd_rank", "topk_ratio", "compression_error_feedback")
_ATTR = "llmtrain_compression_reducers"


def attach(optimizer, reducers: list) -> None:
    """Remember the compressed reducers on the optimizer, whose state the checkpoint saves
    (those without state, a DP group of one, are left out)."""
    setattr(optimizer, _ATTR, [r for r in reducers if hasattr(r, "state_dict")])


def reducers_of(optimizer) -> list:
    return getattr(optimizer, _ATTR, [])


def _rank_key(rank: int) -> str:
    return f"rank{rank}"


def state(optimizer, rank: int) -> dict[str, dict[str, torch.Tensor]] | None:
    """This rank's part of the checkpoint (fresh tensors; also the template to load into), or
    None when nothing is compressed on this rank."""
    reducers = reducers_of(optimizer)
    if not reducers:
        return None
    return {_rank_key(rank): {f"set{k}.{name}": t for k, r in enumerate(reducers) for name, t in r.state_dict().items()}}


def fit_to_saved(template: dict[str, dict[str, torch.Tensor]], optimizer, saved_meta) -> None:
    """Reshape ``template`` (from :func:`state`) to the sizes the checkpoint saved, in place.

    Why: a fresh reducer sizes its zeros from the parameters' local shards, but a residual has
    the shape of the rank's local *gradient*, which was larger where TP handed a gradient back
    replicated (the vocabulary-parallel embedding's, before the twentieth session kept it in the
    weight's rows: engine/parallel/tensor.py); a checkpoint of such a run still holds that size. Only called when :func:`reset_reason` found the same layout
    and setting, so the saved sizes are this rank's. The checkpoint is untrusted: a size is taken
    only if its element count is at most the reducers' parameters' full (global) element count,
    else the template keeps its own and DCP refuses the mismatch in one line; the reducers check
    at their next call that what was loaded fits the gradient (compression.py)."""
    bound = sum(p.numel() for r in reducers_of(optimizer) for p in r.params)
    for rank_key, entries in template.items():
        for name, tensor in entries.items():
            meta = saved_meta.get(f"{KEY}.{rank_key}.{name}")
            size = getattr(meta, "size", None)
            if size is None or tuple(size) == tuple(tensor.shape):
                continue
            dims = tuple(int(n) for n in size)
            if all(n >= 0 for n in dims) and prod(dims) <= bound:
                entries[name] = torch.zeros(dims, dtype=tensor.dtype)


def load(optimizer, rank: int, part: dict[str, dict[str, torch.Tensor]]) -> None:
    entries = part[_rank_key(rank)]
    for k, r in enumerate(reducers_of(optimizer)):
        prefix = f"set{k}."
        r.load_state_dict({name[len(prefix):]: t for name, t in entries.items() if name.startswith(prefix)})


def reset_reason(meta: dict, recipe, dims: dict, world: int, saved_keys) -> str | None:
    """Why the checkpoint's compression state cannot be used here (None: it can). ``meta``:
    the checkpoint's metadata.json; ``dims``: this run's parallel dims; ``saved_keys``: the
    names in the checkpoint's DCP index."""
    saved = meta.get("recipe", {}).get("parallel", {})
    now = recipe.parallel
    changed = [f"{f} {saved.get(f)!r} -> {getattr(now, f)!r}" for f in SETTING if saved.get(f) != getattr(now, f)]
    if now.grad_compression == "powersgd" and (start := _saved_start(meta)) != powersgd_start(recipe):
        changed.append(f"powersgd_start_step {start!r} -> {powersgd_start(recipe)}")
    if changed:
        return "the compression setting changed (" + ", ".join(changed) + ")"
    if meta.get("world_size") != world or meta.get("dims") != dims:
        return f"the layout changed (saved {meta.get('dims')} on {meta.get('world_size')} ranks, now {dims} on {world})"
    if not any(k.startswith(KEY + ".") for k in saved_keys):
        return "the checkpoint holds no compression state (written without it, or by an older llmtrain)"
    return None


def _saved_start(meta: dict) -> int | None:
    """The checkpoint's resolved ``powersgd_start_step`` (plan/comm.py ``powersgd_start`` on its recipe)."""
    rec = meta.get("recipe", {})
    start = rec.get("parallel", {}).get("powersgd_start_step")
    if start is not None or "powersgd_start_step" not in rec.get("parallel", {}):
        return start
    train = rec.get("train", {})
    return max(int(train.get("schedule", {}).get("warmup_steps", 0)), ceil(int(train.get("steps", 0)) / 10))
