"""ZeRO-1: optimizer states sharded over data-parallel ranks, parameters and gradients full.

Each rank owns a subset of the parameters (greedy by size, in a fixed order, so every rank
computes the same assignment), keeps AdamW states only for those, steps them, and then the
owners broadcast the updated values (one flattened broadcast per owner). Written here rather
than using ``torch.distributed.optim.ZeroRedundancyOptimizer`` because that class assumes plain
tensors and a DDP model; ours must also take tensor-parallel DTensor parameters, whose local
shards are what each owner updates and broadcasts within its DP group (every DP rank holds the
same TP shard). With HSDP-like ``dp_replicate > 1`` the states are sharded over all DP ranks.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from llmtrain.engine.parallel.data_parallel import local_tensor


def partition(params: list[nn.Parameter], size: int) -> list[int]:
    """Owner rank (0..size-1) of each parameter: largest first onto the least-loaded rank."""
    load = [0] * size
    owner = [0] * len(params)
    for i in sorted(range(len(params)), key=lambda i: (-local_tensor(params[i]).numel(), i)):
        rank = min(range(size), key=lambda r: (load[r], r))
        owner[i] = rank
        load[rank] += local_tensor(params[i]).numel()
    return owner


class ZeRO1Optimizer:
    """Wraps an optimizer factory so that each rank only builds and steps its own parameters."""

    def __init__(self, param_groups: list[dict], make: Callable[[list[dict]], torch.optim.Optimizer],
                 group: dist.ProcessGroup, rank: int, size: int):
        self.group, self.rank, self.size = group, rank, size
        self.params = [p for g in param_groups for p in g["params"]]
        self.owner = partition(self.params, size)
        owned = {id(p) for p, o in zip(self.params, self.owner) if o == rank}
        mine = [{**g, "params": [p for p in g["params"] if id(p) in owned]} for g in param_groups]
        mine = [g for g in mine if g["params"]]
        self.inner = make(mine) if mine else None
        # the lr schedule writes to every group of param_groups, owned or not
        self.param_groups = self.inner.param_groups if self.inner else [dict(g, params=[]) for g in param_groups]

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        if self.inner is not None:
            self.inner.step()
        for owner in range(self.size):
            tensors = [local_tensor(p) for p, o in zip(self.params, self.owner) if o == owner]
            if not tensors:
                continue
            flat = torch.cat([t.reshape(-1) for t in tensors])
            dist.broadcast(flat, group=self.group, group_src=owner)
            offset = 0
            for t in tensors:
                t.copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()

    def state_dict(self) -> dict:
        return self.inner.state_dict() if self.inner else {}

    def load_state_dict(self, state: dict) -> None:
        if self.inner:
            self.inner.load_state_dict(state)
