"""Soft-capped attention and logits (Gemma 2; engine/models/softcap.py, engine/parallel/loss.py).

References are autograd over transformers' eager formula (``matmul``, ``cap * tanh(. / cap)``,
mask, ``softmax``, ``matmul``). In fp64 the kernel's math runs in fp64 too, so outputs and
gradients agree to 1e-10 (the differences are summation order: blocks of queries, the
log-sum-exp form of the softmax); a wrong derivative of the cap (``1 - t^2``) or a dropped
mask is off by far more than that (checked by the tests' own controls).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llmtrain.engine.models import softcap
from llmtrain.engine.models.llama import attention_bias, packed_mask, window_mask
from llmtrain.engine.parallel.loss import chunked_cross_entropy, chunked_token_losses

TOL = 1e-10


def eager(q, k, v, bias, cap):
    s = torch.matmul(q, k.transpose(-1, -2)) / q.shape[-1] ** 0.5
    s = torch.tanh(s / cap) * cap
    n = q.shape[2]
    if bias is None:
        s = s.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    else:
        s = s + bias
    return torch.matmul(torch.softmax(s, dim=-1), v)


def masks(n: int):
    yield "causal", None
    yield "window 5", attention_bias(window_mask(torch.arange(n), 5), torch.float64)
    segments = torch.tensor([[0] * 8 + [1] * (n - 8), [0] * n])
    yield "packed", attention_bias(packed_mask(segments), torch.float64)


@pytest.mark.parametrize("block", [7, 512])  # several query blocks (the last one short), and one
def test_kernel_equals_autograd_of_the_eager_formula(monkeypatch, block):
    monkeypatch.setattr(softcap, "QUERY_BLOCK", block)
    gen = torch.Generator().manual_seed(0)
    b, h, n, d = 2, 3, 20, 8
    for name, bias in masks(n):
        q, k, v = (3 * torch.randn(b, h, n, d, dtype=torch.float64, generator=gen) for _ in range(3))
        grad = torch.randn(b, h, n, d, dtype=torch.float64, generator=gen)
        ours = [t.clone().requires_grad_() for t in (q, k, v)]
        theirs = [t.clone().requires_grad_() for t in (q, k, v)]
        out = softcap.softcap_attention(*ours, bias, 2.0)
        want = eager(*theirs, bias, 2.0)
        out.backward(grad)
        want.backward(grad)
        assert (out - want).abs().max() < TOL, name
        for a, w in zip(ours, theirs):
            assert (a.grad - w.grad).abs().max() < TOL, name
        # the cap matters at these scores (|s| up to ~20 against a cap of 2): uncapped is far off
        assert (out - eager(q, k, v, bias, 1e6)).abs().max() > 0.05, name


def test_kernel_keeps_no_score_sized_tensor():
    """What the op keeps for backward: q, k, v, the output, the fp32 log-sum-exp and the
    (shared) mask, never a [b, heads, s, s] tensor; autograd over the eager formula keeps three."""
    b, h, n, d = 1, 4, 64, 8
    q, k, v = (torch.randn(b, h, n, d, requires_grad=True) for _ in range(3))
    scores = b * h * n * n

    def saved(fn) -> list[int]:
        sizes: list[int] = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: sizes.append(t.numel()) or t, lambda t: t):
            fn(q, k, v, None, 2.0)
        return sizes

    assert max(saved(softcap.softcap_attention)) < scores  # q, k, v, out: b h n d each; lse b h n
    assert sum(s >= scores for s in saved(eager)) >= 3


def test_bf16_kernel_is_bf16_close_to_fp32():
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 4, 40, 16, generator=gen) for _ in range(3))
    want = softcap.softcap_attention(q, k, v, None, 5.0)
    got = softcap.softcap_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), None, 5.0)
    assert got.dtype == torch.bfloat16
    assert (got.float() - want).abs().max() < 2e-2  # bf16 inputs (8 bits of mantissa), fp32 math


def test_chunked_loss_caps_the_logits():
    """The chunked loss with ``softcap`` equals F.cross_entropy of the capped logits, value and both
    gradients, over several chunks with ignored labels; per-token losses too."""
    gen = torch.Generator().manual_seed(2)
    n, hidden, vocab, cap = 37, 16, 50, 0.7
    h = torch.randn(1, n, hidden, dtype=torch.float64, generator=gen)
    w = torch.randn(vocab, hidden, dtype=torch.float64, generator=gen)
    labels = torch.randint(0, vocab, (1, n), generator=gen)
    labels[0, ::5] = -100
    ours_h, ours_w = h.clone().requires_grad_(), w.clone().requires_grad_()
    theirs_h, theirs_w = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss = chunked_cross_entropy(ours_h, ours_w, labels, chunk_tokens=8, softcap=cap)
    logits = torch.tanh(theirs_h @ theirs_w.t() / cap) * cap
    want = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
    loss.backward()
    want.backward()
    assert abs(float((loss - want).detach())) < TOL
    assert (ours_h.grad - theirs_h.grad).abs().max() < TOL
    assert (ours_w.grad - theirs_w.grad).abs().max() < TOL
    uncapped = chunked_cross_entropy(h, w, labels, chunk_tokens=8)
    assert abs(float(uncapped - want.detach())) > 0.1  # the cap matters here
    per_token = chunked_token_losses(h, w, labels, chunk_tokens=8, softcap=cap)
    ref = F.cross_entropy(logits.detach().flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="none")
    assert (per_token.flatten() - ref).abs().max() < TOL


def test_custom_op_passes_opcheck_and_compiles_in_a_block():
    """The kernel is one ``torch.library`` custom op (selective recomputation saves its outputs like
    SDPA's): torch's opcheck (schema, autograd registration, fake kernel, AOT dispatch) passes for the
    layouts the model gives it (q/k/v as transposed views, a mask or none), and a Gemma-2-like block
    compiles whole (``fullgraph``) with the eager result (fp32: 1e-5)."""
    from llmtrain.engine.models.init import init_weights
    from llmtrain.engine.models.llama import Transformer
    from llmtrain.recipe.schema import ModelConfig

    gen = torch.Generator().manual_seed(3)
    qkv = [torch.randn(2, 20, 3, 8, generator=gen).transpose(1, 2).requires_grad_() for _ in range(3)]
    for bias in (None, attention_bias(window_mask(torch.arange(20), 5), torch.float32)):
        result = torch.library.opcheck(softcap.softcap_attention_op, (*qkv, bias, 2.0))
        assert set(result.values()) == {"SUCCESS"}, result
    cfg = ModelConfig(preset="debug-dense", attention_softcap=2.0, logit_softcap=3.0, sliding_window=16,
                      full_attention_layers=[1])
    model = Transformer(cfg)
    init_weights(model, seed=0)
    x = torch.randint(0, cfg.vocab_size, (2, 64), generator=gen)
    want = model(x)
    want.square().mean().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    for name, block in model.layers.items():
        model.layers[name] = torch.compile(block, fullgraph=True)
    got = model(x)
    got.square().mean().backward()
    assert (got - want).abs().max() < 1e-5
    assert max((p.grad - g).abs().max().item() for p, g in zip(model.parameters(), grads)) < 1e-5
