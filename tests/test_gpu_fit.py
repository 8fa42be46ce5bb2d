"""Time model v2's constants fitted from this project's GPU record equal the fit of the committed
record (benchmarks/gpu_fit.py, issue 18 item 6: constants only from documented sources): a change
to the record, the fit or the constant that leaves the other behind fails here."""

from __future__ import annotations

import json
import sys

import pytest

from tests.helpers_plan import REPO

sys.path.insert(0, str(REPO))
from benchmarks import gpu_fit  # noqa: E402
from llmtrain.plan.attentiontime import SDPA_MEASURED  # noqa: E402
from llmtrain.plan.gemmtime import GEMM_FIT, GEMM_FIT_FP8, MAMF  # noqa: E402

RECORD = json.loads(gpu_fit.DEFAULT.read_text())


def test_gemm_fit_is_the_records_median():
    """GEMM_FIT of the record's GPU (and of H100 PCIe and H200, which take H100 SXM's MAMF) is the
    median measured / unfitted-price ratio over its 28 GEMM passes; the fit itself leaves the
    constants as they were."""
    before = dict(GEMM_FIT)
    fit = gpu_fit.gemm_fit(RECORD)
    assert GEMM_FIT == before
    gpu = RECORD["steps"]["kernel_rates"]["result"]["gpu"]
    assert gpu == "h100-sxm" and len(RECORD["steps"]["kernel_rates"]["result"]["gemms"]) == 14
    assert GEMM_FIT[gpu] == fit
    assert all(GEMM_FIT[k] == fit for k in GEMM_FIT if MAMF[k] == MAMF[gpu])
    assert 0.8 < fit < 0.95  # "about an eighth less" than the burst figure, as docs/planner.md 9.2 says


def test_fp8_fit_only_from_a_record_that_timed_fp8():
    """GEMM_FIT_FP8 holds exactly the record's FP8 fit: empty while the committed record has no FP8
    GEMMs (the first GPU check did not time them); a record with them fits them like the bf16 ones."""
    fit = gpu_fit.gemm_fit(RECORD, fp8=True)
    gpu = RECORD["steps"]["kernel_rates"]["result"]["gpu"]
    assert GEMM_FIT_FP8 == ({} if fit is None else {gpu: fit})
    with_fp8 = json.loads(json.dumps(RECORD))
    rates = with_fp8["steps"]["kernel_rates"]["result"]
    from llmtrain.plan.gemmtime import gemm_fwd_bwd
    from llmtrain.recipe.gpus import GPUS

    h100 = GPUS[gpu]
    rates["fp8_gemms"] = []
    for g in rates["gemms"][:4]:  # each at 0.9 of the unfitted FP8 price
        fwd, bwd = gemm_fwd_bwd(g["m"], g["n"], g["k"], h100, peak=h100.peak_flops_fp8)
        flops = 2.0 * g["m"] * g["n"] * g["k"]
        rates["fp8_gemms"].append({**g, "fwd_tflops": 0.9 * flops / fwd / 1e12, "bwd_tflops": 0.9 * 2 * flops / bwd / 1e12})
    # the fit prices against the unfitted FP8 rate whatever GEMM_FIT_FP8 holds (it clears it meanwhile)
    assert gpu_fit.gemm_fit(with_fp8, fp8=True) == pytest.approx(0.9, abs=1e-3)


def test_gemm_fit_moves_with_the_record():
    """The fit reads the record: halving every measured rate halves it (not a constant in disguise)."""
    slow = json.loads(json.dumps(RECORD))
    for g in slow["steps"]["kernel_rates"]["result"]["gemms"]:
        g["fwd_tflops"] /= 2
        g["bwd_tflops"] /= 2
    assert gpu_fit.gemm_fit(slow) == pytest.approx(gpu_fit.gemm_fit(RECORD) / 2, abs=1e-3)


def test_sdpa_rates_are_the_records():
    """SDPA_MEASURED is the record's causal SDPA rows with >= 8 heads: forward as measured, backward
    from forward + backward by v2's 1 : 2.5 FLOP convention."""
    family, fitted = gpu_fit.sdpa_fit(RECORD)
    assert SDPA_MEASURED[family] == fitted
    lengths, fwd, bwd, _ = fitted
    assert lengths == (2048, 8192, 32768)
    rows = {r["seq"]: r for r in RECORD["steps"]["kernel_rates"]["result"]["attention"] if r["heads"] >= 8}
    for s, f, b in zip(lengths, fwd, bwd, strict=True):
        total = 3.5 / rows[s]["fwd_bwd_tflops"]
        # 5e-3: the constants are the measured rates rounded to whole TFLOP/s (<= 0.13 % each at >= 395)
        assert 1 / f + 2.5 / b == pytest.approx(total, rel=5e-3)


def test_engine_rows_replanned_with_the_fit():
    """The record's engine steps replan with the code's constants; the record's own plan is kept
    beside them (the script's table in docs/planner.md 9.2)."""
    rows = {r["config"]: r for r in gpu_fit.engine_rows(RECORD)}
    assert {"dense_compiled", "dense_eager", "moe_eager", "fp8_dense_compiled"} <= set(rows)
    for r in rows.values():
        assert r["planned_now_s"] > 0 and r["now"] == pytest.approx(r["measured_s"] / r["planned_now_s"])
