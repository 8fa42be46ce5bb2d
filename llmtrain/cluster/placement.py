"""Node placement: which node and local rank each global rank lands on.

Ranks fill nodes in hostfile order (node 0 gets ranks ``0..slots0-1``), which is what
``torchrun`` does with ``--node-rank`` in hostfile order. Because TP is the innermost mesh
dimension, a TP group stays inside one node whenever ``tp`` divides the node's slot count.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass
from functools import cached_property
from itertools import accumulate


@dataclass(frozen=True)
class Node:
    host: str
    slots: int


@dataclass(frozen=True)
class Placement:
    nodes: tuple[Node, ...]

    @classmethod
    def uniform(cls, nodes: int, gpus_per_node: int) -> Placement:
        return cls(tuple(Node(f"node{i}", gpus_per_node) for i in range(nodes)))

    @cached_property
    def world_size(self) -> int:
        # Cached: validate() and the layout search ask for it many times at 2,048+ nodes.
        return sum(n.slots for n in self.nodes)

    @cached_property
    def distinct_slots(self) -> tuple[int, ...]:
        """The different per-node GPU counts, sorted (validation only needs these, not 2,048 nodes)."""
        return tuple(sorted({n.slots for n in self.nodes}))

    @cached_property
    def first_ranks(self) -> list[int]:
        # Cached: node_of() bisects it for every rank of a group (O(nodes) per call otherwise).
        return [0, *accumulate(n.slots for n in self.nodes)][:-1]

    def node_of(self, rank: int) -> int:
        return bisect_right(self.first_ranks, rank) - 1

    def local_rank(self, rank: int) -> int:
        return rank - self.first_ranks[self.node_of(rank)]

    def spans_nodes(self, ranks: list[int]) -> bool:
        return len({self.node_of(r) for r in ranks}) > 1
