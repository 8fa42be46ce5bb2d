"""Which link a collective runs on, and its time there under time model v1 (``comm.py``'s volumes use
these; time model v2 re-times every collective in ``commtime.py``): NVLink inside a node, the
inter-node network across, at ``LINK_EFFICIENCY`` of the datasheet bandwidth, ring-style volume
factors by collective (``FACTOR``) and a latency per algorithm step."""

from __future__ import annotations

from dataclasses import dataclass
from math import ceil, log2

from llmtrain.cluster.placement import Placement
from llmtrain.plan.dims import MESH_DIMS, ParallelDims
from llmtrain.recipe.gpus import GPUSpec

LINK_EFFICIENCY = 0.8  # NCCL bus bandwidth / link bandwidth for large messages (nccl-tests on DGX)
LATENCY_S = {"nvlink": 5e-6, "network": 15e-6}  # per algorithm step


@dataclass(frozen=True)
class Link:
    kind: str  # "nvlink" or "network"
    bandwidth: float  # bytes/s NCCL reaches, one direction


def link(gpu: GPUSpec, spans_nodes: bool) -> Link:
    if spans_nodes:
        return Link("network", gpu.internode_bytes_per_s * LINK_EFFICIENCY)
    return Link("nvlink", gpu.nvlink_bytes_per_s / 2 * LINK_EFFICIENCY)


FACTOR = {
    "all-reduce": lambda n: 2 * (n - 1) / n,
    "all-gather": lambda n: (n - 1) / n,
    "reduce-scatter": lambda n: (n - 1) / n,
    "all-to-all": lambda n: (n - 1) / n,
    "broadcast": lambda n: (n - 1) / n,
    "p2p": lambda n: 1.0,
}


def collective_time(op: str, message: float, n: int, lk: Link) -> float:
    """Seconds for one collective of ``message`` bytes over ``n`` ranks on ``lk``."""
    if n <= 1 or message <= 0:
        return 0.0
    steps = 1 if op == "p2p" else ceil(log2(n)) * (2 if op == "all-reduce" else 1)
    return FACTOR[op](n) * message / lk.bandwidth + steps * LATENCY_S[lk.kind]


# ---- which link ------------------------------------------------------------------------------------
def spans_nodes_fast(dims: ParallelDims, placement: Placement, names: tuple[str, ...]) -> bool:
    """Whether rank 0's group over ``names`` crosses nodes, from its largest member: ranks fill
    nodes in order, so the group (which contains rank 0) leaves node 0 iff its largest rank does."""
    shape = dims.mesh_shape
    stride, largest = 1, 0
    for i in reversed(range(len(MESH_DIMS))):
        if MESH_DIMS[i] in names:
            largest += (shape[i] - 1) * stride
        stride *= shape[i]
    return largest >= placement.nodes[0].slots


def ep_group_leaves_node(ep: int, tp: int, node_slots: int) -> bool:
    """Whether rank 0's EP group reaches past node 0 (``node_slots`` GPUs). Its members are the
    first ``ep`` of the dp_shard x cp grid, ``tp`` ranks apart: member ``j`` is rank
    ``(j // cp) * cp * tp + (j % cp) * tp = j * tp``, so the last is ``(ep - 1) * tp``."""
    return (ep - 1) * tp >= node_slots


def spans_nodes_ep_fast(dims: ParallelDims, placement: Placement) -> bool:
    return ep_group_leaves_node(dims.ep, dims.tp, placement.nodes[0].slots)


def spans_nodes(dims: ParallelDims, placement: Placement, names: tuple[str, ...] | str, fast: bool = False) -> bool:
    names = (names,) if isinstance(names, str) else tuple(names)
    if names == ("ep",):
        if fast:
            return spans_nodes_ep_fast(dims, placement)
        return placement.spans_nodes(dims.ep_group(0))
    if fast:
        return spans_nodes_fast(dims, placement, names)
    return placement.spans_nodes(dims.group(0, names))
