"""Forward and backward of one optimizer step, without and with pipeline parallelism.

Without PP the rank's micro-batches run one after another with gradient accumulation (each
loss divided by ``grad_accum``; FSDP reduces gradients only on the last one). With PP the
schedule consumes all micro-batches in one call. With TP the logits stay vocabulary-sharded and
the cross-entropy runs under ``loss_parallel``. Returns the rank's mean loss (PP: only the last
stage knows it; other stages return None).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from llmtrain.engine.parallel.pipeline import pipeline_step
from llmtrain.engine.parallelize import ModelParts


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))


def loss_context(tp: bool):
    return loss_parallel() if tp else contextlib.nullcontext()


def accumulation_step(parts: ModelParts, batches, device, fsdp: bool, tp: bool, autocast) -> torch.Tensor:
    model = parts.parts[0]
    loss_sum = torch.zeros((), device=device)
    for i, (inputs, labels) in enumerate(batches):
        inputs, labels = inputs.to(device), labels.to(device)
        if fsdp:
            model.set_requires_gradient_sync(i == len(batches) - 1)
        with loss_context(tp):
            with autocast:
                logits = model(inputs)
            loss = cross_entropy(logits, labels) / len(batches)
            loss.backward()
        loss_sum += (loss.full_tensor() if isinstance(loss, DTensor) else loss).detach()
    return loss_sum


def pipelined_step(parts: ModelParts, schedule, batches, device, tp: bool, autocast) -> torch.Tensor | None:
    inputs = torch.cat([b[0] for b in batches]).to(device)
    labels = torch.cat([b[1] for b in batches]).to(device)
    with loss_context(tp), autocast:
        loss = pipeline_step(schedule, parts.has_first, parts.has_last, inputs, labels)
    if loss is not None and isinstance(loss, DTensor):
        loss = loss.full_tensor()
    return loss
