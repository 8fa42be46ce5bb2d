"""Hierarchical sharding (the seed's "ZeRO-4"): shard inside the NVLink domain, replicate across nodes.

What llmtrain calls HSDP (``parallel.dp_replicate: N`` x ``parallel.dp_shard: G`` with zero 2/3)
is the hierarchical partitioning of ZeRO++'s hpZ, MiCS and PyTorch's HSDP: parameters, gradients
and AdamW states are sharded over the ``G`` ranks of one node (FSDP2 on the ``dp_shard`` mesh
dimension: all-gathers and reduce-scatters stay on NVLink), and the ``N`` node replicas all-reduce
their gradient *shards* over the network (``1/G`` of the gradients per rank, comm.py). Against
full FSDP over ``N x G`` ranks, every weight all-gather and gradient reduce-scatter leaves the
network; what crosses it per rank and step is ``2 (N-1)/N x r P / G`` bytes (``r`` = 4, 2 with
``parallel.reduce_dtype: bf16``) instead of ``(NG-1)/NG x (e P x gathers + r P)``. The price is
memory: model states are sharded ``G``-fold, not ``NG``-fold.

This module gives (a) the shard groups ``plan --search`` tries (:func:`shard_replicas`: the FSDP
group filling one node, 2 or 8 nodes), (b) the bytes a layout sends over the inter-node network
(:func:`internode_bytes`), and (c) ``plan``'s one-line recommendation for an FSDP recipe whose
shard group spans nodes (:func:`hsdp_hint`): the in-node layout, when it fits and its modeled
step is the fastest of FSDP / HSDP / ZeRO-1 or at most :data:`HINT_WITHIN` slower (also worth
showing when slightly slower: it moves the traffic off the network, which other jobs share).
"""

from __future__ import annotations

from llmtrain.plan.comm import FACTOR
from llmtrain.plan.costmodel import CostModel, estimate
from llmtrain.plan.dims import ParallelDims
from llmtrain.cluster.placement import Placement
from llmtrain.plan.validate import divisors, validate
from llmtrain.recipe.schema import Recipe

HINT_WITHIN = 0.03  # show the HSDP recommendation when its step time is at most 3 % above the recipe's
GIB = 2**30


def shard_replicas(dp: int, cp: int, tp: int, ep: int, node_gpus: int) -> list[int]:
    """``dp_replicate`` values (> 1) whose shard group ``dp_shard x cp x tp`` is one node's GPUs (the
    in-node HSDP of ZeRO++ hpZ / MiCS), two nodes or eight; EP borrows from ``dp_shard x cp``."""
    return [r for r in divisors(dp)[1:-1] if (dp // r) * cp * tp in (node_gpus, 2 * node_gpus, 8 * node_gpus)
            and (dp // r * cp) % ep == 0]


def internode_bytes(cost: CostModel) -> float:
    """Bytes one rank (of the slowest pipeline stage) sends over the inter-node network per step:
    the bus volume (comm.py's ``FACTOR`` x message x count) of every collective whose group crosses
    nodes."""
    return sum(FACTOR[c.op](c.group) * c.message_bytes * c.count for c in cost.comms if c.link == "network")


def in_node_layout(recipe: Recipe, placement: Placement, dims: ParallelDims | None = None) -> dict | None:
    """``{"dp_shard": G, "dp_replicate": N}`` for the recipe's FSDP (zero 2/3, no HSDP yet) when its
    shard group spans nodes and one node holds a whole shard group (``G x cp x tp`` = GPUs per node);
    None otherwise. ``dims``: the recipe's validated degrees (validated here when not given)."""
    p = recipe.parallel
    if p.zero < 2 or p.dp_replicate > 1 or len(placement.nodes) < 2:
        return None  # the cheap checks first: plan calls this for every recipe
    if dims is None:
        v = validate(recipe, placement)
        if not v.valid or v.dims is None:
            return None
        dims = v.dims
    slots = {n.slots for n in placement.nodes}
    if len(slots) != 1:
        return None
    gpus = slots.pop()
    d = dims
    if d.dp_shard * d.cp * d.tp <= gpus or gpus % (d.cp * d.tp):
        return None  # already inside a node, or TP x CP does not tile a node
    shard = gpus // (d.cp * d.tp)
    if d.dp_shard % shard or (shard * d.cp) % max(1, d.ep):
        return None
    return {"dp_shard": shard, "dp_replicate": d.dp_shard // shard}


def _priced(recipe: Recipe, placement: Placement, update: dict):
    variant = recipe.model_copy(update={"parallel": recipe.parallel.model_copy(update=update)})
    v = validate(variant, placement)
    if not v.valid or v.dims is None or v.batch is None:
        return None
    cost = estimate(variant, v.dims, v.batch, placement, hints=False)
    return cost if cost.fits else None


def hsdp_hint(recipe: Recipe, placement: Placement, cost: CostModel, dims: ParallelDims | None = None) -> dict | None:
    """``plan``'s recommendation of the in-node HSDP layout for an FSDP recipe spanning nodes, or None.

    Shown when the HSDP layout validates, fits, and is the fastest or within :data:`HINT_WITHIN` of
    the fastest of the three data-parallel modes for the recipe's other degrees: the recipe's full
    FSDP, the HSDP layout, and ZeRO-1 (DDP with sharded optimizer states) when it fits. Three
    estimates, not a search (``plan`` stays well under 0.5 s; ``plan --search`` ranks everything)."""
    layout = in_node_layout(recipe, placement, dims)
    if layout is None:
        return None
    new = _priced(recipe, placement, layout)
    if new is None:
        return None
    rivals = [cost.time.step_s] if cost.fits else []
    zero1 = _priced(recipe, placement, {"zero": 1})
    if zero1 is not None:
        rivals.append(zero1.time.step_s)
    best = min(rivals, default=new.time.step_s)
    if new.time.step_s > best * (1 + HINT_WITHIN):
        return None
    before, after = internode_bytes(cost), internode_bytes(new)
    shard, rep = layout["dp_shard"], layout["dp_replicate"]
    fields = f"parallel.dp_shard: {shard}, parallel.dp_replicate: {rep}"
    line = (f"hierarchical sharding (HSDP): set {fields} (shard inside each node, replicate across {rep} nodes) -> "
            f"{new.time.step_s:.3g} s/step ({new.time.step_s / cost.time.step_s - 1:+.1%}), peak "
            f"{new.worst.peak / GIB:.1f} GiB ({(new.worst.peak - cost.worst.peak) / GIB:+.1f}), inter-node "
            f"{after / GIB:.3g} GiB per GPU per step instead of {before / GIB:.3g}"
            + (f"; ZeRO-1 would take {zero1.time.step_s:.3g} s/step" if zero1 is not None else ""))
    return {"kind": "hsdp", "set": {"parallel.dp_shard": shard, "parallel.dp_replicate": rep}, "message": line,
            "step_s": new.time.step_s, "step_s_now": cost.time.step_s,
            "step_s_zero1": zero1.time.step_s if zero1 is not None else None, "peak_gib": new.worst.peak / GIB,
            "peak_gib_now": cost.worst.peak / GIB, "internode_gib": after / GIB, "internode_gib_now": before / GIB}
