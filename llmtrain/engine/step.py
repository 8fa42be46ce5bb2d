"""Forward and backward of one optimizer step, without and with pipeline parallelism.

Without PP the rank's micro-batches run one after another with gradient accumulation (each
loss divided by ``grad_accum``). FSDP (zero 2/3) reduces the gradients either once, after the
last micro batch (default: ``set_requires_gradient_sync(False)`` before, so FSDP2 accumulates an
unsharded fp32 gradient of every parameter of the rank, ``unsharded_accumulated_grad``:
``dp_shard`` times the sharded gradient, 31 GiB per GPU for recipes/llama3-8b.yaml), or with
``parallel.fsdp_reduce_each_microbatch`` after every micro batch into the sharded gradient (as
torchtitan does). Both are kept because each wins somewhere. Measured (2 ranks, zero 2 and 3,
4 micro batches, hidden 256): 6.13 MiB of gradients held after the first micro batch instead of
12.26 MiB, exactly the sharded size. The cost is one reduce-scatter (HSDP: + the replica
all-reduce) per micro batch instead of one per step; FSDP2 all-gathers the weights once (zero 2)
or twice (zero 3) per micro batch either way (it reshards them after each backward) and runs the
reduce-scatter during the backward. On the shared 2-core machine step times were within noise
(load average 5-19: 470-2907 ms either way); the planner, for recipes/llama3-8b.yaml (FSDP over
64 ranks on the network, 8 micro batches), predicts 67.5 -> 36.1 GiB per GPU but 6.6 -> 8.9 s per
step (2.7 s of exposed reduce-scatter): memory-bound layouts want it, network-bound ones do not,
so it is a recipe choice, off by default (the earlier behaviour). Under PP, torch's schedule
itself delays the reduction to the last micro batch (``PipelineStage.backward_maybe_with_nosync``)
whatever the setting: there the unsharded gradients remain (the planner models all three). With PP the
schedule consumes all micro-batches in one call. With TP the logits stay vocabulary-sharded and
the cross-entropy runs under ``loss_parallel``. Returns the rank's mean loss (PP: only the last
stage knows it; other stages return None).

The trainer's loss is chunked (:mod:`llmtrain.engine.parallel.loss`, on by default because it is
exact: tests/test_chunked_loss.py): the model returns the final norm's output (``return_hidden``)
and :class:`StepLoss` applies the output head and the cross-entropy one token chunk at a time,
vocabulary-parallel under TP, so no ``[b, s, vocab]`` logits or log-probabilities exist. A
``StepLoss`` without a head takes logits (the unchunked path: benchmarks, and callers that build
their own schedules on ``model(tokens)``).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from llmtrain.engine.parallel.loss import IGNORE, chunked_cross_entropy
from llmtrain.engine.parallel.pipeline import pipeline_step
from llmtrain.engine.parallelize import ModelParts
from llmtrain.recipe.schema import bf16_compute


def compute_context(precision: str, fsdp: bool, device: torch.device):
    """What the forward runs under: bf16 autocast for zero 0/1 in bf16 (fp32 parameters, which the
    optimizer updates; the model then keeps its residual stream in bf16, ``models/llama.py``), and
    nothing else (FSDP2 casts its parameters itself: ``MixedPrecisionPolicy``; fp32 computes in fp32)."""
    if bf16_compute(precision) and not fsdp:
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()




def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))


class StepLoss:
    """The loss function of one optimizer step: a per-microbatch mean, or token-weighted.

    Pretraining data (every label counts) keeps the per-microbatch mean (``factor`` None):
    ``accumulation_step`` divides it by the number of microbatches, the pipeline schedule scales
    gradients by ``1 / n_microbatches``.

    Fine-tuning data has ignored labels (-100), so microbatches hold different numbers of target
    tokens and a mean of means would weight a token by its microbatch's size, i.e. by the
    layout. There the loss is token-weighted over the whole global batch: ``sum of token losses
    / targets`` where ``targets`` counts the labels of every DP rank's samples of the step
    (computed by every rank from the data alone, no collective). Each rank returns its share
    times ``factor = ranks_averaged / targets`` (x ``n_microbatches`` under PP, which the
    schedule divides back out), so the gradient average over the ``dp x cp`` ranks and the
    trainer's loss all-reduce both give exactly the global token mean, on any layout.
    """

    def __init__(self, head: torch.nn.Module | None = None, softcap: float | None = None):
        self.factor: float | None = None
        # The output layer (nn.Linear) of the stage that computes the loss: set, the loss takes the
        # final norm's output and applies the head chunk by chunk; None, it takes logits. Its
        # ``weight`` is read at every call (FSDP2 swaps the sharded and unsharded parameters).
        self.head = head
        self.softcap = softcap  # model.logit_softcap (Gemma 2): the chunked loss caps each chunk's logits

    @classmethod
    def for_parts(cls, parts: ModelParts) -> StepLoss:
        """The trainer's chunked loss over ``parts``' output head (None on pipeline ranks without the
        last stage). Sets ``return_hidden`` on a pipeline's last stage: the schedule hands the
        stage's output to this loss."""
        if not parts.has_last:
            return cls()
        last = parts.parts[parts.stage_ids.index(parts.n_stages - 1)]
        if parts.n_stages > 1:
            last.return_hidden = True
        return cls(head=last.output, softcap=last.cfg.logit_softcap)

    def set_targets(self, targets: int | None, ranks_averaged: int, pipeline_microbatches: int = 1) -> None:
        self.factor = None if targets is None else ranks_averaged * pipeline_microbatches / max(1, targets)

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """``logits`` [b, s, V], or with a head the final norm's output [b, s, hidden]."""
        if self.head is not None:
            reduction = "mean" if self.factor is None else "sum"
            loss = chunked_cross_entropy(logits, self.head.weight, labels, reduction=reduction, softcap=self.softcap)
            return loss if self.factor is None else loss * self.factor
        if self.factor is None:
            return cross_entropy(logits, labels)
        total = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1), ignore_index=IGNORE, reduction="sum")
        return total * self.factor


def split_batch(batch, device) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """``(inputs, labels)`` or packed ``(inputs, labels, positions, segments)`` -> inputs, labels, model kwargs."""
    inputs, labels = batch[0].to(device), batch[1].to(device)
    kwargs = {} if len(batch) == 2 else {"positions": batch[2].to(device), "segments": batch[3].to(device)}
    return inputs, labels, kwargs


def loss_context(tp: bool):
    return loss_parallel() if tp else contextlib.nullcontext()


def accumulation_step(parts: ModelParts, batches, device, fsdp: bool, tp: bool, autocast,
                      loss_fn: StepLoss | None = None) -> torch.Tensor:
    """Forward and backward of each micro batch. ``fsdp``: delay FSDP's gradient reduction to the last
    micro batch (False: reduce after each; the trainer passes ``not parallel.fsdp_reduce_each_microbatch``)."""
    model = parts.parts[0]
    loss_fn = loss_fn or StepLoss()
    loss_sum = torch.zeros((), device=device)
    for i, batch in enumerate(batches):
        inputs, labels, kwargs = split_batch(batch, device)
        if fsdp:
            model.set_requires_gradient_sync(i == len(batches) - 1)
        chunked = loss_fn.head is not None
        with loss_context(tp and not chunked):
            with autocast:
                out = model(inputs, return_hidden=True, **kwargs) if chunked else model(inputs, **kwargs)
                loss = loss_fn(out, labels)  # chunked: the head's matmul runs here, in the compute dtype
            del out
            loss = loss / len(batches) if loss_fn.factor is None else loss
            loss.backward()
        loss_sum += (loss.full_tensor() if isinstance(loss, DTensor) else loss).detach()
    return loss_sum


def pipelined_step(parts: ModelParts, schedule, batches, device, tp: bool, autocast) -> torch.Tensor | None:
    whole = [torch.cat([b[j] for b in batches]) for j in range(len(batches[0]))]
    inputs, labels, kwargs = split_batch(whole, device)
    with loss_context(tp), autocast:
        loss = pipeline_step(schedule, parts.has_first, parts.has_last, inputs, labels, kwargs)
    if loss is not None and isinstance(loss, DTensor):
        loss = loss.full_tensor()
    return loss
