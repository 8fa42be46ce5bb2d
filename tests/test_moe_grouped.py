"""The grouped-GEMM expert path (used on CUDA with bf16) equals the per-expert loop.

torch 2.13's ``_grouped_mm`` runs forward on CPU (backward only on CUDA), so the padding and
offsets logic is checked here in forward, in fp32: equal to the loop within 1e-4 relative
(different GEMM kernels, same math), including an expert with no tokens and a group that is
already a multiple of the alignment.
"""

import torch

from llmtrain.engine.models.moe import GROUP_ALIGN, grouped_swiglu, grouped_swiglu_gemm, use_grouped_mm


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
