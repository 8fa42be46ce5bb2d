"""Test hooks of the training loop for checkpoint/resume tests (inactive unless their env is set).

* ``LLMTRAIN_TEST_KILL_AT_STEP=K``: after step K (and its checkpoint save/poll) the rank
  ``LLMTRAIN_TEST_KILL_RANK`` (default: the last rank) SIGKILLs itself — a hard crash, no
  cleanup, torchrun then stops the others.
* ``LLMTRAIN_TEST_SAMPLE_LOG=FILE``: every rank with TP/CP/PP coordinate 0 appends one JSON line
  per step ``{"step", "dp_rank", "positions"}`` (global sample positions it trains on), so a test
  can audit that a resumed run neither skips nor repeats a sample.
"""

from __future__ import annotations

import json
import os
import signal
from dataclasses import dataclass


@dataclass
class TestHooks:
    rank: int
    dp_rank: int
    kill_at: int | None = None
    kill_rank: int | None = None
    sample_log: str | None = None

    @classmethod
    def from_env(cls, rank: int, dp_rank: int, dims) -> "TestHooks":
        env = os.environ
        kill_at = int(env["LLMTRAIN_TEST_KILL_AT_STEP"]) if env.get("LLMTRAIN_TEST_KILL_AT_STEP") else None
        kill_rank = int(env.get("LLMTRAIN_TEST_KILL_RANK", dims.world_size - 1))
        log = env.get("LLMTRAIN_TEST_SAMPLE_LOG") or None
        c = dims.coord_dict(rank)
        if log and any(c[k] != 0 for k in ("pp", "cp", "tp")):
            log = None  # one writer per DP rank
        return cls(rank, dp_rank, kill_at, kill_rank, log)

    def log_samples(self, step: int, sampler) -> None:
        if self.sample_log:
            positions = [p for micro in sampler.step_positions() for p in micro]
            with open(self.sample_log, "a") as f:
                f.write(json.dumps({"step": step + 1, "dp_rank": self.dp_rank, "positions": positions}) + "\n")

    def maybe_kill(self, step: int) -> None:
        if self.kill_at is not None and step == self.kill_at and self.rank == self.kill_rank:
            os.kill(os.getpid(), signal.SIGKILL)
