"""The rule by which ring CP skips a windowed layer's blocks (llmtrain/plan/ringwindow.py), against brute force.

The engine skips exactly the blocks :func:`block_visible` calls invisible, and the planner counts the rest,
so the rule must equal the truth: a block is visible iff some (query row, key) pair of it lies in the causal
band ``0 <= p - q < window``, checked here pair by pair over the ring's zigzag chunks (pure Python, exact).
Without a window the shares reduce to the closed forms the planner used before: ``(cp + 1) / (2 cp)``
counted and executed, ``(cp + 1 + r) / 2`` blocks kept by selective recomputation on rank ``r``.
"""

from __future__ import annotations

import pytest

from llmtrain.plan.ringwindow import block_chunks, block_visible, ring_window_work, step_kind


def _brute_visible(kind: str, rank: int, src: int, cp: int, chunk: int, window: int) -> bool:
    rows, keys = block_chunks(kind, rank, src, cp)
    return any(0 <= p - q < window for g in rows for h in keys
               for p in range(g * chunk, (g + 1) * chunk) for q in range(h * chunk, (h + 1) * chunk))


@pytest.mark.parametrize("cp, chunk, window", [(2, 8, 3), (3, 5, 7), (4, 8, 8), (4, 8, 9), (4, 8, 17), (5, 4, 1),
                                               (6, 3, 10), (8, 4, 30)])
def test_block_visibility_equals_brute_force(cp, chunk, window):
    skipped = 0
    for rank in range(cp):
        for step in range(cp):
            src = (rank - step) % cp
            kind = step_kind(step, src, rank)
            got = block_visible(kind, rank, src, cp, chunk, window)
            assert got == _brute_visible(kind, rank, src, cp, chunk, window), (rank, src, kind)
            skipped += not got
    if cp >= 4 and window <= chunk:  # narrow windows leave blocks to skip (the test would pass vacuously otherwise)
        assert skipped > 0


@pytest.mark.parametrize("cp", [1, 2, 3, 4, 8])
def test_without_a_reachable_window_the_shares_are_the_closed_forms(cp):
    seq = 2 * cp * 16
    counted, executed, saved = ring_window_work(cp, seq, seq)
    assert counted == pytest.approx((cp + 1) / (2 * cp)) and executed == pytest.approx((cp + 1) / (2 * cp))
    assert saved == tuple((cp + 1 + r) / 2 for r in range(cp))


@pytest.mark.parametrize("cp, chunk, window", [(4, 8, 8), (8, 4, 6), (3, 6, 5)])
def test_a_narrow_window_skips_work_counted_exactly(cp, chunk, window):
    """The shares from the blocks brute force finds visible: scores of whole blocks (rows x keys), the
    most loaded rank's over its [s_local, seq], and each rank's kept rows in units of s_local."""
    seq, s_local = 2 * cp * chunk, 2 * chunk
    work, rows_kept = [], []
    for rank in range(cp):
        blocks = [block_chunks(k, rank, src, cp) for src, k in
                  (((rank - t) % cp, step_kind(t, (rank - t) % cp, rank)) for t in range(cp))
                  if _brute_visible(k, rank, src, cp, chunk, window)]
        work.append(sum(len(r) * len(k) * chunk * chunk for r, k in blocks))
        rows_kept.append(sum(len(r) * chunk for r, _ in blocks) / s_local)
    counted, executed, saved = ring_window_work(cp, seq, window)
    assert counted == pytest.approx(sum(work) / seq ** 2) and executed == pytest.approx(max(work) / (s_local * seq))
    assert saved == tuple(rows_kept)
    assert counted < (cp + 1) / (2 * cp)  # something was skipped (the most loaded rank may skip nothing)
