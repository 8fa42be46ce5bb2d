"""Which chunk pairs ring context parallelism runs for a windowed layer, and which rows and keys of each:
the rule the engine follows (``engine/parallel/context_ring_window.py``, ``context_exchange.py``) and the
planner counts with (FLOPs, time, selective's saved kernel outputs, CP bytes).

The ring's zigzag split (``engine/parallel/context.py``): the row is ``2 cp`` chunks of ``c`` tokens, and
cp rank ``r`` holds chunks ``r`` and ``2 cp - 1 - r`` (local chunks 0 and 1). At step ``t`` rank ``r``
holds the K/V of rank ``src = (r - t) mod cp``, whose chunks are ``src`` and ``2 cp - 1 - src``. Under a
sliding window (query ``p`` sees keys ``p - window < q <= p``) most (query chunk, key chunk) pairs of a
long row see nothing: a windowed layer runs only the pairs with a visible score (:func:`pair_visible`),
each as one masked kernel call, instead of the ring's usual blocks (which group up to four pairs). A pair
of different chunks runs only its visible scores' bounding box (:func:`pair_box`, forty-second session):
the first ``window - 1`` queries against the last ``window - 1`` keys of the chunk before, when the window
is shorter than a chunk (every row of the box sees at least its last key). Decided from the chunk
positions alone, never from the mask's values: no device sync, the same work for any data (packed rows'
samples only hide more scores inside the boxes that run). A rank's own diagonal pairs always run first,
whole (every row sees itself). The band is by index difference, as the engine's masks build it
(``models/masks.py``: within a packed sample the index difference is the position difference; across
samples the sample mask hides everything anyway).
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


def pair_box(g: int, h: int, chunk: int, window: int | None) -> tuple[int, int, int, int]:
    """``(r0, r1, k0, k1)``: the rows ``[r0, r1)`` of query chunk ``g`` and keys ``[k0, k1)`` of key chunk ``h``
    (offsets inside the chunks) that hold every visible score of the pair, the band's bounding box; empty
    (``r0 >= r1``) when none is visible. A query ``p`` sees ``q`` iff ``0 <= p - q < window``."""
    reach = chunk * 2 * (g + h + 2) if window is None else window  # no window: beyond any index difference
    r0 = max(0, (h - g) * chunk)  # causal: no query before the chunk's first key
    r1 = min(chunk, (h - g + 1) * chunk - 1 + reach)  # past it, the chunk's last key is out of the window
    k0 = max(0, (g - h) * chunk - reach + 1)  # before it, out of the window of the chunk's first query
    k1 = min(chunk, (g - h + 1) * chunk)  # causal: no key after the chunk's last query
    return r0, r1, k0, k1


def step_boxes(rank: int, src: int, cp: int, chunk: int, window: int | None) -> list[tuple[int, int, int, int, int, int]]:
    """:func:`step_pairs` with each pair's box: ``(i, j, r0, r1, k0, k1)`` (:func:`pair_box`)."""
    mine, theirs = local_chunks(rank, cp), local_chunks(src, cp)
    return [(i, j, *pair_box(mine[i], theirs[j], chunk, window)) for i, j in step_pairs(rank, src, cp, chunk, window)]


def _area(box: tuple[int, int, int, int, int, int]) -> int:
    return (box[3] - box[2]) * (box[5] - box[4])


@lru_cache(maxsize=256)
def ring_window_steps(cp: int, seq: int, window: int) -> tuple[float, ...]:
    """Each step's share of a windowed layer's attention on the most loaded rank (its boxes' scores per step
    over all of them): what the ring's hops can hide behind (``plan/ringtime.py``)."""
    chunk = seq // (2 * cp)
    work = [[sum(map(_area, step_boxes(rank, (rank - t) % cp, cp, chunk, window))) for t in range(cp)]
            for rank in range(cp)]
    worst = max(work, key=sum)
    return tuple(n / sum(worst) for n in worst)


@lru_cache(maxsize=256)
def ring_window_work(cp: int, seq: int, window: int) -> tuple[float, float, tuple[float, ...]]:
    """For a windowed layer under ring CP over ``seq`` tokens: ``(counted, executed, saved)``.

    ``counted``: the boxes' scores over all ranks, each box whole (the FLOP counter's convention), as a
    share of the full ``seq x seq`` square (``(cp + 1) / (2 cp)`` for the ring's usual blocks without a
    window); ``executed``: the most loaded rank's executed scores (masked boxes run whole) over its full
    ``[s_local, seq]`` block; ``saved``: per rank, the boxes' query rows in units of the rank's
    ``s_local`` rows (what selective recomputation keeps: each kernel call's output and lse)."""
    chunk = seq // (2 * cp)
    s_local = 2 * chunk
    total, worst, saved = 0, 0, []
    for rank in range(cp):
        boxes = [b for t in range(cp) for b in step_boxes(rank, (rank - t) % cp, cp, chunk, window)]
        area = sum(map(_area, boxes))
        total += area
        worst = max(worst, area)
        saved.append(sum(b[3] - b[2] for b in boxes) / s_local)
    return total / (seq * seq), worst / (s_local * seq), tuple(saved)


@lru_cache(maxsize=256)
def exchange_plan(cp: int, chunk: int, window: int) -> tuple[tuple[tuple[int, tuple, tuple], ...], ...]:
    """Per cp rank, the steps of a windowed layer's neighbour exchange (``engine/parallel/context_exchange.py``):
    ``(t, recv, send)`` for each ``t`` in ``1 .. cp - 1`` where the rank receives anything from rank ``r - t``
    or sends anything to rank ``r + t``. ``recv``: ``(j, k0)`` for each local chunk ``j`` of that rank some
    visible pair of this rank reads, of which it needs the keys from ``k0`` on (every box of another rank's
    chunk ends at the chunk's end, so the union of its boxes' keys is that suffix); ``send``: the same for
    what rank ``r + t`` needs of this rank's chunks. Every rank computes every rank's needs from chunk
    positions alone, so the sends and receives match without a handshake."""
    def needs(rank: int, t: int) -> tuple[tuple[int, int], ...]:
        first: dict[int, int] = {}
        for _, j, _, _, k0, _ in step_boxes(rank, (rank - t) % cp, cp, chunk, window):
            first[j] = min(first.get(j, chunk), k0)
        return tuple(sorted(first.items()))

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
def exchange_tokens(cp: int, chunk: int, window: int) -> tuple[int, int]:
    """The busiest rank's ``(sent, received)`` tokens of K/V (key positions, each one token of K and of V)
    per forward pass of a windowed layer's exchange; the busiest by the larger of the two."""
    def tokens(parts) -> int:
        return sum(chunk - k0 for _, k0 in parts)

    per_rank = [(sum(tokens(s) for _, _, s in steps), sum(tokens(r) for _, r, _ in steps))
                for steps in exchange_plan(cp, chunk, window)]
    return max(per_rank, key=lambda sr: (max(sr), sr))


def use_exchange(cp: int, chunk: int, window: int | None) -> bool:
    """Whether a windowed layer's ring CP fetches only the keys its window needs, each straight from its
    owner (``engine/parallel/context_exchange.py``), instead of walking the ring: when no rank sends or
    receives more than ``(cp - 1) c`` tokens of K/V per forward, half of what every rank receives on the
    ring (``2 (cp - 1) c``: both of each other rank's chunks). The ring hides its hops behind each step's
    attention and the exchange's backward does not (module docstring there), so the exchange is chosen only
    where it moves at most half the bytes: a window of a few chunks, the local layers of Gemma 2/3 or
    Mistral at long context. The same rule for engine and planner."""
    if window is None or cp < 2 or window >= 2 * cp * chunk:
        return False
    return max(exchange_tokens(cp, chunk, window)) <= (cp - 1) * chunk
