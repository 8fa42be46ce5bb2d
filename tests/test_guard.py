"""Loss-spike / NaN guard: the pure bookkeeping (:class:`llmtrain.engine.guard.LossGuard`) and one
real run with poisoned batches.

End to end (real ``llmtrain launch``, 2 ranks FSDP, fp32, 10 steps of 8 sequences, checkpoints
every 2 steps, ``train.guard.max_bad_steps=2``): ``LLMTRAIN_TEST_NAN_SAMPLES`` poisons the loss
and the gradients of the rank whose batch holds sample 17 (step 3), 56 (step 8) and 64 (step 9).

* step 3 alone: the update is skipped (the AdamW step counter of the final checkpoint is one
  short for it), training goes on;
* steps 8 and 9 in a row: rollback to the latest checkpoint (step-8, whose weights are those
  after step 7 because step 8 was skipped), the data window [56, 72) is skipped, and steps 9-10
  train on samples 72..87;
* the run exits 0 with finite losses; without the skip, the NaN gradients would have made every
  weight NaN (the final checkpoint is checked for finiteness).
"""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import torch

from llmtrain.engine.guard import LossGuard
from tests.test_checkpoint_resume import cli, load_ckpt, sample_audit


def cfg(**kw):
    base = dict(enabled=True, spike_factor=3.0, window=5, min_history=3, max_bad_steps=2, max_rollbacks=1)
    return SimpleNamespace(**{**base, **kw})


def test_judge_nan_inf_and_spikes():
    g = LossGuard(cfg())
    assert g.judge(float("nan"), 1.0) == "nan" and g.judge(1.0, float("inf")) == "nan"
    assert g.judge(100.0, 1.0) is None  # no spike verdict before min_history accepted losses
    for x in (2.0, 2.2, 1.8):
        g.accept(x)
    assert g.judge(6.0, 1.0) is None  # 6.0 = 3 x median 2.0: not above
    assert g.judge(6.01, 1.0) == "spike"
    assert LossGuard(cfg(spike_factor=0.0)).judge(1e9, 1.0) is None  # 0 = spikes off
    assert LossGuard(cfg(enabled=False)).judge(float("nan"), float("nan")) is None


def test_running_median_window_and_rows():
    g = LossGuard(cfg(window=3, min_history=1))
    for x in (10.0, 1.0, 1.0, 1.0):  # the 10.0 falls out of the window of 3
        g.accept(x)
    assert g.judge(3.5, 0.0) == "spike"
    assert g.reject(consumed_before=40) is False and g.first_bad_sample == 40
    assert g.reject(consumed_before=48) is True and g.first_bad_sample == 40  # 2 in a row: rollback due
    g.rolled_back()
    assert g.bad_in_row == 0 and g.rollbacks == 1 and len(g.history) == 3
    g.reject(0)
    g.accept(1.0)
    assert g.bad_in_row == 0 and g.first_bad_sample is None
    assert LossGuard(cfg(max_bad_steps=0)).reject(0) is False  # 0 = never roll back


def test_injected_nan_skips_then_rolls_back(tmp_path):
    samples = tmp_path / "samples.jsonl"
    args = ["launch", "recipes/debug.yaml", "--runs", str(tmp_path / "runs")]
    for s in ("train.steps=10", "checkpoint.interval=2", "train.seq_len=64", "train.micro_batch_size=2",
              "train.global_batch_size=8", "train.log_interval=1", "cluster.gpus_per_node=2", "parallel.tp=1",
              "train.guard.max_bad_steps=2"):
        args += ["--set", s]
    proc = cli(args, {"LLMTRAIN_TEST_NAN_SAMPLES": "17,56,64", "LLMTRAIN_TEST_SAMPLE_LOG": str(samples)})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "guard: step 3: nan" in out and "update skipped" in out
    assert "guard: rollback 1: bad steps up to 9; reloaded step 8, skipping samples [56, 72)" in out
    run = next((tmp_path / "runs" / "debug").iterdir())
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    skipped = [r["step"] for r in records if "skipped" in r]
    assert skipped == [3, 8, 9]
    assert [r for r in records if "rollback" in r] == [
        {"step": 9, "rollback": 1, "restored_step": 8, "skipped_samples": [56, 72]}]
    good = {r["step"]: r["loss"] for r in records if "loss" in r and "skipped" not in r}
    assert sorted(good) == [1, 2, 4, 5, 6, 7, 8 + 1, 10] and all(math.isfinite(v) for v in good.values())
    final = load_ckpt(run / "checkpoints" / "step-10", tmp_path)
    steps = {float(v) for k, v in final.items() if k.startswith("optimizer.state.") and k.endswith(".step")}
    assert steps == {8.0}  # 10 step slots - step 3 - steps 8, 9 (the rollback replays 9, 10 on new data)
    assert all(torch.isfinite(v).all() for v in final.values() if torch.is_tensor(v) and v.is_floating_point())
    audit = sample_audit(samples)  # the last attempt at each step
    assert audit[9] == list(range(72, 80)) and audit[10] == list(range(80, 88))
    assert audit[3] == list(range(16, 24))  # consumed, but its update was skipped
