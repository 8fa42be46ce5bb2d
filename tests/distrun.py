"""Helpers to run a multi-rank job with torchrun's elastic agent and collect rank 0's results.

The job is tests/dist_launch.py: ``elastic_launch`` (what ``torch.distributed.run`` calls) with
the ranks forked from one single-threaded forkserver that imported torch and the engine (see its
docstring: the imports were half of a 16-rank job); tests/dist_worker.py runs the same under plain ``torchrun``."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "tests" / "dist_worker.py"
LAUNCH = ROOT / "tests" / "dist_launch.py"
GLOG_PREFIX = re.compile(r"^[EWI]\d{4} [\d:.]+ \d+ \S+:\d+\] ")  # "E1203 16:05:12.093000 11179 .../api.py:836] "


def run_cases(tmp: Path, nproc: int, recipe: str, cases: list[dict], steps: int, common: list[str] | None = None,
              timeout: int = 600) -> dict:
    """Run every case of ``cases`` in ONE torchrun job of ``nproc`` ranks; return rank 0's results."""
    out = tmp / f"results-{nproc}.pt"
    spec = tmp / f"spec-{nproc}.json"
    spec.write_text(json.dumps({"recipe": str(ROOT / recipe), "cases": cases, "steps": steps,
                                "set": common or [], "out": str(out)}))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LLMTRAIN_TENSORBOARD": "0", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, str(LAUNCH), str(nproc), str(WORKER), str(spec)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    if proc.returncode != 0:
        raise AssertionError(f"torchrun failed ({proc.returncode}):\n{error_lines(proc.stdout + proc.stderr)}\n"
                             f"{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    ours = own_warnings(proc.stdout + proc.stderr)
    if ours:
        raise AssertionError("the engine's own code warned (a deprecated torch API: every rank prints it to the "
                             "user):\n" + "\n".join(ours))
    return torch.load(out, weights_only=False)


OWN_WARNING = re.compile(r"/llmtrain/[\w/]+\.py:\d+: \w*Warning: ")  # ".../llmtrain/engine/x.py:12: FutureWarning: ..."


def own_warnings(text: str) -> list[str]:
    """Python warnings raised at a line of llmtrain's own source (torch's deprecations of the
    functional collectives were: one line per rank and call site), distinct, in order."""
    found = (OWN_WARNING.search(line) for line in text.splitlines())
    return list(dict.fromkeys(m.string[m.start():].strip()[:300] for m in found if m))  # rank prefixes dropped


def error_lines(text: str, most: int = 20) -> str:
    """Every distinct exception line of a failed job, in order of first appearance. The tail
    alone shows the first rank the agent saw fail; a peer's own error (the cause of a gloo
    "Connection closed by peer" on the rank that failed first) is earlier in the output."""
    seen: dict[str, None] = {}
    for line in text.splitlines():
        msg = GLOG_PREFIX.sub("", line).strip()  # the agent logs each rank's traceback line behind one
        if msg and ("Error:" in msg or "Exception:" in msg) and not msg.startswith("raise "):
            seen.setdefault(msg[:500])
    lines = list(seen)
    return "distinct errors:\n" + "\n".join(lines[:most]) + (f"\n(+{len(lines) - most} more)" if len(lines) > most else "")


def compare_to_reference(case: str, got: dict, ref: dict, steps: int, loss_tol: float, weight_tol: float
                         ) -> tuple[float, float]:
    """Assert one ``run_cases`` result equals its 1-process reference: ``steps`` losses within
    ``loss_tol`` that fall over the run, the same weight names, every weight within ``weight_tol``.
    Returns (worst loss difference, worst weight difference)."""
    assert len(got["losses"]) == steps
    loss_diff = max(abs(a - b) for a, b in zip(got["losses"], ref["losses"]))
    assert loss_diff <= loss_tol, f"{case}: losses {got['losses']} vs {ref['losses']}"
    assert got["losses"][-1] < got["losses"][0] - 0.05, f"{case}: the loss must fall over {steps} steps"
    assert set(got["state"]) == set(ref["state"])
    worst = max((got["state"][k] - ref["state"][k]).abs().max().item() for k in ref["state"])
    assert worst <= weight_tol, f"{case}: max weight diff {worst}"
    return loss_diff, worst
