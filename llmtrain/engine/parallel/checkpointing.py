"""Activation checkpointing per transformer block.

- ``full``: the whole block is recomputed in backward (``checkpoint_wrapper``, non-reentrant);
  only the block input is kept: the least memory, about one extra forward of compute.
- ``selective``: an op-level policy (``create_selective_checkpoint_contexts``) keeps the outputs
  of matmuls and of scaled-dot-product attention — the expensive ops — and recomputes the cheap
  element-wise ones (norms, SiLU, RoPE, residual adds), which hold most of the activation bytes
  of a block relative to their compute (Korthikanti et al. 2022 make the same trade-off).
- ``selective_mm``: ``selective`` that also recomputes wk's, w3's (and without TP wo's) matmul
  output: torchtitan's op policy (below).

The row-parallel projections (issue 16; docs/planner.md §8 found them to be most of the saved
bytes at TP 8): under DTensor TP, ``wo``'s and ``w2``'s ``mm`` returns a *Partial* sum of the full
``[b s, h]`` size on every rank, and only then does RowwiseParallel's output hook reduce it
(all-reduce; with sequence parallelism a reduce-scatter to ``[b, s/tp, h]``). Saving every ``mm``
output kept those partial sums (and, not saving the reduction, re-ran it — a collective — in
backward). What backward really needs of the two projections:

- ``wo``: its reduced output (the residual add and the MLP norm that are recomputed read it); its
  ``mm`` backward needs only its input (SDPA's output, saved) and the weight. So under TP we save
  the **reduced output** (``_c10d_functional.all_reduce`` / ``reduce_scatter_tensor``: ``1/tp`` of
  the partial sum with SP, the same size without) and **neither save nor recompute** the partial
  sum: in recompute the ``mm`` returns an uninitialised placeholder of its shape, which only feeds
  the cached reduction (:class:`_Placeholder`; "discard"). Nothing expensive is recomputed,
  Megatron's and torchtitan's answer too (they save the post-reduce tensor).
- ``w2`` (the block's last op): nothing at all, with or without TP — its output only feeds the
  residual add that makes the block output, which the next block keeps as its input, and the
  non-reentrant checkpoint stops recomputing at the last tensor backward needs (``w2``'s input:
  early stop), so the ``mm`` output and its reduction are discarded too.
- without TP, ``wo``'s ``mm`` output *is* the attention output: saved as before.

Measured on debug-dense (tests/test_costmodel.py, 4 ranks, tp 2): the planner's terms are exact
within the 2 % there; per layer and micro batch the saved bytes fall from ``e (q + 2kv + q + 2bsh
+ 2f) `` to ``e (q + 2kv + q + bsh/n + 2f)`` (``n = tp`` with SP). LoRA adapters on the
projections follow the same rule (``lora_b``'s output is a Partial sum of the projection's width;
``lora_a``'s ``[b s, rank]`` output is kept: ``lora_b`` saves it for its weight gradient).

``selective_mm`` is ``selective`` with the outputs of every second matmul of a block recomputed
instead of saved: torchtitan's default op policy (its ``_save_list`` minus every second
``aten.mm`` by a per-block counter, parallelize_llama.py at 9dec370: wk, wo and w3 of the Llama
block), for the planner to describe the published torchtitan runs. It is decided **by module,
not by counting** matmuls, so that LoRA adapters (two more ``mm`` per target), TP, the CP
attention blocks and MoE blocks do not shift which outputs go: the base ``mm`` of the
``nn.Linear`` modules ``attention.wk``, ``feed_forward.w3`` and ``attention.wo`` returns
PREFER_RECOMPUTE (forward hooks tell the policy it is inside one of them, and not inside their
``lora_a`` / ``lora_b``, whose outputs stay saved as in ``selective``). ``wo`` only without TP:
under TP its ``mm`` output is the Partial sum, whose recomputation would re-run the reduction —
a collective — in backward, so ``wo`` keeps selective's rule (reduced output saved, partial sum
discarded) and torchtitan's recomputation of it is not copied. Nothing new is saved for the
recomputation: wk's and w3's inputs are the attention / MLP norms' outputs, recomputed from the
saved block input and residual as in ``selective``; wo's input is the saved SDPA output; the
residual ``h`` after attention (the MLP norm's input) is recomputed from wo's recomputed output.
Cost: the forward GEMMs of wk, w3 (and wo without TP) once more in backward, about one extra
forward matmul in three; saved: their outputs (``e bs (kv + f)``, ``+ e bsh`` without TP). A block
without those modules keeps selective's rule for what it lacks: an MoE block (``moe`` instead
of ``feed_forward``: grouped experts are parameters, not Linears; the shared experts' ``w3`` is
``moe.shared.w3``) recomputes only wk (and wo without TP). Under ``torch.compile`` (checked on
CPU, one process: gradients equal no recomputation) dynamo breaks the graph at the checkpoint,
since the hooks mutate the region ("HOP: Unsafe side effect"; selective's row-parallel hooks do
the same), so the checkpointed region is not compiled as one graph.

"Discard" is built on torch's own selective-checkpoint modes (private in torch 2.13:
``_CachingTorchDispatchMode`` and the storage layout it shares with ``_CachedTorchDispatchMode``):
the policy says MUST_SAVE and the stored value is then swapped for a placeholder. Where those
names are missing (another torch), the policy degrades to saving the partial sums as before
(selective_mm's recomputed outputs still go: the public policy sees ``ctx.op_output``).
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

import llmtrain.engine.models.softcap  # noqa: F401  (registers torch.ops.llmtrain.softcap_attention, saved below)

try:  # torch's selective-checkpoint internals (2.13): see the module docstring
    from torch.utils.checkpoint import _CachedTorchDispatchMode, _CachingTorchDispatchMode, _sac_storage_key
except ImportError:  # pragma: no cover - other torch versions: plain SAC, partial sums saved
    _CachingTorchDispatchMode = None

# Every fused SDPA backend's forward op (tests/test_selective_ac.py enumerates aten's): which
# one ``F.scaled_dot_product_attention`` dispatches to depends on the GPU and torch's cuDNN. cuDNN's
# was missing until the GPU check ran on an H100, where torch >= 2.11 picks it first, so selective
# recomputed the attention there (the record's selective row ran 1.11x its plan, the dense rows'
# highest; how much of that this explains, the next GPU run shows).
_SAVE = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.aten._scaled_dot_product_fused_attention_overrideable.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_attention_math_for_mps.default,
    torch.ops.llmtrain.softcap_attention.default,  # Gemma 2's soft-capped attention, the engine's own (models/softcap.py)
}
_MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default}
_REDUCTIONS = {  # the row-parallel output's reduction under DTensor TP (functional collectives)
    torch.ops._c10d_functional.all_reduce.default,
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
}
_DISCARD = "discard"  # neither saved nor recomputed: a placeholder in recompute (module docstring)


# (owner, name) of the projections whose base ``mm`` output ``selective_mm`` recomputes (wo: without TP)
RECOMPUTED_MM = (("attention", "wk"), ("feed_forward", "w3"), ("attention", "wo"))


class _Region:
    """Which projection of one block is running (set by forward hooks, also in recompute): the
    row-parallel ones (``module``), and for ``selective_mm`` the one whose ``mm`` is recomputed."""

    def __init__(self):
        self.module: nn.Linear | None = None
        self.tail = False  # w2: the block's last op, nothing of it is needed
        self.adapter_in = False  # inside a LoRA ``lora_a`` (its output is saved)
        self.recompute: nn.Linear | None = None  # selective_mm: inside wk / w3 / wo, not their adapters


def _partial(x) -> bool:
    return isinstance(x, DTensor) and any(p.is_partial() for p in x.placements)


def _recomputed(region: _Region, op, out) -> bool:
    """selective_mm: the base mm of wk, w3 or wo (wo's Partial sum under TP keeps selective's rule)."""
    r = region.recompute
    if r is None or op not in _MATMULS:
        return False
    o = out[0] if isinstance(out, (tuple, list)) else out
    return isinstance(o, torch.Tensor) and o.shape[-1] == r.out_features and not _partial(o)


def _decide(region: _Region, op, out):
    if _recomputed(region, op, out):
        return CheckpointPolicy.PREFER_RECOMPUTE
    m = region.module
    if m is not None and not region.adapter_in:
        o = out[0] if isinstance(out, (tuple, list)) else out
        if op in _MATMULS and isinstance(o, torch.Tensor) and o.shape[-1] == m.out_features:
            if region.tail or _partial(o):  # wo without TP: its output is the attention output, kept
                return _DISCARD
        if op in _REDUCTIONS:
            return _DISCARD if region.tail else CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.MUST_SAVE if op in _SAVE else CheckpointPolicy.PREFER_RECOMPUTE


def _policy(ctx, op, *args, **kwargs):  # the plain policy (no block context)
    return CheckpointPolicy.MUST_SAVE if op in _SAVE else CheckpointPolicy.PREFER_RECOMPUTE


class _Placeholder:
    """Stands in a selective-checkpoint storage entry: recompute gets an uninitialised tensor of the
    original's shape, strides, dtype (and DTensor spec) instead of the saved value."""

    def __init__(self, t):
        local = t._local_tensor if isinstance(t, DTensor) else t
        self.meta = (local.shape, local.stride(), local.dtype, local.device)
        self.spec = t._spec if isinstance(t, DTensor) else None

    def get_val(self, allow_cache_entry_mutation=False):
        shape, stride, dtype, device = self.meta
        local = torch.empty_strided(shape, stride, dtype=dtype, device=device)
        return local if self.spec is None else DTensor(local, self.spec, requires_grad=False)


if _CachingTorchDispatchMode is not None:
    class _DiscardingMode(_CachingTorchDispatchMode):
        """torch's forward-side SAC mode; an op the policy discards is stored as a placeholder."""

        def __init__(self, region: _Region, storage):
            self.region, self.discard = region, False
            super().__init__(self._policy_fn, storage)

        def _policy_fn(self, ctx, op, *args, **kwargs):
            decision = _decide(self.region, op, ctx.op_output)
            self.discard = decision is _DISCARD
            return CheckpointPolicy.MUST_SAVE if self.discard else decision

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.discard = False
            out = super().__torch_dispatch__(func, types, args, kwargs)
            if self.discard and not torch.compiler.is_compiling():  # compiled: the partitioner decides
                key = _sac_storage_key(func, args)
                idx = self.func_counter[key] - 1
                self.storage[key][idx] = tree_map(lambda x: _Placeholder(x) if isinstance(x, torch.Tensor) else x, out)
                self.discard = False
            return out


def _region_policy(region: _Region, ctx, op, *args, **kwargs):  # no discard mode: plain SAC + selective_mm's rule
    if _recomputed(region, op, getattr(ctx, "op_output", None)):
        return CheckpointPolicy.PREFER_RECOMPUTE
    return _policy(ctx, op, *args, **kwargs)


def _selective_context(region: _Region | None = None):
    if region is None:
        return create_selective_checkpoint_contexts(_policy)
    if _CachingTorchDispatchMode is None:
        return create_selective_checkpoint_contexts(partial(_region_policy, region))
    from collections import defaultdict
    storage = defaultdict(dict)
    return _DiscardingMode(region, storage), _CachedTorchDispatchMode(None, storage)


def _enter(region: _Region, tail: bool, module, args):
    region.module, region.tail = module, tail


def _leave(region: _Region, module, args, output):
    region.module, region.tail = None, False


def _reset(region: _Region, module, args):
    region.module, region.tail, region.adapter_in, region.recompute = None, False, False, None


def _set_recompute(region: _Region, linear: nn.Linear | None, *hook_args):
    region.recompute = linear


def _set_adapter(region: _Region, value: bool, *hook_args):
    region.adapter_in = value


def _track_row_parallel(block: nn.Module) -> _Region:
    """Forward hooks that tell the policy when ``wo`` / ``w2`` (and their TP output hook) run."""
    region = _Region()
    # Reset at every block entry, forward and recompute: the recomputation stops early *inside*
    # w2 (torch raises out of it once backward has all it needs), so w2's exit hook never runs
    # there and the region would otherwise still say "w2" when the block runs next.
    block.register_forward_pre_hook(partial(_reset, region))
    for owner, name, tail in (("attention", "wo", False), ("feed_forward", "w2", True)):
        linear = getattr(getattr(block, owner, None), name, None)
        if not isinstance(linear, nn.Linear):
            continue
        # registered after TP's hooks (parallelize order: TP -> LoRA -> AC): the region spans the
        # output reduction that RowwiseParallel's forward hook issues
        linear.register_forward_pre_hook(partial(_enter, region, tail))
        linear.register_forward_hook(partial(_leave, region))
        adapter = getattr(linear, "lora_a", None)
        if isinstance(adapter, nn.Module):
            adapter.register_forward_pre_hook(partial(_set_adapter, region, True))
            adapter.register_forward_hook(partial(_set_adapter, region, False))
    return region


def _track_recomputed_mm(block: nn.Module, region: _Region) -> None:
    """``selective_mm``: hooks that tell the policy when wk, w3 or wo runs, outside its adapters
    (by module, so adapters, TP, CP and MoE blocks do not shift anything; module docstring)."""
    for owner, name in RECOMPUTED_MM:
        linear = getattr(getattr(block, owner, None), name, None)
        if not isinstance(linear, nn.Linear):  # MoE block: no feed_forward.w3, selective's rule
            continue
        linear.register_forward_pre_hook(partial(_set_recompute, region, linear))
        linear.register_forward_hook(partial(_set_recompute, region, None))
        for adapter_name in ("lora_a", "lora_b"):  # the adapters' outputs stay saved
            adapter = getattr(linear, adapter_name, None)
            if isinstance(adapter, nn.Module):
                adapter.register_forward_pre_hook(partial(_set_recompute, region, None))
                adapter.register_forward_hook(partial(_set_recompute, region, linear))


def apply_activation_checkpointing(model: nn.Module, mode: str) -> None:
    """``mode``: ``train.activation_checkpointing`` (none, selective, selective_mm, full)."""
    if mode == "none":
        return
    if mode not in ("selective", "selective_mm", "full"):
        raise ValueError(f"train.activation_checkpointing: unknown mode {mode!r}; use none, selective, selective_mm or full")
    layers = model.layers
    for key in list(layers.keys()):
        block = layers[key]
        if mode == "full":
            layers[key] = checkpoint_wrapper(block, preserve_rng_state=False)
            continue
        region = _track_row_parallel(block)
        if mode == "selective_mm":
            _track_recomputed_mm(block, region)
        layers[key] = checkpoint_wrapper(block, preserve_rng_state=False, context_fn=partial(_selective_context, region))


def apply_compile(model: nn.Module) -> None:
    """Compile each transformer block in place (names stay unchanged, FSDP wraps them after)."""
    for block in model.layers.values():
        block.compile(fullgraph=False)
