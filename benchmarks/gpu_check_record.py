"""The GPU check's record (benchmarks/gpu_check.py): written atomically after every step, its
``speed`` summary, and ``--publish``: one or more records brought back from the device (a first
run, then ``--steps`` reruns of what its budget left out) merged into
benchmarks/results/gpu_check.json and the results section of docs/benchmarks.md. No torch here:
publishing runs on any machine."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "gpu_check.json"


def write_json(path: Path, record: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(record, indent=2, default=str) + "\n")
    os.replace(tmp, path)  # atomic: a reader (or a kill) never sees half a file


def read_json(path: Path) -> dict:
    return json.loads(path.read_text())


def summarize(record: dict) -> None:
    """The ``speed`` table from the step results, with vs_hf against the HF rows that ran."""
    steps = record["steps"]
    hf = {n: s["result"]["tokens_per_s"] for n, s in steps.items()
          if n.startswith("hf_llama") and s.get("status") == "ok"}
    keys = ("tokens_per_s", "mfu", "peak_mem_gib", "planned_step_s", "planned_peak_gib", "step_s_vs_plan", "peak_vs_plan")
    rows = []
    for name, s in steps.items():
        res = s.get("result") or {}
        if s.get("status") != "ok" or "tokens_per_s" not in res:
            continue
        row = {"config": name, **{k: res.get(k) for k in keys}}
        if name.startswith("dense") and res.get("precision", "bf16") == "bf16":
            row["vs_hf"] = res["tokens_per_s"] / hf["hf_llama_eager"] if "hf_llama_eager" in hf else None
            if "hf_llama_compiled" in hf:
                row["vs_hf_compiled"] = res["tokens_per_s"] / hf["hf_llama_compiled"]
        rows.append(row)
    record["speed"] = rows
    record["measured"] = record.get("device_type") == "cuda" and any(not r["config"].startswith("hf") for r in rows)


def results_md(record: dict) -> str:
    """docs/benchmarks.md's results section of one (measured) record."""
    import common

    cmds = " then ".join(f"`{c}`" for c in record.get("commands", [record["command"]]))  # a merged rerun: both
    head = (f"## GPU check results\n\n{cmds} — {record['date']}; {record.get('device')}, driver "
            f"{record.get('driver')}, CUDA {record.get('cuda')}, torch {record.get('torch')}, python "
            f"{record.get('python')}; measured: {str(record.get('measured')).lower()}; wall {record.get('wall_s')} s "
            f"of a {record.get('budget_s'):.0f} s budget. Raw numbers: benchmarks/results/gpu_check.json.\n")
    cols = [("config", "config"), ("tokens_per_s", "tokens/s"), ("mfu", "MFU"), ("peak_mem_gib", "peak GiB"),
            ("planned_step_s", "planned s/step"), ("step_s_vs_plan", "measured/planned time"),
            ("planned_peak_gib", "planned peak GiB"), ("peak_vs_plan", "measured/planned memory"), ("vs_hf", "vs HF")]
    steps = [{"step": n, "status": s["status"], "seconds": s.get("seconds"),
              "note": (s.get("error") or s.get("reason") or "")[:160].replace("|", "/").replace("\n", " ")}
             for n, s in record["steps"].items()]
    return "\n".join([head, common.md_table(record["speed"], cols), common.md_table(steps)])


def merge(records: list[tuple[Path, dict]]) -> dict:
    """One record of a first run and its reruns (``--steps``), in the order given: a later
    record's step replaces the earlier one where it ran (ok or error), so a skipped step never
    hides a measurement. Raises ValueError naming the file that does not belong."""
    (first_src, merged), *rest = records
    merged = json.loads(json.dumps(merged))
    merged["commands"] = [merged["command"]]
    for src, rec in rest:
        if rec.get("device") != merged.get("device") or rec.get("torch") != merged.get("torch"):
            raise ValueError(f"{src}: device {rec.get('device')!r} / torch {rec.get('torch')!r} differ from "
                             f"{first_src}'s {merged.get('device')!r} / {merged.get('torch')!r}; merge runs of one machine")
        for name, st in rec["steps"].items():
            if st.get("status") in ("ok", "error") or name not in merged["steps"]:
                merged["steps"][name] = st
        merged["commands"].append(rec["command"])
        merged["wall_s"] = round((merged.get("wall_s") or 0) + (rec.get("wall_s") or 0), 1)
        merged["budget_s"] = (merged.get("budget_s") or 0) + (rec.get("budget_s") or 0)
    summarize(merged)
    return merged


def publish(srcs: list[Path]) -> int:
    """``--publish JSON [JSON ...]``: the record(s) brought back from the device (a first run, then
    any ``--steps`` reruns, merged by :func:`merge`) become benchmarks/results/gpu_check.json and
    the results section of docs/benchmarks.md (no torch needed)."""
    import common

    records = []
    for src in srcs:
        if not src.is_file():
            print(f"error: --publish {src}: no such file; give the gpu_check.json the device run wrote", file=sys.stderr)
            return 2
        rec = read_json(src)
        if rec.get("tiny"):
            print(f"error: --publish {src}: a --tiny record is a smoke run, not results; publish the device's run",
                  file=sys.stderr)
            return 2
        records.append((src, rec))
    try:
        record = merge(records)
    except ValueError as exc:
        print(f"error: --publish {exc}", file=sys.stderr)
        return 2
    write_json(DEFAULT_OUT, record)
    common.write_section("gpu_check", results_md(record))
    print(f"wrote {os.path.relpath(DEFAULT_OUT, ROOT)} and the gpu_check section of docs/benchmarks.md "
          f"(measured: {record.get('measured')})")
    return 0


