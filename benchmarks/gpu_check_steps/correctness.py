"""Step group (b): correctness on the device, before any speed number means anything.

Sizes are the smallest that still test the thing (a 2-layer 64-wide model for the training paths,
a few hundred rows for the kernels): these steps are about seconds each, so the acceptance speed
rows after them (gpu_check_steps/speed.py) stay inside the first command's budget. Estimates
(``est_s``): CUDA/cuBLAS first-call costs and the trainer's setup dominate, not the arithmetic.

Each check compares a CUDA path with a reference that CI already trusts (CPU fp32, the
per-expert loop, a plain for-loop AdamW, an uninterrupted run, the engine's own model), with a
tolerance stated next to it. On CPU (``--device cpu --tiny``) the same code runs with CPU on
both sides, so the smoke test knows the code works before a GPU is there.
"""

from __future__ import annotations

import contextlib
import os

from . import TINY_MODEL, CheckFailed, Skip, recipe, step, train_run

# bf16 vs fp32 over 20 steps of the tiny model. bf16 keeps 8 mantissa bits (relative rounding
# 2^-9 ~ 0.2 % per operation) in every matmul input and activation, while FSDP's mixed precision
# keeps fp32 master weights and fp32 gradient reduction, so the two loss curves start equal to
# ~1e-3 relative and drift apart only slowly. Seen on CPU (bf16 vs fp32, this model, 20 steps):
# max relative difference 0.04 % (the trainer's autocast path) and 0.3 % (FSDP2 MixedPrecisionPolicy).
# 3 % relative per step is 10x the larger, far below what a wrong path does (a wrong mask, cast or
# reduction shows at once as loss differences of 10-100 %). CUDA's bf16 kernels round alike.
BF16_REL_TOL = 0.03


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


@step("train_bf16_vs_fp32", est_s=8)
def train_bf16_vs_fp32(ctx) -> dict:
    """The engine's trainer (world 1: the plain model under bf16 autocast; FSDP2 is the next
    step) trains the tiny model 20 steps in bf16 on the device and in fp32 on CPU, same seed and
    synthetic data; the loss curves agree within BF16_REL_TOL."""
    import torch

    seq, micro = (32, 4)
    bf = recipe(ctx, TINY_MODEL, precision="bf16", seq=seq, micro=micro, steps=20)
    fp = recipe(ctx, TINY_MODEL, precision="fp32", seq=seq, micro=micro, steps=20, device_type="cpu")
    got, _ = train_run(ctx, bf, ctx.device)
    ref, _ = train_run(ctx, fp, torch.device("cpu"))
    rel = [_rel(a, b) for a, b in zip(got.losses, ref.losses)]
    out = {"steps": len(got.losses), "loss_device_bf16": got.losses, "loss_cpu_fp32": ref.losses,
           "max_rel_diff": max(rel), "tolerance_rel": BF16_REL_TOL}
    if len(got.losses) != 20 or not max(rel) <= BF16_REL_TOL:
        raise CheckFailed(f"bf16 loss curve vs fp32: max relative difference {max(rel):.4f} > {BF16_REL_TOL}")
    if not ref.losses[-1] < ref.losses[0]:
        raise CheckFailed(f"fp32 reference did not learn: loss {ref.losses[0]:.4f} -> {ref.losses[-1]:.4f}")
    return out


@step("fsdp2_bf16_vs_fp32", est_s=6)
def fsdp2_bf16_vs_fp32(ctx) -> dict:
    """FSDP2 ``fully_shard`` with the bf16 ``MixedPrecisionPolicy`` (fp32 master weights, fp32
    reduce) on a 1-rank group on the device (gpu_check_steps/fsdp1.py: the engine's trainer skips
    FSDP on one rank) vs the plain model in fp32 on CPU: 20 steps on one fixed batch, same
    weights; loss curves within BF16_REL_TOL (the reasoning above holds: bf16 compute, fp32 state)."""
    import torch

    from llmtrain.recipe.schema import ModelConfig

    from .fsdp1 import build, train_fixed

    cfg = ModelConfig(**TINY_MODEL)
    dev = build(cfg, ctx.device, "bf16", compile_=False, fsdp=True)
    ref = build(cfg, torch.device("cpu"), "fp32", compile_=False, fsdp=False)
    got, _ = train_fixed(dev, cfg, ctx.device, 20, 4, 32)
    want, _ = train_fixed(ref, cfg, torch.device("cpu"), 20, 4, 32)
    rel = [_rel(a, b) for a, b in zip(got, want)]
    out = {"loss_device_fsdp2_bf16": got, "loss_cpu_fp32": want, "max_rel_diff": max(rel),
           "tolerance_rel": BF16_REL_TOL, "param_dtype": str(next(dev.parameters()).dtype)}
    if not max(rel) <= BF16_REL_TOL:
        raise CheckFailed(f"FSDP2 bf16 loss curve vs fp32: max relative difference {max(rel):.4f} > {BF16_REL_TOL}")
    if not want[-1] < want[0]:
        raise CheckFailed(f"fp32 reference did not learn: loss {want[0]:.4f} -> {want[-1]:.4f}")
    return out


@contextlib.contextmanager
def _env(key: str, value: str):
    old = os.environ.get(key)
    os.environ[key] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = old


@step("moe_grouped_gemm", est_s=5)
def moe_grouped_gemm(ctx) -> dict:
    """``torch._grouped_mm`` experts (the engine's CUDA bf16 path) vs the per-expert loop: output
    and every gradient. bf16 on CUDA: both accumulate in fp32 and round outputs to bf16 (2^-9
    relative), in different kernels; relative L2 error <= 2e-2 allows that rounding through three
    matmuls and SwiGLU, and is far below a wrong offset or padding (error ~1). CPU (smoke): the
    forward only, fp32, rtol 1e-4 (torch's CPU ``_grouped_mm`` has no backward). Then the same
    under bf16 autocast from fp32 inputs (:func:`_grouped_under_autocast`), bf16 tolerance 2e-2."""
    import torch

    from llmtrain.engine.models.moe import (
        GROUP_ALIGN,
        grouped_swiglu,
        grouped_swiglu_gemm,
    )

    if not hasattr(torch, "_grouped_mm"):
        raise Skip(f"torch {torch.__version__} has no torch._grouped_mm")
    dtype = torch.bfloat16 if ctx.cuda else torch.float32
    g = torch.Generator(device="cpu").manual_seed(0)
    h, f = (256, 512) if not ctx.tiny else (32, 48)
    counts = [37, 0, GROUP_ALIGN, 5, 300 if not ctx.tiny else 9]
    e = len(counts)
    make = lambda *s: (torch.randn(*s, generator=g) * 0.1).to(ctx.device, dtype).requires_grad_()
    x, w1, w3, w2 = make(sum(counts), h), make(e, f, h), make(e, f, h), make(e, h, f)
    with _env("LLMTRAIN_GROUPED_MM", "0"):
        loop = grouped_swiglu(x, counts, w1, w2, w3)
    try:
        gemm = grouped_swiglu_gemm(x, counts, w1, w2, w3)
    except (RuntimeError, NotImplementedError) as exc:
        raise Skip(f"torch._grouped_mm on {ctx.device.type} {dtype}: {str(exc).splitlines()[0][:200]}") from None
    rel = lambda a, b: float((a.detach().float() - b.detach().float()).norm() / b.detach().float().norm().clamp_min(1e-30))
    out = {"dtype": str(dtype), "forward_rel_l2": rel(gemm, loop)}
    tol = 2e-2 if ctx.cuda else 1e-4
    if ctx.cuda:
        dy = torch.randn(loop.shape, generator=g).to(ctx.device, dtype)
        g_loop = torch.autograd.grad(loop, (x, w1, w2, w3), dy)
        g_gemm = torch.autograd.grad(gemm, (x, w1, w2, w3), dy)
        out["grad_rel_l2"] = {n: rel(a, b) for n, a, b in zip(("x", "w1", "w2", "w3"), g_gemm, g_loop)}
    else:
        out["backward"] = "not checked: torch's CPU _grouped_mm has no backward (needs CUDA)"
    worst = max([out["forward_rel_l2"], *out.get("grad_rel_l2", {}).values()])
    out["tolerance_rel_l2"] = tol
    if not worst <= tol:
        raise CheckFailed(f"grouped GEMM vs loop: relative L2 error {worst:.3g} > {tol} ({out})")
    out["autocast"] = auto = _grouped_under_autocast(ctx, x, counts, w1, w2, w3, rel, g)
    auto["tolerance_rel_l2"] = 2e-2  # bf16 on both sides, on CPU too
    if not max(auto["rel_l2"].values()) <= 2e-2:
        raise CheckFailed(f"grouped GEMM under bf16 autocast vs the loop: {auto['rel_l2']} > 2e-2")
    return out


def _grouped_under_autocast(ctx, x, counts, w1, w2, w3, rel, g) -> dict:
    """The trainer's one-rank bf16 path (issue 19): fp32 token rows and fp32 expert weights under
    bf16 autocast must take the grouped kernel (``grouped_swiglu``'s own dispatch on CUDA; the
    call is counted) and equal the loop under the same autocast, forward and (CUDA) every fp32
    gradient, within the bf16 tolerance above. CPU: the cast path's forward (no CPU backward)."""
    import torch

    from llmtrain.engine.models import grouped_experts as moe  # the kernels' own module: patch where they are looked up

    leaves = [t.detach().float().requires_grad_() for t in (x, w1, w2, w3)]
    calls = []
    original = moe.grouped_swiglu_gemm
    moe.grouped_swiglu_gemm = lambda *a: calls.append(a[0].dtype) or original(*a)
    try:
        with torch.autocast(ctx.device.type, dtype=torch.bfloat16):
            fn = moe.grouped_swiglu if ctx.cuda else moe.grouped_swiglu_autocast
            auto = fn(leaves[0], counts, *leaves[1:])
            with _env("LLMTRAIN_GROUPED_MM", "0"):
                loop = moe.grouped_swiglu(leaves[0], counts, *leaves[1:])
    finally:
        moe.grouped_swiglu_gemm = original
    out = {"grouped_calls": len(calls), "kernel_dtype": str(calls[0]) if calls else None,
           "rel_l2": {"forward": rel(auto, loop)}}
    if calls != [torch.bfloat16]:
        raise CheckFailed(f"fp32 inputs under bf16 autocast did not take the bf16 grouped GEMM once: {calls}")
    if ctx.cuda:
        dy = torch.randn(loop.shape, generator=g).to(ctx.device)
        for n, a, b in zip(("x", "w1", "w2", "w3"), torch.autograd.grad(auto.float(), leaves, dy),
                           torch.autograd.grad(loop.float(), leaves, dy)):
            out["rel_l2"][f"d{n}"] = rel(a, b)
    return out


@step("moe_grouped_lora", est_s=5, group="options")
def moe_grouped_lora(ctx) -> dict:
    """LoRA on the routed experts (``train.lora.experts``, written without a GPU): the grouped GEMM path
    with each adapter as two more ``torch._grouped_mm`` calls (rank 8: rows 16-byte aligned in bf16) vs
    the per-expert loop, output and the gradients of the token rows and of every adapter factor (the base
    frozen). Tolerances as ``moe_grouped_gemm``: bf16 on CUDA 2e-2 relative L2; CPU (smoke) the forward
    in fp32, 1e-4."""
    import torch

    from llmtrain.engine.models.grouped_experts import ExpertAdapters, grouped_swiglu, grouped_swiglu_gemm

    if not hasattr(torch, "_grouped_mm"):
        raise Skip(f"torch {torch.__version__} has no torch._grouped_mm")
    dtype = torch.bfloat16 if ctx.cuda else torch.float32
    g = torch.Generator(device="cpu").manual_seed(1)
    h, f, r = (256, 512, 8) if not ctx.tiny else (32, 48, 8)
    counts = [37, 0, 16, 5, 300 if not ctx.tiny else 9]
    e = len(counts)
    make = lambda *s, grad=True: (torch.randn(*s, generator=g) * 0.1).to(ctx.device, dtype).requires_grad_(grad)
    x = make(sum(counts), h)
    w1, w3, w2 = make(e, f, h, grad=False), make(e, f, h, grad=False), make(e, h, f, grad=False)
    pairs = {"w1": (make(e, r, h), make(e, f, r)), "w3": (make(e, r, h), make(e, f, r)),
             "w2": (make(e, r, f), make(e, h, r))}
    adapters = ExpertAdapters(pairs, 2.0)
    with _env("LLMTRAIN_GROUPED_MM", "0"):
        loop = grouped_swiglu(x, counts, w1, w2, w3, adapters)
    try:
        gemm = grouped_swiglu_gemm(x, counts, w1, w2, w3, adapters)
    except (RuntimeError, NotImplementedError) as exc:
        raise Skip(f"torch._grouped_mm on {ctx.device.type} {dtype}: {str(exc).splitlines()[0][:200]}") from None
    rel = lambda a, b: float((a.detach().float() - b.detach().float()).norm() / b.detach().float().norm().clamp_min(1e-30))
    out = {"dtype": str(dtype), "rank": r, "forward_rel_l2": rel(gemm, loop)}
    if ctx.cuda:
        leaves = [x] + [t for pair in pairs.values() for t in pair]
        names = ["x"] + [f"{k}_{n}" for k in pairs for n in ("a", "b")]
        dy = torch.randn(loop.shape, generator=g).to(ctx.device, dtype)
        out["grad_rel_l2"] = {n: rel(a, b) for n, a, b in zip(names, torch.autograd.grad(gemm, leaves, dy),
                                                                 torch.autograd.grad(loop, leaves, dy))}
    else:
        out["backward"] = "not checked: torch's CPU _grouped_mm has no backward (needs CUDA)"
    tol = 2e-2 if ctx.cuda else 1e-4
    worst = max([out["forward_rel_l2"], *out.get("grad_rel_l2", {}).values()])
    out["tolerance_rel_l2"] = tol
    if not worst <= tol:
        raise CheckFailed(f"grouped GEMM with expert adapters vs loop: relative L2 error {worst:.3g} > {tol} ({out})")
    return out


@step("fused_adamw", est_s=3)
def fused_adamw(ctx) -> dict:
    """The engine's AdamW (``fused=True``, engine/optim.py) on FSDP2 DTensor parameters on the
    device vs ``torch.optim.AdamW(foreach=False)`` on plain CPU tensors, 5 steps with the same
    gradients, fp32. Updates are lr x ~sign(grad) = 1e-2; the kernels differ only in rounding
    (fp32: ~1e-7 relative of weights ~0.1-1), so max |dw| <= 1e-5 is 100x that, while a wrong
    bias correction or decay shows at 1e-3."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from llmtrain.engine.optim import make_adamw
    from llmtrain.recipe.schema import TrainConfig

    torch.manual_seed(0)
    n = 64 if ctx.tiny else 1024
    ref = torch.nn.Sequential(torch.nn.Linear(n, 2 * n), torch.nn.Linear(2 * n, n))
    dev = torch.nn.Sequential(torch.nn.Linear(n, 2 * n), torch.nn.Linear(2 * n, n)).to(ctx.device)
    dev.load_state_dict(ref.state_dict())
    fully_shard(dev, mesh=init_device_mesh(ctx.device.type, (1,)))
    if not all(isinstance(p, DTensor) for p in dev.parameters()):
        raise CheckFailed("fully_shard left non-DTensor parameters")
    cfg = TrainConfig(optimizer={"lr": 1e-2, "weight_decay": 0.1, "betas": [0.9, 0.95]})
    opt = make_adamw(cfg)([{"params": list(dev.parameters()), "weight_decay": 0.1}])
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), foreach=False)
    g = torch.Generator().manual_seed(1)
    for _ in range(5):
        for p_ref, p_dev in zip(ref.parameters(), dev.parameters()):
            grad = torch.randn(p_ref.shape, generator=g)
            p_ref.grad = grad.clone()
            p_dev.grad = DTensor.from_local(grad.to(ctx.device), p_dev.device_mesh, p_dev.placements)
        opt.step()
        ref_opt.step()
    diff = max(float((p_dev.full_tensor().cpu() - p_ref.detach()).abs().max())
               for p_ref, p_dev in zip(ref.parameters(), dev.parameters()))
    fused = bool(opt.param_groups[0].get("fused"))
    out = {"max_abs_diff": diff, "tolerance": 1e-5, "fused": fused, "params": sum(p.numel() for p in ref.parameters())}
    if not fused:
        raise CheckFailed("the engine's AdamW is not fused")
    if not diff <= 1e-5:
        raise CheckFailed(f"fused AdamW on {ctx.device.type} DTensors vs for-loop AdamW on CPU: max |dw| {diff:.3g} > 1e-5")
    return out


def _weights(res) -> dict:
    """Full fp32 weights of a TrainResult's single part (DTensors gathered)."""
    from torch.distributed.tensor import DTensor

    out = {}
    for k, v in res.parts.parts[0].state_dict().items():
        v = v.full_tensor() if isinstance(v, DTensor) else v
        out[k] = v.detach().cpu().clone()
    return out


@step("dcp_async_resume", est_s=12)
def dcp_async_resume(ctx) -> dict:
    """Async DCP save from device tensors (checkpoint.async, the engine's default) at step 3 of 6,
    then a new run resumed from it: its losses of steps 4-6 and its final weights equal the
    uninterrupted run's BITWISE. On CUDA deterministic algorithms are on for this step (the flash
    backward otherwise may sum in a different order from run to run, which is not a checkpoint bug)."""
    import torch

    seq, micro = 32, 4
    ck = {"interval": 3, "async": True, "keep": 3}
    r = recipe(ctx, TINY_MODEL, precision="bf16" if ctx.cuda else "fp32", seq=seq, micro=micro, steps=6, checkpoint=ck)
    run_a, run_b = ctx.tmp("dcp-a"), ctx.tmp("dcp-b")
    det = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        a, _ = train_run(ctx, r, ctx.device, run_dir=run_a)
        wa = _weights(a)
        b, _ = train_run(ctx, r, ctx.device, run_dir=run_b, resume=str(run_a / "checkpoints" / "step-3"))
        wb = _weights(b)
    finally:
        torch.use_deterministic_algorithms(det)
    ctx.shared["run_dir"], ctx.shared["run_recipe"], ctx.shared["run_weights"] = run_a, r, wa
    unequal = [k for k in wa if not torch.equal(wa[k], wb[k])]
    out = {"losses_uninterrupted": a.losses, "losses_resumed": b.losses, "tensors": len(wa),
           "unequal_tensors": unequal[:10]}
    if b.losses != a.losses[3:]:
        raise CheckFailed(f"resumed losses {b.losses} != uninterrupted {a.losses[3:]}")
    if unequal:
        worst = max(float((wa[k].float() - wb[k].float()).abs().max()) for k in unequal)
        raise CheckFailed(f"{len(unequal)} of {len(wa)} weights differ after resume (max |d| {worst:.3g}): {unequal[:3]}")
    return out


@step("hf_export", est_s=10)
def hf_export(ctx) -> dict:
    """``ckpt export --hf``'s code on the checkpoint of the device run above (fp32), loaded by
    transformers' own ``from_pretrained`` on the device: its logits equal the engine's model with
    the same weights within 1e-3 (fp32 on both sides, TF32 off; kernels differ in summation
    order only, ~1e-6; a mapping error — names, the RoPE row permutation — gives O(1))."""
    import torch
    from transformers import AutoModelForCausalLM

    from llmtrain.engine.checkpoint_meta import CheckpointMeta
    from llmtrain.engine.checkpoint_store import resolve
    from llmtrain.engine.hf.export import export_hf
    from llmtrain.engine.models.llama import Transformer

    if "run_dir" not in ctx.shared:
        r = recipe(ctx, TINY_MODEL, precision="bf16" if ctx.cuda else "fp32", seq=32, micro=4, steps=2)
        run = ctx.tmp("hf-run")
        res, _ = train_run(ctx, r, ctx.device, run_dir=run)
        ctx.shared["run_dir"], ctx.shared["run_recipe"], ctx.shared["run_weights"] = run, r, _weights(res)
    run, r, weights = ctx.shared["run_dir"], ctx.shared["run_recipe"], ctx.shared["run_weights"]
    path, meta, _ = resolve(run / "checkpoints", "latest", require=("recipe",), check_index=True)
    out_dir = ctx.tmp("hf-out")
    export_hf(path, CheckpointMeta.model_validate(meta).files, r.model, out_dir, "fp32", workers=1)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        hf = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32, attn_implementation="sdpa").to(ctx.device)
        ours = Transformer(r.model).to(ctx.device)
        ours.load_state_dict({k: v.to(ctx.device) for k, v in weights.items()})
        tokens = torch.randint(0, r.model.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0)).to(ctx.device)
        with torch.no_grad():
            diff = float((hf(input_ids=tokens, use_cache=False).logits - ours(tokens)).abs().max())
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    out = {"files": sorted(p.name for p in out_dir.iterdir()), "max_abs_logit_diff": diff, "tolerance": 1e-3,
           "hf_class": type(hf).__name__}
    if not diff <= 1e-3:
        raise CheckFailed(f"exported HF model's logits differ from the engine's by {diff:.3g} > 1e-3")
    return out
