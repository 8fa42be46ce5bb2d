"""Optimizer and gradient synchronization for the chosen data-parallel mode.

- FSDP (zero 2/3): gradients are reduce-scattered by FSDP itself; one AdamW over the shards.
- zero 0/1: gradients are averaged by :class:`GradientAllReduce` — dense weights over all
  data/context-parallel ranks, routed-expert weights (with EP) only over the ranks holding the
  same experts (expert-DP). zero 1 shards AdamW states the same way, one
  :class:`ZeRO1Optimizer` per group of ranks.
"""

from __future__ import annotations

from collections.abc import Callable

from llmtrain.engine.mesh import Meshes
from llmtrain.engine.optim import is_expert_param, make_adamw, param_groups
from llmtrain.engine.parallel.data_parallel import GradientAllReduce
from llmtrain.engine.parallel.zero1 import ZeRO1Optimizer
from llmtrain.engine.parallelize import ModelParts
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


def build_optimizer(parts: ModelParts, recipe: Recipe, meshes: Meshes, fsdp: bool) -> tuple[object, Callable | None]:
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
    syncs = [(GradientAllReduce(dp_group, dp_size), [p for g in dense for p in g["params"]])]
    if ep:
        syncs.append((GradientAllReduce(edp_group, edp_size), [p for g in expert for p in g["params"]]))

    def grad_sync(_params=None) -> None:
        for sync, params in syncs:
            sync(params)

    if recipe.parallel.zero == 1:
        import torch.distributed as dist

        optimizers = [ZeRO1Optimizer(dense, make, dp_group, dist.get_rank(dp_group), dp_size)] if dense else []
        if expert:
            optimizers.append(ZeRO1Optimizer(expert, make, edp_group, dist.get_rank(edp_group), edp_size))
        return CombinedOptimizer(optimizers), grad_sync
    return make(dense + expert), grad_sync
