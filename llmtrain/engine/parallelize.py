"""Apply the recipe's parallelism to a model built on the meta device, in a fixed order.

0. pipeline split (PP > 1): one model chunk per local stage (:mod:`.parallel.pipeline`);
then for each chunk:
0b. ``train.precision: fp8``: the blocks' Linears become torchao ``Float8Linear`` s
   (:mod:`.parallel.float8`) *before* any sharding, as TorchTitan does: TP then shards them with
   torchao's Float8 styles and FSDP2 shards the converted weights (its FP8 all-gather hooks);
1. tensor parallel (+ sequence parallel, vocabulary-parallel loss) over the ``tp`` mesh, MoE
   experts included (expert-TP: each expert split over ``tp``);
2. context parallel attention (ring / ulysses / allgather) over the ``cp`` mesh, and expert
   parallelism (experts sharded over ``ep``, all-to-all dispatch);
   then LoRA adapters when ``train.lora`` (:mod:`.finetune.lora`: base weights frozen);
3. activation checkpointing (none / selective / selective_mm / full) per block;
4. ``torch.compile`` per block (optional);
5. data parallel by ``parallel.zero`` (FSDP2 for 2/3, gradient all-reduce for 0/1).

Each step is a free function over (model, mesh, narrow arguments) so the order is visible
here and each pass can be tested alone. Weights are materialized and initialized afterwards
(:func:`materialize`), from the seed and each parameter's global name, identically for every
layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from llmtrain.engine.finetune.lora import apply_lora
from llmtrain.engine.mesh import Meshes
from llmtrain.engine.models.init import init_weights
from llmtrain.engine.models.llama import Transformer
from llmtrain.engine.parallel.checkpointing import apply_activation_checkpointing, apply_compile
from llmtrain.engine.parallel.context import apply_context_parallel
from llmtrain.engine.parallel.data_parallel import apply_fsdp
from llmtrain.engine.parallel.expert import apply_expert_parallel
from llmtrain.engine.parallel.pipeline import layer_ranges, local_stage_ids, prune_to_stage
from llmtrain.engine.parallel.tensor import apply_tensor_parallel, keep_embedding_grad_sharded
from llmtrain.recipe.schema import Recipe


@dataclass
class ModelParts:
    parts: list[nn.Module]  # one per local pipeline stage (exactly one without PP)
    stage_ids: list[int]
    n_stages: int

    @property
    def has_first(self) -> bool:
        return 0 in self.stage_ids

    @property
    def has_last(self) -> bool:
        return self.n_stages - 1 in self.stage_ids

    def parameters(self) -> list[nn.Parameter]:
        return [p for part in self.parts for p in part.parameters() if p.requires_grad]


def uses_fsdp(recipe: Recipe, meshes: Meshes) -> bool:
    return recipe.parallel.zero >= 2 and meshes.dims.dp * meshes.dims.cp > 1


def parallelize(model: nn.Module, meshes: Meshes, recipe: Recipe) -> nn.Module:
    p, t = recipe.parallel, recipe.train
    if t.precision == "fp8":  # CUDA only (validation refuses it elsewhere): Float8 Linears before TP and FSDP
        from llmtrain.engine.parallel.float8 import apply_float8

        apply_float8(model, fp8_all_gather=p.fp8_all_gather, skip=tuple(t.lora.target_names) if t.lora else ())
    if meshes.dims.tp > 1:
        apply_tensor_parallel(model, meshes.tp, sequence_parallel=p.sequence_parallel, loss_parallel=True)
    if meshes.dims.cp > 1:
        apply_context_parallel(model, meshes.cp, p.cp_method, t.seq_len)
    if meshes.dims.ep > 1:
        # experts already split over tp (expert-TP) keep that split on the inner dim of (ep, tp)
        apply_expert_parallel(model, meshes.ep_root["ep", "tp"] if meshes.dims.tp > 1 else meshes.ep)
    if t.lora is not None:  # adapters on the (TP-sharded) projections, everything else frozen
        apply_lora(model, t.lora, meshes.tp if meshes.dims.tp > 1 else None)
    apply_activation_checkpointing(model, t.activation_checkpointing)
    if p.async_tp:  # CUDA only (validation refuses it elsewhere): before the blocks are compiled
        from llmtrain.engine.parallel.async_tp import enable_async_tp

        enable_async_tp(meshes.tp if meshes.dims.tp > 1 else None, t.compile)
    if t.compile:
        apply_compile(model)
    if uses_fsdp(recipe, meshes):
        expert_mesh = meshes.edp_fsdp_mesh() if meshes.dims.ep > 1 else None
        apply_fsdp(model, meshes.fsdp_mesh(), p.zero, pp_enabled=meshes.dims.pp > 1, precision=t.precision,
                   expert_mesh=expert_mesh, reduce_dtype=p.reduce_dtype)
    return model


def materialize(model: nn.Module, device: torch.device, seed: int) -> nn.Module:
    model.to_empty(device=device)
    init_weights(model, seed)
    return model


def build_parts(recipe: Recipe, meshes: Meshes, device: torch.device) -> ModelParts:
    dims, p = meshes.dims, recipe.parallel
    if dims.pp == 1:
        stage_ids, n_stages, ranges = [0], 1, [range(recipe.model.layers)]
    else:
        n_stages = dims.pp * p.pp_virtual_stages
        ranges = layer_ranges(recipe.model.layers, n_stages, p.pp_layers_per_stage)
        stage_ids = local_stage_ids(meshes.pp.get_local_rank(), dims.pp, p.pp_virtual_stages, p.pp_schedule)
    parts = []
    for sid in stage_ids:
        with torch.device("meta"):
            model = Transformer(recipe.model)
        if n_stages > 1:
            prune_to_stage(model, sid, n_stages, ranges[sid])
        parallelize(model, meshes, recipe)
        parts.append(materialize(model, device, recipe.train.seed))
        if dims.tp > 1 and not uses_fsdp(recipe, meshes):  # after to_empty, which drops tensor hooks;
            keep_embedding_grad_sharded(model)  # FSDP reduce-scatters the embedding's gradient itself
    return ModelParts(parts, stage_ids, n_stages)
