"""The chunked cross-entropy (llmtrain/engine/parallel/loss.py) against ``F.cross_entropy``.

One process, tiny shapes (the TP 2 cases run in tests/test_engine_parity.py's 4-rank job,
tests/chunked_loss_check.py). Tolerances:
- fp64: values and gradients within 1e-12 (relative to the largest): the math is the same,
  only the summation order differs (measured ~2e-15); a wrong softmax, onehot or scale is O(1);
- fp32 against fp32 ``F.cross_entropy``: loss |diff| <= 1e-6 at loss ~7 (the issue's bar; measured
  ~5e-7, 1-2 ulps). Gradients: <= 2e-6 x max|grad|: against the fp64 truth both implementations
  are ~6e-7 x max off (measured: torch 6.2e-7, chunked 5.6e-7 to 8.5e-7; each is a matmul summing
  over the 512-word vocabulary in its own order), so their difference is at most the sum;
- bf16 autocast: see test_bf16_autocast_close_to_unchunked.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llmtrain.engine.models.llama import Transformer
from llmtrain.engine.parallel.loss import chunked_cross_entropy, chunked_token_losses
from llmtrain.engine.step import StepLoss
from llmtrain.plan import activations as act
from llmtrain.recipe.schema import ModelConfig

B, S, H, V = 2, 64, 32, 512


def _data(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(B, S, H, generator=g, dtype=torch.float64).to(dtype)
    w = (0.2 * torch.randn(V, H, generator=g, dtype=torch.float64)).to(dtype)
    y = torch.randint(0, V, (B, S), generator=g)
    y[0, :5] = -100  # ignored: a prompt, and padding at the end of a row
    y[1, -3:] = -100
    return h, w, y


def _grads(loss_fn, h, w):
    h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss = loss_fn(h, w)
    return (loss.detach(), *torch.autograd.grad(loss, (h, w)))


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("chunk", [1, 7, None])  # None: the default rule, one chunk at these sizes
def test_values_and_grads_equal_cross_entropy(reduction, chunk):
    h, w, y = _data(torch.float64)
    ref = _grads(lambda h, w: F.cross_entropy((h @ w.T).flatten(0, 1), y.flatten(), reduction=reduction), h, w)
    got = _grads(lambda h, w: chunked_cross_entropy(h, w, y, reduction=reduction, chunk_tokens=chunk), h, w)
    assert all(_rel(a, b) <= 1e-12 for a, b in zip(got, ref)), [_rel(a, b) for a, b in zip(got, ref)]

    h, w, y = _data(torch.float32)
    ref = _grads(lambda h, w: F.cross_entropy((h @ w.T).flatten(0, 1).float(), y.flatten(), reduction=reduction), h, w)
    got = _grads(lambda h, w: chunked_cross_entropy(h, w, y, reduction=reduction, chunk_tokens=chunk), h, w)
    scale = 1.0 if reduction == "mean" else float(ref[0])  # a sum over ~120 tokens: the same relative bar
    assert abs(got[0] - ref[0]).item() <= 1e-6 * scale
    assert _rel(got[1], ref[1]) <= 2e-6 and _rel(got[2], ref[2]) <= 2e-6


def test_token_losses_and_step_loss_factor():
    h, w, y = _data(torch.float32)
    ref = F.cross_entropy((h @ w.T).flatten(0, 1), y.flatten(), reduction="none").view(B, S)
    got = chunked_token_losses(h, w, y, chunk_tokens=5)
    assert got.shape == (B, S) and (got[y == -100] == 0).all()
    assert (got - ref).abs().max().item() <= 1e-6 * ref.max().item()
    # StepLoss with a head: token-weighted (sum x factor) for data with ignored labels
    head = torch.nn.Linear(H, V, bias=False)
    head.weight.data.copy_(w)
    loss_fn = StepLoss(head=head)
    loss_fn.set_targets(targets=200, ranks_averaged=2)
    expected = F.cross_entropy((h @ w.T).flatten(0, 1), y.flatten(), reduction="sum") * (2 / 200)
    assert abs(loss_fn(h, y) - expected).item() <= 1e-6 * expected.item()


def test_frozen_head_keeps_no_weight_gradient():
    """LoRA freezes the output head: its [V, H] gradient must be neither computed nor kept."""
    h, w, y = _data(torch.float32)
    h.requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t, lambda t: t):
        loss = chunked_cross_entropy(h, w, y, chunk_tokens=16)  # w.requires_grad is False
    assert [sh for sh in saved if sh.numel() > 1] == [torch.Size([B * S, H])]  # dL/dh (and the mean's count)
    loss.backward()
    assert h.grad is not None and w.grad is None


def _tiny(tie: bool) -> Transformer:
    cfg = ModelConfig(layers=2, hidden=H, heads=4, kv_heads=2, ffn_hidden=48, vocab_size=V, max_seq_len=S, rope_theta=10000.0, norm_eps=1e-5,
                      tie_embeddings=tie)
    torch.manual_seed(0)
    model = Transformer(cfg)
    for p in model.parameters():
        p.data.normal_(std=0.1)
    return model


@pytest.mark.parametrize("tie", [False, True])
def test_model_gradients_equal_the_unchunked_loss(tie):
    """The trainer's path (``return_hidden`` + StepLoss over ``model.output``) gives every
    parameter, the tied embedding included, the gradient of ``F.cross_entropy(model(tokens))``;
    ``model(tokens)`` still returns logits."""
    model = _tiny(tie)
    _, _, y = _data(torch.float32)
    tokens = y.clamp(min=0)
    logits = model(tokens)
    assert logits.shape == (B, S, V)
    F.cross_entropy(logits.flatten(0, 1), y.flatten()).backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    hidden = model(tokens, return_hidden=True)
    assert hidden.shape == (B, S, H)
    StepLoss(head=model.output)(hidden, y).backward()
    for n, p in model.named_parameters():
        assert _rel(p.grad, ref[n]) <= 2e-6, n
    assert (model.output.weight is model.tok_embeddings.weight) == tie


def test_bf16_autocast_close_to_unchunked():
    """Under bf16 autocast both paths run the head's matmul in bf16 and the loss in fp32; the
    gradients differ in where the ``1/tokens`` scale is applied (before the bf16 cast of
    ``softmax - onehot`` in the unchunked backward, after it, in fp32, here): one bf16 rounding,
    2^-8 relative per element, so grads within 1e-2 x max|grad|, loss within 1e-5 (same bf16
    logits, fp32 math). A missing autocast (fp32 matmuls) would still pass the loss bound, so the
    weight gradient must also differ from the fp32 one (the matmul really ran in bf16)."""
    model = _tiny(False)
    _, _, y = _data(torch.float32)
    tokens = y.clamp(min=0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref_loss = F.cross_entropy(model(tokens).flatten(0, 1).float(), y.flatten())
    ref_loss.backward()
    ref = model.output.weight.grad.clone()
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = StepLoss(head=model.output)(model(tokens, return_hidden=True), y)
    loss.backward()
    assert loss.dtype == torch.float32 and model.output.weight.grad.dtype == torch.float32
    assert abs(loss - ref_loss).item() <= 1e-5
    assert _rel(model.output.weight.grad, ref) <= 1e-2
    model.zero_grad(set_to_none=True)
    StepLoss(head=model.output)(model(tokens, return_hidden=True), y).backward()
    assert _rel(model.output.weight.grad, ref) > 1e-4


def test_planner_chunk_rule_and_loss_terms():
    """The shared chunk rule, and the planner's last-stage terms: the chunked loss keeps no
    vocabulary-sized tensor (only dL/dh and, when the head trains, dL/dW)."""
    assert act.loss_chunk_tokens(8192, 32768) == 1024
    assert act.loss_chunk_tokens(8192, 128256) == 256
    assert act.loss_chunk_tokens(8192, 151936) == 128  # floor
    assert act.loss_chunk_tokens(100, 512) == 100  # never more than the tokens
    # at least half the hidden size (the weight gradient's accumulation per chunk, plan/losstime.py)
    assert act.loss_chunk_tokens(8192, 128256, 4096) == 2048  # Llama 3 8B
    assert act.loss_chunk_tokens(8192, 32768, 2048) == 1024  # the memory rule already gives as many
    assert act.loss_chunk_tokens(8192, 128256, 300) == 256  # 150 rounds up to 256 = the memory rule
    assert act.loss_chunk_tokens(8192, 16032, 16384) == 8192  # 405B under TP 8
    assert act.loss_chunk_tokens(8192, 129280, 7168) == 2048  # DeepSeek-V3: the 1 GiB cap, not 3584
    x = act.ActShape(b=4, s=2048, h=128, heads=8, kv_heads=4, ffn=352, vocab=32768, e=4)
    old = act.ActShape(**{**{k: getattr(x, k) for k in x.__dataclass_fields__}, "chunked_loss": False})
    terms, old_terms = act.last_stage_terms(x), act.last_stage_terms(old)
    assert terms["loss_grad_hidden"] == 4 * 4 * 2048 * 128 and terms["loss_grad_weight"] == 4 * 32768 * 128
    assert "log_probs" not in terms and old_terms["log_probs"] == 4 * 4 * 2048 * 32768
    assert act.logits_bytes(x) == 0 and act.loss_backward_bytes(x) == 1024 * 32768 * 4
    assert sum(terms.values()) + act.loss_backward_bytes(x) < (sum(old_terms.values()) + act.loss_backward_bytes(old)) / 10
