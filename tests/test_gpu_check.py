"""The CI smoke test of the prepared GPU check (benchmarks/gpu_check.py, issue 19).

``--device cpu --tiny`` runs every step at toy size on CPU, so the script is known to work before
a GPU machine is lent: the JSON must say ``measured: false``, hold every step in order with a
final status and its seconds, every correctness step (groups correctness, kernels) ``ok``, the
CUDA-only step ``skipped: needs CUDA``, and speed rows with tokens/s and the planner's
prediction beside them. No number is compared with a threshold here: toy sizes on a shared
2-core machine mean nothing; the correctness steps carry their own stated tolerances (in their
docstrings) and fail the step, hence this test, when a path is wrong.

The same run checks independence with a worker that dies (the test hook
``LLMTRAIN_GPU_CHECK_CRASH`` at fp8_dense_compiled, the first CUDA-only step, so every CPU step
runs in the first worker and the fresh one only imports torch: ~6 s less than a crash earlier):
that step is recorded as an error and a fresh worker decides the ones after it. Bad arguments are one-line errors (no torch started). The
run order and estimates are checked without running anything: the acceptance steps come first
and fit the device command's budget; ``--publish`` merges a rerun into its first run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "gpu_check.py"
sys.path.insert(0, str(REPO / "benchmarks"))

from gpu_check_steps import load_all

EXPECTED = ["env_nccl", "train_bf16_vs_fp32", "fsdp2_bf16_vs_fp32", "moe_grouped_gemm", "fused_adamw",
            "dcp_async_resume", "hf_export", "cp_attention_blocks", "dense_compiled", "hf_llama_eager", "dense_eager",
            "dense_compiled_selective_ac", "dense_compiled_full_ac", "dense_compiled_fsdp1", "moe_eager",
            "moe_compiled_fsdp1", "hf_llama_compiled", "moe_grouped_lora", "kernel_rates", "loss_rates", "adamw_quantized_states", "fp8_dense_compiled", "fp8_all_gather",
            "fp8_tp", "async_tp", "moe_profile", "dense_profile", "softcap_attention", "gqa_attention",
            "masked_rows_attention"]  # fp8_tp, async_tp: issue 17
ACCEPTANCE = ["env_nccl", "train_bf16_vs_fp32", "fsdp2_bf16_vs_fp32", "moe_grouped_gemm", "fused_adamw",
              "dcp_async_resume", "hf_export", "cp_attention_blocks", "dense_compiled", "hf_llama_eager"]
SPEED_KEYS = ("tokens_per_s", "mfu", "peak_mem_gib", "planned_step_s", "planned_peak_gib")


def run(args: list[str], tmp_path: Path, **env) -> tuple[subprocess.CompletedProcess, dict | None]:
    out = tmp_path / "out"
    full_env = dict(os.environ, OMP_NUM_THREADS="1", TMPDIR=str(tmp_path), **env)
    proc = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--tiny", "--out", str(out), *args],
                          cwd=REPO, env=full_env, capture_output=True, text=True, timeout=600, check=False)
    path = out / "gpu_check.json"
    return proc, json.loads(path.read_text()) if path.is_file() else None


def test_cpu_smoke_runs_every_step(tmp_path):
    steps = load_all()
    assert [s.name for s in steps] == EXPECTED
    # the test hook kills the worker at fp8_dense_compiled (module docstring): that step must be an
    # error and a fresh worker must decide the next ones
    proc, rec = run([], tmp_path, LLMTRAIN_GPU_CHECK_CRASH="fp8_dense_compiled")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert rec["measured"] is False and rec["device_type"] == "cpu" and rec["tiny"] is True
    assert list(rec["steps"]) == EXPECTED
    problems = {}
    for s in steps:
        entry = rec["steps"][s.name]
        assert isinstance(entry.get("seconds"), float), (s.name, entry)
        if s.name == "fp8_dense_compiled":
            if entry["status"] != "error" or "worker exited with 9" not in entry["error"]:
                problems[s.name] = entry
        elif s.cuda_only:  # decided by the fresh worker started after the crash
            if entry != {**entry, "status": "skipped", "reason": "needs CUDA"}:
                problems[s.name] = entry
        elif entry["status"] != "ok":
            problems[s.name] = entry.get("error") or entry.get("reason")
    assert not problems, problems
    assert rec["steps"]["env_nccl"]["result"]["backend"] == "gloo"
    assert rec["torch"] and rec["versions"]["torch"] == rec["torch"]
    # the SDPA rows say which backend torch chose (what benchmarks/gpu_fit.py's SDPA_MEASURED is a rate of)
    attention = rec["steps"]["kernel_rates"]["result"]["attention"]
    assert attention and all(r["backend"] not in ("", "unknown", "ERROR") and r["fa2_fwd_bwd_tflops"] > 0
                             for r in attention), attention
    # the MoE profile (CPU: the aten ops stand in for kernels) has its per-step tables
    prof = rec["steps"]["moe_profile"]["result"]
    assert prof["wall_ms"] > 0 and prof["kernel_ms"] > 0 and prof["kernels_per_step"] > 0, prof
    assert prof["top"] and set(prof["by_category"]) >= {"gemm"} and "planned_step_s" in prof, prof
    # the dense profile: measured kernel time by category beside v2's price of each (eager only at --tiny)
    dense = rec["steps"]["dense_profile"]["result"]["rows"]
    assert [r["config"] for r in dense] == ["dense_eager"], dense
    planned = dense[0]["planned_ms"]
    assert {"gemm", "attention", "elementwise", "rest"} <= set(planned) and planned["gemm"] > 0, planned
    assert dense[0]["by_category"]["gemm"]["ms"] > 0 and dense[0]["planned_step_s"] > 0, dense
    rows = {r["config"]: r for r in rec["speed"]}
    assert {"dense_compiled", "dense_eager", "dense_compiled_fsdp1", "moe_compiled_fsdp1", "hf_llama_eager"} <= set(rows)
    for name in ("dense_compiled", "dense_eager", "moe_compiled_fsdp1", "moe_eager", "dense_compiled_fsdp1"):
        row = rows[name]
        assert set(SPEED_KEYS) <= set(row), row
        assert row["tokens_per_s"] > 0 and row["planned_step_s"] > 0 and row["planned_peak_gib"] > 0, row
    assert rows["dense_eager"]["vs_hf"] > 0  # our tokens/s over HF's, both measured in this run
    assert rec["wall_s"] > 0


def test_bad_arguments_are_one_line_errors(tmp_path):
    for args, needle in ((["--steps", "env_nccl,nope"], "unknown step(s) nope"), (["--budget-s", "0"], "--budget-s 0")):
        proc, rec = run(args, tmp_path)
        assert proc.returncode == 2 and rec is None
        assert needle in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_gpu_names_map_to_catalog_entries():
    """MFU and the plan use the catalog entry of the device's name: every mapped key must exist."""
    import gpu_check

    from llmtrain.recipe.gpus import GPUS

    assert {key for _, key in gpu_check.NAME_TO_GPU} <= set(GPUS)
    assert gpu_check.NAME_TO_GPU[0] == ("H200", "h200")


def test_acceptance_steps_first_and_inside_the_budget():
    """The first device command is ``--budget-s 420`` (docs/benchmarks.md): the acceptance steps
    (env, correctness, 1B dense compiled, its HF peer) are the first ones and, with one worker
    start, fit in it with 200 s to spare for the estimates' error (they are assumptions until a
    device run measures them; gpu_check_steps/__init__.py). Every estimate is positive and the
    speed rows' estimates include their compile cost (compiled > eager of the same model)."""
    from gpu_check_steps import WORKER_START_S

    steps = load_all()
    assert [s.name for s in steps[:len(ACCEPTANCE)]] == ACCEPTANCE
    est = {s.name: s.est_s for s in steps}
    assert all(v > 0 for v in est.values()), est
    assert WORKER_START_S + sum(est[n] for n in ACCEPTANCE) <= 420 - 200, est
    assert est["dense_compiled"] > est["dense_eager"] + 30 and est["hf_llama_compiled"] > est["hf_llama_eager"] + 30


def test_rerun_plan_and_publish_merge(tmp_path, monkeypatch):
    """What the budget left out becomes one ``--steps`` command; publishing the first run and
    that rerun merges them (the rerun's measured step replaces the skipped one, vs_hf recomputed
    across both); a record of another device is a one-line error."""
    import gpu_check
    import gpu_check_record

    ok = lambda tps: {"status": "ok", "seconds": 1.0, "result": {"tokens_per_s": tps, "mfu": 0.5}}
    skipped = {"status": "skipped", "seconds": 0.0, "reason": "budget: 10 s left, the step needs ~57 s"}
    base = {"tiny": False, "device": "NVIDIA H200", "torch": "2.11.0", "device_type": "cuda", "wall_s": 400.0,
            "budget_s": 420.0, "date": "2026-12-02 00:00 UTC", "command": "python benchmarks/gpu_check.py --budget-s 420", "speed": []}
    first = {**base, "steps": {"hf_llama_eager": ok(100.0), "dense_compiled": skipped, "moe_eager": skipped}}
    plan = gpu_check.rerun_plan(first, {"dense_compiled": 57.0, "moe_eager": 11.0})
    assert plan["steps"] == ["dense_compiled", "moe_eager"] and plan["est_s"] == 68.0
    assert plan["command"].startswith("python3 benchmarks/gpu_check.py --steps dense_compiled,moe_eager --budget-s ")
    assert plan["budget_s"] >= 68 + 30
    second = {**base, "command": "python benchmarks/gpu_check.py --steps dense_compiled", "wall_s": 90.0,
              "steps": {"dense_compiled": ok(150.0), "moe_eager": skipped}}
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(first))
    b.write_text(json.dumps(second))
    monkeypatch.setattr(gpu_check_record, "DEFAULT_OUT", tmp_path / "merged.json")
    import common

    monkeypatch.setattr(common, "write_section", lambda *a: None)
    assert gpu_check_record.publish([a, b]) == 0
    merged = json.loads((tmp_path / "merged.json").read_text())
    assert merged["steps"]["dense_compiled"]["status"] == "ok" and merged["steps"]["moe_eager"] == skipped
    assert merged["measured"] is True and merged["wall_s"] == 490.0 and len(merged["commands"]) == 2
    row = {r["config"]: r for r in merged["speed"]}["dense_compiled"]
    assert row["vs_hf"] == 1.5
    other = tmp_path / "c.json"
    other.write_text(json.dumps({**second, "device": "NVIDIA H100 80GB HBM3"}))
    assert gpu_check_record.publish([a, other]) == 2
