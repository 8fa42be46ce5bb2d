"""Test hooks of the training loop for checkpoint/resume/guard tests (inactive unless their env is set).

* ``LLMTRAIN_TEST_KILL_AT_STEP=K``: after step K (and its checkpoint save/poll) the rank
  ``LLMTRAIN_TEST_KILL_RANK`` (default: the last rank) SIGKILLs itself — a hard crash, no
  cleanup, torchrun then stops the others. Only in the first attempt: a worker group that
  torchrun restarted (``TORCHELASTIC_RESTART_COUNT`` > 0), or a retried job/step
  (``LLMTRAIN_AUTO_RESUME=1``), is left alone.
* ``LLMTRAIN_TEST_KILL_IN_SAVE=K``: the same rank SIGKILLs itself right after it started the
  (asynchronous) save of step K, before the save can be committed.
* ``LLMTRAIN_TEST_NAN_SAMPLES=i,j,...``: a rank whose step trains on one of these global sample
  positions makes its loss and its gradients NaN (a poisoned batch), before gradient sync.
* ``LLMTRAIN_TEST_SAMPLE_LOG=FILE``: every rank with TP/CP/PP coordinate 0 appends one JSON line
  per step ``{"step", "dp_rank", "positions"}`` (global sample positions it trains on), so a test
  can audit that a resumed run neither skips nor repeats a sample.
"""

from __future__ import annotations

import json
import os
import signal
from dataclasses import dataclass, field

import torch


@dataclass
class TestHooks:
    rank: int
    dp_rank: int
    kill_at: int | None = None
    kill_rank: int | None = None
    sample_log: str | None = None
    kill_in_save: int | None = None
    nan_samples: set[int] = field(default_factory=set)

    @classmethod
    def from_env(cls, rank: int, dp_rank: int, dims) -> "TestHooks":
        env = os.environ
        first_attempt = int(env.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) == 0 and env.get("LLMTRAIN_AUTO_RESUME") != "1"
        kill_at = int(env["LLMTRAIN_TEST_KILL_AT_STEP"]) if env.get("LLMTRAIN_TEST_KILL_AT_STEP") and first_attempt else None
        kill_save = int(env["LLMTRAIN_TEST_KILL_IN_SAVE"]) if env.get("LLMTRAIN_TEST_KILL_IN_SAVE") and first_attempt else None
        kill_rank = int(env.get("LLMTRAIN_TEST_KILL_RANK", dims.world_size - 1))
        log = env.get("LLMTRAIN_TEST_SAMPLE_LOG") or None
        nan = {int(x) for x in env.get("LLMTRAIN_TEST_NAN_SAMPLES", "").split(",") if x.strip()}
        c = dims.coord_dict(rank)
        if log and any(c[k] != 0 for k in ("pp", "cp", "tp")):
            log = None  # one writer per DP rank
        return cls(rank, dp_rank, kill_at, kill_rank, log, kill_save, nan)

    def log_samples(self, step: int, sampler) -> None:
        if self.sample_log:
            positions = [p for micro in sampler.step_positions() for p in micro]
            with open(self.sample_log, "a") as f:
                f.write(json.dumps({"step": step + 1, "dp_rank": self.dp_rank, "positions": positions}) + "\n")

    def maybe_poison(self, sampler, loss: torch.Tensor, params) -> None:
        if not self.nan_samples:
            return
        mine = {p for micro in sampler.step_positions() for p in micro}
        if mine & self.nan_samples:
            with torch.no_grad():
                loss.fill_(float("nan"))
                for p in params:
                    if p.grad is not None:
                        p.grad.mul_(float("nan"))

    def maybe_kill(self, step: int) -> None:
        if self.kill_at is not None and step == self.kill_at and self.rank == self.kill_rank:
            os.kill(os.getpid(), signal.SIGKILL)

    def maybe_kill_in_save(self, step: int) -> None:
        if self.kill_in_save is not None and step == self.kill_in_save and self.rank == self.kill_rank:
            os.kill(os.getpid(), signal.SIGKILL)
