"""Single-process checks of the kernel blocks behind ring / all-gather CP (engine/parallel/context_blocks.py).

The multi-rank parity of the CP methods is tests/test_engine_5d.py (cp_attention_worker.py and
the cp cases of the matrix); these cover what one process can: the bottom-right causal prefix
attention of the all-gather method against SDPA with an explicit mask, the same under selective
recomputation (whose policy caches the kernels' outputs: an in-place merge into a cached output
once made the recomputation fail), and the plain-matmul fallback block (fp64 on CUDA) against the
CPU flash kernel. fp64 throughout: tolerance 1e-12, ~1e4 x machine epsilon for sums over a
few hundred keys; the selective run replays the very same kernels, so it must be bit-identical.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from torch.utils.checkpoint import checkpoint  # noqa: E402

from llmtrain.engine.parallel.checkpointing import _selective_context  # noqa: E402
from llmtrain.engine.parallel.context_blocks import PrefixCausalAttention, block_backward, block_forward  # noqa: E402

S, TOL = 96, 1e-12


def _inputs(seed: int, s_q: int, s_k: int):
    gen = torch.Generator().manual_seed(seed)
    # the model's layout: a transpose of [b, s, h, d]
    q = torch.randn(2, s_q, 3, 16, generator=gen, dtype=torch.float64).transpose(1, 2)
    k, v = (torch.randn(2, s_k, 3, 16, generator=gen, dtype=torch.float64).transpose(1, 2) for _ in range(2))
    return q, k, v


@pytest.mark.parametrize("offset", [0, S, 2 * S])
def test_prefix_causal_attention_matches_masked_sdpa_also_under_selective_recompute(offset):
    q0, k0, v0 = _inputs(offset, S, 3 * S)
    w = torch.randn(16, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    runs = {}
    for mode in ("reference", "plain", "selective"):
        q, k, v = (t.clone().requires_grad_() for t in (q0, k0, v0))
        if mode == "reference":  # key j visible to local query i iff j <= offset + i
            mask = torch.arange(3 * S)[None, :] <= offset + torch.arange(S)[:, None]
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask) @ w
        elif mode == "plain":
            out = PrefixCausalAttention.apply(q, k, v, offset) @ w
        else:
            out = checkpoint(lambda a, b, c: PrefixCausalAttention.apply(a * 1.0, b * 1.0, c * 1.0, offset) @ w,
                             q, k, v, use_reentrant=False, context_fn=_selective_context)
        out.pow(2).sum().backward()
        runs[mode] = [out.detach(), q.grad, k.grad, v.grad]
    for got, ref in zip(runs["plain"], runs["reference"]):
        assert (got - ref).abs().max().item() < TOL
    for got, ref in zip(runs["selective"], runs["plain"]):
        assert torch.equal(got, ref)
    assert runs["plain"][2][:, :, offset + S:].abs().sum().item() == 0  # keys after the chunk: untouched


@pytest.mark.parametrize("causal", [True, False])
def test_math_fallback_block_equals_the_cpu_flash_kernel(causal):
    q, k, v = _inputs(7, S, S if causal else 2 * S)
    dout = torch.randn_like(q)
    results = {}
    for kind in ("cpu", "math"):
        out, lse, aux = block_forward(q, k, v, causal, 0.25, kind=kind)
        results[kind] = [out, lse, *block_backward(dout, q, k, v, out, lse, causal, 0.25, aux)]
    for got, ref in zip(results["math"], results["cpu"]):
        assert got.shape == ref.shape and (got - ref).abs().max().item() < TOL
