"""The grouped-GEMM expert path (used on CUDA with bf16) equals the per-expert loop.

torch 2.13's ``_grouped_mm`` runs forward on CPU (backward only on CUDA), so the padding and
offsets logic is checked here in forward, in fp32: equal to the loop within 1e-4 relative
(different GEMM kernels, same math), including an expert with no tokens and a group that is
already a multiple of the alignment.
"""

import torch

from llmtrain.engine.models.moe import (
    GROUP_ALIGN,
    grouped_mm_dtype,
    grouped_swiglu,
    grouped_swiglu_autocast,
    grouped_swiglu_gemm,
    use_grouped_mm,
)


def test_grouped_gemm_matches_loop():
    torch.manual_seed(0)
    counts = [5, 0, GROUP_ALIGN, 3]
    x = torch.randn(sum(counts), 32)
    w1, w3 = torch.randn(4, 48, 32) * 0.1, torch.randn(4, 48, 32) * 0.1
    w2 = torch.randn(4, 32, 48) * 0.1
    loop = grouped_swiglu(x, counts, w1, w2, w3)
    gemm = grouped_swiglu_gemm(x, counts, w1, w2, w3)
    assert gemm.shape == loop.shape
    assert torch.allclose(gemm, loop, rtol=1e-4, atol=1e-5)


def test_grouped_gemm_only_on_cuda_bf16():
    assert not use_grouped_mm(torch.zeros(2, 2))
    assert not use_grouped_mm(torch.zeros(2, 2, dtype=torch.bfloat16))


def test_grouped_gemm_under_bf16_autocast():
    """The trainer's one-rank bf16 path (fp32 token stream under bf16 autocast) takes the grouped
    GEMM in bf16 (issue 19): the dispatch dtype, and the cast path's forward vs the loop under the
    same autocast on CPU. Both round inputs and outputs to bf16 and accumulate in fp32; relative
    L2 <= 1e-2 is ~4x bf16's 2^-9 rounding through three matmuls and SwiGLU, while wrong padding
    or a missing cast is O(1). On CPU use_grouped_mm stays False (no CPU backward); CUDA's
    dispatch, forward and backward, is benchmarks/gpu_check_steps/correctness.py moe_grouped_gemm."""
    torch.manual_seed(0)
    counts = [5, 0, GROUP_ALIGN, 3]
    x = torch.randn(sum(counts), 32)
    w1, w3, w2 = torch.randn(4, 48, 32) * 0.1, torch.randn(4, 48, 32) * 0.1, torch.randn(4, 32, 48) * 0.1
    assert grouped_mm_dtype(x) is None  # fp32, no autocast: the loop
    with torch.autocast("cpu", dtype=torch.float16):
        assert grouped_mm_dtype(x) is None  # the kernel is bf16 only
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert grouped_mm_dtype(x) == torch.bfloat16
        assert not use_grouped_mm(x)
        loop = grouped_swiglu(x, counts, w1, w2, w3)
        gemm = grouped_swiglu_autocast(x, counts, w1, w2, w3)
    assert gemm.dtype == torch.bfloat16  # (the loop's cat with an empty fp32 chunk promotes; values equal)
    rel = float((gemm.float() - loop.float()).norm() / loop.float().norm())
    assert rel <= 1e-2, rel


class _LocalRegion:
    """Stands in for ExpertTPRegion on one process: the collectives become sums done by the test."""

    def enter(self, x):
        return x

    def exit(self, out):
        return out

    def replicated(self, w):
        return w


def test_expert_tp_partial_sums_equal_the_whole_moe():
    """The convention expert-TP relies on (engine/parallel/expert.py): inside the region every
    output and gradient is a partial sum over the TP ranks. Two halves of every routed and shared
    expert's F (what tp 2 ranks hold), each with a 1/2 aux-loss seed, must add up to the whole
    block: output, input gradient and router gradient (summed), expert gradients (concatenated).
    The aux loss is on (debug-moe preset) so its seed share is checked. fp32; the only difference
    is summation order over F, so 1e-5 (outputs ~1e-1) is ~100x the rounding seen."""
    from llmtrain.engine.models.moe import MoE
    from llmtrain.recipe.schema import ModelConfig

    cfg = ModelConfig(preset="debug-moe")
    torch.manual_seed(0)
    full = MoE(cfg)
    for p in full.parameters():
        p.data.normal_(std=0.1)
    f = cfg.expert_ffn
    halves = []
    for r in range(2):
        part = MoE(cfg)
        sl = slice(r * f // 2, (r + 1) * f // 2)
        with torch.no_grad():
            part.router.weight.copy_(full.router.weight)
            part.experts.w1 = torch.nn.Parameter(full.experts.w1[:, sl].clone())
            part.experts.w3 = torch.nn.Parameter(full.experts.w3[:, sl].clone())
            part.experts.w2 = torch.nn.Parameter(full.experts.w2[:, :, sl].clone())
            part.shared.w1.weight = torch.nn.Parameter(full.shared.w1.weight[sl].clone())
            part.shared.w3.weight = torch.nn.Parameter(full.shared.w3.weight[sl].clone())
            part.shared.w2.weight = torch.nn.Parameter(full.shared.w2.weight[:, sl].clone())
        part.tp_region, part.aux_grad_share = _LocalRegion(), 0.5
        halves.append(part)
    x = torch.randn(2, 16, cfg.hidden)
    g = torch.randn(2, 16, cfg.hidden)
    xs = [x.clone().requires_grad_(True) for _ in range(3)]
    want = full(xs[0])
    (want * g).sum().backward()
    outs = [half(xi) for half, xi in zip(halves, xs[1:])]
    for out in outs:
        (out * g).sum().backward()
    tol = dict(rtol=0, atol=1e-5)
    assert torch.allclose(outs[0] + outs[1], want, **tol)
    assert not torch.allclose(outs[0], want, **tol)  # each half alone is a partial sum
    assert torch.allclose(xs[1].grad + xs[2].grad, xs[0].grad, **tol)
    router = halves[0].router.weight.grad + halves[1].router.weight.grad
    assert torch.allclose(router, full.router.weight.grad, **tol)
    assert torch.allclose(torch.cat([h.experts.w1.grad for h in halves], 1), full.experts.w1.grad, **tol)
    assert torch.allclose(torch.cat([h.experts.w2.grad for h in halves], 2), full.experts.w2.grad, **tol)
    assert torch.allclose(torch.cat([h.shared.w2.weight.grad for h in halves], 1), full.shared.w2.weight.grad, **tol)
