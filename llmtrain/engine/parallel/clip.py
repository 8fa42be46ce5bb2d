"""Gradient clipping with the true global norm across every mesh dimension.

Gradients come in three kinds: FSDP/TP DTensors (possibly on different meshes: a norm weight
is sharded by FSDP only, an attention weight by FSDP and TP), and plain tensors that are
already identical across data-parallel ranks (zero 0/1 after the all-reduce). DTensors are taken
by their local shards: the squared norm of a group with the same (mesh, placements) is this
rank's share, summed over the mesh dimensions the group is sharded on (``Shard``, and FSDP's
``_StridedShard`` on a TP-sharded weight, which torch 2.13's ``is_shard()`` does not count) and
not over those it is replicated on. The shares of every group on one
mesh with the same sharded dimensions are added locally and all-reduced once per dimension.
torch's ``get_total_norm`` on the DTensors themselves costs a reduction per group and dimension
(``torch.stack`` of the partial norms makes DTensor materialise each one) and, on torch 2.13, a
warning on every rank of every TP x FSDP run that it reduced a 2-D partial with "2 sequential
all_reduce operations". A gradient still ``Partial`` (not reduced yet: no engine path leaves
one) keeps that route, the only correct one for it. Plain tensors contribute their local norm.
With pipeline parallelism each stage only holds its own parameters, so the squared norms are
summed over the ``pp`` group as well. ``skip`` names
parameters whose gradient is already counted on this or another rank (the last stage's copy of a
tied embedding under PP, :mod:`.tied`): left out of the norm, but scaled like every other.
torch's ``clip_grad_norm_`` cannot mix DTensors of different meshes, hence this function.
"""

from __future__ import annotations

from collections.abc import Collection

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
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
    shares: dict[tuple, tuple[DeviceMesh, torch.Tensor]] = {}  # (mesh, sharded dims) -> summed local squares
    for tensors in groups.values():
        placements = tensors[0].placements
        if any(p.is_partial() for p in placements):  # unreduced gradients (module docstring)
            total_sq += torch.nn.utils.get_total_norm(tensors, norm_type=2.0).full_tensor().float().to(device) ** 2
            continue
        dims = tuple(i for i, p in enumerate(placements) if not p.is_replicate())  # Shard, _StridedShard
        square = torch.nn.utils.get_total_norm([t.to_local() for t in tensors], norm_type=2.0).float().to(device) ** 2
        mesh = tensors[0].device_mesh
        key = (id(mesh), dims)
        shares[key] = (mesh, square + shares[key][1] if key in shares else square)
    for (_, dims), (mesh, square) in shares.items():  # parameter order: the same on every rank of a group
        for dim in dims:
            dist.all_reduce(square, group=mesh.get_group(dim))
        total_sq += square
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
