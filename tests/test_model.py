"""Unit tests of the engine's model code: RoPE, GQA attention, init, param counts (MoE routing:
tests/test_model_moe.py).

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
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from llmtrain.engine.models import (
    Transformer,
    apply_rope,
    init_weights,
    rope_cos_sin,
)
from llmtrain.plan.params import count_params
from llmtrain.recipe.schema import ModelConfig
from tests.helpers_model import build, moe_cfg, one_thread, tiny_cfg

ROOT = Path(__file__).resolve().parent.parent


_one_thread = one_thread  # autouse (tests/helpers_model.py)


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


@pytest.mark.parametrize("cfg", [tiny_cfg(), tiny_cfg(qk_norm=True, head_dim=16), moe_cfg()], ids=["dense", "qk_norm", "moe"])
def test_autocast_keeps_the_residual_stream_in_bf16(cfg):
    """zero 0/1 in bf16 run the model under autocast with fp32 parameters: every block's input and
    output, every norm's output and the hidden states a pipeline stage sends are bf16 (as under
    FSDP's bf16 parameters), and no norm falls back from torch's fused kernel over mixed dtypes. Without
    autocast (precision fp32) everything stays fp32. Before the change the embedding's fp32 output
    kept the whole stream fp32 (docs/planner.md 1.2)."""
    model = build(cfg, dtype=torch.float32)
    seen = []
    for module in model.modules():
        if isinstance(module, torch.nn.RMSNorm) or module in model.layers.values():
            module.register_forward_hook(lambda mod, args, out: seen.append((type(mod).__name__, args[0].dtype, out.dtype)))
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.autocast("cpu", dtype=torch.bfloat16), warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*[Mm]ismatch dtype")  # a norm's fallback from the fused kernel
        hidden = model(tokens, return_hidden=True)
        logits = model(tokens)
    assert hidden.dtype == torch.bfloat16 and logits.dtype == torch.bfloat16
    assert seen and {(i, o) for _, i, o in seen} == {(torch.bfloat16, torch.bfloat16)}, seen
    assert {name for name, _, _ in seen} >= {"RMSNorm", "TransformerBlock"}
    seen.clear()
    model(tokens)
    assert {(i, o) for _, i, o in seen} == {(torch.float32, torch.float32)}
    loss = F.cross_entropy(logits.float().flatten(0, 1), tokens.flatten())
    loss.backward()
    assert all(p.grad.dtype == torch.float32 for p in model.parameters() if p.grad is not None)


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


@pytest.mark.parametrize("needs", [(True, True), (True, False), (False, True)])
def test_swiglu_product_keeps_its_inputs_only_and_matches_eager_bitwise(needs):
    """engine/models/swiglu.py: the same values and gradients as ``F.silu(gate) * up`` bit for bit,
    keeping ``gate`` (and ``up`` when ``gate`` needs a gradient) instead of eager's ``gate``,
    ``silu(gate)`` and ``up``: one saved tensor fewer when both need gradients, never more."""
    import torch.nn.functional as F

    from llmtrain.engine.models.swiglu import swiglu

    torch.manual_seed(0)
    base = [torch.randn(4, 8, 16), torch.randn(4, 8, 16)]
    grad = torch.randn(4, 8, 16)
    results = []
    for fn in (lambda g, u: F.silu(g) * u, swiglu):
        inputs = [t.clone().requires_grad_(n) for t, n in zip(base, needs)]
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda x: saved.append(x) or x, lambda x: x):
            out = fn(*inputs)
        out.backward(grad)
        results.append((out.detach(), [t.grad for t in inputs], len(saved)))
    (out_e, grads_e, n_e), (out_f, grads_f, n_f) = results
    assert torch.equal(out_e, out_f)
    for a, b in zip(grads_e, grads_f):
        assert (a is None and b is None) or torch.equal(a, b)
    # only gate: both keep gate and up; only up: eager silu(gate), this gate; both: 3 against 2
    assert (n_e, n_f) == {(True, True): (3, 2), (True, False): (2, 2), (False, True): (1, 1)}[needs]
