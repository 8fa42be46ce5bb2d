"""Training quality on synthetic data: the loss approaches the data's known entropy floor.

The synthetic source is a seeded Markov chain whose entropy rate is computed exactly, so the
best achievable mean cross-entropy is known: rate + (H(start) - rate) / seq_len (the first
token of each sample has no context). A tiny model (vocab 64) trained for 150 steps must get
within 0.1 nats of that floor from ~ln(64) = 4.16 at the start; a broken model, loss scaling
or data/label misalignment stalls far above it (ln 4 ~ 1.4 nats of slack for k=4 successors).
"""

from __future__ import annotations

import math

import numpy as np

from llmtrain.engine.data import MarkovChain
from tests.distrun import run_cases

VOCAB, SEQ, STEPS, SEED = 64, 64, 150, 0


def test_loss_approaches_entropy_floor(tmp_path):
    case = {"name": "floor", "set": [f"model.vocab_size={VOCAB}", f"train.seq_len={SEQ}", "train.micro_batch_size=16",
                                     "train.global_batch_size=16", "parallel.tp=1", "parallel.zero=0",
                                     "train.optimizer.lr=0.01", f"train.seed={SEED}", "train.schedule.warmup_steps=10"]}
    losses = run_cases(tmp_path, 1, "recipes/debug.yaml", [case], STEPS)["floor"]["losses"]
    chain = MarkovChain(VOCAB, SEQ, SEED)
    rate = chain.entropy_rate()
    pi = chain.stationary
    start_entropy = float(-(pi[pi > 0] * np.log(pi[pi > 0])).sum())
    floor = rate + (start_entropy - rate) / SEQ
    final = float(np.mean(losses[-10:]))
    print(f"start {losses[0]:.4f}  final (mean of last 10) {final:.4f}  floor {floor:.4f}  rate {rate:.4f}")
    assert abs(losses[0] - math.log(VOCAB)) < 0.3, f"untrained loss {losses[0]:.3f} should be ~ln({VOCAB})"
    assert final >= floor - 0.05, f"final {final:.3f} below the entropy floor {floor:.3f}: labels leak into inputs?"
    assert final - floor < 0.1, f"final loss {final:.3f} is not within 0.1 nats of the floor {floor:.3f}"
