"""Exposed time of ring context parallelism's P2P hops (``parallel.cp_method: ring``).

The engine's ring (``engine/parallel/context_ring.py``) starts each step's transfer before the
step's attention kernels and waits for it after them, as Transformer Engine's ring does, so a hop
costs only what it takes beyond the block's compute. Per layer and micro batch, with ``h`` the
time of one K/V-sized message (``comm.py``'s ``per_item_s``), ``g`` the dK/dV messages per hop
(the accumulation dtype over the activation dtype: 2 in bf16, :func:`ring_grad_units`) and each
step's share of the layer's attention, ``a_f / cp`` forward and ``a_b / cp`` backward (the zigzag
steps are equal work: one diagonal block and ``cp - 1`` half blocks; a windowed layer's chunk pairs
are not, ``steps`` in :func:`ring_exposed_share`, and a step without pairs hides nothing):

- each forward pass (a second one when the forward is recomputed) sends ``cp - 1`` K/V blocks,
  each behind one step's kernels: ``(cp - 1) max(0, h - a_f / cp)``;
- the backward's steps carry the next K/V (steps ``0 .. cp - 2``) and the previous step's dK/dV
  accumulators (steps ``1 .. cp - 1``), each behind one step's kernels:
  ``max(0, h - c) + (cp - 2) max(0, (1 + g) h - c) + max(0, g h - c)`` with ``c = a_b / cp``,
  and the last dK/dV hop home has nothing after it: ``+ g h``.

The merges and copies between the blocks are in ``a_f`` / ``a_b`` since the twenty-ninth session
(``ops.layer_attention_seconds``, plan/cpmerge.py): they run on the same stream as the kernels, so
they hide the hops too. What is not modelled: the SMs a P2P kernel holds while it overlaps
(``ops.overlap_slowdown`` prices that for hidden DP traffic only).
"""

from __future__ import annotations


def forward_passes(recompute: str) -> int:
    """Forward passes per micro batch: the forward, and the recomputed one unless ``recompute`` is
    none (every mode re-runs attention's inputs' projections or more, so the ring sends its K/V again
    and TP and EP repeat their forward collectives)."""
    return 1 + (recompute != "none")


def ring_grad_units(e: int) -> int:
    """dK/dV messages per K/V message: the engine accumulates them in fp32 at least
    (``context_blocks.acc_dtype``), in ``e``-byte activations' K/V-sized units."""
    return max(e, 4) // e


def ring_units(cp: int, passes: int, grad: int) -> int:
    """K/V-sized messages per layer and micro batch (``comm.py``'s count for the ring)."""
    return (cp - 1) * (passes + 1 + grad) + grad


def ring_exposed_share(cp: int, passes: int, grad: int, hop_s: float, attn_fwd_s: float, attn_bwd_s: float,
                       steps: tuple[float, ...] | None = None) -> float:
    """Share of the ring's P2P seconds on the critical path (module docstring): ``passes``
    forward passes, ``grad`` dK/dV messages per hop, ``hop_s`` one K/V message, ``attn_*_s`` the
    layer's attention seconds per micro batch on this rank (forward, backward without recomputation),
    ``steps`` each step's share of them (default equal, ``1 / cp``: the zigzag blocks; a windowed layer's
    chunk pairs leave some steps with little or nothing to hide a hop behind, ``plan/ringwindow.py``)."""
    if cp <= 1 or hop_s <= 0:
        return 1.0
    steps = steps or (1.0 / cp,) * cp
    h = hop_s
    fwd = passes * sum(max(0.0, h - attn_fwd_s * share) for share in steps[:-1])  # hop t behind step t
    c = [attn_bwd_s * share for share in steps]
    bwd = (max(0.0, h - c[0]) + sum(max(0.0, (1 + grad) * h - ct) for ct in c[1:-1]) + max(0.0, grad * h - c[-1])
           + grad * h)
    return min(1.0, (fwd + bwd) / (ring_units(cp, passes, grad) * h))


def apply_ring_overlap(comms, cp: int, passes: int, grad: int, attn_fwd_s: float, attn_bwd_s: float,
                       steps: tuple[float, ...] | None = None) -> None:
    """Set the ring comm's ``exposed_share`` (:func:`ring_exposed_share`) and say so in its note."""
    for c in comms:
        if c.phase == "cp-ring":
            c.exposed_share = ring_exposed_share(cp, passes, grad, c.per_item_s, attn_fwd_s, attn_bwd_s, steps)
            c.note += "; each hop behind its block's attention, what exceeds it exposed"
