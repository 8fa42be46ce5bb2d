"""Data pipeline, the pure-logic part: the batch sampler (determinism, data-parallel slices, epochs,
layout independence, resume) and the synthetic Markov chain (index-addressable, exact entropy rate,
stationary start). Split from tests/test_data.py by concept; statistical tolerances are stated.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from llmtrain.engine.data import BatchSampler, MarkovChain
from llmtrain.errors import LLMTrainError


# -- sampler ---------------------------------------------------------------------------


def all_steps(sampler: BatchSampler, steps: int) -> list[list[list[int]]]:
    out = []
    for _ in range(steps):
        out.append(sampler.step_indices())
        sampler.advance()
    return out


def test_sampler_deterministic_and_dp_slices_tile_the_step():
    a = all_steps(BatchSampler(100, 16, 2, 1, 4, seed=7), 10)
    b = all_steps(BatchSampler(100, 16, 2, 1, 4, seed=7), 10)
    assert a == b and a != all_steps(BatchSampler(100, 16, 2, 1, 4, seed=8), 10)
    samplers = [BatchSampler(None, 24, 3, r, 2, seed=0) for r in range(2)]  # grad_accum 4
    for step in range(3):
        positions = [s.step_positions() for s in samplers]
        flat = [p for rank in positions for micro in rank for p in micro]
        assert len(flat) == 24 and set(flat) == set(range(24 * step, 24 * step + 24))
        assert all(len(rank) == 4 and all(len(m) == 3 for m in rank) for rank in positions)
        assert [s.step_indices() for s in samplers] == positions  # infinite dataset: index = position
        for s in samplers:
            s.advance()


def test_sampler_epoch_covers_every_index_once():
    n = 48
    seen = [i for s in all_steps(BatchSampler(n, 8, 2, 0, 1, seed=3), n // 8) for m in s for i in m]
    assert sorted(seen) == list(range(n)) and seen != list(range(n))  # a permutation, shuffled
    ranks = [BatchSampler(n, 8, 1, r, 4, seed=3) for r in range(4)]
    per_rank = [[i for s in all_steps(sampler, 2 * n // 8) for m in s for i in m] for sampler in ranks]
    epoch0 = [i for r in per_rank for i in r[:len(r) // 2]]
    epoch1 = [i for r in per_rank for i in r[len(r) // 2:]]
    assert sorted(epoch0) == sorted(epoch1) == list(range(n))
    unshuffled = [i for s in all_steps(BatchSampler(n, 8, 2, 0, 1, seed=3, shuffle=False), 7) for m in s for i in m]
    assert unshuffled == list(range(n)) + list(range(8))
    # a global batch larger than the dataset straddles epochs: positions 0..9 are two full epochs
    ranks = [BatchSampler(5, 12, 3, r, 2, seed=1) for r in range(2)]
    big = sorted(i for s in ranks for m in s.step_indices() for i in m)
    assert big == sorted(ranks[0].indices_of(range(12))) and sorted(ranks[0].indices_of(range(10))) == sorted(list(range(5)) * 2)


def step_sets(dataset_len, global_batch, micro, dp, steps, seed=11):
    samplers = [BatchSampler(dataset_len, global_batch, micro, r, dp, seed) for r in range(dp)]
    sets = []
    for _ in range(steps):
        sets.append(sorted(i for s in samplers for m in s.step_indices() for i in m))
        for s in samplers:
            s.advance()
    return sets


@pytest.mark.parametrize("dataset_len", [None, 37])
def test_sampler_steps_independent_of_layout(dataset_len):
    reference = step_sets(dataset_len, 16, 4, 2, 6)
    assert step_sets(dataset_len, 16, 2, 4, 6) == reference
    assert step_sets(dataset_len, 16, 1, 1, 6) == reference
    assert step_sets(dataset_len, 16, 8, 2, 6) == reference


def test_sampler_state_dict_resumes_exactly():
    full = all_steps(BatchSampler(50, 12, 2, 1, 3, seed=5), 9)
    first = BatchSampler(50, 12, 2, 1, 3, seed=5)
    all_steps(first, 4)
    state = json.loads(json.dumps(first.state_dict()))  # survives serialization
    assert state == {"consumed_samples": 48}
    resumed = BatchSampler(50, 12, 2, 1, 3, seed=5)
    resumed.load_state_dict(state)
    assert all_steps(resumed, 5) == full[4:]
    # resuming on a different DP size continues the same global stream
    sets_after = step_sets(50, 12, 2, 3, 9)[4:]
    other = [BatchSampler(50, 12, 3, r, 2, seed=11) for r in range(2)]
    for s in other:
        s.load_state_dict({"consumed_samples": np.int64(48)})
    for expected in sets_after:
        assert sorted(i for s in other for m in s.step_indices() for i in m) == expected
        for s in other:
            s.advance()
    with pytest.raises(LLMTrainError, match="consumed_samples"):
        resumed.load_state_dict({"consumed": 3})


def test_sampler_rejects_indivisible_batch():
    with pytest.raises(LLMTrainError, match="not divisible by micro_batch 3 x dp 2 = 6"):
        BatchSampler(None, 16, 3, 0, 2, seed=0)


# -- synthetic Markov chain ------------------------------------------------------------


def test_markov_deterministic_and_index_addressable():
    a, b = MarkovChain(512, 256, seed=3), MarkovChain(512, 256, seed=3)
    first = {i: a.sample(i) for i in (5, 0, 1000)}
    assert all(np.array_equal(first[i], b.sample(i)) for i in (1000, 0, 5, 5))  # any order, any instance
    assert not np.array_equal(a.sample(0), a.sample(1))
    assert not np.array_equal(a.sample(0), MarkovChain(512, 256, seed=4).sample(0))
    s = a.sample(7)
    assert s.shape == (257,) and s.dtype == np.int64 and 0 <= s.min() and s.max() < 512
    allowed = {(x, y) for x in range(512) for y in a.successors[x].tolist()}
    assert all((x, y) in allowed for x, y in zip(s[:-1].tolist(), s[1:].tolist()))
    assert 0.3 < a.entropy_rate() < math.log(4) < a.uniform_entropy()


def test_markov_entropy_rate_is_exact_and_matches_empirical():
    chain = MarkovChain(16, 4096, seed=1)
    # exact: the stationary distribution equals the dense eigenvector of P^T for eigenvalue 1
    P = chain.transition_matrix()
    w, v = np.linalg.eig(P.T)
    pi = np.real(v[:, np.argmin(np.abs(w - 1))])
    pi /= pi.sum()
    assert np.abs(pi - chain.stationary).max() < 1e-10
    rows = -np.sum(np.where(P > 0, P * np.log(np.where(P > 0, P, 1)), 0), axis=1)
    assert abs(chain.entropy_rate() - float(pi @ rows)) < 1e-10
    # empirical plug-in conditional entropy from 49 x 4096 = 200k transitions. Its standard error
    # is ~sqrt(Var(-log p)/N) ~ 2e-3 and its bias ~(#transitions - #states)/(2N) ~ 1e-4, so 0.01 nats
    # is a ~5-sigma tolerance.
    counts = np.zeros((16, 16))
    for i in range(49):
        s = chain.sample(i)
        np.add.at(counts, (s[:-1], s[1:]), 1)
    joint = counts / counts.sum()
    cond = counts / counts.sum(axis=1, keepdims=True).clip(min=1)
    empirical = -np.sum(np.where(counts > 0, joint * np.log(np.where(cond > 0, cond, 1)), 0))
    assert abs(empirical - chain.entropy_rate()) < 0.01, (empirical, chain.entropy_rate())


def test_markov_samples_start_from_the_stationary_distribution():
    # 20000 first tokens over V=16 states: the expected total-variation distance to pi is
    # ~0.5 * sum_s sqrt(2 pi_s / (pi N)) <= 0.012; 0.03 is a comfortable bound. A uniform start
    # would be off by TV(uniform, pi), asserted > 0.1 for this seed so the test can tell them apart.
    chain = MarkovChain(16, 1, seed=1)
    firsts = np.array([chain.sample(i)[0] for i in range(20000)])
    freq = np.bincount(firsts, minlength=16) / len(firsts)
    assert 0.5 * np.abs(freq - chain.stationary).sum() < 0.03
    assert 0.5 * np.abs(np.full(16, 1 / 16) - chain.stationary).sum() > 0.1
