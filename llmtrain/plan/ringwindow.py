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


@lru_cache(maxsize=256)
def exchange_plan(cp: int, chunk: int, window: int) -> tuple[tuple[tuple[int, tuple[int, ...], tuple[int, ...]], ...], ...]:
    """Per cp rank, the steps of a windowed layer's neighbour exchange (``engine/parallel/context_exchange.py``):
    ``(t, recv, send)`` for each ``t`` in ``1 .. cp - 1`` where the rank receives anything from rank ``r - t``
    (``recv``: that rank's local chunks some visible pair of this rank needs) or sends anything to rank
    ``r + t`` (``send``: this rank's local chunks that rank needs at its step ``t``). Every rank computes
    every rank's needs from chunk positions alone, so the sends and receives match without a handshake."""
    def needs(rank: int, t: int) -> tuple[int, ...]:
        return tuple(sorted({j for _, j in step_pairs(rank, (rank - t) % cp, cp, chunk, window)}))

    plan = []
    for rank in range(cp):
        steps = []
        for t in range(1, cp):
            recv, send = needs(rank, t), needs((rank + t) % cp, t)
            if recv or send:
                steps.append((t, recv, send))
        plan.append(tuple(steps))
    return tuple(plan)


@lru_cache(maxsize=256)
def exchange_chunks(cp: int, chunk: int, window: int) -> tuple[int, int]:
    """The busiest rank's ``(sent, received)`` chunks of K/V (each one ``c``-token chunk of K and of V) per
    forward pass of a windowed layer's exchange; the busiest by the larger of the two."""
    per_rank = [(sum(len(s) for _, _, s in steps), sum(len(r) for _, r, _ in steps))
                for steps in exchange_plan(cp, chunk, window)]
    return max(per_rank, key=lambda sr: (max(sr), sr))


def use_exchange(cp: int, chunk: int, window: int | None) -> bool:
    """Whether a windowed layer's ring CP fetches only the chunks its window needs, each straight from its
    owner (``engine/parallel/context_exchange.py``), instead of walking the ring: when no rank receives
    more than ``cp - 1`` chunks per forward, half of what every rank receives on the ring (``2 (cp - 1)``,
    both of each other rank's chunks). The ring hides its hops behind each step's attention and the
    exchange's backward does not (module docstring there), so the exchange is chosen only where it moves
    at most half the bytes: a window of a few chunks, the local layers of Gemma 2/3 or Mistral at long
    context. The same rule for engine and planner."""
    if window is None or cp < 2 or window >= 2 * cp * chunk:
        return False
    return max(exchange_chunks(cp, chunk, window)) <= cp - 1
