"""Fit time model v2's measured constants from a GPU check record (issue 18 item 6).

    python benchmarks/gpu_fit.py [RECORD.json] [--out DIR]   # default: benchmarks/results/gpu_check.json

(``--out DIR`` also writes DIR/gpu_fit.json; ``--tiny`` is accepted, and changes nothing, for the
benchmarks' CI smoke test: the fit reads a file and replans on the CPU in about a second.)

Prints, from the record's ``kernel_rates`` step (no torch needed, no GPU):

- ``GEMM_FIT``: the median, over every GEMM pass the record timed (the published rows' per-rank
  shapes, forward and backward), of measured TFLOP/s / v2's price of the same shape *without* the
  fit (Bekman's MAMF x tile and wave efficiency, the roofline), to 3 decimals; ``GEMM_FIT_FP8`` the
  same over its FP8 GEMMs (``fp8_gemms``, recorded since the twenty-fifth session) at the FP8 price;
- ``SDPA_MEASURED``: causal SDPA's forward and backward TFLOP/s at each measured key length, the
  rows with at least ``MIN_HEADS`` heads (fewer leave SMs idle, which v2 does not model for any
  kernel), backward from forward + backward by v2's convention (backward 2.5x the forward FLOPs:
  ``3.5 / total = 1 / fwd + 2.5 / bwd``), rounded to whole TFLOP/s;

and then each engine step of the record replanned with the constants now in the code, beside what it
measured: measured / planned then (the record's) and now. tests/test_gpu_fit.py checks the code's
constants equal this fit of the committed record, so a constant cannot drift from its source.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
DEFAULT = ROOT / "benchmarks" / "results" / "gpu_check.json"
MIN_HEADS = 8  # SDPA rows with fewer heads are left out of the fit (module docstring)


def gemm_fit(record: dict, fp8: bool = False) -> float | None:
    """Median measured / unfitted v2 rate over the record's GEMM passes (3 decimals): bf16's
    ``gemms``, or with ``fp8`` its ``fp8_gemms`` against the FP8 price (None: the record has none)."""
    from llmtrain.plan import gemmtime
    from llmtrain.recipe.gpus import GPUS

    rates = record["steps"]["kernel_rates"]["result"]
    passes = rates.get("fp8_gemms" if fp8 else "gemms") or []
    if not passes:
        return None
    gpu = GPUS[rates["gpu"]]
    fits = gemmtime.GEMM_FIT_FP8 if fp8 else gemmtime.GEMM_FIT
    saved = dict(fits)
    fits.clear()  # v2's price without the fit this computes
    try:
        ratios = []
        for g in passes:
            fwd, bwd = gemmtime.gemm_fwd_bwd(g["m"], g["n"], g["k"], gpu, peak=gpu.peak_flops_fp8 if fp8 else None)
            flops = 2.0 * g["m"] * g["n"] * g["k"]
            ratios += [g["fwd_tflops"] * 1e12 * fwd / flops, g["bwd_tflops"] * 1e12 * bwd / (2 * flops)]
    finally:
        fits.update(saved)
    return round(statistics.median(ratios), 3)


def sdpa_fit(record: dict) -> tuple[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], int]]:
    """(family, (lengths, forward TFLOP/s, backward TFLOP/s, peak TFLOP/s)) from the SDPA rows."""
    from llmtrain.plan.attentiontime import ATTENTION_FAMILY
    from llmtrain.recipe.gpus import GPUS

    rates = record["steps"]["kernel_rates"]["result"]
    rows = sorted((r for r in rates["attention"] if r["heads"] >= MIN_HEADS), key=lambda r: r["seq"])
    fwd = tuple(round(r["fwd_tflops"]) for r in rows)
    bwd = tuple(round(2.5 / (3.5 / r["fwd_bwd_tflops"] - 1.0 / r["fwd_tflops"])) for r in rows)
    peak = round(GPUS[rates["gpu"]].peak_flops_bf16 / 1e12)
    return ATTENTION_FAMILY[GPUS[rates["gpu"]].rates_key], (tuple(r["seq"] for r in rows), fwd, bwd, peak)


def engine_rows(record: dict) -> list[dict]:
    """The record's engine steps (those with a plan), replanned with the code's constants."""
    import torch

    from benchmarks.gpu_check_steps import planned, recipe
    from benchmarks.gpu_check_steps.speed import DENSE, MOE

    gpu = record["steps"]["kernel_rates"]["result"]["gpu"]
    ctx = SimpleNamespace(device=torch.device("cuda"), gpu_key=gpu)
    out = []
    for name, s in record["steps"].items():
        res = s.get("result") or {}
        if s.get("status") != "ok" or "planned_step_s" not in res or name.startswith("hf_"):
            continue
        model = MOE if name.startswith("moe") else DENSE
        r = recipe(ctx, model, precision=res.get("precision", "bf16"), seq=res.get("seq", 2048),
                   micro=res.get("micro_batch", 4), steps=1, compile_=res.get("compile") is True,
                   ac=res.get("activation_checkpointing", "none"))
        now = planned(r)["planned_step_s"]
        out.append({"config": name, "measured_s": res["step_s"], "planned_then_s": res["planned_step_s"],
                    "planned_now_s": now, "then": res["step_s"] / res["planned_step_s"], "now": res["step_s"] / now})
    return out


def main(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("record", nargs="?", type=Path, default=DEFAULT)
    parser.add_argument("--out", type=Path, help="also write OUT/gpu_fit.json")
    parser.add_argument("--tiny", action="store_true", help="accepted for the smoke test; the fit is the same")
    args = parser.parse_args(argv)
    path = args.record.resolve()
    record = json.loads(path.read_text())
    if record.get("steps", {}).get("kernel_rates", {}).get("status") != "ok":
        print(f"{path}: no kernel_rates result to fit", file=sys.stderr)
        return 1
    from llmtrain.plan.attentiontime import SDPA_MEASURED
    from llmtrain.plan.gemmtime import GEMM_FIT, GEMM_FIT_FP8

    gpu = record["steps"]["kernel_rates"]["result"]["gpu"]
    fit, fit_fp8 = gemm_fit(record), gemm_fit(record, fp8=True)
    family, sdpa = sdpa_fit(record)
    print(f"record: {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path} ({record.get('device')}, "
          f"torch {record.get('torch')})")
    print(f"GEMM_FIT[{gpu!r}] = {fit}   (code: {GEMM_FIT.get(gpu)})")
    print(f"GEMM_FIT_FP8[{gpu!r}] = {fit_fp8 if fit_fp8 is not None else '(no FP8 GEMMs in the record)'}   "
          f"(code: {GEMM_FIT_FP8.get(gpu)})")
    print(f"SDPA_MEASURED[{family!r}] = {sdpa}   (code: {SDPA_MEASURED.get(family)})")
    print()
    rows = engine_rows(record)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "gpu_fit.json").write_text(json.dumps({
            "name": "gpu_fit", "tiny": args.tiny, "record": str(path),
            "results": {"gpu": gpu, "gemm_fit": fit, "gemm_fit_fp8": fit_fp8, "sdpa": {family: sdpa},
                        "engine_rows": rows}}, indent=2) + "\n")
    print("| engine step | measured s | planned s (record) | planned s (now) | measured / planned (record) | (now) |")
    print("|---|---:|---:|---:|---:|---:|")
    for row in rows:
        print(f"| {row['config']} | {row['measured_s']:.4f} | {row['planned_then_s']:.4f} | {row['planned_now_s']:.4f} "
              f"| {row['then']:.2f} | {row['now']:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
