"""One named DeviceMesh for every rank, built from the recipe's :class:`ParallelDims`.

The root mesh has the five dimensions of :data:`llmtrain.plan.dims.MESH_DIMS` in that order
(size-1 dimensions included), so rank ``r``'s mesh coordinates are exactly
``ParallelDims.coords(r)`` — what ``llmtrain plan`` prints. Derived (flattened) meshes:

- ``dp_shard_cp``: FSDP shards over data-parallel and context-parallel ranks together (CP
  ranks hold the same weights and see different tokens of the same samples), as torchtitan.
- ``dp_cp``: every rank that holds a replica or shard of the same weights and sees different
  tokens: gradients and the logged loss are averaged over it.
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
    return Meshes(dims, root, dp_shard_cp, dp_cp)


def hsdp_mesh(meshes: Meshes) -> DeviceMesh:
    """(dp_replicate, dp_shard_cp). With cp == 1 it is a plain slice of the root mesh;
    otherwise the flattened dim is sliced from the root, which torch 2.13 still supports
    (with a deprecation warning that we silence: there is no other way to get this 2-D mesh)."""
    if meshes.dims.cp == 1:
        return meshes.root["dp_replicate", "dp_shard"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return meshes.root["dp_replicate", "dp_shard_cp"]
