"""Apply the recipe's parallelism to a model built on the meta device, in a fixed order.

1. tensor parallel (+ sequence parallel, vocabulary-parallel loss) over the ``tp`` mesh;
2. activation checkpointing (none / selective / full) per block;
3. ``torch.compile`` per block (optional);
4. data parallel by ``parallel.zero`` (FSDP2 for 2/3, gradient all-reduce for 0/1).

Each step is a free function over (model, mesh, narrow arguments) so the order is visible
here and each pass can be tested alone. Weights are materialized and initialized afterwards
(:func:`materialize`), from the seed, identically for every layout.
"""

from __future__ import annotations

import torch
from torch import nn

from llmtrain.engine.mesh import Meshes
from llmtrain.engine.models.init import init_weights
from llmtrain.engine.parallel.checkpointing import apply_activation_checkpointing, apply_compile
from llmtrain.engine.parallel.data_parallel import apply_fsdp
from llmtrain.engine.parallel.tensor import apply_tensor_parallel
from llmtrain.recipe.schema import Recipe


def uses_fsdp(recipe: Recipe, meshes: Meshes) -> bool:
    return recipe.parallel.zero >= 2 and meshes.dims.dp * meshes.dims.cp > 1


def parallelize(model: nn.Module, meshes: Meshes, recipe: Recipe) -> nn.Module:
    p, t = recipe.parallel, recipe.train
    if meshes.dims.tp > 1:
        apply_tensor_parallel(model, meshes.tp, sequence_parallel=p.sequence_parallel, loss_parallel=True)
    apply_activation_checkpointing(model, t.activation_checkpointing)
    if t.compile:
        apply_compile(model)
    if uses_fsdp(recipe, meshes):
        apply_fsdp(model, meshes.fsdp_mesh(), p.zero, pp_enabled=meshes.dims.pp > 1, precision=t.precision)
    return model


def materialize(model: nn.Module, device: torch.device, seed: int) -> nn.Module:
    model.to_empty(device=device)
    init_weights(model, seed)
    return model
