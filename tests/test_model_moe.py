"""Unit tests of the engine's MoE: router scores and normalization, the aux loss, bias-based balancing,
dispatch against a per-token reference, capacity drops. CPU, one process, fp64 where an exact
comparison is the point (split from tests/test_model.py by concept)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from llmtrain.engine.models import MoE, load_balancing_loss, route_tokens, set_aux_loss_scale, update_expert_bias
from llmtrain.engine.models.moe import dispatch_order
from tests.helpers_model import moe_cfg, one_thread

_one_thread = one_thread  # autouse (tests/helpers_model.py)


def test_softmax_router_renormalizes_top_k_probs():
    r = route_tokens(torch.tensor([[1.0, 2.0, 3.0, 0.0]]), top_k=2, score_fn="softmax")
    assert r.expert_idx.tolist() == [[2, 1]]
    e = math.e  # p2 / (p1 + p2) = e^3 / (e^3 + e^2) = e / (e + 1)
    torch.testing.assert_close(r.weights, torch.tensor([[e / (e + 1), 1 / (e + 1)]]), rtol=0, atol=1e-6)  # fp32 ulps


def test_sigmoid_router_normalizes_top_k_scores():
    r = route_tokens(torch.tensor([[0.0, 1.0, -1.0, 2.0]]), top_k=2, score_fn="sigmoid")
    assert r.expert_idx.tolist() == [[3, 1]]
    s2, s1 = 1 / (1 + math.exp(-2)), 1 / (1 + math.exp(-1))
    torch.testing.assert_close(r.weights, torch.tensor([[s2 / (s1 + s2), s1 / (s1 + s2)]]), rtol=0, atol=1e-6)


def test_aux_loss_hand_computed():
    probs = torch.tensor([[0.9, 0.1], [0.8, 0.2], [0.4, 0.6], [0.7, 0.3]])
    idx = torch.tensor([[0], [0], [1], [0]])
    # f = [3/4, 1/4], P = [0.7, 0.3]: 2 * (0.75 * 0.7 + 0.25 * 0.3) = 1.2
    assert load_balancing_loss(probs, idx, 2).item() == pytest.approx(1.2, abs=1e-6)  # fp32
    uniform = torch.full((4, 4), 0.25)
    balanced = torch.tensor([[0, 1], [2, 3], [1, 0], [3, 2]])
    assert load_balancing_loss(uniform, balanced, 4).item() == pytest.approx(1.0, abs=1e-6)
    # In the module, the value is coef x loss; a zero router gives uniform probs, so the loss is 1.
    moe = MoE(moe_cfg(aux_loss_coef=0.3))
    randomize(moe)
    torch.nn.init.zeros_(moe.router.weight)
    moe(torch.randn(1, 5, 32, generator=torch.Generator().manual_seed(0)))
    assert moe.last_aux_loss.item() == pytest.approx(0.3, abs=1e-6)


def randomize(moe: MoE) -> None:
    """Weights of std 0.3 (larger than init's 0.02, so routing and outputs are far from trivial)."""
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
        moe.expert_bias.zero_()
        moe.tokens_per_expert.zero_()


def identity_router_moe(**moe) -> MoE:
    """MoE with hidden == num_experts == 4 and router = identity: logits are the input itself."""
    module = MoE(moe_cfg(hidden=4, **moe)).double()
    randomize(module)
    with torch.no_grad():
        module.router.weight.copy_(torch.eye(4))
    return module


def test_bias_changes_selection_not_weights():
    moe = identity_router_moe(router="sigmoid", balance="bias")
    x = torch.tensor([[2.0, 1.0, 0.0, -1.0]], dtype=torch.float64)
    assert moe.route(x).expert_idx.tolist() == [[0, 1]]
    moe.expert_bias.copy_(torch.tensor([0.0, 0.0, 5.0, 0.0]))
    r = moe.route(x)
    assert r.expert_idx.tolist() == [[2, 0]]  # the bias promoted expert 2
    s0, s2 = 1 / (1 + math.exp(-2)), 0.5  # weights from the unbiased sigmoid scores
    torch.testing.assert_close(r.weights.double(), torch.tensor([[s2 / (s0 + s2), s0 / (s0 + s2)]], dtype=torch.float64),
                               rtol=0, atol=1e-7)  # scores are fp32 by design: a few fp32 ulps
    aux_mode = identity_router_moe(router="sigmoid", balance="aux_loss")
    aux_mode.expert_bias.fill_(5.0)  # ignored unless balance == bias
    assert aux_mode.route(x).expert_idx.tolist() == [[0, 1]]


def test_update_expert_bias_direction_and_reset():
    model = torch.nn.ModuleDict({"a": identity_router_moe(balance="bias", bias_update_rate=0.1),
                                 "b": identity_router_moe(balance="bias", bias_update_rate=0.1)})
    # Every token prefers experts 0 and 1: their bias must go down, 2 and 3 up.
    x = torch.tensor([[3.0, 2.0, 0.0, -1.0]] * 5, dtype=torch.float64).view(1, 5, 4)
    model["a"](x)
    assert model["a"].tokens_per_expert.tolist() == [5, 5, 0, 0]
    model["a"].eval()
    model["a"](x)  # eval forwards do not count
    assert model["a"].tokens_per_expert.tolist() == [5, 5, 0, 0]
    model["b"].tokens_per_expert.copy_(torch.tensor([3.0, 1.0, 0.0, 4.0]))

    def fake_all_reduce(t):  # another "rank" routed 5 extra tokens to layer b's expert 1
        t.add_(torch.tensor([0, 0, 0, 0, 0, 5.0, 0, 0], dtype=t.dtype))

    totals = update_expert_bias(model, all_reduce=fake_all_reduce)
    step = torch.tensor(0.1, dtype=torch.float64)
    # exact: 0 + 0.1 * sign(...) in the buffer's dtype
    assert torch.equal(model["a"].expert_bias, step * torch.tensor([-1.0, -1.0, 1.0, 1.0], dtype=torch.float64))
    # b: counts [3, 6, 0, 4], mean 3.25 -> signs [+, -, +, -]
    assert torch.equal(model["b"].expert_bias, step * torch.tensor([1.0, -1.0, 1.0, -1.0], dtype=torch.float64))
    assert totals[1].tolist() == [3, 6, 0, 4]
    assert all(m.tokens_per_expert.abs().sum() == 0 for m in model.values())


def expert_mlp(moe: MoE, e: int, x: torch.Tensor) -> torch.Tensor:
    return (F.silu(x @ moe.experts.w1[e].T) * (x @ moe.experts.w3[e].T)) @ moe.experts.w2[e].T


def test_moe_forward_equals_per_token_reference():
    moe = MoE(moe_cfg(shared_experts=1)).double()
    randomize(moe)
    x = torch.randn(2, 5, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    out = moe(x)
    flat, r = x.view(-1, 32), moe.route(x.view(-1, 32))
    for t in range(10):
        ref = moe.shared(flat[t])
        for j in range(2):
            ref = ref + r.weights[t, j].double() * expert_mlp(moe, r.expert_idx[t, j].item(), flat[t])
        torch.testing.assert_close(out.view(-1, 32)[t], ref, rtol=0, atol=1e-12)  # fp64 (weights fp32-exact)


def test_capacity_drops_latest_tokens():
    cfg = moe_cfg(hidden=4, num_experts=2, top_k=1, capacity_factor=0.5)
    moe = MoE(cfg).double()
    randomize(moe)
    with torch.no_grad():
        moe.router.weight.copy_(torch.tensor([[10.0, 0, 0, 0], [0, 10.0, 0, 0]]))
    x = torch.randn(1, 6, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    x[0, :, :2] = torch.tensor([1.0, 0.0])
    x[0, 3, :2] = torch.tensor([0.0, 1.0])  # tokens 0,1,2,4,5 -> expert 0; token 3 -> expert 1
    # capacity = ceil(0.5 * 6 * 1 / 2) = 2: expert 0 keeps tokens 0 and 1 only.
    out = moe(x)[0]
    for t in (0, 1):
        torch.testing.assert_close(out[t], expert_mlp(moe, 0, x[0, t]), rtol=0, atol=1e-12)  # top-1 weight is 1
    torch.testing.assert_close(out[3], expert_mlp(moe, 1, x[0, 3]), rtol=0, atol=1e-12)
    assert out[[2, 4, 5]].abs().amax() == 0  # dropped: exactly zero (no shared expert here)
    tokens, slots, counts = dispatch_order(torch.tensor([[0], [0], [0], [1], [0], [0]]), 2, capacity=2)
    assert tokens.tolist() == [0, 1, 3] and slots.tolist() == [0, 0, 0] and counts.tolist() == [2, 1]


def test_aux_loss_autograd_equals_explicit_loss():
    gen = torch.Generator().manual_seed(4)
    coef = 1.0  # large, so the aux gradient stands far above the fp32 tolerance below
    auto = MoE(moe_cfg(aux_loss_coef=coef)).double()
    randomize(auto)
    explicit = copy.deepcopy(auto)
    explicit.aux_loss_coef = 0.0  # no attached loss: we add it to the loss by hand
    x = torch.randn(2, 6, 32, dtype=torch.float64, generator=gen)
    g = torch.randn(2, 6, 32, dtype=torch.float64, generator=gen)

    def grads(module, extra_scale):
        xi = x.clone().requires_grad_(True)
        loss = (module(xi) * g).sum()
        if extra_scale:
            r = module.route(xi.view(-1, 32))
            loss = loss + extra_scale * coef * load_balancing_loss(r.probs, r.expert_idx, 4)
        loss.backward()
        out = {n: p.grad.clone() for n, p in module.named_parameters()} | {"x": xi.grad.clone()}
        module.zero_grad()
        return out

    no_aux = grads(explicit, 0.0)
    for scale in (1.0, 0.5):  # 0.5: as a trainer with grad_accum=2 would set it
        set_aux_loss_scale(auto, scale)
        got, want = grads(auto, 0.0), grads(explicit, scale)
        for name in want:
            # Routing math is fp32 by design even in an fp64 module (scores, probs, weights), and the
            # two graphs sum fp32 terms in different orders: allow ~20 fp32 ulps of the largest entry.
            tol = 1e-6 * want[name].abs().max().item()
            torch.testing.assert_close(got[name], want[name], rtol=0, atol=tol, msg=name)
        aux_part = (got["router.weight"] - no_aux["router.weight"]).abs().amax().item()
        assert aux_part > 1e-3  # the aux term is there, far above the tolerance
    assert torch.equal(auto(x), explicit(x))  # forward value untouched
