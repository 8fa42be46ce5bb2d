"""Data parallelism by ``parallel.zero``.

- zero 2 and 3: FSDP2 ``fully_shard`` per transformer block and on the root, over the
  ``dp_shard_cp`` mesh (HSDP: the 2-D ``(dp_replicate, dp_shard_cp)`` mesh). zero 3 reshards
  parameters after forward (full ZeRO-3); zero 2 keeps them unsharded until backward is done
  (``reshard_after_forward=False``: gradients and optimizer states sharded, parameters gathered
  once per step). With PP > 1 parameters are never resharded after forward (zero-bubble
  schedules need them for the weight-gradient pass; CPU facts note, trap 3).
- zero 0 and 1: every rank holds full parameters and gradients are all-reduced (averaged) over
  all data- and context-parallel ranks, bucket by bucket during the last backward
  (:class:`~llmtrain.engine.parallel.grad_buckets.BucketedGradReducer`; :class:`GradientAllReduce`
  below is the previous post-backward path, kept for the benchmarks' before/after). We do not use
  ``DistributedDataParallel``/``replicate``: they do not accept the DTensor parameters that tensor
  parallelism creates, and one small, explicit code path serves TP and non-TP layouts alike.
  zero 1 additionally shards optimizer states (:mod:`llmtrain.engine.parallel.zero1`).

bf16: ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` keeps fp32 master weights
and fp32 gradient reduction (FSDP); for zero 0/1 the trainer runs the forward under autocast
and reduces the fp32 gradients (:mod:`llmtrain.engine.parallel.grad_buckets`).

Stacked expert weights (``GroupedExperts`` ``w1``/``w3`` [E, F, H], ``w2`` [E, H, F]) are sharded
on dim 0 like every parameter when their expert count (``E / ep`` on a rank) divides the shard
count; otherwise FSDP2's ``torch.chunk`` split of dim 0 is uneven (Mixtral's 8 experts at ep 8 and
edp 4: the first rank of each expert-DP group held the expert and three held nothing), so they
are sharded on their hidden dimension H instead (``shard_placement_fn``; FSDP2 requires an even
split there, and H is never split by expert-TP, which splits F), and stay on dim 0 if H does not
divide either. :func:`expert_placement` is the rule; the planner follows it
(``plan/dp_shards.py``, ``fsdp_numel``).

``parallel.reduce_dtype: bf16`` sets ``MixedPrecisionPolicy.reduce_dtype=bf16``. In torch 2.13
this is real also with fp32 parameters: ``FSDPParam.init_dtype_attrs`` clamps ``reduce_dtype``
to None only when it equals ``param_dtype`` (None for fp32 compute), so the fp32 gradients are
cast to bf16 for the reduce-scatter (and HSDP's all-reduce) and the sharded result is cast back
to the fp32 parameters' dtype (``foreach_reduce``). The expert unit (EP) takes the same policy.

Prefetch (zero 3, where parameters are resharded after forward): each block's unit is told to
all-gather the next block's parameters at its own pre-forward, and in backward the previous
block's, one unit ahead (``set_modules_to_forward_prefetch`` / ``set_modules_to_backward_prefetch``),
so the gather is issued before it is needed instead of when the module runs. **Not adopted**
(:data:`PREFETCH` is False): measured on CPU/gloo in benchmarks/parallel_overheads.py
(docs/benchmarks.md, zero 3 dp 2), it did not help — exposed communication 0.118 s with vs
0.059 s without, step time within noise (1.04x) — since FSDP2 already prefetches one unit ahead
in backward implicitly, and on CPU its all-gathers run on the same cores as compute. The
benchmark's worker turns it on for its comparison row; re-measure on GPUs before enabling.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

from llmtrain.engine.models.grouped_experts import GroupedExperts
from llmtrain.recipe.schema import bf16_compute


PREFETCH = False  # explicit one-unit-ahead prefetch (zero 3): not adopted, see the module docstring


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, zero: int, pp_enabled: bool, precision: str,
               expert_mesh: DeviceMesh | None = None, reduce_dtype: str = "fp32") -> None:
    """FSDP2 per block and on the root; with EP the experts get their own FSDP unit on the
    expert-data-parallel mesh first (the block's unit then skips their parameters)."""
    reshard = zero == 3 and not pp_enabled
    bf16 = bf16_compute(precision)
    reduce = torch.bfloat16 if reduce_dtype == "bf16" else (torch.float32 if bf16 else None)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else None, reduce_dtype=reduce)
    layers = getattr(model, "layers", None)
    blocks = []
    if layers is not None:
        for block in layers.values():
            experts = getattr(getattr(block, "moe", None), "experts", None)
            if expert_mesh is not None and experts is not None:
                fully_shard(experts, mesh=expert_mesh, reshard_after_forward=reshard, mp_policy=mp,
                            shard_placement_fn=expert_placement(experts, _shard_size(expert_mesh)))
            in_block = experts is not None and expert_mesh is None  # no EP: the experts are the block unit's
            place = expert_placement(experts, _shard_size(mesh)) if in_block else None
            fully_shard(block, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp, shard_placement_fn=place)
            blocks.append(block)
    if reshard and PREFETCH:
        for i, block in enumerate(blocks):
            if i + 1 < len(blocks):
                block.set_modules_to_forward_prefetch([blocks[i + 1]])
            if i > 0:
                block.set_modules_to_backward_prefetch([blocks[i - 1]])
    # The root wraps embeddings, final norm and output. It is never resharded after forward:
    # backward starts with the output layer, so a reshard would be gathered again at once.
    fully_shard(model, mesh=mesh, reshard_after_forward=False, mp_policy=mp)


def _shard_size(mesh: DeviceMesh) -> int:
    """Ranks a parameter is sharded over: the mesh, or its last (shard) dimension under HSDP."""
    return mesh.size(mesh.ndim - 1)


# dimension of each stacked expert weight that holds the model's hidden size H
EXPERT_HIDDEN_DIM = {"w1": 2, "w3": 2, "w2": 1}


def expert_placement(experts: GroupedExperts, shards: int):
    """FSDP2 ``shard_placement_fn`` for ``experts``' stacked weights over ``shards`` ranks: ``Shard(H's
    dim)`` where dim 0 (the rank's experts) would split unevenly and H evenly, else the default
    (None: ``Shard(0)``). Other parameters (a block's own) get the default."""
    hidden_dim = {id(getattr(experts, name)): d for name, d in EXPERT_HIDDEN_DIM.items()}

    def place(param: nn.Parameter) -> Shard | None:
        d = hidden_dim.get(id(param))
        if d is None:
            return None
        local = param.to_local() if isinstance(param, DTensor) else param  # [E / ep, ...] under EP
        if local.shape[0] % shards == 0 or local.shape[d] % shards != 0:
            return None
        return Shard(d)

    return place


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (the tensor itself otherwise)."""
    return t._local_tensor if isinstance(t, DTensor) else t


def local_grad(param: torch.Tensor) -> torch.Tensor | None:
    return None if param.grad is None else local_tensor(param.grad)


def in_param_layout(grad: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``grad`` in ``param``'s DTensor placements (DTensor's embedding backward returns the
    vocabulary-sharded weight's gradient Replicate; Replicate -> Shard is a local copy)."""
    if isinstance(grad, DTensor) and grad.placements != param.placements:
        return grad.redistribute(param.device_mesh, param.placements)
    return grad


class GradientAllReduce:
    """Average gradients over the data/context-parallel group (zero 0 and 1).

    Gradients are flattened into buckets of at most ``bucket_bytes`` and all-reduced with one
    collective per bucket (fewer, larger messages); tensor-parallel DTensor gradients are
    reduced through their local shards, which is exact because every DP rank holds the same
    TP shard layout.
    """

    def __init__(self, group: dist.ProcessGroup, size: int, bucket_bytes: int = 32 << 20):
        self.group, self.size, self.bucket_bytes = group, size, bucket_bytes

    def __call__(self, params: list[nn.Parameter]) -> None:
        if self.size == 1:
            return
        grads = [g for g in (local_grad(p) for p in params) if g is not None]
        bucket: list[torch.Tensor] = []
        nbytes = 0
        for g in grads:
            bucket.append(g)
            nbytes += g.numel() * g.element_size()
            if nbytes >= self.bucket_bytes:
                self._reduce(bucket)
                bucket, nbytes = [], 0
        if bucket:
            self._reduce(bucket)

    def _reduce(self, bucket: list[torch.Tensor]) -> None:
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for g in bucket:
            by_dtype.setdefault(g.dtype, []).append(g)
        for tensors in by_dtype.values():
            flat = torch.cat([t.reshape(-1) for t in tensors])
            dist.all_reduce(flat, group=self.group)
            flat /= self.size
            offset = 0
            for t in tensors:
                n = t.numel()
                t.copy_(flat[offset:offset + n].view_as(t))
                offset += n
