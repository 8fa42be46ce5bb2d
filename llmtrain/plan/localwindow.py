"""Which score boxes a windowed layer runs without context parallelism: the rule the engine follows
(``engine/models/window_attention.py``) and the planner counts with (FLOPs, time, selective's kept outputs).

A sliding window shorter than the row as SDPA with a dense band mask runs every score, visible or not (the
kernels given a mask skip nothing): ``s^2`` per head for ``s window`` visible ones. Instead the row is cut
into ``n`` chunks of ``c`` tokens, ``c`` the divisor of ``s`` nearest the window (:func:`local_chunk`), and
each (query chunk, key chunk) pair with a visible score runs the bounding box of those scores
(``ringwindow.pair_box``, the ring's rule on chunk indices in row order): every chunk's diagonal whole and,
under a window no longer than a chunk, its first ``window - 1`` queries against the chunk before's last
``window - 1`` keys; about ``s (c + window)`` scores instead of ``s^2``. Decided from positions alone (no
device sync, the same work for any data; packed rows' samples hide more scores inside the boxes that run).
Where no divisor lies within a factor of 2 of the window, or the row is not longer than the window, the
layer keeps the dense masked call.
"""

from __future__ import annotations

from functools import lru_cache

from llmtrain.plan.ringwindow import pair_box


@lru_cache(maxsize=256)
def local_chunk(seq: int, window: int | None) -> int | None:
    """The chunk length a windowed layer over ``seq`` tokens runs its boxes in: the divisor of ``seq`` nearest
    ``window`` (the larger on a tie) when it lies in ``[window / 2, 2 window]`` and gives at least 2 chunks;
    None: the dense masked call (no window, a row no longer than it, or no such divisor)."""
    if window is None or seq <= window:
        return None
    best = None
    for c in range(max(1, window // 2), min(seq // 2, 2 * window) + 1):
        if seq % c == 0 and (best is None or (abs(c - window), -c) < (abs(best - window), -best)):
            best = c
    return best


@lru_cache(maxsize=256)
def local_boxes(seq: int, window: int) -> tuple[tuple[int, int, int, int, int, int], ...]:
    """``(g, h, r0, r1, k0, k1)`` for every pair of chunks (query chunk ``g``, key chunk ``h``) with a visible
    score, each query chunk's diagonal first, then the chunks before it, nearest first; rows and keys are
    offsets inside the chunks (``ringwindow.pair_box``). Requires :func:`local_chunk` to be set."""
    c = local_chunk(seq, window)
    if c is None:
        raise ValueError(f"no local chunking for a window of {window} over {seq} tokens")
    out = []
    for g in range(seq // c):
        for h in range(g, -1, -1):
            r0, r1, k0, k1 = pair_box(g, h, c, window)
            if r0 >= r1 or k0 >= k1:
                break  # the chunks before see nothing either
            out.append((g, h, r0, r1, k0, k1))
    return tuple(out)


@lru_cache(maxsize=256)
def local_window_work(seq: int, window: int) -> tuple[float, float] | None:
    """``(executed, saved)`` of a windowed layer without CP: its boxes' scores over ``seq^2`` (counted and
    executed alike: each box is one masked kernel call, run whole) and their query rows over ``seq`` (what
    selective recomputation keeps: each call's output and lse); None where the layer runs the dense call."""
    if local_chunk(seq, window) is None:
        return None
    boxes = local_boxes(seq, window)
    area = sum((r1 - r0) * (k1 - k0) for _, _, r0, r1, k0, k1 in boxes)
    rows = sum(r1 - r0 for _, _, r0, r1, _, _ in boxes)
    return area / (seq * seq), rows / seq
