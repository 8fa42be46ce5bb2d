"""Batch math: global batch = micro_batch_size x grad_accum x dp, tokens per step, microbatches.

Convention (as in Megatron-Core): ``grad_accum`` is the number of micro-batches each
data-parallel rank processes per optimizer step. Without PP they run one after another with
gradient accumulation; with PP the schedule consumes all of them in one step, so
``microbatches == grad_accum`` and must be >= pp to fill the pipeline.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class BatchMath:
    dp: int
    micro_batch_size: int
    grad_accum: int
    global_batch_size: int
    seq_len: int

    @property
    def microbatches(self) -> int:
        return self.grad_accum

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch_size * self.seq_len

    def to_dict(self) -> dict[str, int]:
        out = asdict(self)
        out.update(microbatches=self.microbatches, tokens_per_step=self.tokens_per_step)
        return out
