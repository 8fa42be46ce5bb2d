"""Which blocks of ring context parallelism a sliding window leaves empty: the rule the engine skips by
(``engine/parallel/context_ring.py``) and the planner counts with (FLOPs, time, selective's saved blocks).

The ring's zigzag split (``engine/parallel/context.py``): the row is ``2 cp`` chunks of ``c`` tokens, and
cp rank ``r`` holds chunks ``r`` and ``2 cp - 1 - r``. At step ``t`` rank ``r`` holds the K/V of rank
``src = (r - t) mod cp``, and its block is (:func:`block_chunks`):

- step 0, ``diag``: both local chunks against both (causal);
- ``src < r``, ``kv_half``: both local chunks against src's first chunk;
- ``src > r``, ``q_half``: the second local chunk against both of src's.

Under a sliding window (query ``p`` sees keys ``p - window < q <= p``) a block whose every (row, key)
pair lies outside the band has nothing to compute: every score is masked, every row of it empty.
Such blocks are skipped, decided from the chunk positions alone (:func:`block_visible`), never from
the mask's values: no device sync, and the same work for any data (packed rows' samples only remove
more scores inside the blocks that run). The diagonal block always runs (every row sees itself). The
band is by index difference, as the engine's masks build it (``models/masks.py``: within a packed
sample the index difference is the position difference; across samples the sample mask hides
everything anyway).
"""

from __future__ import annotations

from functools import lru_cache


def step_kind(step: int, src: int, rank: int) -> str:
    """``diag`` (own K/V), ``kv_half`` (K/V of an earlier rank) or ``q_half`` (of a later one)."""
    if step == 0:
        return "diag"
    return "kv_half" if src < rank else "q_half"


def block_chunks(kind: str, rank: int, src: int, cp: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(global chunk indices of the block's query rows, of its keys), each chunk ``c`` tokens."""
    mine, theirs = (rank, 2 * cp - 1 - rank), (src, 2 * cp - 1 - src)
    if kind == "diag":
        return mine, mine
    if kind == "kv_half":
        return mine, theirs[:1]
    return mine[1:], theirs


def block_visible(kind: str, rank: int, src: int, cp: int, chunk: int, window: int | None) -> bool:
    """Whether any query row of the block sees any of its keys under the causal mask and ``window``
    (None: no window, every block of the ring's structure has visible scores)."""
    if window is None or kind == "diag":
        return True
    rows, keys = block_chunks(kind, rank, src, cp)
    for g in rows:
        for h in keys:
            lo = (g - h) * chunk - (chunk - 1)  # smallest query - key index difference of the chunk pair
            hi = (g - h) * chunk + (chunk - 1)  # largest
            if hi >= 0 and lo < window:
                return True
    return False


@lru_cache(maxsize=256)
def ring_window_work(cp: int, seq: int, window: int) -> tuple[float, float, tuple[float, ...]]:
    """For a windowed layer under ring CP over ``seq`` tokens: ``(counted, executed, saved)``.

    ``counted``: the blocks' scores over all ranks, each block whole (the FLOP counter's convention),
    as a share of the full ``seq x seq`` square (``(cp + 1) / (2 cp)`` with nothing skipped);
    ``executed``: the most loaded rank's executed scores (masked blocks run whole) over its full
    ``[s_local, seq]`` block; ``saved``: per rank, the blocks' query rows in units of the rank's
    ``s_local`` rows (what selective recomputation keeps: each block's output and lse;
    ``(cp + 1 + r) / 2`` with nothing skipped)."""
    chunk = seq // (2 * cp)
    s_local = 2 * chunk
    total, worst, saved = 0, 0, []
    for rank in range(cp):
        work = rows_kept = 0
        for step in range(cp):
            src = (rank - step) % cp
            kind = step_kind(step, src, rank)
            if not block_visible(kind, rank, src, cp, chunk, window):
                continue
            rows, keys = block_chunks(kind, rank, src, cp)
            work += len(rows) * len(keys) * chunk * chunk
            rows_kept += len(rows) * chunk
        total += work
        worst = max(worst, work)
        saved.append(rows_kept / s_local)
    return total / (seq * seq), worst / (s_local * seq), tuple(saved)
