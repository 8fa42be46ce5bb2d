"""LoRA on the routed experts (``train.lora.experts: true``): one low-rank adapter per expert and
adapted projection, stacked like the experts' own weights.

For an MLP target ``t`` in ``train.lora.targets`` (``w1 w3``: base ``[E, F, H]``; ``w2``: ``[E, H, F]``)
every MoE block's :class:`~llmtrain.engine.models.grouped_experts.GroupedExperts` gets
``lora_a[t]`` ``[E, r, in]`` and ``lora_b[t]`` ``[E, out, r]`` (``nn.ParameterDict`` entries, so
the state-dict keys are ``layers.N.moe.experts.lora_a.w1`` ...), and expert ``e``'s projection
becomes ``x W_e^T + scale * (x A_e^T) B_e^T`` (:func:`grouped_experts.grouped_swiglu`, factored: only
the ``[rows, r]`` intermediate is saved, never a merged expert weight). Decisions:

* **Opt-in.** MLP targets keep meaning the dense MLPs; ``experts: true`` adds the routed experts
  (PEFT's ``target_parameters`` is opt-in the same way). The shared experts and the router stay
  frozen.
* **Placements follow the base weight** (applied after expert and expert-tensor parallelism, on
  the base's mesh): EP ``Shard(0)`` (the rank's experts) on both factors; under expert-TP the
  column-wise ``w1``/``w3`` (F split) keep ``A`` replicated and split ``B`` on F (``Shard(1)``), the
  row-wise ``w2`` (``Shard(2)``) splits ``A`` on F (``Shard(2)``) and keeps ``B`` replicated, as the
  dense adapters do. The experts run on local tensors inside the MoE's TP region, where every
  gradient is a partial sum over TP; a replicated factor's gradient is summed over TP by the
  region's hook (``ExpertTPRegion.replicated``, the router weight's), and every factor gets the
  EP gradient scale of its base (``GradScale``). FSDP2 shards them on dim 0 in the experts' unit
  (unevenly, padded, where the rank's experts do not divide: the base weights move to H there,
  ``data_parallel.expert_placement``; the planner's ``dp_shards`` counts both).
* **Initialization** as the dense adapters and PEFT's ``ParamWrapper``: ``A`` kaiming-uniform with
  fan-in ``in`` (each expert's ``[r, in]`` slice drawn like a Linear's), ``B`` zeros
  (:mod:`llmtrain.engine.models.init`).
* **No dropout** (validation refuses ``dropout > 0`` with ``experts``): PEFT's expert adapters have
  none either, so exports stay exact.
"""

from __future__ import annotations

import torch
from torch import nn

from llmtrain.recipe.schema import LoRAConfig

EXPERT_TARGETS = ("w1", "w2", "w3")


def expert_targets(cfg: LoRAConfig) -> tuple[str, ...]:
    """The expert projections ``cfg`` adapts (none unless ``cfg.experts``)."""
    return tuple(t for t in cfg.target_names if t in EXPERT_TARGETS) if cfg.experts else ()


def stacked_shapes(base_shape: tuple[int, ...], rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Global ``(A, B)`` shapes for a stacked base ``[E, out, in]``."""
    e, out_f, in_f = base_shape
    return (e, rank, in_f), (e, out_f, rank)


def _placements(target: str, kind: str, base_placements, dim_names) -> list:
    """The adapter factor's placements on the base's mesh (module docstring)."""
    from torch.distributed.tensor import Replicate, Shard

    from llmtrain.engine.models.grouped_experts import TP_REPLICATED

    # tp: the factor's F dim is split like its base's (B [E, F, r] of w1 / w3: 1; A [E, r, F] of w2: 2), the
    # other factor is whole; ep: the rank's experts, as the base
    split = Shard(1 if kind == "b" else 2)
    return [(Replicate() if (kind, target) in TP_REPLICATED else split) if name == "tp" else placement
            for name, placement in zip(dim_names, base_placements)]


def _factor(shape: tuple[int, ...], base: torch.Tensor, target: str, kind: str) -> nn.Parameter:
    from torch.distributed.tensor import DTensor, distribute_tensor

    full = torch.empty(shape, dtype=base.dtype, device=base.device)
    if isinstance(base, DTensor):
        names = base.device_mesh.mesh_dim_names
        if names is None or any(n not in ("ep", "tp") for n in names):
            raise ValueError(f"LoRA: expert weight {target} is on a mesh with dims {names}; expected ep and/or tp "
                             "(apply LoRA after expert parallelism and before FSDP)")
        full = distribute_tensor(full, base.device_mesh, _placements(target, kind, base.placements, names),
                                 src_data_rank=None)
    return nn.Parameter(full)


def add_expert_adapters(moe: nn.Module, cfg: LoRAConfig) -> list[str]:
    """Give ``moe``'s routed experts adapters for :func:`expert_targets`; returns the adapted names
    (``moe.experts.<t>``, relative to the block)."""
    targets = expert_targets(cfg)
    experts = moe.experts
    if not targets or getattr(experts, "lora_a", None) is not None:
        return []
    lora_a, lora_b = nn.ParameterDict(), nn.ParameterDict()
    for t in targets:
        base = getattr(experts, t)
        a_shape, b_shape = stacked_shapes(tuple(base.shape), cfg.rank)
        lora_a[t] = _factor(a_shape, base, t, "a")
        lora_b[t] = _factor(b_shape, base, t, "b")
    experts.lora_a, experts.lora_b = lora_a, lora_b
    experts.lora_scale = float(cfg.scale)
    region = getattr(moe, "tp_region", None)
    if region is not None:
        experts.lora_tp_sum = region.replicated
    return [f"moe.experts.{t}" for t in targets]
