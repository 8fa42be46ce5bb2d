"""Parity of every engine-core layout with a 1-process run of the same seed and data.

One 4-rank torchrun job runs all layouts (sharing the process group); a 1-rank job is the
reference. Model debug-dense, fp32, 5 AdamW steps with gradient clipping active, global batch 8
sequences of 64 tokens, so every layout sees the same samples per step (the sampler is
layout-independent) and gradient accumulation differs (reference: 4 micro-batches; dp 4: 1).

Tolerances (fp32): the layouts differ from the reference only in summation order (all-reduce,
reduce-scatter, TP partial sums, accumulation order), i.e. relative rounding ~1e-7 per op.
- losses: |diff| <= 2e-5 at loss ~6 (~3e-6 relative), far below any real bug (a wrong gradient
  scale or a missing reduction changes step-2 loss by > 1e-3);
- weights after 5 AdamW steps: |diff| <= 2e-4 absolute. AdamW normalizes each update to
  ~lr = 3e-3 per step whatever the gradient's size, so a rounding-level gradient difference dg on
  a near-zero gradient moves a weight by up to lr * dg / eps per step (CPU facts note: ~1e-4
  seen with torch's eps = 1e-8; which element is hit depends on the CPU's kernels). The runs use
  eps = 1e-6 (COMMON), ~1000x below the typical |g| ~ 1e-3, which damps that 100x and leaves the
  update ~lr * sign(g) (measured for the 5D matrix, tests/test_engine_5d.py); a bug (missing
  reduction, wrong shard) shows up as errors of order lr * steps = 1.5e-2.
"""

from __future__ import annotations

import pytest
import torch

from tests.distrun import run_cases

STEPS = 5
COMMON = ["train.seq_len=64", "train.micro_batch_size=2", "train.global_batch_size=8", "train.steps=5",
          "train.grad_clip=1.0", "train.schedule.warmup_steps=2", "train.optimizer.eps=1e-6",  # eps: see docstring
          "parallel.dp_shard=-1"]
LOSS_TOL = 2e-5
WEIGHT_TOL = 2e-4

CASES = {
    "ddp": ["parallel.zero=0"],
    "zero1": ["parallel.zero=1"],
    "zero2": ["parallel.zero=2"],
    "zero3": ["parallel.zero=3"],
    "zero3_ac_full": ["parallel.zero=3", "train.activation_checkpointing=full"],
    "hsdp_2x2": ["parallel.zero=3", "parallel.dp_replicate=2"],
    "tp2_ddp": ["parallel.tp=2", "parallel.zero=0", "parallel.sequence_parallel=false"],
    "tp2_sp_ddp": ["parallel.tp=2", "parallel.zero=0", "parallel.sequence_parallel=true"],
    "tp2_fsdp2": ["parallel.tp=2", "parallel.zero=3", "parallel.sequence_parallel=true"],
    "tp2_fsdp2_ac_selective": ["parallel.tp=2", "parallel.zero=3", "train.activation_checkpointing=selective"],
    "zero1_ac_selective": ["parallel.zero=1", "train.activation_checkpointing=selective"],
}
# MoE without expert parallelism (EP is the 5D issue). Bias balancing with a sigmoid router:
# the per-expert token counts are summed over DP ranks before the bias update, so every layout
# must equal one process. (The auxiliary loss, by contrast, is computed per rank and
# micro-batch, as in Megatron: it is not expected to equal a 1-process run and is not compared.)
MOE = ["model.preset=debug-moe", "model.moe.balance=bias", "model.moe.router=sigmoid", "model.moe.bias_update_rate=0.01"]
MOE_CASES = {
    "moe_zero3": MOE + ["parallel.zero=3"],
    "moe_tp2_sp_fsdp2": MOE + ["parallel.tp=2", "parallel.zero=3", "parallel.sequence_parallel=true"],
}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("parity")
    single = ["parallel.tp=1", "parallel.zero=0"]
    refs = run_cases(tmp, 1, "recipes/debug.yaml", [{"name": "dense", "set": single}, {"name": "moe", "set": MOE + single}],
                     STEPS, COMMON)
    cases = {**CASES, **MOE_CASES}
    layouts = run_cases(tmp, 4, "recipes/debug.yaml", [{"name": k, "set": v} for k, v in cases.items()], STEPS, COMMON)
    return refs, layouts


@pytest.mark.parametrize("case", [*CASES, *MOE_CASES])
def test_layout_matches_single_process(results, case):
    refs, layouts = results
    ref = refs["moe" if case in MOE_CASES else "dense"]
    got = layouts[case]
    assert len(got["losses"]) == STEPS
    loss_diff = max(abs(a - b) for a, b in zip(got["losses"], ref["losses"]))
    assert loss_diff <= LOSS_TOL, f"{case}: losses {got['losses']} vs {ref['losses']}"
    assert got["losses"][-1] < got["losses"][0] - 0.05, "the loss must fall over 5 steps"
    assert set(got["state"]) == set(ref["state"])
    worst = max((got["state"][k] - ref["state"][k]).abs().max().item() for k in ref["state"])
    assert worst <= WEIGHT_TOL, f"{case}: max weight diff {worst}"
    norm_diff = max(abs(a - b) / b for a, b in zip(got["grad_norms"], ref["grad_norms"]))
    assert norm_diff <= 1e-5, f"{case}: global grad norm differs by {norm_diff:.2e} (relative)"


def test_references_trained_and_bias_moved(results):
    """Guards the test itself: training changes the weights and the MoE expert biases, so
    equality is not vacuous (the bias buffers are part of the compared state)."""
    refs, _ = results
    for ref in refs.values():
        assert all(torch.isfinite(v).all() for v in ref["state"].values())
        assert ref["losses"][0] > ref["losses"][-1]
    biases = [v for k, v in refs["moe"]["state"].items() if k.endswith("expert_bias")]
    assert biases and max(b.abs().max().item() for b in biases) > 0
