"""Unit tests of the engine's model code: RoPE, GQA attention, MoE routing, init, param counts.

All on CPU in one process (one short subprocess for the DTensor init path), fp64 where an
exact comparison is the point, fp32 where the production dtype matters. Run:

    /work/venv/bin/python -m pytest -q tests/test_model.py
"""

from __future__ import annotations

import copy
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from llmtrain.engine.models import (
    MoE,
    Transformer,
    apply_rope,
    init_weights,
    load_balancing_loss,
    rope_cos_sin,
    route_tokens,
    set_aux_loss_scale,
    update_expert_bias,
)
from llmtrain.engine.models.moe import dispatch_order
from llmtrain.plan.params import count_params
from llmtrain.recipe.schema import ModelConfig

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # Tiny matmuls: intra-op threads only add contention on a 2-core CI box (10x slower there).
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def tiny_cfg(**overrides) -> ModelConfig:
    base = dict(layers=2, hidden=32, heads=4, kv_heads=2, ffn_hidden=64, vocab_size=64, max_seq_len=64,
                rope_theta=10000.0, norm_eps=1e-5, tie_embeddings=False)
    base.update(overrides)
    return ModelConfig(**base)


def moe_cfg(hidden: int = 32, **moe) -> ModelConfig:
    spec = dict(num_experts=4, top_k=2, shared_experts=0, expert_ffn_hidden=16, router="softmax",
                balance="aux_loss", aux_loss_coef=0.1)
    spec.update(moe)
    return tiny_cfg(hidden=hidden, moe=spec)


def build(cfg: ModelConfig, seed: int = 0, dtype=torch.float64) -> Transformer:
    model = Transformer(cfg)
    init_weights(model, seed)
    return model.to(dtype)


# ----------------------------------------------------------------------------------- RoPE


def test_rope_matches_explicit_rotation_of_each_pair():
    d, theta = 8, 10000.0
    positions = torch.tensor([0, 3, 17, 250, 1023])  # non-contiguous, as context parallel passes them
    x = torch.randn(2, 5, 3, d, generator=torch.Generator().manual_seed(0))
    out = apply_rope(x, *rope_cos_sin(positions, d, theta))
    ref = torch.empty(2, 5, 3, d, dtype=torch.float64)
    for si, p in enumerate(positions.tolist()):
        for i in range(d // 2):
            a = p * theta ** (-2 * i / d)
            rot = torch.tensor([[math.cos(a), -math.sin(a)], [math.sin(a), math.cos(a)]], dtype=torch.float64)
            ref[:, si, :, 2 * i : 2 * i + 2] = x[:, si, :, 2 * i : 2 * i + 2].double() @ rot.T
    # fp32 angles: |error| <= p * inv_freq * ~2 ulp(fp32) ~= 1023 * 2.4e-7 = 2.4e-4 rad, times |pair| <= ~5.
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=2e-3)
    assert out.dtype == x.dtype


def test_rope_depends_only_on_position_values():
    d, theta = 16, 500000.0
    positions = torch.tensor([[7, 2, 900, 33], [0, 1, 2, 3]])  # per-sequence positions [b, s]
    cos_all, sin_all = rope_cos_sin(torch.arange(1024), d, theta)
    cos, sin = rope_cos_sin(positions, d, theta)
    # Same fp32 elementwise ops on the same values: bitwise equal (what makes CP layout-independent).
    assert torch.equal(cos, cos_all[positions]) and torch.equal(sin, sin_all[positions])
    x = torch.randn(2, 4, 2, d, generator=torch.Generator().manual_seed(1))
    batched = apply_rope(x, cos, sin)
    for b in range(2):
        per_row = apply_rope(x[b : b + 1], cos_all[positions[b]], sin_all[positions[b]])
        assert torch.equal(batched[b : b + 1], per_row)  # [s, d/2] and [b, s, d/2] paths: same ops, exact


# ------------------------------------------------------------------------------ attention


def test_gqa_equals_mha_with_repeated_kv_heads():
    gqa = build(tiny_cfg(heads=4, kv_heads=2))
    mha = Transformer(tiny_cfg(heads=4, kv_heads=4)).double()
    state = gqa.state_dict()
    hd, hidden = 8, 32
    for key in list(state):
        if key.endswith(("attention.wk.weight", "attention.wv.weight")):
            # query head j uses kv head j // 2: repeat each kv head's rows twice, in place
            state[key] = state[key].view(2, hd, hidden).repeat_interleave(2, dim=0).reshape(4 * hd, hidden)
    mha.load_state_dict(state)
    tokens = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(0))
    # fp64, identical math after the repeat: only summation-order noise, far below 1e-10.
    torch.testing.assert_close(gqa(tokens), mha(tokens), rtol=0, atol=1e-10)


@pytest.mark.parametrize("cfg", [tiny_cfg(), moe_cfg()], ids=["dense", "moe"])
def test_attention_is_causal(cfg):
    model = build(cfg)
    tokens = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    changed = tokens.clone()
    changed[:, 7] = (changed[:, 7] + 1) % 64
    a, b = model(tokens), model(changed)
    # fp64; masked keys contribute exactly 0, kernels may only reorder sums: 1e-12.
    torch.testing.assert_close(a[:, :7], b[:, :7], rtol=0, atol=1e-12)
    assert (a[:, 7:] - b[:, 7:]).abs().amax() > 1e-3  # the change is visible from position 7 on


def test_attn_fn_is_replaceable():
    model = build(tiny_cfg())
    tokens = torch.randint(0, 64, (1, 9), generator=torch.Generator().manual_seed(0))
    ref = model(tokens)

    def naive(q, k, v):
        s = q.shape[-2]
        scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        mask = torch.ones(s, s, dtype=torch.bool).triu(1)
        return scores.masked_fill(mask, float("-inf")).softmax(-1) @ v

    for block in model.layers.values():
        block.attention.attn_fn = naive
    torch.testing.assert_close(model(tokens), ref, rtol=0, atol=1e-10)  # fp64, same math


def test_pipeline_stage_pieces_compose():
    model = build(tiny_cfg(layers=4))
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    full = model(tokens)
    first, last = copy.deepcopy(model), copy.deepcopy(model)
    first.norm = first.output = None
    del first.layers["2"], first.layers["3"]
    last.tok_embeddings = None
    del last.layers["0"], last.layers["1"]
    # Same modules, same ops in the same order: bitwise equal.
    assert torch.equal(last(first(tokens)), full)


# ------------------------------------------------------------------------------------ MoE


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


# ------------------------------------------------------------------------ params and init


@pytest.mark.parametrize("model_kw", [
    dict(preset="debug-dense"),
    dict(preset="debug-moe"),
    dict(preset="debug-dense", tie_embeddings=True),
    dict(preset="debug-moe", tie_embeddings=True, moe=dict(balance="bias", router="sigmoid")),
], ids=["dense", "moe", "dense-tied", "moe-tied-bias"])
def test_param_count_matches_plan(model_kw):
    cfg = ModelConfig(**model_kw)
    with torch.device("meta"):
        model = Transformer(cfg)
    assert sum(p.numel() for p in model.parameters()) == count_params(cfg).total  # integers: exact
    if cfg.tie_embeddings:
        assert model.output.weight is model.tok_embeddings.weight


def test_meta_init_equals_eager_and_seeds():
    cfg = ModelConfig(preset="debug-moe", tie_embeddings=True, moe=dict(balance="bias"))
    eager = Transformer(cfg)
    init_weights(eager, seed=3)
    with torch.device("meta"):
        lazy = Transformer(cfg)
    lazy.to_empty(device="cpu")
    assert lazy.output.weight is lazy.tok_embeddings.weight  # to_empty must not untie
    init_weights(lazy, seed=3)
    a = dict(eager.named_parameters()) | dict(eager.named_buffers())
    b = dict(lazy.named_parameters()) | dict(lazy.named_buffers())
    assert a.keys() == b.keys()
    for name in a:  # same generator, same seed: bitwise
        assert torch.equal(a[name], b[name]), name
    other = Transformer(cfg)
    init_weights(other, seed=4)
    for name, p in other.named_parameters():
        if name.endswith("norm.weight"):
            assert torch.equal(p, a[name]) and bool((p == 1).all())
        else:
            assert not torch.equal(p, a[name]), name
    # fp32 sample std of 65536 normals has ~0.3% relative error: 3% tolerance
    assert eager.tok_embeddings.weight.std().item() == pytest.approx(0.02, rel=0.03)
    assert eager.layers["0"].attention.wo.weight.std().item() == pytest.approx(0.02 / math.sqrt(8), rel=0.03)
    assert eager.layers["1"].moe.experts.w2.std().item() == pytest.approx(0.02 / math.sqrt(8), rel=0.03)


def test_init_is_layout_independent():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    cfg = ModelConfig(preset="debug-moe")
    full = Transformer(cfg)
    init_weights(full, seed=0)
    stage = Transformer(cfg)  # a last pipeline stage with activation-checkpoint-wrapped blocks
    stage.tok_embeddings = None
    del stage.layers["0"], stage.layers["1"]
    stage.layers["3"] = checkpoint_wrapper(stage.layers["3"])
    init_weights(stage, seed=0)
    ref = dict(full.named_parameters())
    names = [n for n, _ in stage.named_parameters()]
    assert any("_checkpoint_wrapped_module." in n for n in names)
    for name, p in stage.named_parameters():
        assert torch.equal(p, ref[name.replace("_checkpoint_wrapped_module.", "")]), name  # bitwise


def check_dtensor_init() -> None:
    """Be rank 1 of 2 on a fake process group (no peers: ``distribute_tensor`` with
    ``src_data_rank=None`` only chunks locally) and compare local shards with a full init."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        cfg = ModelConfig(preset="debug-moe")
        full = Transformer(cfg)
        init_weights(full, seed=5)
        model = Transformer(cfg)
        plan = {"layers.0.attention.wq.weight": Shard(0), "layers.0.attention.wo.weight": Shard(1),
                "layers.1.moe.experts.w1": Shard(0), "tok_embeddings.weight": Replicate()}
        for name, placement in plan.items():
            mod_name, leaf = name.rsplit(".", 1)
            mod = model.get_submodule(mod_name)
            dt = distribute_tensor(torch.empty(getattr(mod, leaf).shape), mesh, [placement], src_data_rank=None)
            setattr(mod, leaf, torch.nn.Parameter(dt))
        init_weights(model, seed=5)
        ref = dict(full.named_parameters())
        for name, p in model.named_parameters():
            want = ref[name]
            if isinstance(plan.get(name), Shard):
                want = want.chunk(2, dim=plan[name].dim)[1]  # rank 1's chunk
            got = p.to_local() if name in plan else p
            assert torch.equal(got, want), name  # same generator stream, local cut: bitwise
    finally:
        dist.destroy_process_group()


def test_init_dtensor_local_shards():
    import torch.distributed as dist

    if not dist.is_initialized():
        check_dtensor_init()
        return
    # Another test left a default process group in this process: run the check in a fresh one.
    code = "import torch; torch.set_num_threads(1); from tests.test_model import check_dtensor_init; check_dtensor_init()"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-4000:]


def test_tiny_model_learns_a_repeated_batch():
    cfg = tiny_cfg(moe=dict(num_experts=4, top_k=2, shared_experts=1, expert_ffn_hidden=16, first_dense_layers=1))
    model = Transformer(cfg)
    init_weights(model, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(20):
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, 64), tokens[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    # Starts near ln(64) = 4.16; memorizing 32 targets should at least halve it in 20 steps.
    assert losses[0] == pytest.approx(math.log(64), abs=0.3)
    assert losses[-1] < 0.5 * losses[0], losses
