"""Deterministic distributed batch sampler: which dataset indices each DP rank uses in each step.

The data order is a function of the **global sample position** only. Positions are consumed
in order; one optimizer step consumes ``global_batch`` consecutive positions starting at
``consumed_samples``. Within a step, micro-batch ``a`` (``0 <= a < grad_accum``) of data-parallel
rank ``r`` takes::

    start + a * micro * dp + r * micro + [0, micro)        with start = consumed_samples

so the micro-batches of all ranks tile the step's positions without gaps or overlap. Because a
step always covers positions ``[start, start + global_batch)``, the *set* of samples in a step
does not depend on the layout (``dp=2, micro=4`` and ``dp=4, micro=2`` see the same samples,
and only the split between ranks differs). That is what makes a resume on a different number of
DP ranks continue the exact same data stream: the checkpoint only needs ``consumed_samples``.

Position ``p`` maps to a dataset index through a seeded permutation per epoch: ``epoch = p //
dataset_len`` and ``index = perm_epoch[p % dataset_len]`` with ``perm_epoch =
Generator(PCG64(seed + epoch)).permutation(dataset_len)`` (cached, a couple of epochs at a
time; a step may straddle an epoch boundary). For an infinite dataset (``dataset_len=None``,
the synthetic Markov chain, whose samples are already i.i.d. given the seed) ``index = p``.
``shuffle=False`` uses ``p % dataset_len``.

Which ranks pass which ``dp_rank``: all ranks that hold one model replica-shard together (its
TP, CP and PP ranks) must see the same samples, so they pass the same ``dp_rank`` = the rank's
flattened coordinate on the ``dp_replicate x dp_shard`` mesh dims, and ``dp_size =
dp_replicate * dp_shard``. (EP borrows dp_shard ranks, which keep their own dp_rank.) CP ranks take the same samples and split the
sequence themselves; with PP the first stage consumes inputs and the last stage labels, and
both must use the same indices (the other stages may simply skip loading).
"""

from __future__ import annotations

import operator
from collections import OrderedDict

import numpy as np

from llmtrain.errors import LLMTrainError

PERM_CACHE = 3  # epochs kept; a step straddles at most a few if global_batch <= dataset_len


class BatchSampler:
    """Per-rank view of the global, deterministic sample stream (see module docstring)."""

    def __init__(self, dataset_len: int | None, global_batch: int, micro_batch: int, dp_rank: int,
                 dp_size: int, seed: int, shuffle: bool = True):
        if dataset_len is not None and dataset_len < 1:
            raise LLMTrainError(f"dataset has {dataset_len} samples", "prepare more data or lower train.seq_len")
        if micro_batch < 1 or dp_size < 1 or global_batch < 1:
            raise LLMTrainError(f"global_batch {global_batch}, micro_batch {micro_batch}, dp {dp_size} must all be >= 1",
                                "fix train.global_batch_size / train.micro_batch_size")
        if global_batch % (micro_batch * dp_size):
            raise LLMTrainError(
                f"global batch {global_batch} is not divisible by micro_batch {micro_batch} x dp {dp_size} = {micro_batch * dp_size}",
                "make train.global_batch_size a multiple of micro_batch_size x dp", path="train.global_batch_size")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} not in [0, {dp_size})")
        self.dataset_len = dataset_len
        self.global_batch = int(global_batch)
        self.micro_batch = int(micro_batch)
        self.dp_rank = int(dp_rank)
        self.dp_size = int(dp_size)
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        self.grad_accum = self.global_batch // (self.micro_batch * self.dp_size)
        self.consumed_samples = 0
        self._perms: OrderedDict[int, np.ndarray] = OrderedDict()

    # -- position -> index ----------------------------------------------------------------------

    def _permutation(self, epoch: int) -> np.ndarray:
        perm = self._perms.get(epoch)
        if perm is None:
            perm = np.random.Generator(np.random.PCG64(self.seed + epoch)).permutation(self.dataset_len)
            self._perms[epoch] = perm
            while len(self._perms) > PERM_CACHE:
                self._perms.popitem(last=False)
        else:
            self._perms.move_to_end(epoch)
        return perm

    def indices_of(self, positions: np.ndarray) -> list[int]:
        """Dataset indices of global positions (vectorized; positions may span epochs)."""
        positions = np.asarray(positions, dtype=np.int64)
        if self.dataset_len is None:
            return positions.tolist()
        epochs, offsets = np.divmod(positions, self.dataset_len)
        if not self.shuffle:
            return offsets.tolist()
        out = np.empty_like(positions)
        for epoch in np.unique(epochs).tolist():
            mask = epochs == epoch
            out[mask] = self._permutation(epoch)[offsets[mask]]
        return out.tolist()

    # -- the step API ---------------------------------------------------------------------------

    def step_positions(self) -> list[list[int]]:
        """Global positions of this rank's ``grad_accum`` micro-batches for the next step."""
        micro, dp = self.micro_batch, self.dp_size
        base = self.consumed_samples + self.dp_rank * micro
        return [list(range(base + a * micro * dp, base + a * micro * dp + micro)) for a in range(self.grad_accum)]

    def step_indices(self) -> list[list[int]]:
        """Dataset indices of this rank's micro-batches for the next step (does not advance)."""
        positions = self.step_positions()
        flat = self.indices_of(np.array(positions, dtype=np.int64).ravel())
        m = self.micro_batch
        return [flat[a * m:(a + 1) * m] for a in range(self.grad_accum)]

    def advance(self) -> None:
        """Mark one optimizer step as consumed (call after the step succeeded)."""
        self.consumed_samples += self.global_batch

    @property
    def epoch(self) -> int:
        """Epoch of the next sample position (0 for an infinite dataset)."""
        return 0 if self.dataset_len is None else self.consumed_samples // self.dataset_len

    # -- checkpointing --------------------------------------------------------------------------

    def state_dict(self) -> dict[str, int]:
        return {"consumed_samples": self.consumed_samples}

    def load_state_dict(self, state: dict) -> None:
        consumed = state.get("consumed_samples") if isinstance(state, dict) else None
        try:  # accept int-likes (numpy ints, 0-d tensors) as checkpoint loaders may return them
            consumed = None if isinstance(consumed, bool) else operator.index(consumed)
        except TypeError:
            consumed = None
        if consumed is None or consumed < 0:
            raise LLMTrainError(f"sampler state {state!r} has no valid consumed_samples",
                                "the checkpoint's data state is damaged; resume from another checkpoint")
        self.consumed_samples = consumed

    def __repr__(self) -> str:
        return (f"BatchSampler(dataset_len={self.dataset_len}, global_batch={self.global_batch}, micro={self.micro_batch}, "
                f"grad_accum={self.grad_accum}, dp_rank={self.dp_rank}/{self.dp_size}, consumed={self.consumed_samples})")
