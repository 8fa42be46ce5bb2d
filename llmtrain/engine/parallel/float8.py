"""FP8 training of the Linear layers (``train.precision: fp8``), with torchao's float8 API, and FP8
all-gather of FSDP2 parameters (``parallel.fp8_all_gather``).

``torchao.float8.convert_to_float8_training`` swaps each ``nn.Linear`` for a ``Float8Linear``
(tensorwise dynamic scaling, torchao's default recipe: one scale per tensor, computed each
step); its matmuls run on FP8 tensor cores through ``torch._scaled_mm``, everything else stays
bf16 (``precision: fp8`` implies bf16 mixed precision). Conversion happens before FSDP so FSDP2
shards the converted weights. The output head is left in bf16 (its vocabulary dimension is
numerically the most sensitive, TorchTitan's default filter), and so is any layer whose
dimensions are not multiples of 16 (``_scaled_mm``'s requirement).

**FP8 all-gather** (``enable_fsdp_float8_all_gather``): each converted weight's local shard is
wrapped in torchao's ``WeightWithDynamicFloat8CastTensor``, whose FSDP2 pre-all-gather hook casts
the shard to float8_e4m3 with the *global* tensorwise scale, so FSDP2 all-gathers 1 byte per
element instead of 2 (bf16) and the unsharded weight is already the FP8 operand of the forward
matmul (with tensorwise scaling the values are identical to all-gathering bf16 and casting after:
one scale for the whole tensor either way). Without a precomputed scale the hook all-reduces one
amax per weight; :func:`precompute_fp8_scales` computes all of them in ONE all-reduce
(torchao's ``precompute_float8_dynamic_scale_for_fsdp``). Decision: the trainer calls it at the
**start** of every step, not after the optimizer step as torchao's example does: the two are the
same all-reduce on the same weights in the normal loop, but only the start of the step is right
after a checkpoint restore or a loss-guard rollback, which replace the weights behind the scales.
Only zero 2/3 (FSDP2) all-gather parameters; validation refuses the option elsewhere.

Not with tensor parallelism (yet): the engine applies TP (engine/parallel/tensor.py, plain
``ColwiseParallel`` / ``RowwiseParallel``) before this conversion, and a ``Float8Linear`` over a
TP-sharded weight fails (measured with the CPU emulation, with and without FSDP: "aten.mm.default
got mixed torch.Tensor and DTensor"); torchao's way is converting first and sharding with its
``Float8ColwiseParallel`` / ``Float8RowwiseParallel`` (torchao/float8/float8_tensor_parallel.py,
as TorchTitan does). Until that is wired, :func:`apply_float8` refuses TP-sharded Linears at
start (one line) and validation warns (not an error: the planner still models fp8 + TP, as
TorchTitan runs it, for published runs and ``plan --search``).

Where it runs: FP8 matmuls need CUDA with FP8 tensor cores (sm89+); validation (plan/validate.py)
refuses ``precision: fp8`` on CPU and older GPUs. torchao's ``emulate=True`` (casts to FP8 and
back, matmuls in high precision) runs the same conversion and FSDP2 FP8 all-gather on CPU with
gloo: tests/test_fp8.py trains a small FSDP2 model that way and checks the all-gathered weights
are float8 and the losses equal the bf16-all-gather run; the recipe path (``--set
train.precision=fp8``) stays refused on CPU because emulation measures nothing useful about FP8
speed. The real CUDA path runs in the GPU check (benchmarks/gpu_check_steps/options.py).
"""

from __future__ import annotations

from torch import nn

from llmtrain.errors import LLMTrainError


def _convertible(module: nn.Module, fqn: str) -> bool:
    if not isinstance(module, nn.Linear) or fqn.split(".")[-1] == "output":
        return False
    return module.in_features % 16 == 0 and module.out_features % 16 == 0


def _torchao_float8():
    try:
        import torchao.float8 as float8
    except ImportError as e:
        raise LLMTrainError(f"train.precision fp8 needs torchao (pip install torchao): {e}") from None
    return float8


def apply_float8(model: nn.Module, fp8_all_gather: bool = False, emulate: bool = False) -> int:
    """Convert the model's Linear layers in place; returns how many were converted.
    ``fp8_all_gather``: FSDP2 (applied afterwards) all-gathers the converted weights in FP8.
    ``emulate``: torchao's CPU emulation (tests only: the recipe path refuses fp8 on CPU)."""
    from torch.distributed.tensor import DTensor

    if any(isinstance(m, nn.Linear) and isinstance(m.weight, DTensor) for m in model.modules()):
        raise LLMTrainError("fp8 with tensor parallelism is not supported yet: the Linears are already TP-sharded "
                            "(plan/validate.py warns of it: torchao's Float8 TP plans are not wired in)",
                            "use parallel.tp 1 with fp8, or train.precision bf16", path="train.precision")
    float8 = _torchao_float8()
    config = float8.Float8LinearConfig(enable_fsdp_float8_all_gather=fp8_all_gather, emulate=emulate)
    before = sum(isinstance(m, nn.Linear) for m in model.modules())
    float8.convert_to_float8_training(model, config=config, module_filter_fn=_convertible)
    after = sum(type(m) is nn.Linear for m in model.modules())
    return before - after


def precompute_fp8_scales(parts: list[nn.Module]) -> None:
    """One all-reduce for the tensorwise scales of every FP8-all-gathered weight (module docstring:
    called at the start of each step). A no-op for modules without such weights."""
    float8 = _torchao_float8()
    for part in parts:
        float8.precompute_float8_dynamic_scale_for_fsdp(part)
