"""FP8 all-gather of FSDP2 parameters (``parallel.fp8_all_gather``) and async TP (``parallel.async_tp``),
issue 17 items 3-4: what runs on CPU, what is refused, and what the planner does with them.

FP8 all-gather runs here through torchao's CPU emulation (``emulate=True``) in this process (a gloo
group of one rank, FSDP2 on a 1-rank mesh): the same function the GPU check runs on CUDA without
emulation (benchmarks/gpu_check_steps/options.py ``fp8_all_gather_runs``). fp8 with TP runs on 4 gloo
ranks in the engine-parity job (tests/fp8_tp_check.py; asserted in tests/test_engine_parity.py); here
are its validation (accepted, no warning), the conversion filter and the choice of TP styles. Async TP cannot run
on CPU (CUDA symmetric-memory kernels): its tests are the refusals (validation and the engine's own)
and the planner's time effect; the GPU check runs it where two GPUs exist.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from llmtrain.errors import LLMTrainError
from llmtrain.plan.api import plan_recipe
from llmtrain.plan.asynctp import async_tp_exposed_factor
from llmtrain.plan.costmodel import estimate
from llmtrain.recipe.load import load_recipe

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))


@pytest.fixture(scope="module")
def group(one_rank_gloo):
    return one_rank_gloo  # tests/conftest.py: this process as a 1-rank gloo group


def test_fp8_all_gather_runs_emulated_on_cpu(group):
    """The engine's apply_float8 + FSDP2 (zero 3, bf16 mixed precision) + precompute_fp8_scales, 4
    SGD steps on one fixed batch, with and without fp8_all_gather. With it, every converted weight
    (2 layers x 7 projections = 14) reaches FSDP2's all-gather as float8_e4m3fn through torchao's
    hook, at least once per step each (zero 3 gathers again for backward); without it, never. The
    losses agree within FP8_AG_LOSS_TOL (5e-3 at loss ~5.5; its docstring says why not bitwise:
    one rounding fp32 -> fp8 instead of fp32 -> bf16 -> fp8; measured 9.4e-4) and fall."""
    from gpu_check_steps.options import FP8_AG_LOSS_TOL, fp8_all_gather_runs

    res = fp8_all_gather_runs(torch.device("cpu"), emulate=True, steps=4)
    plain, fp8 = res["bf16_ag"], res["fp8_ag"]
    assert plain["converted"] == fp8["converted"] == 14
    assert fp8["gathered_dtypes"] == ["torch.float8_e4m3fn"] and fp8["fp8_gathers"] >= 14 * 4, fp8
    assert plain["fp8_gathers"] == 0 and plain["gathered_dtypes"] == [], plain
    diff = max(abs(a - b) for a, b in zip(plain["losses"], fp8["losses"]))
    assert diff <= FP8_AG_LOSS_TOL, (plain["losses"], fp8["losses"])
    assert fp8["losses"][-1] < fp8["losses"][0] - 0.1, fp8["losses"]


def _errors(sets: list[str]) -> list[str]:
    recipe = load_recipe(REPO / "recipes/debug.yaml", sets)
    return [f"{p.path}: {p.message}" for p in plan_recipe(recipe, None, 1, 4).validation.errors]


H100 = ["cluster.gpu=h100-sxm", "train.precision=fp8", "parallel.tp=1"]
ASYNC = ["cluster.gpu=h100-sxm", "parallel.async_tp=true", "train.compile=true", "parallel.tp=2",
         "parallel.sequence_parallel=true"]


@pytest.mark.parametrize("sets, field, words", [
    (["parallel.fp8_all_gather=true"], "parallel.fp8_all_gather", "train.precision fp8 (it is fp32)"),
    (H100 + ["parallel.fp8_all_gather=true", "parallel.zero=1"], "parallel.fp8_all_gather", "parallel.zero 2 or 3 (it is 1)"),
    (["parallel.fp8_all_gather=true", "train.precision=fp8"], "train.precision", "CPU engine has no FP8"),
    (ASYNC + ["cluster.gpu=cpu"], "parallel.async_tp", "needs CUDA GPUs"),
    (ASYNC + ["parallel.sequence_parallel=false"], "parallel.async_tp", "parallel.sequence_parallel: true"),
    (ASYNC + ["train.compile=false", "parallel.tp=1"], "parallel.async_tp", "torch.compile pass); parallel.tp >= 2"),
])
def test_refusals_name_the_field_and_reason(sets, field, words):
    errors = _errors(sets)
    assert any(e.startswith(field) and words in e for e in errors), errors


def test_fp8_with_tp_is_accepted_without_a_warning():
    """fp8 + TP runs in the engine (Float8 TP styles; tests/fp8_tp_check.py, GPU check ``fp8_tp``), so
    plan and launch agree: no error and no fp8 warning, with and without sequence parallelism."""
    for sp in ("true", "false"):
        recipe = load_recipe(REPO / "recipes/debug.yaml", H100 + ["parallel.tp=2", f"parallel.sequence_parallel={sp}"])
        v = plan_recipe(recipe, None, 1, 4).validation
        assert not [e for e in v.errors if "fp8" in e.message or e.path == "train.precision"], v.errors
        assert not [w for w in v.warnings if w.path == "train.precision" or "fp8" in w.message], v.warnings


def test_accepted_where_they_can_run():
    assert not [e for e in _errors(H100 + ["parallel.fp8_all_gather=true", "parallel.zero=3"]) if "fp8" in e]
    assert not [e for e in _errors(ASYNC) if "async_tp" in e]


def test_float8_conversion_must_precede_tp(group):
    """apply_float8 on Linears already TP-sharded (the wrong order: torchao's matmul would fail with
    mixed Tensor / DTensor) is refused in one line naming the field and the order to use."""
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    from llmtrain.engine.parallel.float8 import apply_float8

    model = nn.Sequential(nn.Linear(32, 32))
    parallelize_module(model, init_device_mesh("cpu", (1,)), {"0": ColwiseParallel()})
    with pytest.raises(LLMTrainError, match=r"^train\.precision: fp8 conversion must run before tensor parallelism"):
        apply_float8(model, emulate=True)


def test_float8_filter_and_tp_style_choice():
    """What apply_float8 converts on debug-moe (meta, no group): the 4 blocks' q/k/v/o and block 0's
    dense MLP (19); never the output head, the router (128 -> 4 experts) or the shared experts (the
    ``moe`` subtree: bf16, as the planner counts, and expert-TP shards them itself); with LoRA on wq/wv
    those 8 stay plain too. tensor.py takes torchao's Float8 styles for a region only when all of its
    column-parallel inputs are Float8Linear (a plain Linear must never receive an FP8 input)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel
    from torchao.float8.float8_tensor_parallel import (
        Float8ColwiseParallel,
        Float8RowwiseParallel,
        PrepareFloat8ModuleInput,
    )

    from llmtrain.engine.models.llama import Transformer
    from llmtrain.engine.parallel.float8 import apply_float8, is_float8_linear
    from llmtrain.engine.parallel.tensor import _styles

    cfg = load_recipe(REPO / "recipes/debug.yaml", ["model.preset=debug-moe"]).model
    for skip, want in (((), 19), (("wq", "wv"), 11)):
        with torch.device("meta"):
            model = Transformer(cfg)
        assert apply_float8(model, emulate=True, skip=skip) == want
        names = {n for n, m in model.named_modules() if is_float8_linear(m)}
        assert not [n for n in names if ".moe." in n or n == "output"], names
        assert ("layers.1.attention.wq" in names) is (not skip) and "layers.0.feed_forward.w2" in names
    attn = model.layers["0"].attention
    assert _styles(attn.wk, attn.wo) == (Float8ColwiseParallel, Float8RowwiseParallel, PrepareFloat8ModuleInput)
    assert _styles(attn.wq, attn.wk, attn.wv) == (ColwiseParallel, RowwiseParallel, PrepareModuleInput)  # wq skipped


def test_engine_refuses_async_tp_off_cuda(group):
    """The engine's own check (a recipe validated for H100 but started here): one-line errors that
    name the field, and inductor's switch stays off. The CUDA-device reason needs a tp >= 2 mesh;
    a stand-in with the two attributes the check reads covers that pure branch."""
    import torch._inductor.config as inductor_config
    from torch.distributed.device_mesh import init_device_mesh

    from llmtrain.engine.parallel.async_tp import async_tp_blocker, enable_async_tp

    with pytest.raises(LLMTrainError, match=r"^parallel\.async_tp: async TP needs train\.compile"):
        enable_async_tp(None, compile_=False)
    with pytest.raises(LLMTrainError, match=r"^parallel\.async_tp: async TP needs parallel\.tp >= 2"):
        enable_async_tp(init_device_mesh("cpu", (1,)), compile_=True)

    class TwoRankCpuMesh:
        device_type = "cpu"

        def size(self):
            return 2

    assert async_tp_blocker(TwoRankCpuMesh()).startswith("CUDA devices (this rank's TP mesh is on cpu)")
    assert inductor_config._micro_pipeline_tp is False


def test_planner_hides_the_fused_tp_collectives_only_in_time():
    """llama3-70b (tp 8 with SP, H100, selective recomputation: per layer and micro batch 6
    all-gathers, the recomputed forward's 2 included, and 4 reduce-scatters, wo's reduction being
    cached: plan/recompute_comm.py), compiled, with and without async TP: the same TP bytes (async
    TP moves the same data); fused: all 6 all-gathers and 2 of the 4 reduce-scatters (the
    backward's two input-gradient reduce-scatters are sums of matmuls, which torch's pass does not
    fuse), so the TP exposed time is about 1/tp of 8/10 of it plus the 2/10 that stay plain (the
    fused part never below 1/tp); step time down by at least that much minus the bubble's share."""
    out = {}
    for on in (False, True):
        r = load_recipe(REPO / "recipes/llama3-70b.yaml", ["train.compile=true", f"parallel.async_tp={str(on).lower()}"])
        plan = plan_recipe(r)
        assert plan.valid, [e.line() for e in plan.validation.errors]
        v = plan.validation
        cm = estimate(r, v.dims, v.batch, plan.placement, hints=False)
        out[on] = (sum(c.message_bytes * c.count for c in cm.comms if c.dim == "tp"), cm.time.breakdown["tp_comm"],
                   cm.time.step_s, [c.phase for c in cm.comms if c.dim == "tp"])
        if on:
            fused = {c.op: c.count for c in cm.comms if c.dim == "tp" and c.phase == "tp-overlap"}
            layers = r.model.layers // v.dims.pp  # one pipeline rank's blocks
            assert fused["all-gather"] * 2 == fused["reduce-scatter"] * 6, fused
            assert fused["all-gather"] % (6 * layers) == 0, (fused, layers)
    (bytes_off, tp_off, step_off, phases_off), (bytes_on, tp_on, step_on, phases_on) = out[False], out[True]
    assert bytes_on == bytes_off
    assert "tp-overlap" in phases_on and "tp-overlap" not in phases_off
    want = 2 / 10 + (8 / 10) / 8  # the plain share, plus 1/tp of the fused share
    assert tp_off * want * 0.95 <= tp_on <= tp_off * want * 1.15, (tp_off, tp_on, tp_on / tp_off)
    assert step_on < step_off - (tp_off - tp_on) * 0.9, (step_off, step_on)


def test_async_tp_exposed_factor():
    """1/tp always exposed; the rest hides under compute up to the compute's length."""
    assert async_tp_exposed_factor(1.0, 10.0, 4) == pytest.approx(0.25)
    assert async_tp_exposed_factor(10.0, 5.0, 2) == pytest.approx(0.5 + 0.0)  # 5 of the 10 hidden: 0.5 + max(0, 0.5 - 0.5)
    assert async_tp_exposed_factor(10.0, 2.0, 2) == pytest.approx(0.5 + 0.3)
    assert async_tp_exposed_factor(0.0, 1.0, 2) == 1.0


def test_planner_gathers_the_float8_linears_at_one_byte():
    """llama3-8b, fp8, zero 3 on 8 H100: with fp8_all_gather the FSDP all-gather message is the
    bf16 one minus one byte per converted weight element: 32 blocks x (q/o 2 x 4096^2 + k/v
    2 x 4096 x 1024 + MLP 3 x 4096 x 14336) = 6.98e9 elements (exact integers); the rest
    (embedding, output head, norms) stays 2-byte. Off, the message is 2 bytes per parameter."""
    per_layer = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336
    got = {}
    for on in (False, True):
        r = load_recipe(REPO / "recipes/llama3-8b.yaml", ["train.precision=fp8", "parallel.tp=1", "parallel.zero=3",
                                                          "cluster.gpu=h100-sxm", f"parallel.fp8_all_gather={str(on).lower()}"])
        plan = plan_recipe(r)
        v = plan.validation
        assert plan.valid, [e.line() for e in v.errors]
        cm = estimate(r, v.dims, v.batch, plan.placement, hints=False)
        (gather,) = [c for c in cm.comms if c.phase == "fsdp-gather"]
        got[on] = (gather.message_bytes, cm.time.step_s)
    assert got[False][0] - got[True][0] == 32 * per_layer
    assert got[True][1] < got[False][1]


def test_planner_holds_the_fp8_gathered_weights_at_one_byte():
    """plan/memory.py param_buffer_bytes with ``fp8_all_gather``: llama3-8b on 8 ranks, tp 1. Zero 3
    holds two blocks unsharded (current + prefetched): each block's Float8 Linears (q/o 2 x 4096^2,
    k/v 2 x 4096 x 1024, MLP 3 x 4096 x 14336) at 1 byte instead of 2, so the buffer drops by exactly
    2 x that many bytes; zero 2 holds all 32 blocks: 32 x. The root (embedding, output head, norms)
    stays 2-byte. At tp 2 every count halves."""
    from llmtrain.plan.dims import ParallelDims
    from llmtrain.plan.memory import dp_mode, fp8_unsharded_numel, param_buffer_bytes
    from llmtrain.plan.shards import inventory, stage_layers

    m = load_recipe(REPO / "recipes/llama3-8b.yaml", []).model
    per_layer = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336
    for tp in (1, 2):
        assert fp8_unsharded_numel(m, range(32), tp) == (32 * per_layer // tp, per_layer // tp)
        inv = inventory(m, stage_layers(32, 1, 1), [0], tp, 1)
        for zero, blocks in ((3, 2), (2, 32)):
            mode = dp_mode(zero, ParallelDims(tp=tp, dp_shard=8 // tp))
            args = (inv.dense_numel, inv.matmul_numel, mode, "fp8", inv.largest_block, inv.root, "none")
            bf16, fp8 = param_buffer_bytes(*args), param_buffer_bytes(*args, fp8=fp8_unsharded_numel(m, inv.layers, tp))
            assert bf16 - fp8 == blocks * per_layer // tp, (tp, zero, bf16, fp8)
            assert fp8 > 2 * inv.root  # the root's bf16 weights are still there


def test_plan_counts_the_fp8_gathered_weight_buffers():
    """End to end through ``plan_recipe`` + ``estimate`` (what ``llmtrain plan`` prints): llama3-8b,
    8 H100, zero 3, fp8: ``parallel.fp8_all_gather`` lowers the weight buffers by exactly the two
    held blocks' Float8 Linears at one byte less each (2 x 218,103,808 bytes), nothing else."""
    from llmtrain.plan.api import plan_recipe
    from llmtrain.plan.costmodel import estimate

    def buffers(*extra):
        r = load_recipe(REPO / "recipes/llama3-8b.yaml", ["cluster.gpu=h100-sxm", "cluster.nodes=1", "cluster.gpus_per_node=8",
                                                          "train.precision=fp8", "parallel.zero=3", "parallel.tp=1", *extra])
        plan = plan_recipe(r)
        assert plan.valid, [e.line() for e in plan.validation.errors]
        v = plan.validation
        return estimate(r, v.dims, v.batch, plan.placement, hints=False).worst.other_detail["weight_buffers"]

    assert buffers() - buffers("parallel.fp8_all_gather=true") == 2 * 218_103_808
