"""FP8 training of the Linear layers (``train.precision: fp8``), with torchao's float8 API.

``torchao.float8.convert_to_float8_training`` swaps each ``nn.Linear`` for a ``Float8Linear``
(tensorwise dynamic scaling, torchao's default recipe: one scale per tensor, computed each
step); its matmuls run on FP8 tensor cores through ``torch._scaled_mm``, everything else stays
bf16 (``precision: fp8`` implies bf16 mixed precision). Conversion happens before FSDP so FSDP2
shards the converted weights. The output head is left in bf16 (its vocabulary dimension is
numerically the most sensitive, TorchTitan's default filter), and so is any layer whose
dimensions are not multiples of 16 (``_scaled_mm``'s requirement).

UNTESTED HERE: this machine has no CUDA; validation (plan/validate.py) refuses fp8 on CPU and on
GPUs without FP8 tensor cores, so this code path runs only in the GPU check (issue 17, item 3).
FP8 all-gather of FSDP2 parameters (``enable_fsdp_float8_all_gather``) is not switched on yet.
"""

from __future__ import annotations

from torch import nn

from llmtrain.errors import LLMTrainError


def _convertible(module: nn.Module, fqn: str) -> bool:
    if not isinstance(module, nn.Linear) or fqn.split(".")[-1] == "output":
        return False
    return module.in_features % 16 == 0 and module.out_features % 16 == 0


def apply_float8(model: nn.Module) -> int:
    """Convert the model's Linear layers in place; returns how many were converted."""
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as e:
        raise LLMTrainError(f"train.precision fp8 needs torchao (pip install torchao): {e}") from None
    before = sum(isinstance(m, nn.Linear) for m in model.modules())
    convert_to_float8_training(model, config=Float8LinearConfig(), module_filter_fn=_convertible)
    after = sum(type(m) is nn.Linear for m in model.modules())
    return before - after
