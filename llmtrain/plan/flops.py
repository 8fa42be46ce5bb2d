"""Model FLOPs per token, shared by the planner and the engine's MFU.

``6 N + 12 L h s``: 6 FLOPs per parameter per token for forward + backward over the matmul
parameters ``N`` (active parameters for MoE, without the input embedding, which is a lookup),
plus the attention score and value matmuls, ``12 L h s`` for sequence length ``s`` (PaLM,
Chowdhery et al. 2022, appendix B). The attention term is counted WITHOUT the causal halving,
as PaLM and Megatron do, so MFU numbers compare across projects; recomputation is not counted
(these are model FLOPs, not hardware FLOPs).
"""

from __future__ import annotations

from llmtrain.plan.params import count_params
from llmtrain.recipe.schema import ModelConfig


def flops_per_token(model: ModelConfig, seq_len: int) -> float:
    params = count_params(model)
    matmul_params = params.active - params.embedding
    return 6.0 * matmul_params + 12.0 * model.layers * model.hidden * seq_len
