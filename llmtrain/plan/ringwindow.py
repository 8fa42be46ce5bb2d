"""Which chunk pairs ring context parallelism runs for a windowed layer: the rule the engine follows
(``engine/parallel/context_ring_window.py``) and the planner counts with (FLOPs, time, selective's saved
kernel outputs).

The ring's zigzag split (``engine/parallel/context.py``): the row is ``2 cp`` chunks of ``c`` tokens, and
cp rank ``r`` holds chunks ``r`` and ``2 cp - 1 - r`` (local chunks 0 and 1). At step ``t`` rank ``r``
holds the K/V of rank ``src = (r - t) mod cp``, whose chunks are ``src`` and ``2 cp - 1 - src``. Under a
sliding window (query ``p`` sees keys ``p - window < q <= p``) most (query chunk, key chunk) pairs of a
long row see nothing: a windowed layer runs only the pairs with a visible score (:func:`pair_visible`),
each as one masked kernel call on its ``c x c`` view of the mask, instead of the ring's usual blocks
(which group up to four pairs). Decided from the chunk positions alone, never from the mask's values:
no device sync, the same work for any data (packed rows' samples only hide more scores inside the pairs
that run). A rank's own diagonal pairs always run first (every row sees itself). The band is by index
difference, as the engine's masks build it (``models/masks.py``: within a packed sample the index
difference is the position difference; across samples the sample mask hides everything anyway).
"""

from __future__ import annotations

from functools import lru_cache


def local_chunks(rank: int, cp: int) -> tuple[int, int]:
    """Global chunk indices of rank ``rank``'s local chunks 0 and 1 (its rows, and its K/V)."""
    return rank, 2 * cp - 1 - rank


def pair_visible(g: int, h: int, chunk: int, window: int | None) -> bool:
    """Whether any query of global chunk ``g`` sees any key of chunk ``h``: causal (``q <= p``) and, with
    a ``window``, inside it (``p - q < window``)."""
    lo = (g - h) * chunk - (chunk - 1)  # smallest query - key index difference of the pair
    hi = (g - h) * chunk + (chunk - 1)  # largest
    return hi >= 0 and (window is None or lo < window)


def step_pairs(rank: int, src: int, cp: int, chunk: int, window: int | None) -> list[tuple[int, int]]:
    """The visible (local query chunk, local key chunk of src's K/V) pairs of one ring step, the
    diagonal ones (own K/V, same chunk) first."""
    mine, theirs = local_chunks(rank, cp), local_chunks(src, cp)
    pairs = [(i, j) for i in range(2) for j in range(2) if pair_visible(mine[i], theirs[j], chunk, window)]
    return sorted(pairs, key=lambda p: (src != rank or p[0] != p[1], p))


@lru_cache(maxsize=256)
def ring_window_steps(cp: int, seq: int, window: int) -> tuple[float, ...]:
    """Each step's share of a windowed layer's attention on the most loaded rank (its pairs per step over
    all its pairs): what the ring's hops can hide behind (``plan/ringtime.py``)."""
    chunk = seq // (2 * cp)
    counts = [[len(step_pairs(rank, (rank - t) % cp, cp, chunk, window)) for t in range(cp)] for rank in range(cp)]
    worst = max(counts, key=sum)
    return tuple(n / sum(worst) for n in worst)


@lru_cache(maxsize=256)
def ring_window_work(cp: int, seq: int, window: int) -> tuple[float, float, tuple[float, ...]]:
    """For a windowed layer under ring CP over ``seq`` tokens: ``(counted, executed, saved)``.

    ``counted``: the pairs' scores over all ranks, each pair whole (the FLOP counter's convention), as a
    share of the full ``seq x seq`` square (``(cp + 1) / (2 cp)`` for the ring's usual blocks without a
    window); ``executed``: the most loaded rank's executed scores (masked pairs run whole) over its full
    ``[s_local, seq]`` block; ``saved``: per rank, the pairs' query rows in units of the rank's
    ``s_local`` rows (what selective recomputation keeps: each kernel call's output and lse)."""
    chunk = seq // (2 * cp)
    s_local = 2 * chunk
    total, worst, saved = 0, 0, []
    for rank in range(cp):
        pairs = sum(len(step_pairs(rank, (rank - t) % cp, cp, chunk, window)) for t in range(cp))
        total += pairs * chunk * chunk
        worst = max(worst, pairs * chunk * chunk)
        saved.append(pairs * chunk / s_local)
    return total / (seq * seq), worst / (s_local * seq), tuple(saved)
