"""Shared plumbing of the benchmarks: arguments, machine facts, JSON results and the results page.

Every benchmark is one command (``python benchmarks/NAME.py``) and ends in :func:`publish`,
which writes ``benchmarks/results/NAME.json`` (the numbers, the machine, the versions, the exact
command) and replaces the section of ``docs/benchmarks.md`` between the markers
``<!-- bench:NAME:start -->`` / ``<!-- bench:NAME:end -->`` with a Markdown table. ``--tiny``
runs the same code at a toy size (the CI smoke test, tests/test_benchmarks.py) and writes to a
scratch directory only, never to docs/.

Ratios are measured inside one run with interleaved repetitions (:func:`interleaved`), and
reported as medians, never compared across machines.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "benchmarks.md"
RESULTS = ROOT / "benchmarks" / "results"
DOC_HEAD = """# Benchmarks

Every table below was written by the script named in its section, one command each
(`python benchmarks/NAME.py`); the raw numbers, the machine and the versions are in
`benchmarks/results/NAME.json`. Ratios are measured inside one run with interleaved
repetitions and medians. `python benchmarks/NAME.py --tiny` runs the same code at a toy size
(the CI smoke test, tests/test_benchmarks.py) and writes nothing here.
"""


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--tiny", action="store_true", help="toy size for the CI smoke test; writes only to --out")
    p.add_argument("--out", type=Path, default=None, help="directory of the JSON result (default benchmarks/results)")
    p.add_argument("--no-doc", action="store_true", help="do not update docs/benchmarks.md")
    return p


def machine() -> dict:
    """What the numbers were measured on."""
    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_gib = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                mem_gib = round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    gpu = None
    try:
        import torch

        if torch.cuda.is_available():
            gpu = torch.cuda.get_device_name(0)
    except Exception:  # noqa: BLE001 - machine facts are best effort
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_gib": mem_gib, "gpu": gpu,
            "os": f"{platform.system()} {platform.release()}", "loadavg_at_end": [round(x, 2) for x in os.getloadavg()]}


def versions(*extra: str) -> dict:
    out = {"python": platform.python_version()}
    for dist in ("torch", "llmtrain", *extra):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    try:
        out["git"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                    text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        out["git"] = None
    return out


def command_line() -> str:
    script = Path(sys.argv[0]).resolve()
    try:
        script = script.relative_to(ROOT)
    except ValueError:
        pass
    return shlex.join(["python", str(script), *sys.argv[1:]])


def interleaved(fns: dict[str, Callable[[], float | None]], reps: int, warmup: int = 1) -> dict[str, list[float]]:
    """Run ``fns`` round-robin ``reps`` times (after ``warmup`` rounds) and return each one's
    timings. A function may return its own measured seconds; otherwise its wall time is used."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for i in range(warmup + reps):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            got = fn()
            dt = got if isinstance(got, (int, float)) else time.perf_counter() - t0
            if i >= warmup:
                times[name].append(float(dt))
    return times


def median(xs: list[float]) -> float:
    return float(statistics.median(xs))


def md_table(rows: list[dict], columns: list[tuple[str, str]] | None = None) -> str:
    """A Markdown table; ``columns`` = [(key, header)], default every key of the first row."""
    if not rows:
        return "(no rows)\n"
    columns = columns or [(k, k) for k in rows[0]]
    fmt = lambda v: f"{v:,.4g}" if isinstance(v, float) else ("" if v is None else str(v))  # noqa: E731
    lines = ["| " + " | ".join(h for _, h in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(r.get(k)) for k, _ in columns) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def publish(args, name: str, title: str, results: dict, table_md: str, notes: str = "",
            extra_versions: tuple[str, ...] = ()) -> Path:
    """Write the JSON result and (unless --tiny / --no-doc) the section of docs/benchmarks.md."""
    record = {"name": name, "title": title, "command": command_line(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "tiny": bool(args.tiny), "machine": machine(), "versions": versions(*extra_versions), "results": results}
    out_dir = args.out or (RESULTS if not args.tiny else Path(os.environ.get("TMPDIR", "/tmp")) / "llmtrain-bench")
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps(record, indent=2, default=str) + "\n")
    print(table_md)
    print(f"wrote {path}")
    if not args.tiny and not args.no_doc:
        write_section(name, section_md(record, title, table_md, notes))
        print(f"updated {DOC.relative_to(ROOT)} section {name}")
    return path


def section_md(record: dict, title: str, table_md: str, notes: str) -> str:
    m, v = record["machine"], record["versions"]
    ver = ", ".join(f"{k} {val}" for k, val in v.items() if val)
    mach = f"{m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB" + (f", {m['gpu']}" if m.get("gpu") else "")
    body = [f"## {title}", "", f"`{record['command']}` — {record['date']}; {mach}; load average at the end "
            f"{m['loadavg_at_end'][0]}; {ver}.", "", table_md.rstrip(), ""]
    if notes:
        body += [notes.rstrip(), ""]
    return "\n".join(body)


def write_section(name: str, text: str) -> None:
    start, end = f"<!-- bench:{name}:start -->", f"<!-- bench:{name}:end -->"
    doc = DOC.read_text() if DOC.is_file() else DOC_HEAD
    block = f"{start}\n{text.rstrip()}\n{end}"
    if start in doc and end in doc:
        head, rest = doc.split(start, 1)
        _, tail = rest.split(end, 1)
        doc = head + block + tail
    else:
        doc = doc.rstrip() + "\n\n" + block + "\n"
    DOC.write_text(doc)
