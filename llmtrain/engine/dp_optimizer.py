"""Optimizer and gradient synchronization for the chosen data-parallel mode.

- FSDP (zero 2/3): gradients are reduce-scattered by FSDP itself; one AdamW over the shards.
- zero 0/1: gradients are averaged by :class:`GradSync` — dense weights over all
  data/context-parallel ranks, routed-expert weights (with EP) only over the ranks holding the
  same experts (expert-DP), each set by its own :class:`BucketedGradReducer` (buckets of
  ``parallel.dp_bucket_mb`` started during the last micro batch's backward, in
  ``parallel.reduce_dtype``). zero 1 shards AdamW states the same way, one
  :class:`ZeRO1Optimizer` per group of ranks. ZeRO-1 still all-reduces the whole gradient (not a
  reduce-scatter to the owners): clipping takes the norm of the full, identical gradients on
  every rank (parallel/clip.py), and the owners' broadcast then spreads the updated weights.

``parallel.grad_compression`` (powersgd, topk) replaces each set's reducer by the compressed one
of :mod:`llmtrain.engine.parallel.compression` (run at the call, after the whole backward and,
under PP, after the schedule's ``1 / n``: nothing is armed, it has no ``expect_backwards``).

``build_optimizer(..., overlap=False)`` selects the previous post-backward path
(:class:`GradientAllReduce`, 32 MiB buckets in forward order, started after backward); it is
kept for the before/after measurement of benchmarks/parallel_overheads.py.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from torch.distributed.pipelining.schedules import PipelineScheduleSingle, _ComputationType

from llmtrain.engine.mesh import Meshes
from llmtrain.engine.optim import is_expert_param, make_adamw, param_groups
from llmtrain.engine.parallel.compression import build_reducer
from llmtrain.engine.parallel.compression_state import attach
from llmtrain.engine.parallel.data_parallel import GradientAllReduce
from llmtrain.engine.parallel.grad_buckets import BucketedGradReducer
from llmtrain.engine.parallel.zero1 import ZeRO1Optimizer
from llmtrain.engine.parallelize import ModelParts
from llmtrain.plan.comm import powersgd_start
from llmtrain.recipe.schema import Recipe


class CombinedOptimizer:
    """Several optimizers stepped as one (dense and expert ZeRO-1 groups)."""

    def __init__(self, optimizers: list):
        self.optimizers = optimizers
        self.param_groups = [g for o in optimizers for g in o.param_groups]

    def step(self) -> None:
        for o in self.optimizers:
            o.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)


class GradSync:
    """The trainer's ``grad_sync``: one reducer per group of ranks (dense, and expert with EP).

    ``expect_backwards(n, schedule)`` before a step's forward/backward arms the overlap (n =
    micro batches; ``schedule``: the torch pipeline schedule under PP, whose ``1 / n`` is
    accounted for, see parallel/grad_buckets.py); calling it waits for every reduction and
    leaves averaged gradients. Without the arming call (other callers) every bucket starts at
    the call.

    Multi-stage schedules (interleaved, zero-bubble, V-shaped) run torch's
    ``_PipelineScheduleRuntime``; its ``REDUCE_GRAD`` action (one per stage, right after the
    stage's last backward) is replaced, once per schedule, by torch's own
    ``perform_reduce_grad`` followed by :meth:`BucketedGradReducer.stage_done`, so that a stage
    whose weight gradients no hook reports (zero-bubble's weight pass) still starts its buckets
    before the schedule ends. A schedule type without that API (another torch version) keeps
    the post-backward path: nothing is armed, every bucket starts at the call."""

    def __init__(self, reducers: list):
        self.reducers = reducers

    def expect_backwards(self, n: int, schedule=None) -> None:
        """Arm for ``n`` backward passes; ``schedule``: the PP schedule object (None without PP)."""
        rescale = 1
        if schedule is not None:
            if not (isinstance(schedule, PipelineScheduleSingle) or self._attach(schedule)):
                return  # post-backward path (the docstring)
            rescale = n if getattr(schedule, "scale_grads", True) else 1
        for r in self.reducers:
            if hasattr(r, "expect_backwards"):
                r.expect_backwards(n, rescale)

    def _attach(self, schedule) -> bool:
        """Route ``schedule``'s per-stage REDUCE_GRAD through the reducers' ``stage_done``; False
        when the schedule has no such action to hook."""
        if getattr(schedule, "_llmtrain_grad_sync", None) is self:
            return True
        reduce_grad = getattr(_ComputationType, "REDUCE_GRAD", None)
        if reduce_grad is None or not hasattr(schedule, "register_custom_function"):
            return False
        stages = {s.stage_index: s for s in schedule._stages}

        def on_reduce_grad(action, _ctx) -> None:
            stage = stages[action.stage_index]  # torch's own REDUCE_GRAD first (the 1 / n), then ours
            stage.perform_reduce_grad(schedule._n_microbatches if schedule.scale_grads else 1)
            for r in self.reducers:
                if hasattr(r, "stage_done"):
                    r.stage_done(action.stage_index)

        schedule.register_custom_function(reduce_grad, on_reduce_grad)
        schedule._llmtrain_grad_sync = self  # attached once (a marker on the schedule, not an id)
        return True

    def __call__(self, _params=None) -> None:
        for r in self.reducers:
            r()


def registration_order(parts: ModelParts, params: list) -> tuple[list, list[int]]:
    """``params`` in the order the model parts register them (the buckets take it reversed),
    and the pipeline stage of each (buckets never span two stages)."""
    wanted = {id(p) for p in params}
    ordered = [(p, sid) for part, sid in zip(parts.parts, parts.stage_ids) for p in part.parameters() if id(p) in wanted]
    return [p for p, _ in ordered], [sid for _, sid in ordered]


def build_optimizer(parts: ModelParts, recipe: Recipe, meshes: Meshes, fsdp: bool,
                    overlap: bool = True) -> tuple[object, Callable | None]:
    t, wd = recipe.train, recipe.train.optimizer.weight_decay
    make = make_adamw(t)
    ep = meshes.dims.ep > 1
    dense = [g for part in parts.parts for g in param_groups(part, wd, select=lambda n: not (ep and is_expert_param(n)))]
    expert = [g for part in parts.parts for g in param_groups(part, wd, select=is_expert_param)] if ep else []
    if fsdp:
        return make(dense + expert), None

    dp_group, dp_size = meshes.dp_cp.get_group(), meshes.dp_cp.size()
    edp_group = meshes.edp_group() if ep else None
    edp_size = meshes.dims.dp_replicate * meshes.dims.edp
    sets = [(dp_group, dp_size, [p for g in dense for p in g["params"]])]
    if ep:
        sets.append((edp_group, edp_size, [p for g in expert for p in g["params"]]))
    compression = recipe.parallel.grad_compression
    if compression != "none":  # PowerSGD / top-k at the step's end, no overlap (parallel/compression.py)
        grad_sync = GradSync([build_reducer(compression, registration_order(parts, ps)[0], g, n, recipe.parallel,
                                            seed=recipe.train.seed + k, start_step=powersgd_start(recipe))
                              for k, (g, n, ps) in enumerate(sets)])
    elif overlap:
        bucket = int(recipe.parallel.dp_bucket_mb * 2**20)
        rdtype = torch.bfloat16 if recipe.parallel.reduce_dtype == "bf16" else None
        reducers = []
        for g, n, ps in sets:
            ordered, stages = registration_order(parts, ps)
            reducers.append(BucketedGradReducer(ordered, g, n, bucket, rdtype, stages=stages))
        grad_sync = GradSync(reducers)
    else:  # the post-backward path (benchmarks' "before")
        grad_sync = GradSync([partial(GradientAllReduce(g, n), ps) for g, n, ps in sets])

    if recipe.parallel.zero == 1:
        import torch.distributed as dist

        optimizers = [ZeRO1Optimizer(dense, make, dp_group, dist.get_rank(dp_group), dp_size)] if dense else []
        if expert:
            optimizers.append(ZeRO1Optimizer(expert, make, edp_group, dist.get_rank(edp_group), edp_size))
        optimizer = CombinedOptimizer(optimizers)
    else:
        optimizer = make(dense + expert)
    if compression != "none":  # their state is checkpointed with the optimizer's (parallel/compression_state.py)
        attach(optimizer, grad_sync.reducers)
    return optimizer, grad_sync
