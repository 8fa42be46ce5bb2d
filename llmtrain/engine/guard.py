"""Loss-spike and NaN guard of the training loop (recipe ``train.guard``).

After backward and the global gradient norm, every rank judges the step:

* ``loss`` or ``grad norm`` is NaN/inf -> bad ("nan");
* ``loss > spike_factor x median`` of the last ``window`` accepted losses (once at least
  ``min_history`` are known) -> bad ("spike").

The verdicts are OR-ed over the whole world (one 1-element MAX all-reduce, so a NaN seen by a
single tensor-parallel or pipeline rank stops every rank's update). A bad step **skips the
update**: no optimizer step, no MoE bias update, gradients dropped; the learning-rate schedule
and the data position go on (the batch is consumed). After ``max_bad_steps`` bad steps in a
row the trainer **rolls back** to the latest committed checkpoint and jumps the data position
past the offending window (the samples of the bad steps), continuing at the checkpoint's step;
at most ``max_rollbacks`` times per run, then it stops with an error. Everything is printed by
rank 0 and written to ``metrics.jsonl`` (``{"step", "skipped": reason}`` and
``{"rollback": ...}``).

Decision: skipped steps still count as steps (the schedule is a function of the step); a
rollback replays the steps after the checkpoint with *new* data, so a run always ends at
``train.steps`` optimizer-step slots. The running median only contains accepted losses, so a
slow drift upward is followed but a single spike is not.
"""

from __future__ import annotations

import math
import statistics
from collections import deque


class LossGuard:
    """Pure bookkeeping of bad steps; the trainer owns the collectives and the rollback."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.history: deque[float] = deque(maxlen=cfg.window)
        self.bad_in_row = 0
        self.first_bad_sample: int | None = None  # consumed_samples before the first bad step of the row
        self.rollbacks = 0

    @property
    def enabled(self) -> bool:
        return bool(self.cfg.enabled)

    def judge(self, loss: float, grad_norm: float) -> str | None:
        """This rank's verdict: None (good), "nan" or "spike"."""
        if not self.enabled:
            return None
        if not math.isfinite(loss) or not math.isfinite(grad_norm):
            return "nan"
        if self.cfg.spike_factor > 0 and len(self.history) >= self.cfg.min_history:
            if loss > self.cfg.spike_factor * statistics.median(self.history):
                return "spike"
        return None

    def accept(self, loss: float) -> None:
        self.history.append(loss)
        self.bad_in_row = 0
        self.first_bad_sample = None

    def reject(self, consumed_before: int) -> bool:
        """Count a bad step; True when a rollback is due."""
        if self.bad_in_row == 0:
            self.first_bad_sample = consumed_before
        self.bad_in_row += 1
        return self.cfg.max_bad_steps > 0 and self.bad_in_row >= self.cfg.max_bad_steps

    def rolled_back(self) -> None:
        self.rollbacks += 1
        self.bad_in_row = 0
        self.first_bad_sample = None  # the accepted-loss history is kept: it is still the reference


REASON_CODE = {None: 0, "spike": 1, "nan": 2}
CODE_REASON = {v: k for k, v in REASON_CODE.items()}
