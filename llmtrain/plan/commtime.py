"""Time model v2 (``cluster.time_model: v2``): collective seconds from an alpha-beta model per link.

v1 (:func:`llmtrain.plan.comm.collective_time`) prices a collective on one link: NVLink inside a
node, or *one* NIC as soon as the group leaves the node. That is right for a group with one
member per node (data parallel over TP 8), and up to 8x too slow for a group with several
members per node (FSDP over 64 GPUs): NCCL builds one ring per NIC (channel), each node's
GPUs are consecutive on every ring, and each GPU is the node's exit of one ring, so the node's
traffic leaves through all of its NICs at once (NCCL, src/graph/tuning.cc: ring bus bandwidth =
channels x per-channel speed; nccl-tests PERFORMANCE.md: bus bandwidth).

Decisions (every constant's source is in docs/planner.md, "Time model v2"):

- **Bandwidth term** of a collective over ``n`` ranks with ``local`` of them per node (the
  group's members on one node; ``n`` when it does not leave the node): each rank sends
  ``FACTOR[op](n) x M`` (the bus-bandwidth volume, as v1). Inside a node all of it goes over
  NVLink. Across nodes a ``(local - 1) / local`` share of each ring's hops is NVLink and
  ``1 / local`` the NIC; the two links run at once, so the time is the slower of
  ``(local-1)/local x V / nvlink`` and ``V / (local x nic)``. ``local = 1`` gives v1's NIC time.
  An all-to-all sends ``(local-1)/n`` of its data over NVLink and ``(n-local)/n`` over the
  rank's own NIC, at once. Both links at :data:`BUS_EFFICIENCY` of their datasheet figure
  (v1's ``LINK_EFFICIENCY``, nccl-tests on DGX).
- **Latency term** (message-size efficiency): NCCL's own tuning model for the Simple protocol
  (the one large messages use): ring ``base + (steps - inter) x intra + inter x net`` with
  ``steps = 2 (n-1)`` for all-reduce and ``n-1`` for all-gather / reduce-scatter, ``inter`` the
  node crossings (``2 (nodes-1)`` resp. ``nodes-1``), and the 1.9x "plateau" factor NCCL applies
  to multi-node all-reduce; all-reduce takes the faster of that ring and NCCL's tree
  (``base + 2 ((local-1) intra + log2(nodes) net)``, at :data:`TREE_BW` of the ring bandwidth).
  Point-to-point and all-to-all pay one base latency plus one hop.
- The overlap rules stay those of :mod:`llmtrain.plan.steptime` (v1 and v2 share them): only
  the seconds of each collective change, never its bytes (tests/test_costmodel.py).
"""

from __future__ import annotations

from math import log2

from llmtrain.plan.comm import FACTOR, Comm
from llmtrain.plan.dims import MESH_DIMS, ParallelDims
from llmtrain.recipe.gpus import GPUSpec

BUS_EFFICIENCY = 0.8  # NCCL bus bandwidth / link bandwidth, large messages (as comm.LINK_EFFICIENCY)
# NCCL src/graph/tuning.cc, Simple protocol, microseconds: baseLat (ring), hwLat ring NVLink / PCI / NET
BASE_LAT_S = 8.4e-6
HOP_LAT_S = {"nvlink": 3.4e-6, "pci": 5.7e-6, "net": 9.6e-6}
TREE_HOP_LAT_S = {"nvlink": 28e-6, "pci": 28e-6, "net": 50e-6}  # hwLat tree Simple (a 256 kB chunk per hop)
TREE_BW = 0.9  # tuning.cc: tree bus bandwidth = 0.9 x the ring's
RING_PLATEAU = 1.9  # tuning.cc: multi-node ring all-reduce latency x 1.9 ("plateau effect of ring")


def _intra(gpu: GPUSpec) -> str:
    return "pci" if gpu.nvlink_domain <= 2 and gpu.name != "cpu" else "nvlink"


def collective_seconds(op: str, message: float, n: int, gpu: GPUSpec, local: int | None = None) -> float:
    """Seconds of one ``op`` of ``message`` bytes (unsharded size, as v1) over ``n`` ranks, ``local``
    of them on each node (None or >= n: one node)."""
    if n <= 1 or message <= 0:
        return 0.0
    local = n if local is None else max(1, min(local, n))
    nodes = max(1, -(-n // local))
    nvl = gpu.nvlink_bytes_per_s / 2 * BUS_EFFICIENCY  # one direction
    nic = gpu.internode_bytes_per_s * BUS_EFFICIENCY
    intra, hop = _intra(gpu), HOP_LAT_S[_intra(gpu)]
    if op == "p2p":
        return BASE_LAT_S + (hop + message / nvl if nodes == 1 else HOP_LAT_S["net"] + message / nic)
    if op == "all-to-all":
        if nodes == 1:
            return BASE_LAT_S + hop + FACTOR[op](n) * message / nvl
        return BASE_LAT_S + HOP_LAT_S["net"] + max((local - 1) / n * message / nvl, (n - local) / n * message / nic)
    volume = FACTOR[op](n) * message
    if nodes == 1:
        bw_s = volume / nvl
    else:
        bw_s = max((local - 1) / local * volume / nvl, volume / (local * nic))
    steps = 2 * (n - 1) if op == "all-reduce" else n - 1
    inter = (2 if op == "all-reduce" else 1) * (nodes - 1)
    lat = BASE_LAT_S + (steps - inter) * hop + inter * HOP_LAT_S["net"]
    if op == "all-reduce" and nodes > 1:
        lat *= RING_PLATEAU
    ring = lat + bw_s
    if op != "all-reduce":
        return ring
    tree_lat = BASE_LAT_S + 2 * ((local - 1) * TREE_HOP_LAT_S[intra] + log2(nodes) * TREE_HOP_LAT_S["net"])
    return min(ring, tree_lat + bw_s / TREE_BW)


def local_members(dims: ParallelDims, slots: int, names: tuple[str, ...]) -> int:
    """Members of rank 0's group over ``names`` that sit on node 0 (``slots`` GPUs): ranks fill nodes
    in order and the mesh is row-major over :data:`MESH_DIMS`, so walk the group's dimensions from
    the innermost stride out while they still fit in the node."""
    shape = dims.mesh_shape
    strides, stride = {}, 1
    for i in reversed(range(len(MESH_DIMS))):
        strides[MESH_DIMS[i]] = (stride, shape[i])
        stride *= shape[i]
    local = 1
    for st, size in sorted(strides[name] for name in names if name in strides):
        if size <= 1:
            continue
        if st >= slots:
            break
        fit = max(1, slots // st)
        local *= min(size, fit)
        if size > fit:
            break
    return local


def group_key(c: Comm) -> tuple[str, ...]:
    """The mesh dimensions a planner collective runs over (comm.py's groups)."""
    if c.dim == "dp":
        if c.phase.startswith("fsdp") and c.op == "all-reduce":
            return ("dp_replicate",)
        if c.phase.startswith("fsdp"):
            return ("dp_shard", "cp")
        return ("dp_replicate", "dp_shard", "cp")
    if c.dim == "ep":
        return ("dp_shard", "cp")
    return (c.dim,)


def retime(comms: list[Comm], gpu: GPUSpec, dims: ParallelDims, slots: int) -> None:
    """Replace each collective's seconds with v2's (bytes, counts and phases untouched). A message
    issued as ``units`` separate collectives (FSDP2's per-unit gathers and reduce-scatters, the DP
    gradient buckets: comm.py) pays each one's latency: ``units`` collectives of ``message / units``."""
    for c in comms:
        local = c.group if c.link != "network" else min(c.group, local_members(dims, slots, group_key(c)))
        units = max(1, c.units)
        one = units * collective_seconds(c.op, c.message_bytes / units, c.group, gpu, local)
        c.per_item_s, c.seconds = one, one * c.count
