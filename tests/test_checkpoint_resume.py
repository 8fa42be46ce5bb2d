"""Checkpoint, crash and resume end to end: real ``llmtrain launch`` / ``llmtrain resume``, real torchrun.

Recipe: debug-dense, dp_shard 2 x tp 2 (FSDP2 zero 3), fp32, 6 AdamW steps, global batch 8 x 64
tokens, ``checkpoint.interval=2`` (async saves at steps 2, 4, 6).

* Same layout: a run whose last rank SIGKILLs itself at step 4 while its async save is in
  flight (``LLMTRAIN_TEST_KILL_IN_SAVE``) keeps step-2 as ``latest`` and is resumed with
  ``llmtrain resume``; losses and the final checkpoint (weights AND AdamW moments) must equal an
  uninterrupted run **bitwise** (CPU fp32, same layout: same operations in the same order,
  every bit of state restored). ``launch --max-restarts 1`` with a rank SIGKILLed after step 5
  (``LLMTRAIN_TEST_KILL_AT_STEP``) finishes on its own, bitwise equal too.
* Resharding: a copy of the uninterrupted run resumes from its step-4 checkpoint in another
  layout (dp_shard 4; cp 2 on 2 ranks; 1 process; pp 2 x dp_shard 2 with ZeRO-1 and micro-batch 1, i.e. AdamW
  state saved FSDP-sharded and loaded whole by each ZeRO-1 owner, and grad accumulation 4). Only the summation order changes, so the tolerances of the
  parity tests apply (tests/test_engine_parity.py): losses |diff| <= 2e-5, weights and Adam
  moments |diff| <= 2e-4 (AdamW turns rounding-level gradient differences into up to ~lr-sized
  moves of near-zero-gradient weights; a wrong shard or a lost state is >= 1e-2). Measured:
  ~5e-7 and ~2e-7.
* Sample audit: every DP rank logs the global sample positions it trains on
  (``LLMTRAIN_TEST_SAMPLE_LOG``); the steps kept (the last attempt at each step; steps 1-4 of
  the original plus steps 5-6 of the resharded resume) cover positions 0..47 exactly once, each
  in the same step as in the uninterrupted run.
* The 1-process resume also meets a damaged latest checkpoint (one shard truncated): the
  checksum check names the file and ``latest`` falls back to step-4 with a warning.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers_ckpt import load_ckpt

ROOT = Path(__file__).resolve().parent.parent
STEPS, GBS = 6, 8
SETS = ["train.steps=6", "checkpoint.interval=2", "train.seq_len=64", "train.micro_batch_size=2",
        "train.global_batch_size=8", "train.log_interval=1"]
LOSS_TOL, WEIGHT_TOL = 2e-5, 2e-4


def cli(args: list[str], env_extra: dict | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LLMTRAIN_TENSORBOARD": "0", **(env_extra or {})}
    env.pop("LLMTRAIN_ENGINE_MODULE", None)
    return subprocess.run([sys.executable, "-m", "llmtrain.cli.app", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def launch(runs: Path, samples: Path, kill_at: int | None = None, kill_in_save: int | None = None,
           extra: list[str] = (), recipe: str = "recipes/debug.yaml", sets: list[str] = SETS,
           ) -> tuple[subprocess.CompletedProcess, Path]:
    env = {"LLMTRAIN_TEST_SAMPLE_LOG": str(samples)}
    if kill_at:
        env["LLMTRAIN_TEST_KILL_AT_STEP"] = str(kill_at)
    if kill_in_save:
        env["LLMTRAIN_TEST_KILL_IN_SAVE"] = str(kill_in_save)
    args = ["launch", recipe, "--runs", str(runs), *extra]
    for s in sets:
        args += ["--set", s]
    proc = cli(args, env)
    run = next(next(runs.iterdir()).iterdir())
    return proc, run


def losses(run: Path) -> dict[int, float]:
    out = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        out[rec["step"]] = rec["loss"]  # a resumed run re-logs steps after its checkpoint: last wins
    return out


def sample_audit(log: Path) -> dict[int, list[int]]:
    """step -> sorted positions of the LAST attempt at that step (each DP rank's last record)."""
    last: dict[tuple[int, int], list[int]] = {}
    for line in log.read_text().splitlines():
        rec = json.loads(line)
        last[(rec["step"], rec["dp_rank"])] = rec["positions"]
    by_step: dict[int, list[int]] = {}
    for (step, _), pos in last.items():
        by_step.setdefault(step, []).extend(pos)
    return {s: sorted(p) for s, p in by_step.items()}


def assert_exact_coverage(by_step: dict[int, list[int]]) -> None:
    for step, pos in by_step.items():
        assert pos == list(range((step - 1) * GBS, step * GBS)), f"step {step}: positions {pos}"
    assert sorted(by_step) == list(range(1, STEPS + 1))


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))[:5]
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ref")
    proc, run = launch(tmp / "runs", tmp / "samples.jsonl")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return run, tmp / "samples.jsonl"


def test_checkpoints_committed_with_metadata(reference):
    run, _ = reference
    root = run / "checkpoints"
    assert (root / "latest").read_text().strip() == "step-6"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-2", "step-4", "step-6"]
    meta = json.loads((root / "step-6" / "metadata.json").read_text())
    assert meta["step"] == 6 and meta["consumed_samples"] == 48 and meta["tokens_seen"] == 48 * 64
    assert meta["world_size"] == 4 and meta["dims"]["tp"] == 2 and meta["dims"]["dp_shard"] == 2
    assert meta["recipe"]["train"]["steps"] == 6 and meta["versions"]["torch"] == torch.__version__
    assert ".metadata" in meta["files"] and "rng/rank-3.pt" in meta["files"]
    assert all(len(f["sha256"]) == 64 for f in meta["files"].values())


def test_sigkill_during_async_save_then_resume_is_bitwise_identical(reference, tmp_path):
    """The last rank is SIGKILLed at step 4, right after it started the async save of step 4:
    step-4 is never committed, ``latest`` still names step-2, and ``llmtrain resume`` from it
    reproduces the uninterrupted run bitwise (losses, weights, AdamW moments, sample order).
    (A kill after a committed save is covered by the --max-restarts test below.)"""
    ref_run, ref_samples = reference
    samples = tmp_path / "samples.jsonl"
    proc, run = launch(tmp_path / "runs", samples, kill_in_save=4)
    assert proc.returncode != 0, "the killed run must fail"
    root = run / "checkpoints"
    assert (root / "latest").read_text().strip() == "step-2"
    assert not (root / "step-4").exists() and (root / "step-4.tmp").is_dir()
    resumed = cli(["resume", "--run", str(run)], {"LLMTRAIN_TEST_SAMPLE_LOG": str(samples)})
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "step-2 (step 2 of 6)" in resumed.stdout
    assert losses(run) == losses(ref_run)
    assert max_diff(load_ckpt(ref_run / "checkpoints" / "step-6", tmp_path),
                    load_ckpt(root / "step-6", tmp_path)) == 0.0
    assert not (root / "step-4.tmp").exists()  # the stale temporary directory was removed by the next save
    audit = sample_audit(samples)
    assert audit == sample_audit(ref_samples)
    assert_exact_coverage(audit)


def test_max_restarts_resumes_on_its_own(reference, tmp_path):
    """``launch --max-restarts 1``: a rank SIGKILLed after step 5 makes torchrun restart the
    worker group, which resumes from the latest checkpoint by itself; the one command exits 0
    and matches the uninterrupted run bitwise (same layout, every bit of state restored)."""
    ref_run, ref_samples = reference
    samples = tmp_path / "samples.jsonl"
    proc, run = launch(tmp_path / "runs", samples, kill_at=5, extra=["--max-restarts", "1"])
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "checkpoint: resumed from" in out and "/step-4 at step 4" in out
    assert losses(run) == losses(ref_run)
    assert max_diff(load_ckpt(ref_run / "checkpoints" / "step-6", tmp_path),
                    load_ckpt(run / "checkpoints" / "step-6", tmp_path)) == 0.0
    audit = sample_audit(samples)
    assert audit == sample_audit(ref_samples)
    assert_exact_coverage(audit)


@pytest.mark.parametrize("name,sets,truncate", [
    ("dp4", ["parallel.tp=1"], False),
    ("cp2", ["parallel.tp=1", "parallel.cp=2", "cluster.gpus_per_node=2"], False),
    ("one_process", ["parallel.tp=1", "cluster.gpus_per_node=1"], True),
    ("pp2_zero1", ["parallel.tp=1", "parallel.pp=2", "parallel.zero=1", "train.micro_batch_size=1"], False),
])
def test_resume_resharded(reference, tmp_path, name, sets, truncate):
    ref_run, ref_samples = reference
    run = tmp_path / "runs" / "debug" / ref_run.name
    shutil.copytree(ref_run, run)
    samples = tmp_path / "samples.jsonl"  # only the resumed steps; the layout (DP ranks) differs
    ref_final = load_ckpt(ref_run / "checkpoints" / "step-6", tmp_path)
    if truncate:  # damage the latest checkpoint: resume must name the file and fall back to step-4
        shard = sorted((run / "checkpoints" / "step-6").glob("*.distcp"))[1]
        shard.write_bytes(shard.read_bytes()[:100])
        ckpt = "latest"
    else:
        shutil.rmtree(run / "checkpoints" / "step-6")
        ckpt = "step-4"
    args = ["resume", "--run", str(run), "--ckpt", ckpt]
    for s in sets:
        args += ["--set", s]
    proc = cli(args, {"LLMTRAIN_TEST_SAMPLE_LOG": str(samples)})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "step-4 (step 4 of 6)" in out
    if truncate:
        assert f"{shard.name}: 100 bytes, expected" in out and "falling back" in out
    assert "resharded" in out and "saved as dp_shard2 tp2 zero3 on 4 ranks (grad_accum 2)" in out
    ref_losses, new_losses = losses(ref_run), losses(run)
    assert sorted(new_losses) == list(range(1, 7))
    loss_diff = max(abs(new_losses[step] - ref_losses[step]) for step in (5, 6))
    weight_diff = max_diff(ref_final, load_ckpt(run / "checkpoints" / "step-6", tmp_path))
    print(f"reshard {name}: loss diff {loss_diff:.2e}, weight/moment diff {weight_diff:.2e}")
    assert loss_diff <= LOSS_TOL, (new_losses, ref_losses)
    assert weight_diff <= WEIGHT_TOL
    resumed = sample_audit(samples)
    assert sorted(resumed) == [5, 6], sorted(resumed)
    before = {s: p for s, p in sample_audit(ref_samples).items() if s <= 4}
    assert_exact_coverage({**before, **resumed})


MOE_STEPS = 4
MOE_SETS = ["train.steps=4", "checkpoint.interval=2", "train.seq_len=64", "train.micro_batch_size=2",
            "train.global_batch_size=8", "train.log_interval=1", "cluster.gpus_per_node=2", "parallel.ep=2",
            "model.moe.num_experts=2"]


def test_resume_moe_ep2_as_ep1(tmp_path):
    """MoE (debug-moe with 2 experts, 2 ranks, dp_shard 2 with experts sharded ep 2) saved at step
    2, resumed on 4 ranks with ep 1: every rank holds both experts, FSDP-sharded over 4 ranks on
    their hidden dimension (2 experts do not split evenly over 4: data_parallel.expert_placement),
    so the experts' weights and AdamW moments are re-cut by DCP from dim 0 (ep) to dim 1 / 2, and
    the resumed run's step-4 checkpoint is written in that layout; same tolerances as above (with
    2 experts and top-2 routing every token goes to both, so no routing decision can flip)."""
    ref_samples, samples = tmp_path / "ref.jsonl", tmp_path / "samples.jsonl"
    proc, ref_run = launch(tmp_path / "ref", ref_samples, recipe="recipes/debug-moe.yaml", sets=MOE_SETS)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = tmp_path / "runs" / "debug-moe" / ref_run.name
    shutil.copytree(ref_run, run)
    shutil.rmtree(run / "checkpoints" / "step-4")
    proc = cli(["resume", "--run", str(run), "--ckpt", "step-2", "--set", "parallel.ep=1",
                "--set", "cluster.gpus_per_node=4"], {"LLMTRAIN_TEST_SAMPLE_LOG": str(samples)})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "saved as dp_shard2 ep2 zero3 on 2 ranks" in out and "now dp_shard4 zero3 on 4 ranks" in out
    ref_losses, new_losses = losses(ref_run), losses(run)
    ref_final = load_ckpt(ref_run / "checkpoints" / "step-4", tmp_path)
    assert any(".moe." in k and "exp_avg" in k for k in ref_final)
    loss_diff = max(abs(new_losses[step] - ref_losses[step]) for step in (3, 4))
    weight_diff = max_diff(ref_final, load_ckpt(run / "checkpoints" / "step-4", tmp_path))
    print(f"reshard moe ep2 -> ep1 on 4 ranks: loss diff {loss_diff:.2e}, weight/moment diff {weight_diff:.2e}")
    assert loss_diff <= LOSS_TOL, (new_losses, ref_losses)
    assert weight_diff <= WEIGHT_TOL
    kept = {**{s: p for s, p in sample_audit(ref_samples).items() if s <= 2}, **sample_audit(samples)}
    assert {s: p for s, p in kept.items()} == {s: list(range((s - 1) * GBS, s * GBS)) for s in range(1, MOE_STEPS + 1)}


def test_hf_export_after_4_ranks_equals_export_resharded_to_1_rank(reference, tmp_path):
    """``ckpt export --hf`` of the 4-rank checkpoint (TP 2 x FSDP 2) equals the export of the same
    weights resharded to 1 rank. The 1-rank checkpoint comes from a 1-process resume of step-6
    that trains one more step at lr 1e-30 (the schema wants lr > 0): AdamW then moves each weight by
    about 1e-30, below half an fp32 ulp of any weight above ~1e-22 in magnitude, so step-7 holds
    step-6's weights bit for bit, saved by one rank. Tolerance 0 (``torch.equal``): both exports copy
    the same values (DCP reshards by offsets; no arithmetic)."""
    from safetensors.torch import load_file

    ref_run, _ = reference
    run = tmp_path / "runs" / "debug" / ref_run.name
    shutil.copytree(ref_run, run)
    proc = cli(["resume", "--run", str(run), "--ckpt", "step-6", "--set", "parallel.tp=1", "--set",
                "cluster.gpus_per_node=1", "--set", "train.steps=7", "--set", "train.optimizer.lr=1e-30"])
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    meta = json.loads((run / "checkpoints" / "step-7" / "metadata.json").read_text())
    assert meta["world_size"] == 1
    exports = {}
    for name, ckpt in (("four", ref_run / "checkpoints" / "step-6"), ("one", run / "checkpoints" / "step-7")):
        out = tmp_path / name
        proc = cli(["ckpt", "export", str(ckpt), "--hf", str(out), "--max-shard-size", "200KB"])
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
        exports[name] = out
    a, b = exports["four"], exports["one"]
    assert sorted(p.name for p in a.iterdir()) == sorted(p.name for p in b.iterdir())
    assert json.loads((a / "config.json").read_text()) == json.loads((b / "config.json").read_text())
    shards = sorted(p.name for p in a.glob("*.safetensors"))
    assert len(shards) > 1, shards  # several shard files, written by parallel workers
    ta = {k: v for s in shards for k, v in load_file(str(a / s)).items()}
    tb = {k: v for s in shards for k, v in load_file(str(b / s)).items()}
    assert ta.keys() == tb.keys() and [k for k in ta if not torch.equal(ta[k], tb[k])] == []
