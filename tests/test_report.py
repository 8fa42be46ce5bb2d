"""``llmtrain report RUN_DIR``: PNG curves and a terminal summary from metrics.jsonl."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from llmtrain.analysis.report import load_metrics, report, summarize
from llmtrain.errors import LLMTrainError

CLI = [sys.executable, "-c", "from llmtrain.cli.app import main; main()"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def write_metrics(run: Path, steps: int = 30, junk: bool = True) -> None:
    run.mkdir(parents=True)
    with open(run / "metrics.jsonl", "w") as fp:
        for step in range(1, steps + 1):
            row = {"step": step, "loss": 5.0 - 0.1 * step + (0.5 if step == 7 else 0.0), "lr": 1e-3 * min(1, step / 5),
                   "grad_norm": 1.0, "tokens_per_s": 100.0 if step == 1 else 1000.0 + step, "tflops_per_gpu": 1.0,
                   "mfu": 0.25, "memory_gib": 1.0, "elapsed_s": step * 0.1}
            fp.write(json.dumps(row) + "\n")
        if junk:
            fp.write('{"step": 31, "loss": 1.')  # a run killed mid-write


def test_report_summary_values(tmp_path):
    run = tmp_path / "runs" / "debug" / "20260101-000000-abcd"
    write_metrics(run)
    metrics = load_metrics(run)
    summary = summarize(metrics)
    assert (summary.steps, summary.first_step, summary.last_step, summary.skipped_lines) == (30, 1, 30, 1)
    assert summary.first_loss == pytest.approx(4.9) and summary.last_loss == pytest.approx(2.0)
    assert summary.min_loss == pytest.approx(2.0) and summary.min_loss_step == 30
    assert summary.mean_tokens_per_s == pytest.approx(sum(1000.0 + s for s in range(2, 31)) / 29)  # step 1 left out
    assert summary.mean_mfu == pytest.approx(0.25)


def test_report_cli_writes_png_and_prints_summary(tmp_path):
    run = tmp_path / "runs" / "debug" / "20260101-000000-abcd"
    write_metrics(run)
    result = subprocess.run([*CLI, "report", str(run)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    png = (run / "report.png").read_bytes()
    assert png.startswith(PNG_MAGIC) and len(png) > 1000
    out = result.stdout
    assert "steps logged  30 (step 1 .. 30)" in out
    assert "first 4.9000, last 2.0000, min 2.0000 at step 30" in out
    assert "mean 1,016 (first step excluded)" in out
    assert "MFU           mean 25.00%" in out
    assert "skipped       1 unreadable line(s)" in out
    assert f"curves        {run / 'report.png'}" in out


def test_report_to_other_file_with_few_rows(tmp_path):
    run = tmp_path / "r"
    write_metrics(run, steps=2, junk=False)
    summary, png = report(run, tmp_path / "x.png")
    assert png == tmp_path / "x.png" and png.read_bytes().startswith(PNG_MAGIC)
    assert summary.mean_tokens_per_s == pytest.approx((100.0 + 1002.0) / 2)  # too few rows to drop the first


def test_report_errors_are_one_line(tmp_path):
    missing = subprocess.run([*CLI, "report", str(tmp_path / "nope")], capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2
    assert missing.stderr.strip().splitlines() == [f"error: run directory not found: {tmp_path / 'nope'}; "
                                                   "pass a directory like runs/<name>/<run id>"]
    (tmp_path / "empty").mkdir()
    with pytest.raises(LLMTrainError, match="no metrics.jsonl in"):
        load_metrics(tmp_path / "empty")
    (tmp_path / "empty" / "metrics.jsonl").write_text("\n[1]\nnot json\n")
    with pytest.raises(LLMTrainError, match=r"holds no metrics \(2 unreadable lines\)"):
        load_metrics(tmp_path / "empty")
