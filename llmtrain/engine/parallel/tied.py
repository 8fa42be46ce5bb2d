"""Tied embeddings under pipeline parallelism: one matrix, two copies, one gradient.

With ``model.tie_embeddings`` the input embedding and the output layer are one matrix (Llama
3.2 1B/3B). Without PP :class:`~llmtrain.engine.models.llama.Transformer` ties them as one
Parameter. With PP the first stage holds ``tok_embeddings`` and the last stage ``output``, in
different model chunks, so, as in Megatron-LM's "embedding group", the last stage's
``output.weight`` is a **copy** of the embedding that is kept identical to it:

* **Init / load:** the copy is initialized from the embedding's key (:mod:`..models.init` keys
  it as ``tok_embeddings.weight``), read from the HF embedding on ``--init-from-hf``
  (:func:`~llmtrain.engine.hf.stream.sources_for`), and filled from the checkpoint's
  ``tok_embeddings.weight`` on resume (:mod:`..checkpoint_state`: the copy is never saved, so PP
  and non-PP checkpoints are the same).
* **Gradients:** after backward and the data-parallel reduction, and before clipping,
  :meth:`TiedEmbedding.sync_grads` adds the two copies' gradients, over the pair of ranks
  holding the first and the last stage (one group per (dp, cp, tp) coordinate), so both copies
  get the gradient of the tied weight (the sum of its use as embedding and as output layer).
  DTensor gradients are brought to their parameter's placements first (TP: DTensor returns the
  embedding's gradient Replicate, the output's Shard(0); without FSDP the engine already keeps the
  embedding's in its rows, engine/parallel/tensor.py; Replicate -> Shard is a local slice),
  then local shards are summed: both copies have the same placements on meshes of the same
  shape (TP: vocabulary rows; FSDP2: ``dim 0`` chunks), so shard ``i`` meets shard ``i``.
  A sum of two floats is commutative, so the copies' gradients are bitwise equal.
* **Optimizer:** each copy has its own AdamW state (no decay for either: ``optim.param_groups``
  treats the copy like the embedding); equal parameters, gradients, and hyper-parameters give
  bitwise-equal steps, so the copies never drift. The planner counts the copy's parameter,
  gradient and AdamW state on the last stage (:mod:`llmtrain.plan.shards`).
* **Clipping:** the norm counts the tied weight once (the copy is left out of the norm,
  :func:`~llmtrain.engine.parallel.clip.clip_grads` ``skip``; it is still scaled).

Decision: V-shaped schedules (zbv, dualpipev) put the first and the last stage on pp rank 0;
the copy is then still a separate Parameter of the other chunk and the sum is local (no group).
One shared Parameter would save a vocab x hidden matrix (+ gradient + AdamW state) there, but
FSDP2 cannot share one Parameter between the two chunks' ``fully_shard`` roots, and every
parameter list (gradient all-reduce, ZeRO-1 partition, AdamW groups) would have to deduplicate
it: one code path for every layout was preferred.

The pair group is built from the root DeviceMesh's rank tensor: for pp = 2 with a looped
schedule it is the ``pp`` group itself; for pp > 2 one group per (dp, cp, tp) coordinate holding
pp ranks 0 and pp - 1 (every rank takes part in creating them, ranks of middle stages get
none). It lives on the :class:`TiedEmbedding` object the trainer builds (no module state).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from llmtrain.engine.parallel.data_parallel import in_param_layout, local_tensor
from llmtrain.engine.parallel.pipeline import local_stage_ids

SOURCE, COPY = "tok_embeddings.weight", "output.weight"


def holds_copy(part: nn.Module) -> bool:
    """A pipeline chunk whose output layer is a separate copy of the tied embedding."""
    return bool(getattr(part, "tie_embeddings", False)) and getattr(part, "output", None) is not None \
        and getattr(part, "tok_embeddings", None) is None


def checkpoint_name(part: nn.Module, name: str) -> str:
    """The layout-independent name of ``part``'s parameter ``name``: the copy is the embedding."""
    return SOURCE if name == COPY and getattr(part, "tie_embeddings", False) else name


def copy_params(parts) -> list[nn.Parameter]:
    """This rank's copies (last-stage ``output.weight`` of a tied model under PP)."""
    return [part.output.weight for part in parts.parts if holds_copy(part)]


def pp_rank_of_stage(stage: int, pp: int, virtual: int, schedule: str) -> int:
    return next(r for r in range(pp) if stage in local_stage_ids(r, pp, virtual, schedule))


@dataclass
class TiedEmbedding:
    """This rank's share of the tied embedding: the embedding (first stage), the copy (last
    stage), either, both (V-shaped schedules) or none, and the group to sum their gradients over."""

    source: nn.Parameter | None = None
    copy: nn.Parameter | None = None
    group: dist.ProcessGroup | None = None

    @property
    def copies(self) -> tuple[nn.Parameter, ...]:
        """Parameters whose gradient the clipping norm must not count again."""
        return () if self.copy is None else (self.copy,)

    @classmethod
    def build(cls, parts, meshes, parallel) -> "TiedEmbedding":
        """For the trainer, on every rank (pp > 2 creates process groups collectively)."""
        part0 = parts.parts[0]
        if parts.n_stages == 1 or not getattr(part0, "tie_embeddings", False):
            return cls()
        pp = meshes.dims.pp
        first = pp_rank_of_stage(0, pp, parallel.pp_virtual_stages, parallel.pp_schedule)
        last = pp_rank_of_stage(parts.n_stages - 1, pp, parallel.pp_virtual_stages, parallel.pp_schedule)
        group = None
        if first != last:
            if pp == 2:
                group = meshes.pp.get_group()
            else:  # collective: every rank creates every pair's group, middle stages too
                mesh = meshes.root.mesh  # [pp, dp_replicate, dp_shard, cp, tp] -> rank
                pairs = mesh[[first, last]].reshape(2, -1).T.tolist()
                group, _ = dist.new_subgroups_by_enumeration(pairs)
        source = next((p.tok_embeddings.weight for p in parts.parts if p.tok_embeddings is not None), None)
        copy = next((p.output.weight for p in parts.parts if holds_copy(p)), None)
        held = source if source is not None else copy
        if held is None or not held.requires_grad:  # a middle stage; or frozen (LoRA base) on both sides
            return cls()
        return cls(source, copy, group)

    @torch.no_grad()
    def sync_grads(self) -> None:
        """Both copies' gradients := their sum (module docstring). A no-op without tied PP."""
        held = [p for p in (self.source, self.copy) if p is not None]
        if not held:
            return
        grads = [_aligned_grad(p) for p in held]
        if len(grads) == 2:  # both stages on this rank (V-shaped schedules)
            grads[0].add_(grads[1])
            grads[1].copy_(grads[0])
        elif self.group is not None:
            g = grads[0]
            flat = g if g.is_contiguous() else g.contiguous()
            dist.all_reduce(flat, group=self.group)
            if flat is not g:
                g.copy_(flat)


def _aligned_grad(p: nn.Parameter) -> torch.Tensor:
    """``p``'s local gradient, as a tensor in ``p``'s own layout (zeros if it has none)."""
    g = p.grad
    if g is None:
        g = p.grad = torch.zeros_like(p)
    g = p.grad = in_param_layout(g, p)
    return local_tensor(g)
