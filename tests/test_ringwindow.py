"""The rule by which ring CP runs a windowed layer's chunk pairs (llmtrain/plan/ringwindow.py), against brute force.

The engine runs exactly the pairs :func:`step_pairs` lists (engine/parallel/context_ring_window.py) and the
planner counts them, so the rule must equal the truth: a (query chunk, key chunk) pair is visible iff some
(query, key) of it lies in the causal band ``0 <= p - q < window``, checked here position by position over
the ring's zigzag chunks (pure Python, exact); the diagonal pairs come first; every step's pairs together
cover every visible score of the rank's rows against that step's K/V exactly once; each pair runs the
bounding box of its visible scores, which is tight. The neighbour exchange
(engine/parallel/context_exchange.py) moves exactly the keys those boxes read, each send matched by its
receiver's receive at the same step.
"""

from __future__ import annotations

import pytest

from llmtrain.plan.ringwindow import (exchange_plan, exchange_tokens, local_chunks, pair_box, ring_window_work,
                                     step_boxes, step_pairs, use_exchange)

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


def _box(g: int, h: int, chunk: int, window: int) -> tuple[int, int, int, int] | None:
    """The bounding box of pair (g, h)'s visible scores, offsets inside the chunks, by brute force."""
    seen = [(p - g * chunk, q - h * chunk) for p in range(g * chunk, (g + 1) * chunk)
            for q in range(h * chunk, (h + 1) * chunk) if 0 <= p - q < window]
    if not seen:
        return None
    rows, keys = [p for p, _ in seen], [q for _, q in seen]
    return min(rows), max(rows) + 1, min(keys), max(keys) + 1


@pytest.mark.parametrize("cp, chunk, window", CASES)
def test_each_pair_runs_the_tight_box_of_its_visible_scores(cp, chunk, window):
    for g in range(2 * cp):
        for h in range(2 * cp):
            r0, r1, k0, k1 = pair_box(g, h, chunk, window)
            truth = _box(g, h, chunk, window)
            if truth is None:
                assert r0 >= r1 or k0 >= k1, (g, h)
            else:
                assert (r0, r1, k0, k1) == truth, (g, h)
                if g != h:  # another chunk's keys: every box ends at the chunk's end (the exchange's suffixes)
                    assert k1 == chunk
    assert pair_box(3, 3, chunk, window) == (0, chunk, 0, chunk)  # the diagonal runs whole
    assert pair_box(3, 2, chunk, None) == (0, chunk, 0, chunk)  # no window: every earlier chunk whole


@pytest.mark.parametrize("cp, chunk, window", CASES)
def test_shares_are_counted_from_the_visible_boxes(cp, chunk, window):
    """counted: all ranks' boxes over the square; executed: the most loaded rank's over its [s_local, seq];
    saved: each rank's kept query rows (each box's rows) in units of s_local."""
    seq, s_local = 2 * cp * chunk, 2 * chunk
    boxes = [[b for s in range(cp) for g in local_chunks(r, cp) for h in local_chunks(s, cp)
              if (b := _box(g, h, chunk, window))] for r in range(cp)]
    area = [sum((r1 - r0) * (k1 - k0) for r0, r1, k0, k1 in bs) for bs in boxes]
    counted, executed, saved = ring_window_work(cp, seq, window)
    assert counted == pytest.approx(sum(area) / seq ** 2)
    assert executed == pytest.approx(max(area) / (s_local * seq))
    assert saved == pytest.approx(tuple(sum(r1 - r0 for r0, r1, _, _ in bs) / s_local for bs in boxes))


def test_without_a_reachable_window_the_pairs_are_the_causal_half_and_its_diagonal():
    # every chunk sees itself and all earlier chunks: 2 cp (2 cp + 1) / 2 pairs of the (2 cp)^2
    for cp in (1, 2, 3, 4, 8):
        counted, _, _ = ring_window_work(cp, 2 * cp * 16, 10**9)
        assert counted == pytest.approx((2 * cp + 1) / (4 * cp))


@pytest.mark.parametrize("cp, chunk, window", CASES)
def test_exchange_moves_exactly_the_keys_the_visible_boxes_read(cp, chunk, window):
    plan = exchange_plan(cp, chunk, window)
    for rank in range(cp):
        steps = {t: (recv, send) for t, recv, send in plan[rank]}
        assert sorted(steps) == [t for t, _, _ in plan[rank]]  # increasing steps: the P2P order of every rank
        for t in range(1, cp):
            src, dst = (rank - t) % cp, (rank + t) % cp
            need: dict[int, int] = {}  # src's local chunk -> the first of its keys some box of this rank reads
            for g in local_chunks(rank, cp):
                for j, h in enumerate(local_chunks(src, cp)):
                    if (b := _box(g, h, chunk, window)):
                        need[j] = min(need.get(j, chunk), b[2])
            recv, send = steps.get(t, ((), ()))
            assert dict(recv) == need and [j for j, _ in recv] == sorted(need), (rank, t)
            for i, j, r0, r1, k0, k1 in step_boxes(rank, src, cp, chunk, window):  # what runs is what came
                assert k0 >= dict(recv)[j] and k1 == chunk
            # what this rank sends at step t is what rank r + t receives at step t, in the same order
            their = {t2: r2 for t2, r2, _ in plan[dst]}
            assert send == their.get(t, ()), (rank, t)
    sent = [sum(chunk - k0 for _, _, s in p for _, k0 in s) for p in plan]
    received = [sum(chunk - k0 for _, r, _ in p for _, k0 in r) for p in plan]
    assert sum(sent) == sum(received)
    busiest = max(range(cp), key=lambda r: (max(sent[r], received[r]), sent[r], received[r]))
    assert exchange_tokens(cp, chunk, window) == (sent[busiest], received[busiest])


def test_the_exchange_is_chosen_where_it_moves_at_most_half_the_rings_keys():
    # a window within one chunk: each rank needs the last window - 1 keys of its neighbours' chunks, 2 (w - 1)
    # tokens of K/V per forward pass instead of the ring's 2 (cp - 1) chunks
    assert exchange_tokens(8, 8192, 1024) == (2046, 2046) and use_exchange(8, 8192, 1024)  # Gemma 3 at 128K
    assert exchange_tokens(4, 8, 8) == (14, 14) and use_exchange(4, 8, 8)
    # a window of several chunks at cp 4: the busiest rank receives 256 tokens, more than (cp - 1) c = 192: the ring
    assert exchange_tokens(4, 64, 150) == (192, 256) and not use_exchange(4, 64, 150)
    # no window, or one as long as the row: the ring (the exchange would move everything)
    assert not use_exchange(4, 8, None) and not use_exchange(4, 8, 64) and not use_exchange(1, 8, 4)
    # a window of one token: nothing to exchange
    assert exchange_plan(4, 8, 1) == ((), (), (), ()) and use_exchange(4, 8, 1)
