"""Per-step metrics: rank 0 writes ``metrics.jsonl`` and TensorBoard events and prints progress
events (``@@llmtrain {json}`` lines) that the launcher turns into one progress bar.

MFU = model FLOPs per second per rank / the device's peak. On CUDA the peak comes from the GPU
catalog (bf16 dense) when the device name matches, else from a probe; on CPU it is measured by
a matmul probe at start (fp32 GEMM throughput of this process, with the threads it has), so
CPU MFU says how close the run is to what the matmul kernel does alone on this machine.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from pathlib import Path

import torch

from llmtrain.recipe.schema import bf16_compute

EVENT_PREFIX = "@@llmtrain "


def emit(event: str, **fields) -> None:
    """Print one progress event line (rank 0 only; callers check)."""
    sys.stdout.write(EVENT_PREFIX + json.dumps({"event": event, **fields}) + "\n")
    sys.stdout.flush()


def probe_peak_flops(device: torch.device, dtype: torch.dtype = torch.float32, n: int = 512, repeats: int = 5) -> float:
    """Measured matmul FLOP/s of this process on ``device`` (best of ``repeats``)."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    best = float("inf")
    for _ in range(repeats + 1):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        (a @ b).sum().item()
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


def peak_flops(device: torch.device, precision: str) -> float:
    if device.type == "cuda":
        from llmtrain.recipe.gpus import GPUS

        name = torch.cuda.get_device_name(device).lower()
        for key, spec in GPUS.items():
            if key.split("-")[0] in name:
                return spec.peak_flops_bf16 if bf16_compute(precision) else spec.peak_flops_bf16 / 2
        return probe_peak_flops(device, torch.bfloat16, 4096)
    return probe_peak_flops(device)


def memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


class MetricsWriter:
    """Rank 0's sink for step metrics (a no-op elsewhere).

    Rows are one JSON object per line: step rows (``step, loss, lr, ...``), guard events, and
    eval rows (``step, eval_loss, eval_perplexity, eval_tokens, eval_windows, eval_s``: keys
    prefixed ``eval_``, written after that step's own row; TensorBoard tags ``eval/<key>``)."""

    def __init__(self, run_dir: str | None, enabled: bool):
        self.enabled = enabled and run_dir is not None
        self.file = None
        self.tb = None
        if self.enabled:
            path = Path(run_dir)
            path.mkdir(parents=True, exist_ok=True)
            self.file = open(path / "metrics.jsonl", "a", buffering=1)
            if os.environ.get("LLMTRAIN_TENSORBOARD", "1") == "1":
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(path / "tb"))

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        self.file.write(json.dumps(record) + "\n")
        if self.tb is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):  # eval rows: eval/loss, eval/perplexity, ...
                    tag = f"eval/{key[5:]}" if key.startswith("eval_") else f"train/{key}"
                    self.tb.add_scalar(tag, value, record["step"])

    def close(self) -> None:
        if self.file:
            self.file.close()
        if self.tb:
            self.tb.close()
