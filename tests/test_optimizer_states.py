"""Quantized AdamW moments (train.optimizer.states) and the FP8 / async-TP refusals (issue 17).

The multi-rank byte check (FSDP2 x TP DTensors with 8bit, ZeRO-1 with bf16) is in
tests/test_costmodel.py (cases tp2_fsdp2_8bit, zero1_bf16); here: one process, real torchao
optimizers, exact byte counts, and the validation errors.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from llmtrain.engine.quant_optim import make_state_optimizer, moment_bytes
from llmtrain.plan.api import plan_recipe
from llmtrain.plan.steptime import matmul_peak
from llmtrain.recipe.gpus import GPUS
from llmtrain.recipe.load import load_recipe

REPO = Path(__file__).resolve().parents[1]


def _stored(t: torch.Tensor) -> int:
    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        return sum(_stored(getattr(t, n)) for n in names)
    return t.numel() * t.element_size()


def _model() -> torch.nn.Module:
    torch.manual_seed(0)  # 64x128 = 8192 (quantized), 30x100 = 3000 (< 4096: fp32 moments), biases fp32
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Linear(128, 64), torch.nn.Linear(64, 30))


def _train(states: str, steps: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, float]:
    m = _model()
    if states == "fp32":
        opt = torch.optim.AdamW(m.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    else:
        opt = make_state_optimizer(states, [{"params": list(m.parameters()), "weight_decay": 0.1}], 3e-3,
                                   (0.9, 0.95), 1e-8, 0.1)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(256, 64, generator=g), torch.randint(0, 30, (256,), generator=g)
    for _ in range(steps):
        loss = torch.nn.functional.cross_entropy(m(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
    return m, opt, loss.item()


@pytest.mark.parametrize("states", ["8bit", "bf16"])
def test_optimizer_bytes_equal_the_planners_rule(states):
    """Exact (0 bytes tolerance): the planner's moment_bytes is what torchao allocates."""
    m, opt, _ = _train(states, 2)
    got = sum(_stored(v) for s in opt.state.values() for v in s.values())
    assert got == sum(moment_bytes(p.numel(), states) + 4 for p in m.parameters())
    fp32 = sum(8 * p.numel() + 4 for p in m.parameters())
    assert got < fp32 * (0.45 if states == "8bit" else 0.51)  # the 3000-element layer keeps fp32 moments


def test_quantized_moments_train_like_fp32():
    """60 steps on a fixed batch: final loss within 3 % of fp32 moments (the issue's bound; 8-bit
    moments typically land within 1 %). fp32 vs 8bit differ, so the test can fail."""
    _, _, ref = _train("fp32", 60)
    for states in ("8bit", "bf16"):
        _, _, loss = _train(states, 60)
        assert abs(loss - ref) <= 0.03 * ref, (states, loss, ref)


def _errors(sets: list[str]) -> list[str]:
    recipe = load_recipe(REPO / "recipes/debug.yaml", sets)
    return [f"{p.path}: {p.message}" for p in plan_recipe(recipe, None, 1, 4).validation.errors]


@pytest.mark.parametrize("sets, field, words", [
    (["train.precision=fp8"], "train.precision", "CPU engine has no FP8"),
    (["train.precision=fp8", "cluster.gpu=a100-80g"], "train.precision", "a100-80g has no FP8 tensor cores"),
    (["parallel.async_tp=true"], "parallel.async_tp", "needs CUDA"),
    (["parallel.async_tp=true", "cluster.gpu=h100-sxm"], "parallel.async_tp", "train.compile"),
])
def test_fp8_and_async_tp_are_refused(sets, field, words):
    errors = _errors(sets)
    assert any(e.startswith(field) and words in e for e in errors), errors


def test_fp8_on_h100_is_accepted_and_uses_the_fp8_peak():
    assert not [e for e in _errors(["train.precision=fp8", "cluster.gpu=h100-sxm"]) if "fp8" in e]
    h100 = GPUS["h100-sxm"]
    assert matmul_peak(h100, "bf16", 0.9) == h100.peak_flops_bf16
    # 90 % of the FLOPs at 1979 TFLOPS, 10 % at 989: 1 / (0.1 / 989 + 0.9 / 1979) = 1799 TFLOPS
    assert matmul_peak(h100, "fp8", 0.9) == pytest.approx(1799e12, rel=1e-3)


def test_resume_with_8bit_moments_is_bitwise_identical(tmp_path):
    """2 ranks, FSDP2 (zero 3, DTensor moments), 8bit moments: a run resumed from its step-2
    checkpoint reproduces the uninterrupted 6-step run bitwise (tolerance 0: losses, weights, and
    the saved codes / scales / steps of every moment). Two torchrun jobs (150 s at load average 24)."""
    import json
    import shutil

    from tests.helpers_ckpt import load_ckpt
    from tests.test_checkpoint_resume import SETS, cli, launch, losses

    sets = SETS + ["train.optimizer.states=8bit", "cluster.gpus_per_node=2", "parallel.tp=1", "parallel.zero=3"]
    proc, ref = launch(tmp_path / "runs", tmp_path / "samples.jsonl", sets=sets)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    saved = load_ckpt(ref / "checkpoints" / "step-6", tmp_path / "a")
    assert any(k.endswith("exp_avg.codes") for k in saved)
    run = tmp_path / "copy" / ref.name
    shutil.copytree(ref, run)
    for step in ("step-4", "step-6"):
        shutil.rmtree(run / "checkpoints" / step)
    (run / "checkpoints" / "latest").write_text("step-2\n")
    metrics = run / "metrics.jsonl"  # the resumed run re-logs steps 3-6: drop them so they must be re-made
    metrics.write_text("".join(ln + "\n" for ln in metrics.read_text().splitlines() if json.loads(ln)["step"] <= 2))
    # another moment format is refused before anything starts (the checkpoint holds 8-bit codes)
    refused = cli(["resume", "--run", str(run), "--set", "train.optimizer.states=fp32"], {})
    assert refused.returncode != 0 and "Traceback" not in refused.stderr, refused.stderr[-2000:]
    assert "train.optimizer.states" in refused.stderr and "8bit" in refused.stderr, refused.stderr[-2000:]
    assert (run / "checkpoints" / "latest").read_text() == "step-2\n"
    resumed = cli(["resume", "--run", str(run)], {"LLMTRAIN_TEST_SAMPLE_LOG": str(tmp_path / "s2.jsonl")})
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert losses(run) == losses(ref) and sorted(losses(run)) == list(range(1, 7))
    again = load_ckpt(run / "checkpoints" / "step-6", tmp_path / "b")
    assert saved.keys() == again.keys()
    assert [k for k in saved if not torch.equal(saved[k], again[k])] == []


def test_float8_conversion_runs_in_torchaos_cpu_emulation():
    """engine/parallel/float8.py on CPU (torch 2.13's ``_scaled_mm`` runs on CPU, so torchao's
    Float8Linear forward/backward execute here; validation still refuses fp8 training on CPU: no
    speed-up, and the issue asks for it). The block Linears convert, the output head does not.
    Tolerances: e4m3 activations/weights carry 3 mantissa bits (relative rounding <= 2^-4 per
    element), e5m2 gradients 2 bits (<= 2^-3): output within 8 %, weight gradient within 12 %;
    and at least 0.5 % off, so the test fails if the layers silently stayed bf16/fp32 (bf16's
    own error here is ~0.4 % at most)."""
    import copy

    from llmtrain.engine.parallel.float8 import apply_float8

    torch.manual_seed(0)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w1, self.w2, self.output = torch.nn.Linear(64, 128), torch.nn.Linear(128, 64), torch.nn.Linear(64, 32)

        def forward(self, x):
            return self.output(self.w2(torch.nn.functional.gelu(self.w1(x))))

    ref = Net()
    f8 = copy.deepcopy(ref)
    assert apply_float8(f8) == 2 and type(f8.output) is torch.nn.Linear
    x = torch.randn(32, 64)
    y_ref, y8 = ref(x), f8(x)
    y_ref.square().sum().backward()
    y8.square().sum().backward()

    def rel(a, b):
        return float((a - b).norm() / b.norm())

    assert 0.005 < rel(y8, y_ref) < 0.08
    assert 0.005 < rel(f8.w1.weight.grad, ref.w1.weight.grad) < 0.12


def test_planner_prices_fp8_matmuls_at_the_fp8_peak():
    """llama3-8b on 64 H100s: fp8 runs the blocks' Linear FLOPs (72 % of the model FLOPs,
    plan/flops.fp8_matmul_fraction) at 1979 instead of 989 TFLOPS, so the compute time falls to
    0.28 + 0.72 x 989 / 1979 = 0.64 of bf16's (2 % tolerance: the fraction excludes the small norm
    terms the FLOP model counts in the blocks). That is time model v1's rule; under v2, the default,
    the FP8 GEMMs run at their measured fraction of the FP8 peak and torchao's eager scaling casts and
    layout copies are priced beside them (plan/fp8time.py), so fp8 gains less: between v1's ratio and 1."""
    import json
    import subprocess
    import sys

    def compute_s(precision: str, time_model: str) -> float:
        out = subprocess.run([sys.executable, "-m", "llmtrain.cli.app", "plan", "recipes/llama3-8b.yaml", "--json",
                              "--set", f"train.precision={precision}", "--set", f"cluster.time_model={time_model}"],
                             cwd=REPO, capture_output=True, text=True, check=True).stdout
        return json.loads(out)["time"]["breakdown_s"]["compute"]

    from llmtrain.plan.flops import fp8_matmul_fraction

    f = fp8_matmul_fraction(load_recipe(REPO / "recipes/llama3-8b.yaml", []).model, 8192)
    assert 0.6 < f < 0.85
    ideal = (1 - f) + f * 989 / 1979
    assert compute_s("fp8", "v1") / compute_s("bf16", "v1") == pytest.approx(ideal, rel=0.02)
    assert ideal * 1.05 < compute_s("fp8", "v2") / compute_s("bf16", "v2") < 1


def test_torchao_is_imported_without_its_import_time_lines():
    """engine/torchao_import.py: the engine's torchao imports (fp8, quantized moments) print neither
    torch 2.13's deprecation of torchao's Enum register_constant nor torchao's "Failed to load" lines
    for the prebuilt extensions this machine cannot load; a plain ``import torchao`` prints the first
    (torch 2.13, torchao 0.18: the line the filter exists for), so the check can fail."""
    import subprocess
    import sys

    def stderr_of(code: str) -> str:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)
        assert proc.returncode == 0, proc.stderr[-2000:]
        return proc.stderr

    assert "is an Enum subclass" in stderr_of("import torchao")
    for entry in ("from llmtrain.engine.parallel.float8 import _torchao_float8; _torchao_float8()",
                  "from llmtrain.engine.quant_optim import _torchao; _torchao()"):
        ours = stderr_of(entry)
        assert "is an Enum subclass" not in ours and "Failed to load" not in ours, (entry, ours[-2000:])
