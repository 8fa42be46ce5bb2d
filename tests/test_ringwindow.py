"""The rule by which ring CP runs a windowed layer's chunk pairs (llmtrain/plan/ringwindow.py), against brute force.

The engine runs exactly the pairs :func:`step_pairs` lists (engine/parallel/context_ring_window.py) and the
planner counts them, so the rule must equal the truth: a (query chunk, key chunk) pair is visible iff some
(query, key) of it lies in the causal band ``0 <= p - q < window``, checked here position by position over
the ring's zigzag chunks (pure Python, exact); the diagonal pairs come first; every step's pairs together
cover every visible score of the rank's rows against that step's K/V exactly once. The neighbour
exchange (engine/parallel/context_exchange.py) moves exactly the chunks those pairs read, each send matched
by its receiver's receive at the same step.
"""

from __future__ import annotations

import pytest

from llmtrain.plan.ringwindow import (exchange_chunks, exchange_plan, local_chunks, ring_window_work, step_pairs,
                                     use_exchange)

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


@pytest.mark.parametrize("cp, chunk, window", CASES)
def test_exchange_moves_exactly_the_chunks_the_visible_pairs_read(cp, chunk, window):
    plan = exchange_plan(cp, chunk, window)
    for rank in range(cp):
        steps = {t: (recv, send) for t, recv, send in plan[rank]}
        assert sorted(steps) == [t for t, _, _ in plan[rank]]  # increasing steps: the P2P order of every rank
        for t in range(1, cp):
            src, dst = (rank - t) % cp, (rank + t) % cp
            mine = local_chunks(rank, cp)
            need = {j for i in range(2) for j in range(2)
                    if _visible(mine[i], local_chunks(src, cp)[j], chunk, window)}
            recv, send = steps.get(t, ((), ()))
            assert set(recv) == need, (rank, t)
            # what this rank sends at step t is what rank r + t receives at step t, in the same order
            their = {t2: r2 for t2, r2, _ in plan[dst]}
            assert send == their.get(t, ()), (rank, t)
    sent = [sum(len(s) for _, _, s in p) for p in plan]
    received = [sum(len(r) for _, r, _ in p) for p in plan]
    assert sum(sent) == sum(received)
    busiest = max(range(cp), key=lambda r: (max(sent[r], received[r]), sent[r], received[r]))
    assert exchange_chunks(cp, chunk, window) == (sent[busiest], received[busiest])


def test_the_exchange_is_chosen_where_it_moves_at_most_half_the_rings_chunks():
    # a window within one chunk: each rank needs its neighbours' chunks only (2 of the ring's 2 (cp - 1))
    assert exchange_chunks(8, 64, 64) == (2, 2) and use_exchange(8, 64, 64)
    assert exchange_chunks(4, 8, 8) == (2, 2) and use_exchange(4, 8, 8)
    # a window of several chunks at cp 4: rank 1 sends 5 chunks, more than cp - 1 = 3: the ring
    assert exchange_chunks(4, 64, 150) == (5, 3) and not use_exchange(4, 64, 150)
    # no window, or one as long as the row: the ring (the exchange would move everything)
    assert not use_exchange(4, 8, None) and not use_exchange(4, 8, 64) and not use_exchange(1, 8, 4)
