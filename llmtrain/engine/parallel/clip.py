"""Gradient clipping with the true global norm across every mesh dimension.

Gradients come in three kinds: FSDP/TP DTensors (possibly on different meshes: a norm weight
is sharded by FSDP only, an attention weight by FSDP and TP), and plain tensors that are
already identical across data-parallel ranks (zero 0/1 after the all-reduce). For each DTensor
we take the norm of the DTensor (a Partial/Replicate DTensor that accounts for its shards) and
materialize it, grouped by (mesh, placements) so that each group costs one reduction.
Plain tensors contribute their local norm. With pipeline parallelism each stage only holds its
own parameters, so the squared norms are summed over the ``pp`` group as well. ``skip`` names
parameters whose gradient is already counted on this or another rank (the last stage's copy of a
tied embedding under PP, :mod:`.tied`): left out of the norm, but scaled like every other.
torch's ``clip_grad_norm_`` cannot mix DTensors of different meshes, hence this function.
"""

from __future__ import annotations

from collections.abc import Collection

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


@torch.no_grad()
def global_grad_norm(params: list[torch.Tensor], pp_group: dist.ProcessGroup | None = None,
                     skip: Collection[torch.Tensor] = ()) -> torch.Tensor:
    skipped = {id(p) for p in skip}
    grads = [p.grad for p in params if p.grad is not None and id(p) not in skipped]
    groups: dict[tuple, list[torch.Tensor]] = {}
    plain: list[torch.Tensor] = []
    for g in grads:
        if isinstance(g, DTensor):
            groups.setdefault((id(g.device_mesh), g.placements), []).append(g)
        else:
            plain.append(g)
    device = grads[0].device if grads else torch.device("cpu")
    total_sq = torch.zeros((), dtype=torch.float32, device=device)
    for tensors in groups.values():
        norm = torch.nn.utils.get_total_norm(tensors, norm_type=2.0)
        norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
        total_sq += norm.float().to(device) ** 2
    for g in plain:
        total_sq += g.float().norm() ** 2
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        dist.all_reduce(total_sq, group=pp_group)
    return total_sq.sqrt()


@torch.no_grad()
def clip_grads(params: list[torch.Tensor], max_norm: float, pp_group: dist.ProcessGroup | None = None,
               skip: Collection[torch.Tensor] = ()) -> torch.Tensor:
    norm = global_grad_norm(params, pp_group, skip)
    if max_norm > 0:
        coef = min(1.0, max_norm / (norm.item() + 1e-6))
        if coef < 1.0:
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(coef)
    return norm
