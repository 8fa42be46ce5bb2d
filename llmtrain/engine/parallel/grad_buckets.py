"""Bucketed gradient averaging for zero 0/1, overlapped with the last micro batch's backward.

The way torch DDP's reducer and Megatron's ``--overlap-grad-reduce`` work, written for our
parameters (plain tensors and tensor-parallel DTensors, whose local shards are reduced: every
DP rank holds the same TP shard layout, so the flat buffers line up):

- **Buckets.** The trainable parameters, in *reverse registration order* (backward produces the
  output layer's gradients first and the embedding's last), are cut into buckets of about
  ``bucket_bytes`` (``parallel.dp_bucket_mb``); a bucket never mixes gradient dtypes. Frozen
  parameters (LoRA's base) have no gradient and are not in any bucket.
- **Overlap.** :meth:`BucketedGradReducer.expect_backwards` ``(n)`` arms the reducer for a step
  of ``n`` backward passes (gradient accumulation: one per micro batch). A
  ``register_post_accumulate_grad_hook`` counts each parameter's accumulations; at its ``n``-th
  the parameter's gradient is final, and once every parameter of a bucket is final the bucket is
  flattened (a copy) and its ``all_reduce`` starts with ``async_op=True`` while autograd goes on
  with the earlier layers. Earlier micro batches only accumulate (their hook calls count).
- **Order.** Buckets start strictly in index order (a ready bucket waits for the ones before
  it), so every rank issues the same sequence of collectives on the group even if a parameter
  missed a gradient on one rank: gloo and NCCL match collectives by order.
- **Finish.** :meth:`__call__` (the trainer's ``grad_sync``, before clipping) starts whatever
  has not started (a parameter that got no gradient in some micro batch, or an un-armed step:
  PP, see below), waits for every bucket, and writes ``sum / size`` back into the gradients.
  A missing local gradient contributes zeros and stays ``None``.
- **bf16** (``parallel.reduce_dtype: bf16``): the flat bucket is cast to bf16, summed in bf16
  (half the bytes; each sum rounds to 8 significant bits, ~2^-8 relative), cast back to fp32
  and divided by the group size in fp32.

Pipeline parallelism (gpipe and 1f1b only, :data:`OVERLAP_SCHEDULES`): the schedule runs the
backward of every micro batch on the stage, so a parameter is accumulated ``n_microbatches``
times per step and the ``n``-th hook call is its last: the same count works
(``expect_backwards(n, rescale=n)``). The schedule divides gradients by ``n_microbatches`` after
its last backward (``scale_grads``), i.e. after the buckets started in backward were copied, so
those reductions are divided by ``n`` at finish too (a bucket written back early, inside
backward, gets the schedule's division itself); a bucket that only starts at finish holds
already-scaled gradients, which are multiplied back by ``n`` first, so every rank contributes
the same unscaled quantity whichever way its bucket started. Not armed (post-backward path,
same buckets and dtype): interleaved-1f1b gave wrong gradients when armed (measured: grad norm
off by ~50 % at pp 2 x dp 2, cause not found: its multi-stage runtime must accumulate some
weight gradients outside the once-per-micro-batch pattern the count relies on), and the
zero-bubble schedules (zero-bubble, zbv, dualpipev) assign most weight gradients themselves
(``pipelining/_backward.stage_backward_weight``: no hook fires), so nothing would overlap.
(Torch's dynamic shape inference would run an extra real backward at the first step; the
engine always gives the stages static shapes.)

Memory: each bucket's flat copy lives until its reduction is written back. Whenever a bucket
starts inside backward, the earlier buckets whose collective has already completed are written
back and freed (``Work.is_completed``, no waiting), so in practice only the buckets in flight
hold copies; in the worst case (the network slower than the whole backward) all of them do
until :meth:`__call__`: one gradient-sized buffer in the reduce dtype, as DDP without
``gradient_as_bucket_view``. (Making the gradients views of persistent flat buffers would
avoid the copy, but TP's DTensor gradients and the pipeline schedule's in-place rescaling of
gradients while their bucket is in flight rule it out here.)
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from llmtrain.engine.parallel.data_parallel import local_grad, local_tensor

OVERLAP_SCHEDULES = ("gpipe", "1f1b")  # pipeline schedules whose backward the buckets overlap (docstring)


class _Bucket:
    __slots__ = ("final", "flat", "params", "sizes", "work")

    def __init__(self, params: list[nn.Parameter]):
        self.params = params
        self.final = 0  # parameters whose gradient is final this step
        self.flat: torch.Tensor | None = None
        self.work = None
        self.sizes: list[int] = []  # numel of each gradient piece in ``flat`` (0: no gradient)


def plan_buckets(params: list[nn.Parameter], bucket_bytes: int) -> list[list[nn.Parameter]]:
    """``params`` (already in the order their gradients become final) cut into buckets of about
    ``bucket_bytes``: a bucket closes once it reaches the cap or before the dtype changes."""
    buckets: list[list[nn.Parameter]] = []
    current: list[nn.Parameter] = []
    nbytes = 0
    for p in params:
        t = local_tensor(p)
        if current and local_tensor(current[-1]).dtype != t.dtype:
            buckets.append(current)
            current, nbytes = [], 0
        current.append(p)
        nbytes += t.numel() * t.element_size()
        if nbytes >= bucket_bytes:
            buckets.append(current)
            current, nbytes = [], 0
    if current:
        buckets.append(current)
    return buckets


class BucketedGradReducer:
    """Average the gradients of ``params`` over ``group`` (``size`` ranks), bucket by bucket.

    ``params`` must be in registration (forward) order; the buckets take them reversed.
    ``on_launch`` (tests, benchmarks) is called with the bucket index whenever a bucket's
    collective starts, and ``in_backward`` tells whether that happened inside a hook.
    """

    def __init__(self, params: list[nn.Parameter], group: dist.ProcessGroup, size: int, bucket_bytes: int,
                 reduce_dtype: torch.dtype | None = None):
        self.group, self.size, self.reduce_dtype = group, size, reduce_dtype
        trainable = [p for p in params if p.requires_grad]
        self.buckets = [_Bucket(b) for b in plan_buckets(list(reversed(trainable)), bucket_bytes)]
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self._count: dict[int, int] = {}
        self._expected = 0  # backward passes that make a gradient final; 0 = not armed
        self._rescale = 1.0
        self._next = 0  # index of the next bucket to start
        self._drained = 0
        self.on_launch = None
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in trainable] if size > 1 else []

    # ---- overlap -------------------------------------------------------------------------------
    def expect_backwards(self, n: int, rescale: float = 1.0) -> None:
        """Arm for a step of ``n`` backward passes: start each bucket during the last one.
        ``rescale``: the factor the caller divides the gradients by after the last backward
        (the pipeline schedule's ``scale_grads``: ``n``), see the module docstring."""
        self._reset()
        self._expected = n if self.size > 1 else 0
        self._rescale = rescale if self._expected else 1.0

    def _on_grad(self, param: nn.Parameter) -> None:
        if not self._expected:
            return
        key = id(param)
        count = self._count.get(key, 0) + 1
        self._count[key] = count
        if count == self._expected:
            bucket = self._bucket_of[key]
            bucket.final += 1
            if bucket.final == len(bucket.params):
                self._start_ready(in_backward=True)

    def _start_ready(self, in_backward: bool) -> None:
        while self._next < len(self.buckets) and self.buckets[self._next].final == len(self.buckets[self._next].params):
            self._start(self._next, in_backward)

    @torch.no_grad()
    def _start(self, index: int, in_backward: bool) -> None:
        bucket = self.buckets[index]
        # A gradient's local tensor need not have its parameter's local shape: with TP the
        # embedding's gradient comes back Replicate for a Shard(0) weight. The pieces are laid out
        # by the gradients' sizes, which every DP rank shares (same layout, same placements).
        pieces, bucket.sizes = [], []
        for p in bucket.params:
            g = local_grad(p)
            pieces.append((g if g is not None else torch.zeros_like(local_tensor(p))).reshape(-1))
            bucket.sizes.append(0 if g is None else g.numel())
        flat = torch.cat(pieces)
        if not in_backward and self._rescale != 1.0:  # already scaled by the schedule: undo (docstring)
            flat.mul_(self._rescale)
        if self.reduce_dtype is not None and flat.dtype != self.reduce_dtype:
            flat = flat.to(self.reduce_dtype)
        bucket.flat = flat
        bucket.work = dist.all_reduce(flat, group=self.group, async_op=True)
        self._next = index + 1
        if self.on_launch is not None:
            self.on_launch(index, in_backward)
        if in_backward:  # free the flat copies of buckets already reduced (memory: docstring)
            while self._drained < index and self.buckets[self._drained].work.is_completed():
                self._unflatten(self.buckets[self._drained], self.size)  # PP: the schedule's 1/n follows
                self._drained += 1

    # ---- finish --------------------------------------------------------------------------------
    @torch.no_grad()
    def __call__(self, _params=None) -> None:
        """Start what has not started, wait for every bucket, write the averages back."""
        if self.size == 1:
            return
        while self._next < len(self.buckets):
            self._start(self._next, in_backward=False)
        for bucket in self.buckets[self._drained:]:
            bucket.work.wait()
            self._unflatten(bucket, self.size * self._rescale)
        self._reset()

    def _unflatten(self, bucket: _Bucket, divisor: float) -> None:
        """Write ``sum / divisor`` into the bucket's gradients and drop its flat copy."""
        flat = bucket.flat
        dtype = local_tensor(bucket.params[0]).dtype
        flat = flat.to(dtype) if flat.dtype != dtype else flat  # bf16 reduction: back to fp32 first,
        flat /= divisor  # then divide in fp32
        offset = 0
        for p, n in zip(bucket.params, bucket.sizes):
            g = local_grad(p)
            if n == 0:  # had no gradient: contributed zeros, keeps None
                offset += local_tensor(p).numel()
                continue
            g.copy_(flat[offset:offset + n].view_as(g))
            offset += n
        bucket.flat = bucket.work = None

    def _reset(self) -> None:
        for bucket in self.buckets:
            bucket.final, bucket.flat, bucket.work, bucket.sizes = 0, None, None, []
        self._count.clear()
        self._next = 0
        self._drained = 0  # buckets before this index are reduced and written back
        self._expected = 0
        self._rescale = 1.0
