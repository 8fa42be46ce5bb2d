"""The rule by which ring CP runs a windowed layer's chunk pairs (llmtrain/plan/ringwindow.py), against brute force.

The engine runs exactly the pairs :func:`step_pairs` lists (engine/parallel/context_ring_window.py) and the
planner counts them, so the rule must equal the truth: a (query chunk, key chunk) pair is visible iff some
(query, key) of it lies in the causal band ``0 <= p - q < window``, checked here position by position over
the ring's zigzag chunks (pure Python, exact); the diagonal pairs come first; every step's pairs together
cover every visible score of the rank's rows against that step's K/V exactly once.
"""

from __future__ import annotations

import pytest

from llmtrain.plan.ringwindow import local_chunks, ring_window_work, step_pairs

CASES = [(2, 8, 3), (3, 5, 7), (4, 8, 8), (4, 8, 9), (4, 8, 17), (5, 4, 1), (6, 3, 10), (8, 4, 30), (4, 8, 10**6)]


def _visible(g: int, h: int, chunk: int, window: int) -> bool:
    return any(0 <= p - q < window for p in range(g * chunk, (g + 1) * chunk) for q in range(h * chunk, (h + 1) * chunk))


@pytest.mark.parametrize("cp, chunk, window", CASES)
def test_step_pairs_are_the_visible_pairs_diagonal_first(cp, chunk, window):
    skipped = 0
    for rank in range(cp):
        for step in range(cp):
            src = (rank - step) % cp
            mine, theirs = local_chunks(rank, cp), local_chunks(src, cp)
            pairs = step_pairs(rank, src, cp, chunk, window)
            truth = {(i, j) for i in range(2) for j in range(2) if _visible(mine[i], theirs[j], chunk, window)}
            assert set(pairs) == truth and len(pairs) == len(truth), (rank, src)
            if step == 0:
                assert pairs[:2] == [(0, 0), (1, 1)]  # each row's own position first: no merge into an empty row
            skipped += 4 - len(pairs)
    assert skipped > 0  # the causal mask alone leaves pairs out (the diagonal block's upper pair, later chunks)


@pytest.mark.parametrize("cp, chunk, window", CASES)
def test_shares_are_counted_from_the_visible_pairs(cp, chunk, window):
    """counted: all ranks' pairs over the square; executed: the most loaded rank's over its [s_local, seq];
    saved: each rank's kept query rows (one chunk per pair) in units of s_local."""
    seq, s_local = 2 * cp * chunk, 2 * chunk
    per_rank = [sum(_visible(g, h, chunk, window) for g in local_chunks(r, cp) for s in range(cp)
                    for h in local_chunks(s, cp)) for r in range(cp)]
    counted, executed, saved = ring_window_work(cp, seq, window)
    assert counted == pytest.approx(sum(per_rank) * chunk * chunk / seq ** 2)
    assert executed == pytest.approx(max(per_rank) * chunk * chunk / (s_local * seq))
    assert saved == tuple(n * chunk / s_local for n in per_rank)


def test_without_a_reachable_window_the_pairs_are_the_causal_half_and_its_diagonal():
    # every chunk sees itself and all earlier chunks: 2 cp (2 cp + 1) / 2 pairs of the (2 cp)^2
    for cp in (1, 2, 3, 4, 8):
        counted, _, _ = ring_window_work(cp, 2 * cp * 16, 10**9)
        assert counted == pytest.approx((2 * cp + 1) / (4 * cp))
