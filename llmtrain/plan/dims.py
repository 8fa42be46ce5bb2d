"""ParallelDims: the 5D degrees and the rank <-> coordinate map shared by ``plan`` and the engine.

Mesh order, outer to inner: ``pp, dp_replicate, dp_shard, cp, tp`` (row-major, so TP groups are
consecutive ranks inside a node and PP stages are the farthest apart). The engine builds its
DeviceMesh with exactly :attr:`ParallelDims.mesh_shape` and :data:`MESH_DIMS`, so the layout
``llmtrain plan`` prints is the layout that runs.

Expert parallelism borrows ranks instead of multiplying them (as in torchtitan and
Megatron-Core): the ``dp_shard x cp`` ranks of one (pp, dp_replicate, tp) slice are flattened
(``dp_shard`` outer, ``cp`` inner) and cut into consecutive blocks of ``ep``. Each block is one
expert-parallel group (experts are split over it); ranks at the same position in different
blocks form the expert-data-parallel group (``edp = dp_shard x cp / ep``) over which each
expert's weights are data-parallel.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

MESH_DIMS: tuple[str, ...] = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


@dataclass(frozen=True)
class ParallelDims:
    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1

    # ---- degrees -------------------------------------------------------------------------
    @property
    def mesh_shape(self) -> tuple[int, ...]:
        return tuple(getattr(self, name) for name in MESH_DIMS)

    @property
    def world_size(self) -> int:
        return prod(self.mesh_shape)

    @property
    def dp(self) -> int:
        """Data-parallel degree: the number of distinct batch slices."""
        return self.dp_replicate * self.dp_shard

    @property
    def edp(self) -> int:
        """Expert-data-parallel degree: ranks holding the same experts within one slice."""
        return self.dp_shard * self.cp // self.ep

    def degree(self, name: str) -> int:
        return getattr(self, name)

    # ---- rank <-> coordinates ---------------------------------------------------------------
    def coords(self, rank: int) -> tuple[int, ...]:
        """Coordinates of ``rank`` in :data:`MESH_DIMS` order."""
        if not 0 <= rank < self.world_size:
            raise IndexError(f"rank {rank} outside world of {self.world_size}")
        out = []
        for size in reversed(self.mesh_shape):
            out.append(rank % size)
            rank //= size
        return tuple(reversed(out))

    def coord_dict(self, rank: int) -> dict[str, int]:
        return dict(zip(MESH_DIMS, self.coords(rank)))

    def rank_of(self, coords: tuple[int, ...] | list[int]) -> int:
        rank = 0
        for value, size in zip(coords, self.mesh_shape):
            rank = rank * size + value
        return rank

    # ---- groups -----------------------------------------------------------------------------
    def group(self, rank: int, dims: tuple[str, ...] | str) -> list[int]:
        """Ranks that share every coordinate of ``rank`` except those in ``dims``."""
        dims = (dims,) if isinstance(dims, str) else dims
        base = list(self.coords(rank))
        free = [MESH_DIMS.index(d) for d in dims]
        shape = self.mesh_shape  # a property that builds a tuple: hoisted out of the loop
        ranks = []
        for flat in range(prod(shape[i] for i in free)):
            for i in reversed(free):
                base[i] = flat % shape[i]
                flat //= shape[i]
            ranks.append(self.rank_of(base))
        return sorted(ranks)

    def groups(self, dims: tuple[str, ...] | str) -> list[list[int]]:
        """Every group of ``dims`` (each rank in exactly one), ordered by first rank."""
        seen: set[int] = set()
        out = []
        for rank in range(self.world_size):
            if rank not in seen:
                members = self.group(rank, dims)
                seen.update(members)
                out.append(members)
        return out

    # ---- expert parallelism -----------------------------------------------------------------
    def _dpcp_index(self, rank: int) -> int:
        c = self.coord_dict(rank)
        return c["dp_shard"] * self.cp + c["cp"]

    def ep_rank(self, rank: int) -> int:
        return self._dpcp_index(rank) % self.ep

    def ep_group(self, rank: int) -> list[int]:
        """The expert-parallel group of ``rank`` (experts are split over these ranks)."""
        members = self.group(rank, ("dp_shard", "cp"))  # sorted == dpcp-index order
        block = self._dpcp_index(rank) // self.ep
        return members[block * self.ep:(block + 1) * self.ep]

    def edp_group(self, rank: int) -> list[int]:
        """Ranks holding the same experts as ``rank`` in its (pp, dp_replicate, tp) slice."""
        members = self.group(rank, ("dp_shard", "cp"))
        return members[self.ep_rank(rank)::self.ep]
