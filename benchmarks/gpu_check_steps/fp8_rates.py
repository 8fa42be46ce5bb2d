"""FP8 GEMM rates for ``kernel_rates`` (kernels.py): the published rows' per-rank shapes as torchao's
tensorwise Float8 linear runs them, beside time model v2's FP8 price (``MAMF_FP8`` x tile/wave
efficiency), so a record can fit the FP8 matmul rate as it fits the bf16 one (benchmarks/gpu_fit.py).

Each product is one ``torch._scaled_mm`` with per-tensor scales and bf16 output, the operands laid
out as the kernel wants them (the first row-major, the second column-major; the casts and the
transposed copies torchao makes are not timed: v2 prices those apart, ``planner.fp8_casts``):
forward ``x W^T`` (e4m3 x e4m3, fast accumulation, torchao's default for the output), input
gradient ``dy W`` and weight gradient ``dy^T x`` (e5m2 x e4m3, no fast accumulation).
"""

from __future__ import annotations


def fp8_rows(ctx, shapes, reps: int, timed) -> dict:
    """``{"fp8_gemms": [...]}`` on a CUDA GPU with FP8 tensor cores, else ``{"fp8_gemms_skipped": why}``."""
    import torch

    from llmtrain.plan.gemmtime import gemm_fwd_bwd
    from llmtrain.recipe.gpus import GPUS

    gpu = GPUS[ctx.gpu_key]
    if not ctx.cuda:
        return {"fp8_gemms_skipped": "needs CUDA"}
    if torch.cuda.get_device_capability(ctx.device) < (8, 9) or gpu.peak_flops_fp8 <= 0:
        return {"fp8_gemms_skipped": "no FP8 tensor cores (sm89+)"}
    e4m3, e5m2, bf16 = torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16
    one = torch.ones((), device=ctx.device, dtype=torch.float32)
    rows = []
    for m, n, k in shapes:
        x = torch.randn(m, k, device=ctx.device, dtype=bf16).to(e4m3)
        w = torch.randn(n, k, device=ctx.device, dtype=bf16).to(e4m3)
        dy = torch.randn(m, n, device=ctx.device, dtype=bf16).to(e5m2)
        w_t, dy_t, x_t = w.t().contiguous(), dy.t().contiguous(), x.t().contiguous()

        def fwd():
            return torch._scaled_mm(x, w.t(), scale_a=one, scale_b=one, out_dtype=bf16, use_fast_accum=True)

        def bwd():
            return (torch._scaled_mm(dy, w_t.t(), scale_a=one, scale_b=one, out_dtype=bf16),
                    torch._scaled_mm(dy_t, x_t.t(), scale_a=one, scale_b=one, out_dtype=bf16))
        t_fwd, t_bwd = timed(fwd, reps, True), timed(bwd, reps, True)
        p_fwd, p_bwd = gemm_fwd_bwd(m, n, k, gpu, peak=gpu.peak_flops_fp8)
        flops = 2.0 * m * n * k
        rows.append({"m": m, "n": n, "k": k, "fwd_tflops": flops / t_fwd / 1e12, "bwd_tflops": 2 * flops / t_bwd / 1e12,
                     "v2_fwd_tflops": flops / p_fwd / 1e12, "v2_bwd_tflops": 2 * flops / p_bwd / 1e12,
                     "fwd_vs_v2": p_fwd / t_fwd, "bwd_vs_v2": p_bwd / t_bwd})
        del x, w, dy, w_t, dy_t, x_t
    return {"fp8_gemms": rows}
