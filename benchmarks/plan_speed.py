"""How fast ``llmtrain plan`` answers: cold subprocess wall time and in-process planning time.

    python benchmarks/plan_speed.py            # 405b on 2,048 nodes x 8 GPUs (16,384 ranks), 9 repetitions
    python benchmarks/plan_speed.py --tiny     # recipes/debug.yaml, 1 repetition (CI smoke test)

What is measured (docs/planning-speed.md explains the goal, < 0.5 s cold):

* **cold** — the wall time (``time.perf_counter`` around ``subprocess.run``) of a fresh
  ``llmtrain`` process, output to /dev/null, for: ``python -c pass`` (the interpreter alone, the
  floor), ``llmtrain plan recipes/llama3-405b.yaml --nodes 2048 --gpus-per-node 8`` and the same
  with ``--search`` (default ``--top 5``). "Cold" = a new interpreter each time; the ``.pyc``
  files already exist, as on any machine after the first run: the children run without
  ``PYTHONDONTWRITEBYTECODE`` (some sandboxes set it, and then an editable install compiles
  llmtrain's modules from source on every run, ~0.1 s more), and one warm-up round writes them
  and is discarded. The commands are run
  round-robin (common.interleaved), so load from other users of the machine hits them alike;
  median and minimum are reported (the minimum is the best estimate of an idle machine), plus
  the child's CPU time (``getrusage(RUSAGE_CHILDREN)``).
* **in-process** — inside this process, after a warm-up call (imports done): ``make_plan`` +
  ``plan_to_dict`` (what ``plan`` computes before printing), and ``search(..., top=5)`` (what
  ``plan --search`` computes), each timed with ``time.perf_counter``.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import common  # noqa: E402

ROOT = common.ROOT


def cli() -> list[str]:
    script = Path(sys.executable).parent / "llmtrain"
    return [str(script)] if script.is_file() else [sys.executable, "-c", "from llmtrain.cli.app import main; main()"]


def timed_run(cmd: list[str], cpu: list[float]):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}

    def fn() -> float:
        r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        done = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        wall = time.perf_counter() - t0
        r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        if done.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} exited {done.returncode}: {done.stderr[-2000:]}")
        cpu.append(r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime)
        return wall
    return fn


def in_process(recipe: str, nodes: int | None, gpn: int | None, reps: int) -> dict[str, list[float]]:
    from llmtrain.plan.api import make_plan
    from llmtrain.plan.report import plan_to_dict
    from llmtrain.plan.search import search

    def plan() -> None:
        plan_to_dict(make_plan(ROOT / recipe, None, nodes, gpn, []))

    def searched() -> None:
        result = make_plan(ROOT / recipe, None, nodes, gpn, [])
        search(result.recipe, result.placement, top=5)

    return common.interleaved({"plan (in-process)": plan, "plan --search (in-process)": searched}, reps, warmup=1)


def main() -> None:
    args = common.parser(__doc__.split("\n\n")[0]).parse_args()
    if args.tiny:
        recipe, nodes, gpn, reps = "recipes/debug.yaml", None, None, 1
    else:
        recipe, nodes, gpn, reps = "recipes/llama3-405b.yaml", 2048, 8, 9
    size = ["--nodes", str(nodes), "--gpus-per-node", str(gpn)] if nodes else []
    plan_cmd = [*cli(), "plan", recipe, *size]
    commands = {"python -c pass": [sys.executable, "-c", "pass"],
                f"llmtrain plan {recipe} {' '.join(size)}".strip(): plan_cmd,
                f"llmtrain plan {recipe} {' '.join(size)} --search".replace("  ", " "): [*plan_cmd, "--search"]}
    cpus: dict[str, list[float]] = {k: [] for k in commands}
    walls = common.interleaved({k: timed_run(cmd, cpus[k]) for k, cmd in commands.items()}, reps, warmup=1)
    rows = []
    for name, ts in walls.items():
        cpu = cpus[name][-len(ts):]  # drop the warm-up round's
        rows.append({"what": f"`{name}`", "kind": "cold subprocess", "median_s": common.median(ts), "min_s": min(ts),
                     "cpu_median_s": common.median(cpu), "n": len(ts), "times_s": ts})
    for name, ts in in_process(recipe, nodes, gpn, reps).items():
        rows.append({"what": name, "kind": "in-process", "median_s": common.median(ts), "min_s": min(ts),
                     "cpu_median_s": None, "n": len(ts), "times_s": ts})
    table = common.md_table(rows, [("what", "command"), ("kind", "kind"), ("median_s", "median s"), ("min_s", "min s"),
                                   ("cpu_median_s", "CPU median s"), ("n", "runs")])
    world = nodes * gpn if nodes else None
    notes = (f"Cold = a fresh process per run (wall clock of `subprocess.run`, output discarded), the three commands "
             f"interleaved; in-process = `make_plan` + `plan_to_dict` and `search(top=5)` after a warm-up call. "
             f"{world:,} ranks. The difference between the cold plan and the in-process plan is interpreter start-up "
             f"and imports (docs/planning-speed.md breaks it down). On this shared 2-core VM the minimum is the best "
             f"estimate of an idle machine." if world else "")
    common.publish(args, "plan_speed", "Planning speed: `llmtrain plan` cold and in-process",
                   {"recipe": recipe, "nodes": nodes, "gpus_per_node": gpn, "reps": reps, "rows": rows,
                    "omp_num_threads": os.environ.get("OMP_NUM_THREADS")}, table, notes)


if __name__ == "__main__":
    main()
