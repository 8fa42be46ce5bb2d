"""One named DeviceMesh for every rank, built from the recipe's :class:`ParallelDims`.

The root mesh has the five dimensions of :data:`llmtrain.plan.dims.MESH_DIMS` in that order
(size-1 dimensions included), so rank ``r``'s mesh coordinates are exactly
``ParallelDims.coords(r)`` — what ``llmtrain plan`` prints. Derived (flattened) meshes:

- ``dp_shard_cp``: FSDP shards over data-parallel and context-parallel ranks together (CP
  ranks hold the same weights and see different tokens of the same samples), as torchtitan.
- ``dp_cp``: every rank that holds a replica or shard of the same weights and sees different
  tokens: gradients and the logged loss are averaged over it.
- with EP, a second root ``(pp, dp_replicate, edp, ep, tp)`` over the same ranks (``dp_shard x cp``
  re-cut as ``edp x ep``, EP inner, exactly :meth:`ParallelDims.ep_group`): experts are sharded
  over ``ep`` and data-parallel over ``edp``.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from llmtrain.plan.dims import MESH_DIMS, ParallelDims


@dataclass
class Meshes:
    dims: ParallelDims
    root: DeviceMesh
    dp_shard_cp: DeviceMesh  # 1-D
    dp_cp: DeviceMesh  # 1-D, all data/context-parallel ranks
    ep_root: DeviceMesh | None = None  # (pp, dp_replicate, edp, ep, tp) when ep > 1

    @property
    def ep(self) -> DeviceMesh:
        return self.ep_root["ep"]

    def edp_fsdp_mesh(self) -> DeviceMesh:
        """FSDP mesh of the expert weights: edp, or (dp_replicate, edp) with HSDP."""
        return self.ep_root["dp_replicate", "edp"] if self.dims.dp_replicate > 1 else self.ep_root["edp"]

    def edp_group(self):
        """Ranks holding the same experts: gradients of expert weights are averaged over them."""
        return self.ep_root["dp_replicate", "edp"]._flatten("edp_full").get_group()

    @property
    def tp(self) -> DeviceMesh:
        return self.root["tp"]

    @property
    def pp(self) -> DeviceMesh:
        return self.root["pp"]

    @property
    def cp(self) -> DeviceMesh:
        return self.root["cp"]

    def fsdp_mesh(self) -> DeviceMesh:
        """1-D (dp_shard_cp) mesh for FSDP, or 2-D (dp_replicate, dp_shard_cp) for HSDP."""
        if self.dims.dp_replicate > 1:
            return hsdp_mesh(self)
        return self.dp_shard_cp


def build_meshes(dims: ParallelDims, device_type: str) -> Meshes:
    root = init_device_mesh(device_type, dims.mesh_shape, mesh_dim_names=MESH_DIMS)
    dp_shard_cp = root["dp_shard", "cp"]._flatten("dp_shard_cp")
    dp_cp = root["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp")
    ep_root = None
    if dims.ep > 1:
        # The same ranks in the same row-major order, with (dp_shard, cp) re-cut as (edp, ep):
        # a second root mesh, so that expert DTensors (ep) and their FSDP mesh (edp) share a root.
        shape = (dims.pp, dims.dp_replicate, dims.edp, dims.ep, dims.tp)
        ep_root = init_device_mesh(device_type, shape, mesh_dim_names=("pp", "dp_replicate", "edp", "ep", "tp"))
    return Meshes(dims, root, dp_shard_cp, dp_cp, ep_root)


def hsdp_mesh(meshes: Meshes) -> DeviceMesh:
    """(dp_replicate, dp_shard_cp). With cp == 1 it is a plain slice of the root mesh;
    otherwise the flattened dim is sliced from the root, which torch 2.13 still supports
    (with a deprecation warning that we silence: there is no other way to get this 2-D mesh)."""
    if meshes.dims.cp == 1:
        return meshes.root["dp_replicate", "dp_shard"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return meshes.root["dp_replicate", "dp_shard_cp"]
