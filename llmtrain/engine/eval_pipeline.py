"""Forward-only pipeline pass for evaluation, over the model chunks the trainer already holds.

Used by :func:`llmtrain.engine.evaluate.evaluate` whenever ``parallel.pp > 1``: by the periodic
eval inside training (``train.eval_interval``) and by ``llmtrain eval``. Decisions:

* **Our own wavefront, not a torch schedule.** torch 2.13's ``schedule.eval()`` cannot run the
  V-shaped schedules forward-only (zbv / dualpipev keep their backward actions: "can't
  steal_bwd_input if this stage doesn't have backward"), and its looped forward-only schedules
  cannot be built over V-placed chunks (rank r holds stages r and 2 pp - 1 - r; the looped
  action lists assume r + k pp). Building a second torch schedule next to the training one would
  also add a second set of ``PipelineStage`` objects (and their P2P warm-up) over the same
  modules. Instead, microbatch m reaches global stage s at tick ``m + s``: at every tick each
  rank runs the forwards of its stages that are due (in stage order), then exchanges the stage
  boundaries in one ``batch_isend_irecv`` (outputs to the next stage's rank, inputs it needs at
  the next tick). Every rank walks the same ticks, so the P2P ops of each rank pair come in the
  same order on both sides (NCCL needs that; gloo matches by tag, the destination stage), and
  a consecutive pair of stages on one rank (the V's turn) hands the tensor over in memory.
  The placement (stage -> pp rank) is that of :func:`~llmtrain.engine.parallel.pipeline.local_stage_ids`
  for the recipe's schedule, checked against the chunks this rank holds. The training
  schedule, its stages and their buffers are never touched.
* **Dynamic shapes.** Every rank of a pipeline group has the same data-parallel coordinate, so
  it knows every microbatch's size; boundary buffers are ``[micro, seq / cp / sp, hidden]``
  (:func:`~llmtrain.engine.parallel.pipeline.stage_io_shapes`, the trainer's own shapes) and a
  short last microbatch needs no padding. A sender's output of another shape is an error, not
  a hang.
* **Bubble.** ``G`` microbatches over ``S`` stages take ``G + S - 1`` ticks; the caller passes
  the training step's microbatch count and size (periodic eval), so eval holds at most what a
  training step holds, and no autograd graph.
* Collectives inside a stage (TP, CP attention, EP all-to-all, FSDP all-gathers) involve only
  ranks with the same stage ids and the same ticks, so they come in the same order everywhere.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from llmtrain.errors import LLMTrainError


def stage_owners(pp: int, virtual: int, schedule: str) -> dict[int, int]:
    """Global stage id -> pp rank holding it, for every rank (the trainer's placement)."""
    from llmtrain.engine.parallel.pipeline import local_stage_ids

    return {sid: r for r in range(pp) for sid in local_stage_ids(r, pp, virtual, schedule)}


class PipelineEval:
    """Forward-only pass of ``parts`` (this rank's chunks) over the pp group of ``meshes``;
    ``loss_fn(logits, labels)`` runs on the last stage and its per-row results are returned."""

    def __init__(self, parts, meshes, recipe, device, seq_len: int, loss_fn, act_dtype=torch.float32):
        from llmtrain.engine.parallel.pipeline import stage_io_shapes

        dims, p, m = meshes.dims, recipe.parallel, recipe.model
        self.owner = stage_owners(dims.pp, p.pp_virtual_stages, p.pp_schedule)
        self.me = meshes.pp.get_local_rank()
        self.group = meshes.pp.get_group()
        self.n_stages = parts.n_stages
        if sorted(self.owner) != list(range(self.n_stages)) or any(self.owner[s] != self.me for s in parts.stage_ids):
            raise LLMTrainError(f"pipeline eval: rank {self.me} holds stages {parts.stage_ids}, the placement of "
                                f"{p.pp_schedule} (pp {dims.pp}, {p.pp_virtual_stages} per rank) says otherwise",
                                "report this as a bug", path="parallel.pp_schedule")
        self.local = sorted(zip(parts.stage_ids, parts.parts), key=lambda x: x[0])
        sp = dims.tp if dims.tp > 1 and p.sequence_parallel else 1
        self.boundary = lambda micro: stage_io_shapes(1, self.n_stages, micro, seq_len // dims.cp, m.hidden,
                                                      m.vocab_size, sp)[0]
        self.device, self.dtype, self.loss_fn = device, act_dtype, loss_fn
        # the group's first P2P under NCCL must not be a pairwise call only some ranks make
        dist.all_reduce(torch.zeros(1, device=device), group=self.group)

    def _peer(self, stage: int) -> int:
        return dist.get_global_rank(self.group, self.owner[stage])

    def __call__(self, inputs: list[torch.Tensor], labels: list[torch.Tensor]) -> torch.Tensor | None:
        """Microbatches ``inputs`` (token ids, on every rank) -> the last stage's ``loss_fn`` rows,
        concatenated in microbatch order (None on ranks without the last stage)."""
        n_micro = len(inputs)
        ready: dict[tuple[int, int], torch.Tensor] = {}  # (stage, microbatch) -> its input
        rows: list[torch.Tensor] = []
        for tick in range(n_micro + self.n_stages - 1):
            sends, recvs = [], []
            for sid, part in self.local:
                mb = tick - sid
                if not 0 <= mb < n_micro:
                    continue
                out = part(inputs[mb] if sid == 0 else ready.pop((sid, mb)))
                if sid == self.n_stages - 1:
                    rows.append(self.loss_fn(out, labels[mb]))
                elif self.owner[sid + 1] == self.me:
                    ready[(sid + 1, mb)] = out  # the V's turn: the next stage is on this rank
                else:
                    want = self.boundary(inputs[mb].shape[0])
                    if tuple(out.shape) != tuple(want):
                        raise LLMTrainError(f"pipeline eval: stage {sid} produced {tuple(out.shape)}, the next stage "
                                            f"expects {tuple(want)}", "report this as a bug", path="parallel.pp")
                    sends.append(dist.P2POp(dist.isend, out.to(self.dtype).contiguous(), self._peer(sid + 1),
                                            self.group, tag=sid + 1))
            for sid, _ in self.local:  # inputs due at the next tick from another rank
                mb = tick + 1 - sid
                if sid > 0 and 0 <= mb < n_micro and self.owner[sid - 1] != self.me:
                    buf = torch.empty(self.boundary(inputs[mb].shape[0]), dtype=self.dtype, device=self.device)
                    ready[(sid, mb)] = buf
                    recvs.append(dist.P2POp(dist.irecv, buf, self._peer(sid - 1), self.group, tag=sid))
            if sends or recvs:
                for work in dist.batch_isend_irecv(sends + recvs):
                    work.wait()
        return torch.cat(rows) if rows else None
