"""Expert parallelism: routed experts split over the ``ep`` ranks, tokens moved by all-to-all.

EP borrows ranks from ``dp_shard x cp`` (design note; :mod:`llmtrain.plan.dims`): the expert
weights ``w1/w2/w3`` [E, ...] become DTensors sharded on dim 0 over the ``ep`` mesh (each rank
owns ``E / ep`` consecutive experts) and are data-parallel over the ``edp = dp_shard x cp / ep``
ranks holding the same experts (FSDP on the ``edp`` mesh, or gradient all-reduce over it for
zero 0/1). Router and shared experts stay ordinary dense weights, data-parallel over all ranks.

Dispatch (:class:`AllToAllDispatcher`): each rank routes its own tokens; the rows, already
grouped by global expert id (so by owning rank), are exchanged with one uneven
``all_to_all_single`` (autograd version from ``_functional_collectives``; gloo accepts uneven
splits only in this form, CPU facts note trap 4). Received rows arrive ordered by (source rank,
local expert); they are regrouped by local expert, run through the local experts (a loop on
CPU), put back in source order and returned with the reverse all-to-all. Per-expert counts are
exchanged first with a small even all-to-all. Token dropping by capacity happens before dispatch,
on each rank's own tokens, exactly as without EP.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor

from llmtrain.engine.models.moe import GroupedExperts


class AllToAllDispatcher:
    def __init__(self, group: dist.ProcessGroup, ep: int, num_experts: int):
        self.group, self.ep, self.local_experts = group, ep, num_experts // ep

    def __call__(self, experts: GroupedExperts, x_grouped: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        ep, el = self.ep, self.local_experts
        send_counts = counts.reshape(ep, el).contiguous()  # rows for (destination rank, its local expert)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)  # [source rank, my local expert]
        in_splits = send_counts.sum(1).tolist()
        out_splits = recv_counts.sum(1).tolist()
        # waited at once, while the (temporary) send buffers are alive: see parallel/context.py
        received = wait_tensor(all_to_all_single_autograd(x_grouped.contiguous(), out_splits, in_splits, self.group))
        perm = _regroup_by_expert(recv_counts)
        y = experts.local_forward(received.index_select(0, perm), recv_counts.sum(0).tolist())
        y_source_order = y.index_select(0, torch.argsort(perm))
        return wait_tensor(all_to_all_single_autograd(y_source_order.contiguous(), in_splits, out_splits, self.group))


def _regroup_by_expert(recv_counts: torch.Tensor) -> torch.Tensor:
    """Row order that turns (source, expert)-ordered rows into (expert, source)-ordered rows."""
    flat = recv_counts.reshape(-1)
    starts = (torch.cumsum(flat, 0) - flat).reshape(recv_counts.shape)
    ep, el = recv_counts.shape
    pieces = [torch.arange(int(starts[s, e]), int(starts[s, e] + recv_counts[s, e])) for e in range(el) for s in range(ep)]
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long)


def apply_expert_parallel(model: nn.Module, ep_mesh: DeviceMesh) -> None:
    """Shard every MoE's experts over ``ep_mesh`` (dim 0) and install the all-to-all dispatcher."""
    group, ep = ep_mesh.get_group(), ep_mesh.size()
    for module in model.modules():
        if isinstance(module, GroupedExperts):
            for name in ("w1", "w2", "w3"):
                param = getattr(module, name)
                module.register_parameter(name, nn.Parameter(distribute_tensor(param, ep_mesh, [Shard(0)])))
            module.dispatcher = AllToAllDispatcher(group, ep, module.w1.shape[0])
            module.grad_scale = 1.0 / ep  # see GradScale: the mean over all data ranks
