"""FP8 training of the Linear layers (``train.precision: fp8``), with torchao's float8 API, and FP8
all-gather of FSDP2 parameters (``parallel.fp8_all_gather``).

``torchao.float8.convert_to_float8_training`` swaps each ``nn.Linear`` for a ``Float8Linear``
(tensorwise dynamic scaling, torchao's default recipe: one scale per tensor, computed each
step); its matmuls run on FP8 tensor cores through ``torch._scaled_mm``, everything else stays
bf16 (``precision: fp8`` implies bf16 mixed precision). Conversion happens before TP and FSDP
so both shard the converted weights.

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

**With tensor parallelism** (TorchTitan's way): the conversion runs *before* TP (engine/
parallelize.py), and engine/parallel/tensor.py shards each converted Linear with torchao's
``Float8ColwiseParallel`` / ``Float8RowwiseParallel`` and prepares each region's input with
``PrepareFloat8ModuleInput`` (torchao/float8/float8_tensor_parallel.py; tensorwise dynamic scaling
only, which is the config here). The input of wq/wk/wv (w1/w3) is cast to float8 once, before the
sequence-parallel all-gather, so SP all-gathers 1-byte activations; each tensorwise amax of a
DTensor (weight shard, sequence-sharded activation, gradient) is all-reduced by DTensor, so every
rank uses the one-process scale and TP changes only the matmuls' summation order (measured with
the CPU emulation against one process: tests/fp8_tp_check.py). The plain styles remain for the
Linears that are not converted. TP + FSDP2 + FP8 all-gather composes (torchao wraps the local
shard of the TP DTensor; checked on gloo, 4 ranks). Applying the conversion to already TP-sharded
Linears fails inside torchao ("aten.mm.default got mixed torch.Tensor and DTensor") and is refused.

Not converted (left bf16): the output head (its vocabulary dimension is numerically the most
sensitive, TorchTitan's default filter), any layer whose dimensions are not multiples of 16
(``_scaled_mm``'s requirement), every Linear inside an MoE block's ``moe`` (the router, whose
top-k is fragile to FP8 rounding and whose expert count is often not a multiple of 16, as
TorchTitan filters it, and the shared experts, which expert-TP shards itself: plan/flops.py and
plan/comm.py count the blocks' attention and dense MLP only), and under ``train.lora`` the adapted
projections (LoRA turns each target into a ``LoRALinear``, whose forward is a plain matmul: a
Float8Linear there would silently lose its FP8 matmul, and converting a LoRALinear would drop its
adapters).

Where it runs: FP8 matmuls need CUDA with FP8 tensor cores (sm89+); validation (plan/validate.py)
refuses ``precision: fp8`` on CPU and older GPUs. torchao's ``emulate=True`` (casts to FP8 and
back, matmuls in high precision) runs the same conversion, FSDP2 FP8 all-gather and TP on CPU with
gloo: tests/test_fp8.py (FSDP2 on one rank: the all-gathered weights are float8 and the losses
equal the bf16-all-gather run) and tests/fp8_tp_check.py (tp 2, and tp 2 x FSDP2 dp 2 with FP8
all-gather, against one process). Not sequence parallelism: gloo has no float8 dtype, and the SP
all-gather of the FP8 activation fails ("RuntimeError: Invalid scalar type"); NCCL moves it. The
recipe path (``--set train.precision=fp8``) stays refused for ``cluster.gpu: cpu`` because FP8 on
a CPU measures nothing useful about FP8 speed, although torch 2.13's CPU float8 ``_scaled_mm`` does
run it: tests/test_engine_parity.py's ``tp2_fp8_fsdp_ag`` case trains the engine's own fp8 path
(tp 2 x dp 2, FP8 all-gather) on gloo with ``cluster.gpu`` h100-sxm as a stand-in. The real CUDA
paths run in the GPU check
(benchmarks/gpu_check_steps/options.py: ``fp8_dense_compiled``, ``fp8_all_gather``, ``fp8_tp``).
"""

from __future__ import annotations

import logging
import sys
from contextlib import contextmanager

from torch import nn

from llmtrain.engine.torchao_import import import_torchao
from llmtrain.errors import LLMTrainError


def _convertible(module: nn.Module, fqn: str, skip: frozenset[str]) -> bool:
    parts = fqn.split(".")
    if not isinstance(module, nn.Linear) or parts[-1] == "output" or "moe" in parts or parts[-1] in skip:
        return False
    return module.in_features % 16 == 0 and module.out_features % 16 == 0


def _torchao_float8():
    try:
        float8 = import_torchao("torchao.float8")
    except ImportError as e:
        raise LLMTrainError(f"train.precision fp8 needs torchao (pip install torchao): {e}") from None
    return float8


def is_float8_linear(module: nn.Module) -> bool:
    """Whether ``module`` is torchao's ``Float8Linear``, without importing torchao (none can exist
    before torchao is imported, so a bf16 run never pays its import)."""
    linear = sys.modules.get("torchao.float8.float8_linear")
    return linear is not None and isinstance(module, linear.Float8Linear)


def float8_tp_styles() -> tuple[type, type, type]:
    """torchao's (Float8ColwiseParallel, Float8RowwiseParallel, PrepareFloat8ModuleInput)."""
    _torchao_float8()
    from torchao.float8.float8_tensor_parallel import (
        Float8ColwiseParallel,
        Float8RowwiseParallel,
        PrepareFloat8ModuleInput,
    )

    return Float8ColwiseParallel, Float8RowwiseParallel, PrepareFloat8ModuleInput


def apply_float8(model: nn.Module, fp8_all_gather: bool = False, emulate: bool = False,
                 skip: tuple[str, ...] = ()) -> int:
    """Convert the model's Linear layers in place; returns how many were converted.
    ``fp8_all_gather``: FSDP2 (applied afterwards) all-gathers the converted weights in FP8.
    ``emulate``: torchao's CPU emulation (tests only: the recipe path refuses fp8 on CPU).
    ``skip``: Linear names left in bf16 (the LoRA targets: module docstring)."""
    from torch.distributed.tensor import DTensor

    if any(isinstance(m, nn.Linear) and isinstance(m.weight, DTensor) for m in model.modules()):
        raise LLMTrainError("fp8 conversion must run before tensor parallelism (the Linears are already "
                            "TP-sharded; engine/parallelize.py converts first)",
                            "call apply_float8 before apply_tensor_parallel", path="train.precision")
    float8 = _torchao_float8()
    config = float8.Float8LinearConfig(enable_fsdp_float8_all_gather=fp8_all_gather, emulate=emulate)
    before = sum(isinstance(m, nn.Linear) for m in model.modules())
    skipped = frozenset(skip)
    float8.convert_to_float8_training(model, config=config,
                                      module_filter_fn=lambda m, fqn: _convertible(m, fqn, skipped))
    after = sum(type(m) is nn.Linear for m in model.modules())
    return before - after


def precompute_fp8_scales(parts: list[nn.Module]) -> None:
    """One all-reduce for the tensorwise scales of every FP8-all-gathered weight (module docstring:
    called at the start of each step). A no-op for modules without such weights.

    Under TP x FSDP2 the weights are 2-D DTensors and torchao stacks their amaxes into one 2-D
    ``Partial(max)`` vector, which DTensor reduces with two sequential all-reduces (one per mesh
    dimension); torch 2.13 logs that once per rank ("... 2 sequential all_reduce operations ...
    flatten mesh dimensions"). The vector is one fp32 value per weight (a few KiB), so the cost is
    one collective latency per step, and torch's remedy (a flattened (dp_shard_cp, tp) mesh: one
    more process group for every 2-D layout) is not worth it; the note is kept out of every rank's
    output for this call only (:func:`_quiet_redistribute_note`)."""
    float8 = _torchao_float8()
    with _quiet_redistribute_note():
        for part in parts:
            float8.precompute_float8_dynamic_scale_for_fsdp(part)


@contextmanager
def _quiet_redistribute_note():
    """DTensor's redistribution logger at ERROR for the block (restored after): its only
    WARNING is the sequential-collectives note of :func:`precompute_fp8_scales`."""
    log = logging.getLogger("torch.distributed.tensor._redistribute")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)
