"""Compressed data-parallel gradient averaging (zero 0/1): PowerSGD and top-k, with error feedback.

``parallel.grad_compression`` replaces the bucketed all-reduce of
:mod:`llmtrain.engine.parallel.grad_buckets` by one of the reducers below, for every group of
ranks the engine averages over (dense weights over dp x cp, routed experts over expert-DP).
They run at the trainer's ``grad_sync`` (before clipping), on the step's real gradient: after
gradient accumulation and, under PP, after the schedule's ``1 / n``. Decision: **no overlap
with backward**. PowerSGD needs two dependent collectives per matrix (P, then Q from the
orthogonalized P) and top-k a global selection, so nothing can start before a whole gradient
is final; the messages are 10-100x smaller, which is the point. The planner prices them as
phase ``step`` (exposed).

**PowerSGD** (Vogels et al. 2019; torch's ``ddp_comm_hooks/powerSGD_hook.py``). Per gradient
``M`` (a matrix: the local gradient reshaped ``(shape[0], -1)``), with error feedback
``M += e``; ``P = M Q``; all-reduce every ``P`` (one flat buffer); orthogonalize ``P``;
``Q = M^T P``; all-reduce every ``Q`` and divide by the group size; the average is
``P Q^T``; error feedback keeps ``e = M - P Q^T`` (torch's choice: the local input minus the
averaged approximation). Warm start: ``Q`` is kept for the next step and orthogonalized
before it is used again (as torch's hook does). The first ``Q`` comes from a generator seeded
with ``seed`` (the same on every rank: the P all-reduce sums products with one shared ``Q``).

Warm-up (``parallel.powersgd_start_step``, torch's ``start_powerSGD_iter``): the first that
many calls all-reduce the whole gradient in one flat fp32 buffer (averaged, nothing kept);
error feedback and warm start begin with the first compressed step (``e`` = 0, ``Q`` from the
seed). Torch's reason, and ours: the first steps are the most sensitive to a biased gradient,
and a trajectory bent there is not recovered. Left out, it is torch's advice: max(the
learning-rate warm-up, 10 % of ``train.steps``) (plan/comm.py ``powersgd_start``, which the
planner shares). Measured (docs/benchmarks.md, debug recipe, 200 steps): rank 4 at ~20x goes
from +17 % to +6.4 % over the plain all-reduce's final loss with the 20-step warm-up (+4.8 %
with 50); rank 16 (~5x) with it is within 3 %. 1-D tensors and matrices that would not shrink by
``min_compression_rate`` (torch's ``_should_compress``: ``(n + m) r x rate < n m``) are
all-reduced uncompressed, in one flat buffer; ``r = min(rank, n, m)``. Reused from torch:
``_orthogonalize`` (Gram-Schmidt for rank <= 2, QR above) and ``_should_compress``. Not reused:
``PowerSGDState`` / ``powerSGD_hook`` themselves, because the hook is written against DDP's
C++ ``GradBucket`` (``bucket.buffer()``, ``bucket.index()``, ``bucket.is_last()``, a future
chain), which cannot be built outside DDP's reducer, and its state is keyed by bucket index;
the engine has no DDP (TP DTensors, PP stages, its own buckets). The math is the same.

**Top-k** (Stich et al. 2018; Lin et al. 2018, "deep gradient compression" without momentum
correction). All the group's gradients flattened into one vector ``a = g + e``; each rank
picks its ``k = ceil(ratio x N)`` largest ``|a|``; one all-gather of ``k`` fp32 values and
``k`` int32 indices (bit-packed into one ``2k`` fp32 message; gloo all-gathers equal sizes);
every rank sums all ranks' pairs with ``index_add_`` and divides by the group size; error
feedback keeps the unsent part ``e = a`` with the sent entries zeroed.

Error feedback off (``parallel.compression_error_feedback: false``): ``e`` stays 0 (shown to
matter by benchmarks/grad_compression.py).

Checkpoints: each reducer's :meth:`state_dict` (the number of calls, the error-feedback
buffers, PowerSGD's warm-start ``Q``; a fixed set of keys, zeros where nothing exists yet) is
saved with the optimizer state per rank and restored in the same layout and setting, so a
resume is bitwise equal to an uninterrupted run (:mod:`compression_state` says when it is
started afresh instead).

Bytes: :attr:`sent_bytes` is what the last call sent, in the planner's convention
(plan/comm.py: an all-reduce of ``M`` bytes counts ``M``; an all-gather counts the full,
gathered size), so tests compare it with the planner's ``bytes_per_step``.
"""

from __future__ import annotations

from math import ceil, prod

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _orthogonalize, _should_compress

from llmtrain.engine.parallel.data_parallel import local_grad, local_tensor
from llmtrain.errors import LLMTrainError

MIN_COMPRESSION_RATE = 2.0  # torch's PowerSGDState default
# torch's orthogonalization_epsilon (its default 0 divides a zero column by 0: NaN). A zero
# gradient happens (LoRA's A while B is still 0); 1e-8 is the value torch's docstring advises.
ORTHO_EPS = 1e-8


def matrix_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    """The matrix PowerSGD compresses a gradient of ``shape`` as (torch's hook: ``(shape[0], -1)``)."""
    return (shape[0], prod(shape[1:])) if len(shape) >= 2 else (prod(shape), 1)


def powersgd_plan(shape: tuple[int, ...], rank: int, min_rate: float = MIN_COMPRESSION_RATE) -> int:
    """The approximation rank for a gradient of ``shape``; 0 = sent uncompressed (1-D, or too small)."""
    if len(shape) < 2:
        return 0
    n, m = matrix_shape(shape)
    r = min(rank, n, m)
    return r if _should_compress(n, m, r, min_rate)[0] else 0


def topk_count(numel: int, ratio: float) -> int:
    """Entries each rank sends of a flattened gradient of ``numel`` entries."""
    return min(numel, max(1, ceil(ratio * numel))) if numel else 0


def _grads(params: list[nn.Parameter]) -> list[torch.Tensor]:
    """Each parameter's local gradient (a missing one: zeros of the parameter's local shape, as
    the bucketed reducer contributes; it stays ``None``)."""
    return [g if (g := local_grad(p)) is not None else torch.zeros_like(local_tensor(p)) for p in params]


def _write(params: list[nn.Parameter], values: list[torch.Tensor]) -> None:
    for p, v in zip(params, values):
        g = local_grad(p)
        if g is not None:
            g.copy_(v.view_as(g))


class PowerSGDReducer:
    """The ``grad_sync`` of ``params`` over ``group`` (``size`` ranks) with rank-``rank`` PowerSGD."""

    def __init__(self, params: list[nn.Parameter], group, size: int, rank: int, error_feedback: bool = True,
                 seed: int = 0, min_rate: float = MIN_COMPRESSION_RATE, start_step: int = 0):
        self.params = [p for p in params if p.requires_grad]
        self.group, self.size, self.rank = group, size, rank
        self.error_feedback, self.seed, self.min_rate = error_feedback, seed, min_rate
        self.start_step = start_step  # calls of plain all-reduce before PowerSGD starts (warm-up)
        self.calls = 0  # gradient averagings done (the warm-up counter; saved in checkpoints)
        self.errors: dict[int, torch.Tensor] = {}  # parameter index -> e (the shape of M)
        self.qs: dict[int, torch.Tensor] = {}  # parameter index -> warm-start Q (m x r)
        self.sent_bytes = 0

    @property
    def compressing(self) -> bool:
        """Whether the next call compresses (the warm-up is over)."""
        return self.calls >= self.start_step

    @torch.no_grad()
    def __call__(self, _params=None) -> None:
        grads = _grads(self.params)
        warm_up = not self.compressing
        self.calls += 1
        if warm_up:  # torch's start_powerSGD_iter: the plain average, nothing remembered
            self.sent_bytes = 0
            flat = torch.cat([g.float().reshape(-1) for g in grads])
            self._all_reduce(flat)
            flat /= self.size
            _write(self.params, self._split(flat, grads))
            return
        plain, packed = [], []  # (index, tensor) sent uncompressed / (index, M, r) compressed
        for i, g in enumerate(grads):
            r = powersgd_plan(tuple(g.shape), self.rank, self.min_rate)
            if not r:
                plain.append((i, g.float().reshape(-1)))
                continue
            m = g.float().reshape(matrix_shape(tuple(g.shape))).clone()
            if self.error_feedback and i in self.errors:
                if self.errors[i].shape != m.shape:  # only a crafted checkpoint (compression_state.fit_to_saved)
                    raise LLMTrainError(f"the checkpoint's PowerSGD residual {i} has shape {tuple(self.errors[i].shape)}, "
                                        f"this rank's gradient {tuple(m.shape)}", "resume from another checkpoint",
                                        path="--ckpt")
                m += self.errors[i]
            packed.append((i, m, r))
        out: dict[int, torch.Tensor] = {}
        self.sent_bytes = 0
        if plain:
            flat = torch.cat([t for _, t in plain])
            self._all_reduce(flat)
            flat /= self.size
            offset = 0
            for i, t in plain:
                out[i] = flat[offset:offset + t.numel()]
                offset += t.numel()
        if packed:
            qs = [self._q(i, m.shape[1], r) for i, m, r in packed]
            ps = [m @ q for (_, m, _), q in zip(packed, qs)]
            flat_p = self._reduce_all(ps)
            ps = self._split(flat_p, ps)
            for p in ps:
                _orthogonalize(p.unsqueeze(0), ORTHO_EPS)
            qs = [m.T @ p for (_, m, _), p in zip(packed, ps)]
            flat_q = self._reduce_all(qs)
            flat_q /= self.size
            qs = self._split(flat_q, qs)
            for (i, m, _), p, q in zip(packed, ps, qs):
                approx = p @ q.T
                self.qs[i] = q.clone()  # warm start
                if self.error_feedback:
                    self.errors[i] = m - approx
                out[i] = approx
        _write(self.params, [out[i] for i in range(len(grads))])

    def _q(self, index: int, cols: int, r: int) -> torch.Tensor:
        q = self.qs.get(index)
        if q is None:  # the same on every rank: a generator seeded per parameter
            gen = torch.Generator().manual_seed((self.seed * 1_000_003 + index) % 2**63)
            q = torch.randn(cols, r, generator=gen)
        elif q.shape != (cols, r):  # only a crafted checkpoint (compression_state.fit_to_saved)
            raise LLMTrainError(f"the checkpoint's PowerSGD Q {index} has shape {tuple(q.shape)}, this rank's gradient "
                                f"needs ({cols}, {r})", "resume from another checkpoint", path="--ckpt")
        else:  # warm start: last step's averaged Q, orthogonalized again (torch's hook)
            q = q.clone()
        _orthogonalize(q.unsqueeze(0), ORTHO_EPS)
        return q

    def _compressed(self) -> list[tuple[int, tuple[int, int], int]]:
        """(index, matrix shape, rank) of every parameter PowerSGD approximates."""
        out = []
        for i, p in enumerate(self.params):
            shape = tuple(local_tensor(p).shape)
            if r := powersgd_plan(shape, self.rank, self.min_rate):
                out.append((i, matrix_shape(shape), r))
        return out

    def state_dict(self) -> dict[str, torch.Tensor]:
        """What resuming needs, as fresh tensors under a fixed set of keys (zeros where nothing
        exists yet: before the first compressed step, or without error feedback's ``e``)."""
        out = {"calls": torch.tensor([self.calls], dtype=torch.int64)}
        for i, (n, m), r in self._compressed():
            out[f"q.{i}"] = self.qs[i].clone() if i in self.qs else torch.zeros(m, r)
            if self.error_feedback:
                out[f"e.{i}"] = self.errors[i].clone() if i in self.errors else torch.zeros(n, m)
        return out

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.calls = int(state["calls"][0])
        ran = self.calls > self.start_step  # a compressed step happened: e and Q exist
        self.qs, self.errors = {}, {}
        for i, _, _ in self._compressed() if ran else ():
            self.qs[i] = state[f"q.{i}"].clone()
            if self.error_feedback:
                self.errors[i] = state[f"e.{i}"].clone()

    def _reduce_all(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        flat = torch.cat([t.reshape(-1) for t in tensors])
        self._all_reduce(flat)
        return flat

    @staticmethod
    def _split(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
        out, offset = [], 0
        for t in like:
            out.append(flat[offset:offset + t.numel()].view_as(t).clone())  # contiguous, owned (orthogonalized in place)
            offset += t.numel()
        return out

    def _all_reduce(self, flat: torch.Tensor) -> None:
        dist.all_reduce(flat, group=self.group)
        self.sent_bytes += flat.numel() * flat.element_size()


class TopKReducer:
    """The ``grad_sync`` of ``params`` over ``group`` (``size`` ranks): top-``ratio`` sparsification."""

    def __init__(self, params: list[nn.Parameter], group, size: int, ratio: float, error_feedback: bool = True):
        self.params = [p for p in params if p.requires_grad]
        self.group, self.size, self.ratio, self.error_feedback = group, size, ratio, error_feedback
        self.error: torch.Tensor | None = None  # the unsent remainder, flat
        self.calls = 0
        self.sent_bytes = 0

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The calls and the unsent remainder (zeros before the first call; absent without error feedback)."""
        out = {"calls": torch.tensor([self.calls], dtype=torch.int64)}
        if self.error_feedback:
            numel = sum(local_tensor(p).numel() for p in self.params)
            out["e"] = self.error.clone() if self.error is not None else torch.zeros(numel)
        return out

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.calls = int(state["calls"][0])
        self.error = state["e"].clone() if self.error_feedback and self.calls else None

    @torch.no_grad()
    def __call__(self, _params=None) -> None:
        if not self.params:
            return
        self.calls += 1
        grads = _grads(self.params)
        acc = torch.cat([g.float().reshape(-1) for g in grads])
        if acc.numel() >= 2**31:
            raise LLMTrainError("top-k compression packs int32 indices: a data-parallel group's gradient has "
                                f"{acc.numel()} entries (at most 2^31 - 1)", "use grad_compression: powersgd",
                                path="parallel.grad_compression")
        if self.error_feedback and self.error is not None:
            if self.error.shape != acc.shape:  # only a crafted checkpoint (compression_state.fit_to_saved)
                raise LLMTrainError(f"the checkpoint's top-k residual has {self.error.numel()} entries, this rank's "
                                    f"gradient {acc.numel()}", "resume from another checkpoint", path="--ckpt")
            acc += self.error
        k = topk_count(acc.numel(), self.ratio)
        index = acc.abs().topk(k, sorted=False).indices
        message = torch.cat([acc[index], index.to(torch.int32).view(torch.float32)])  # bit-packed indices
        gathered = [torch.empty_like(message) for _ in range(self.size)]
        dist.all_gather(gathered, message, group=self.group)
        self.sent_bytes = self.size * message.numel() * message.element_size()
        total = torch.zeros_like(acc)
        for m in gathered:  # rank order: every rank sums in the same order, bitwise equal results
            total.index_add_(0, m[k:].view(torch.int32).long(), m[:k])
        total /= self.size
        if self.error_feedback:
            acc[index] = 0.0
            self.error = acc
        offset, values = 0, []
        for g in grads:
            values.append(total[offset:offset + g.numel()])
            offset += g.numel()
        _write(self.params, values)


def _noop(_params=None) -> None:
    return None


def build_reducer(kind: str, params: list[nn.Parameter], group, size: int, recipe_parallel, seed: int = 0,
                  start_step: int = 0):
    """The compressed ``grad_sync`` for ``parallel.grad_compression`` (``powersgd`` or ``topk``);
    a group of one rank has nothing to average: a no-op (compressing would only lose precision).
    ``start_step``: PowerSGD's warm-up, resolved (plan/comm.py ``powersgd_start``)."""
    p = recipe_parallel
    if size == 1:
        return _noop
    if kind == "powersgd":
        return PowerSGDReducer(params, group, size, p.powersgd_rank, p.compression_error_feedback, seed,
                               start_step=start_step)
    if kind == "topk":
        return TopKReducer(params, group, size, p.topk_ratio, p.compression_error_feedback)
    raise ValueError(f"unknown grad_compression {kind!r}")
