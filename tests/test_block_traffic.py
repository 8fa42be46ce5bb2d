"""Time model v2's element-wise bytes of a block (plan/ops.py ``_elementwise``) against the engine's
own ops, counted under a dispatch mode (tests/traffic.py)."""

from __future__ import annotations

import pytest
import torch

from llmtrain.engine.models.llama import TransformerBlock
from llmtrain.engine.models.rope import rope_cos_sin
from llmtrain.plan import ops
from llmtrain.recipe.schema import ModelConfig
from tests.traffic import Traffic


class _FusedNorm(torch.autograd.Function):
    """Stands in for the RMSNorm kernel GPUs run (one fused kernel each way; the CPU build runs a
    composite): its bytes are added from ops.norm_bytes, its internals not counted."""

    @staticmethod
    def forward(ctx, x, traffic):
        ctx.traffic = traffic
        traffic.paused = True
        y = x.clone()
        traffic.paused = False
        return y

    @staticmethod
    def backward(ctx, grad):
        ctx.traffic.paused = True
        g = grad.clone()
        ctx.traffic.paused = False
        return g, None


@pytest.mark.parametrize("heads, kv_heads", [(8, 8), (8, 2)])
def test_dense_block_elementwise_bytes_are_the_engines_ops(heads, kv_heads):
    """One dense block's forward and backward in bf16: the bytes its element-wise ops move (RoPE's
    fp32 complex multiply, SwiGLU with its recomputed SiLU, the residual adds, GQA's K/V repeat and
    its sum, autograd's sums of the q/k/v and w1/w3 input gradients) equal v2's price within 3 %.
    What the price leaves out is RoPE's per-call frequency table (``[s, head_dim / 2]`` complex,
    conjugated and copied in backward: independent of the heads), here 1.7-1.9 % of the total."""
    h, ffn, s = 512, 1408, 512
    cfg = ModelConfig(layers=1, hidden=h, heads=heads, kv_heads=kv_heads, ffn_hidden=ffn, vocab_size=1024,
                      max_seq_len=s, rope_theta=10000.0, norm_eps=1e-5, tie_embeddings=False)
    torch.manual_seed(0)
    block = TransformerBlock(0, cfg).to(torch.bfloat16)
    traffic = Traffic()
    for name in ("attention_norm", "ffn_norm"):
        getattr(block, name).forward = lambda x: _FusedNorm.apply(x, traffic)
    x = torch.randn(1, s, h, dtype=torch.bfloat16, requires_grad=True)
    cos, sin = rope_cos_sin(torch.arange(s), cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    with traffic:
        y = block(x, cos, sin)
        y.backward(torch.ones_like(y))
    shape = ops.BlockShape(b=1, s=s, seq=s, h=h, heads=heads, kv_heads=kv_heads, hd=h // heads, ffn=ffn,
                           vocab=1024, tp=1, sp=False, e=2)
    nf, nb = ops.norm_bytes(2, False)
    counted = traffic.bytes + 2 * (nf + nb) * s * h
    fwd, bwd = ops._elementwise(shape, False)
    assert counted == pytest.approx(fwd + bwd, rel=0.03)
    assert counted > fwd + bwd  # what is left out is only ever extra


def test_fused_block_kernels_move_what_their_kernels_read_and_write():
    """planner.block_kernels fused (Megatron-Core + Transformer Engine, MPT): per token a fused RoPE
    reads and writes each q / k element (2e each way), the fused activation reads gate and up and
    writes the product (3e; backward reads the gradient, gate and up and writes two: 5e), no K/V
    repeat, no input-gradient sums; norms and residual adds as the engine's. Hand-computed for one
    GQA block, tp 1, bf16."""
    e, tok, h, heads, kv, hd, ffn = 2, 4096, 4096, 32, 8, 128, 14336
    shape = ops.BlockShape(b=1, s=tok, seq=tok, h=h, heads=heads, kv_heads=kv, hd=hd, ffn=ffn, vocab=128256, tp=1,
                           sp=False, e=e, kernels="fused")
    nf, nb = ops.norm_bytes(e, False)
    qk = (heads + kv) * hd * tok
    fwd, bwd = ops._elementwise(shape, False)
    assert fwd == 2 * nf * h * tok + 6 * e * h * tok + 2 * e * qk + 3 * e * ffn * tok
    assert bwd == 2 * nb * h * tok + 6 * e * h * tok + 2 * e * qk + 5 * e * ffn * tok
    engine_f, engine_b = ops._elementwise(ops.BlockShape(**{**shape.__dict__, "kernels": "engine"}), False)
    assert engine_f > fwd and engine_b > bwd
