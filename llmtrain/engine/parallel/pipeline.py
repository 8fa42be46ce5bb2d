"""Pipeline parallelism with ``torch.distributed.pipelining``.

The model is split by layers into ``pp x pp_virtual_stages`` stages (``parallel.pp_layers_per_stage``
for an uneven split, else as even as possible). Stage 0 also holds the token embedding; the last
stage holds the final norm and the output layer, and computes the loss. Stage placement:

- looped schedules (gpipe, 1f1b, interleaved-1f1b, zero-bubble): stage ``s`` on pp rank ``s % pp``;
- V-shaped schedules (zbv, dualpipev): pp rank ``r`` holds stages ``r`` and ``2 pp - 1 - r`` (so the
  first and last stage share rank 0).

Each local stage is its own model chunk (a :class:`Transformer` with the other layers removed);
parameter names keep their global layer index, so checkpoints and initialization do not depend
on the split. With tied embeddings the last stage's ``output.weight`` becomes a Parameter of its
own once the embedding is removed from its chunk: a copy kept equal to the first stage's
embedding by :mod:`.tied`. The schedule splits each rank's batch into ``grad_accum`` microbatches and scales
gradients by ``1 / n_microbatches`` (``scale_grads``), which with a per-microbatch mean loss gives
the mean over the whole batch, as without PP.

Split backward (zero-bubble, zbv, dualpipev) with full recomputation: torch's weight pass
(``stage_backward_weight``) runs one ``autograd.grad`` per parameter group, and the non-reentrant
checkpoint recomputes a block once per graph task, so each block was recomputed once per group it
feeds, and every recomputation's unused tensors stayed until the micro batch's graph was freed
(measured on debug-dense, zero-bubble pp 2: 6.86 MB held at the peak on pp rank 0 against 4.84 MB
without any recomputation, and 1.25 MB now). :class:`Stage` runs each weight pass inside one
``torch.utils.checkpoint.GraphExecGroup``: one recomputation per weight pass (torch's groups do not
unpack a saved tensor twice), as in the input pass. Selective recomputation cannot be grouped that
way across the input and weight passes (both unpack the matmuls' saved tensors) and is refused
under these schedules (plan/validate.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.tensor import DTensor
from torch.distributed.pipelining.schedules import (
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)

try:  # torch 2.13 has it; without it a weight pass recomputes once per parameter group (module docstring)
    from torch.utils.checkpoint import GraphExecGroup
except ImportError:  # pragma: no cover - other torch versions
    GraphExecGroup = None

SCHEDULES = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved-1f1b": ScheduleInterleaved1F1B,
    "zero-bubble": ScheduleInterleavedZeroBubble,
    "zbv": ScheduleZBVZeroBubble,
    "dualpipev": ScheduleDualPipeV,
}
V_SHAPED = ("zbv", "dualpipev")
SINGLE_STAGE = ("gpipe", "1f1b")


def layer_ranges(layers: int, n_stages: int, explicit: list[int] | None) -> list[range]:
    counts = explicit or [layers // n_stages + (1 if i < layers % n_stages else 0) for i in range(n_stages)]
    starts = [sum(counts[:i]) for i in range(n_stages)]
    return [range(s, s + c) for s, c in zip(starts, counts)]


def local_stage_ids(pp_rank: int, pp: int, virtual: int, schedule: str) -> list[int]:
    if schedule in V_SHAPED:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + k * pp for k in range(virtual)]


def prune_to_stage(model: nn.Module, stage: int, n_stages: int, layers: range) -> nn.Module:
    """Keep only this stage's blocks (and embeddings / head on the first / last stage)."""
    for key in list(model.layers.keys()):
        if int(key) not in layers:
            del model.layers[key]
    if stage != 0:
        model.tok_embeddings = None
    if stage != n_stages - 1:
        model.norm = None
        model.output = None
    return model


def stage_io_shapes(stage: int, n_stages: int, micro: int, seq: int, hidden: int, vocab: int,
                    sp_shards: int, head_in_loss: bool = False) -> tuple[tuple, tuple]:
    """Static (input, output) shapes of a stage for one microbatch.

    ``seq`` is this rank's sequence length (after context parallelism); between stages the
    residual stream is additionally split over ``sp_shards`` ranks by sequence parallelism.
    Giving torch the shapes up front selects its STATIC metadata mode: no shape-inference
    forward/backward at the first step, which would run our collectives (ring attention, MoE
    all-to-all) outside the schedule's order and can deadlock across CP/EP peers.
    The last stage returns logits [micro, seq, vocab], or with ``head_in_loss`` (the trainer's
    chunked loss applies the output head itself) the final norm's output [micro, seq, hidden]
    (global shapes: under TP a DTensor, vocabulary- or sequence-sharded).
    """
    boundary = (micro, seq // sp_shards, hidden)
    inp = (micro, seq) if stage == 0 else boundary
    out = (micro, seq, hidden if head_in_loss else vocab) if stage == n_stages - 1 else boundary
    return inp, out


class Stage(PipelineStage):
    """torch's stage whose weight pass recomputes each checkpointed block once (module docstring)."""

    def backward_weight_one_chunk(self, bwd_chunk_id: int, last_backward=False):
        if GraphExecGroup is None:
            return super().backward_weight_one_chunk(bwd_chunk_id, last_backward=last_backward)
        with GraphExecGroup():
            return super().backward_weight_one_chunk(bwd_chunk_id, last_backward=last_backward)


def build_schedule(parts: list[nn.Module], stage_ids: list[int], n_stages: int, schedule: str, n_microbatches: int,
                   loss_fn, device: torch.device, group: dist.ProcessGroup, shapes=None, dtype=torch.float32):
    stages = []
    for part, sid in zip(parts, stage_ids):
        kwargs = {}
        if shapes is not None:
            inp, out = shapes(sid)
            in_dtype = torch.long if sid == 0 else dtype
            # requires_grad marks activations whose gradients cross the stage boundary
            kwargs = dict(input_args=(torch.empty(inp, device="meta", dtype=in_dtype, requires_grad=sid != 0),),
                          output_args=(torch.empty(out, device="meta", dtype=dtype, requires_grad=True),))
        stages.append(Stage(part, sid, n_stages, device, group=group, **kwargs))
    cls = SCHEDULES[schedule]
    if schedule in SINGLE_STAGE:
        return cls(stages[0], n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=True), stages
    return cls(stages, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=True), stages


def pipeline_step(schedule, has_first: bool, has_last: bool, inputs: torch.Tensor, labels: torch.Tensor,
                  kwargs: dict | None = None) -> torch.Tensor | None:
    """One optimizer step's forward and backward; returns the mean microbatch loss on the last stage.

    ``kwargs`` (packed rows: ``positions``, ``segments``, [batch, seq] each) are split into
    microbatches by the schedule and passed to every stage's forward, first or not."""
    losses: list[torch.Tensor] = []
    kw = kwargs or {}
    if has_first:
        schedule.step(inputs, target=labels if has_last else None, losses=losses if has_last else None, **kw)
    elif has_last:
        schedule.step(target=labels, losses=losses, **kw)
    else:
        schedule.step(**kw)
    if not has_last:
        return None
    values = [loss.full_tensor() if isinstance(loss, DTensor) else loss for loss in losses]
    return torch.stack([v.detach().float() for v in values]).mean()
