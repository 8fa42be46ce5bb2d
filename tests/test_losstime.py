"""Time model v2's output layer and cross-entropy (llmtrain/plan/losstime.py)."""

from __future__ import annotations

import pytest
import torch

from llmtrain.engine.parallel.loss import chunked_cross_entropy
from llmtrain.plan.gemmtime import gemm_fwd_bwd, gemm_seconds, membound_seconds
from llmtrain.plan.losstime import engine_loss_bytes, head_loss_seconds, logit_bytes
from llmtrain.recipe.gpus import GPUS
from tests.traffic import Traffic


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_engine_loss_bytes_are_the_engines_ops(dtype):
    """The planner's count of the chunked loss's memory traffic (engine_loss_bytes) equals what the
    engine's forward and backward actually run, op by op, within 1 %: the planner leaves out only
    per-token vectors (row max, log-sum-exp, target logits, masks), here 0.1-0.4 % of the total.
    bf16 exercises the casts and the per-chunk fp32 accumulation of the weight gradient."""
    n, hidden, vocab, chunk = 1024, 256, 4096, 256
    torch.manual_seed(0)
    h = torch.randn(n, hidden, dtype=dtype, requires_grad=True)
    w = torch.randn(vocab, hidden, dtype=dtype, requires_grad=True)
    labels = torch.randint(0, vocab, (n,))
    with Traffic() as traffic:
        chunked_cross_entropy(h, w, labels, reduction="sum", chunk_tokens=chunk).backward()
    fwd, bwd = engine_loss_bytes(n, vocab, hidden, h.element_size(), chunk)
    assert traffic.bytes == pytest.approx(fwd + bwd, rel=0.01)


def test_stacks_losses_are_gemms_plus_their_bytes():
    """A non-engine loss is the output layer's three GEMMs plus its bytes per logit at HBM speed;
    Megatron's unfused loss moves 52 bytes per bf16 logit, its fused one 28, a one-kernel fused loss
    6 (plan/losstime.py's counts); a frozen output layer (LoRA) drops the weight gradient."""
    gpu = GPUS["h100-sxm"]
    tokens, vocab, hidden = 4096, 131072, 2048
    f, b = gemm_fwd_bwd(tokens, vocab, hidden, gpu)
    for kind, total in (("megatron", 52), ("megatron_fused", 28), ("fused", 6), ("unchunked", 48), ("compiled", 8)):
        assert sum(logit_bytes(kind, 2)) == total, kind
        lf, lb = head_loss_seconds(kind, tokens, vocab, hidden, 2, gpu)
        assert lf + lb == pytest.approx(f + b + membound_seconds(tokens * vocab * total, gpu)), kind
    _, frozen = head_loss_seconds("megatron", tokens, vocab, hidden, 2, gpu, weight_trains=False)
    assert frozen == pytest.approx(gemm_seconds(tokens, hidden, vocab, gpu) + membound_seconds(tokens * vocab * 14, gpu))
    # fp32 logits need no casts: Megatron's loss then moves 40 bytes, the engine's 32 per logit
    assert sum(logit_bytes("megatron", 4)) == 40 and sum(logit_bytes("engine", 4)) == 32


def test_engine_loss_weight_gradient_accumulation_scales_with_chunks():
    """In bf16 the engine upcasts and adds each chunk's [vocab, hidden] weight-gradient product to
    its fp32 accumulator (18 bytes per weight element per chunk): halving the chunk adds that
    much again per token; frozen heads (LoRA) and fp32 compute have none."""
    tokens, vocab, hidden = 8192, 128256, 4096
    f256, _ = engine_loss_bytes(tokens, vocab, hidden, 2, 256)
    f512, _ = engine_loss_bytes(tokens, vocab, hidden, 2, 512)
    assert f256 - f512 == pytest.approx((32 - 16) * vocab * hidden * 18)
    assert engine_loss_bytes(tokens, vocab, hidden, 2, 256, weight_trains=False)[0] == \
        engine_loss_bytes(tokens, vocab, hidden, 2, 512, weight_trains=False)[0]
    assert engine_loss_bytes(tokens, vocab, hidden, 4, 256)[0] == engine_loss_bytes(tokens, vocab, hidden, 4, 512)[0]
