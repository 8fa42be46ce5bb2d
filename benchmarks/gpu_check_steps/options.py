"""Step group (e), last: CUDA-only options measured in their smallest form.

``fp8``: ``train.precision: fp8`` (torchao Float8 linears, tensorwise scaling, engine/parallel/
float8.py) on the ~1B dense model, compiled, as the dense_compiled row otherwise: tokens/s, MFU
(still against the bf16 peak, so it compares with the bf16 rows), memory, the planner's
prediction, and the loss must stay finite and fall.

``fp8_all_gather``: ``parallel.fp8_all_gather`` at its smallest: the tiny model, Float8 linears,
FSDP2 (zero 3, bf16 mixed precision) on a 1-rank mesh, trained on one fixed batch with and without
torchao's FP8 all-gather. Checks: every converted weight went through torchao's pre-all-gather
hook as float8 (so FSDP2 moved 1 byte per element), the loss falls, and the two runs' losses agree
(see :func:`fp8_all_gather_runs`). The same function runs on CPU with torchao's emulation in
tests/test_fp8.py.

``fp8_tp``: ``train.precision: fp8`` with ``parallel.tp 2`` and sequence parallelism (torchao's Float8
TP styles) against bf16, on 2 GPUs (skipped with fewer), and with 4 also dp 2 with FP8 all-gather.

``async_tp``: ``parallel.async_tp`` needs tp >= 2, i.e. two GPUs and two processes; with fewer
GPUs it is recorded "skipped: needs >= 2 GPUs" (the honest outcome on a 1-GPU machine). With two
it trains the tiny model at tp 2 (SP, compiled) under torchrun with and without async TP.
"""

from __future__ import annotations

import math

from . import TINY_MODEL, CheckFailed, Skip, step
from .speed import DENSE, TINY_DENSE, speed_row


@step("fp8_dense_compiled", est_s=100, cuda_only=True)
def fp8_dense_compiled(ctx) -> dict:
    import torch

    try:
        from torchao.float8 import convert_to_float8_training  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure means: not available here
        raise Skip(f"torchao not available: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}") from None
    if torch.cuda.get_device_capability(ctx.device) < (8, 9):
        raise Skip(f"fp8 needs sm89+, this GPU is sm{''.join(map(str, torch.cuda.get_device_capability(ctx.device)))}")
    row = speed_row(ctx, "fp8_dense_compiled", TINY_DENSE if ctx.tiny else DENSE, compile_=True, precision="fp8")
    first, last = row["loss_first_last"]
    if not (math.isfinite(last) and last < first):
        raise CheckFailed(f"fp8 loss {first:.4f} -> {last:.4f}")
    bf16 = ctx.shared.get("speed", {}).get("dense_compiled")
    if bf16:
        row["vs_bf16_compiled"] = row["tokens_per_s"] / bf16
    return row


FP8_AG_LOSS_TOL = 5e-3  # see fp8_all_gather_runs


def fp8_all_gather_runs(device, emulate: bool, steps: int = 4, seq: int = 32, micro: int = 2) -> dict:
    """Train the tiny model ``steps`` SGD steps on one fixed batch twice, FSDP2 on a 1-rank mesh, Float8
    linears (engine/parallel/float8.py), with and without ``fp8_all_gather``; the caller owns the
    process group. Returns both loss lists and the dtypes torchao's pre-all-gather hook produced.

    Why the losses are not bitwise equal: without FP8 all-gather FSDP2 gathers the bf16 cast of the
    fp32 shard and Float8Linear casts that to float8 with the bf16 tensor's amax; with it, the fp32
    shard is cast to float8 directly with the fp32 amax (one rounding instead of two, a scale from
    a slightly different amax). Float8 e4m3 keeps 3 mantissa bits (relative step 2^-3), so a weight
    element can land one FP8 step apart. Measured on CPU emulation (SGD lr 0.1, 4 steps, loss ~5.5):
    7e-5 at step 1, at most 9.4e-4; ``FP8_AG_LOSS_TOL`` = 5e-3 leaves 5x. What it catches: an
    unsharded weight that is not the weight (bytes reinterpreted, a scale not paired with its
    data: errors of order 1). What it cannot: a slightly stale scale (it is applied on both sides
    of the cast, so only saturation would show), and local vs global amax (on a 1-rank mesh one
    shard is the whole tensor; that needs dp >= 2 GPUs).
    """
    import torch
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    from llmtrain.engine.models.init import init_weights
    from llmtrain.engine.models.llama import Transformer
    from llmtrain.engine.parallel.data_parallel import apply_fsdp
    from llmtrain.engine.parallel.float8 import apply_float8, precompute_fp8_scales
    from llmtrain.recipe.schema import ModelConfig

    cfg = ModelConfig.model_validate(TINY_MODEL)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (micro, seq + 1), generator=gen).to(device)
    seen: list = []
    original = WeightWithDynamicFloat8CastTensor.fsdp_pre_all_gather

    def recording(self, mesh):  # FSDP2 checks the hook's signature: torchao's is (self, mesh)
        out = original(self, mesh)
        seen.append(out[0][0].dtype)
        return out

    out = {}
    WeightWithDynamicFloat8CastTensor.fsdp_pre_all_gather = recording
    try:
        for ag in (False, True):
            with torch.device("meta"):
                model = Transformer(cfg)
            converted = apply_float8(model, fp8_all_gather=ag, emulate=emulate)
            apply_fsdp(model, init_device_mesh(device.type, (1,)), zero=3, pp_enabled=False, precision="fp8")
            model.to_empty(device=device)
            init_weights(model, 0)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            losses = []
            seen.clear()
            for _ in range(steps):
                if ag:
                    precompute_fp8_scales([model])
                logits = model(tokens[:, :-1])
                loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                losses.append(loss.item())
            out["fp8_ag" if ag else "bf16_ag"] = {"losses": losses, "gathered_dtypes": sorted({str(d) for d in seen}),
                                                  "fp8_gathers": sum("float8" in str(d) for d in seen),
                                                  "converted": converted}
    finally:
        WeightWithDynamicFloat8CastTensor.fsdp_pre_all_gather = original
    return out


@step("fp8_all_gather", est_s=30, cuda_only=True)
def fp8_all_gather(ctx) -> dict:
    import torch

    try:
        import torchao.float8  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure means: not available here
        raise Skip(f"torchao not available: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}") from None
    if torch.cuda.get_device_capability(ctx.device) < (8, 9):
        raise Skip(f"fp8 needs sm89+, this GPU is sm{''.join(map(str, torch.cuda.get_device_capability(ctx.device)))}")
    row = fp8_all_gather_runs(ctx.device, emulate=False)
    plain, fp8 = row["bf16_ag"]["losses"], row["fp8_ag"]["losses"]
    row["max_loss_diff"] = max(abs(a - b) for a, b in zip(plain, fp8))
    if not row["fp8_ag"]["fp8_gathers"] or row["bf16_ag"]["fp8_gathers"]:
        raise CheckFailed(f"pre-all-gather dtypes: {row}")
    if not (math.isfinite(fp8[-1]) and fp8[-1] < fp8[0]) or row["max_loss_diff"] > FP8_AG_LOSS_TOL:
        raise CheckFailed(f"fp8 all-gather losses {fp8} vs bf16 all-gather {plain}")
    return row


FP8_TP_LOSS_TOL = 5e-2  # see fp8_tp


@step("fp8_tp", est_s=80, cuda_only=True)
def fp8_tp(ctx) -> dict:
    """fp8 under tensor parallelism on CUDA (torchao's Float8 TP styles, engine/parallel/tensor.py):
    tp 2 with sequence parallelism, fp8 against bf16, 6 steps (fp8_tp_worker.py); with >= 4 GPUs also
    tp 2 x dp_shard 2, zero 3, fp8_all_gather. Needs >= 2 GPUs (recorded skipped otherwise). The CPU
    emulation covers plain TP and TP + FSDP2 + FP8 all-gather against one process (tests/fp8_tp_check.py)
    but not SP, whose FP8 all-gather of activations gloo cannot move: this step is that path's test.
    Check: losses finite and falling, within ``FP8_TP_LOSS_TOL`` = 5e-2 of bf16 at loss ~5.5 (fp8's own
    effect, e4m3 rounding of weights, activations and gradients, was 2.7e-4 at step 1 emulated on CPU,
    tests/fp8_tp_check.py; 6 AdamW steps in bf16 compute move further; a dropped reduction is O(1))."""
    import os
    import subprocess
    import sys

    import torch

    n = torch.cuda.device_count()
    if n < 2:
        raise Skip(f"needs >= 2 GPUs (tp 2), this machine has {n}")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = {}
    for name, nproc, precision in (("bf16", 2, "bf16"), ("fp8", 2, "fp8"), ("fp8_dp2_ag", 4, "fp8")):
        if nproc > n:
            out[name] = f"skipped: needs {nproc} GPUs"
            continue
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               os.path.join(root, "benchmarks", "gpu_check_steps", "fp8_tp_worker.py"), precision]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=root, check=False,
                              env={**os.environ, "PYTHONPATH": root})
        if proc.returncode:
            raise CheckFailed(f"{name}: torchrun {proc.returncode}: {proc.stderr.strip().splitlines()[-1:]}")
        out[name] = [float(x) for x in proc.stdout.split("LOSSES", 1)[1].split()]
    bf16 = out["bf16"]
    for name in ("fp8", "fp8_dp2_ag"):
        losses = out[name]
        if isinstance(losses, str):
            continue
        out[f"{name}_max_loss_diff"] = diff = max(abs(a - b) for a, b in zip(bf16, losses))
        if diff > FP8_TP_LOSS_TOL or not (math.isfinite(losses[-1]) and losses[-1] < losses[0]):
            raise CheckFailed(f"{name} losses {losses} vs bf16 {bf16}")
    return out


@step("async_tp", est_s=90, cuda_only=True)
def async_tp(ctx) -> dict:
    """tp 2 (sequence parallel, compiled) with and without ``parallel.async_tp`` on 2 GPUs."""
    import os
    import subprocess
    import sys

    import torch

    n = torch.cuda.device_count()
    if n < 2:
        raise Skip(f"needs >= 2 GPUs (tp 2), this machine has {n}")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = {}
    for on in (False, True):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               os.path.join(root, "benchmarks", "gpu_check_steps", "async_tp_worker.py"), "1" if on else "0"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=root, check=False,
                              env={**os.environ, "PYTHONPATH": root})
        if proc.returncode:
            raise CheckFailed(f"async_tp={on}: torchrun {proc.returncode}: {proc.stderr.strip().splitlines()[-1:]}")
        out["async" if on else "sync"] = [float(x) for x in proc.stdout.split("LOSSES", 1)[1].split()]
    sync, asy = out["sync"], out["async"]
    out["max_loss_diff"] = max(abs(a - b) for a, b in zip(sync, asy))
    if out["max_loss_diff"] > 1e-2 or not asy[-1] < asy[0]:  # bf16 compute, a different fusion: 1e-2 at loss ~5.5
        raise CheckFailed(f"async TP losses {asy} vs {sync}")
    return out
