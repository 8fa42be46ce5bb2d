"""Parallel overheads on CPU/gloo: one process against each parallel dimension at degree 2.

    python benchmarks/parallel_overheads.py            # full size, writes docs/benchmarks.md
    python benchmarks/parallel_overheads.py --tiny --out DIR
    python benchmarks/parallel_overheads.py --compare-overlap   # issue 16's before/after, own docs section

The same recipe and the SAME GLOBAL BATCH in every layout (recipes/debug.yaml, fp32; the MoE
layout uses recipes/debug-moe.yaml and its own 1-process reference): 1 process; DP 2 with
``zero 0`` (DDP-like gradient all-reduce); ZeRO-3 (FSDP2) over DP 2; TP 2 (with sequence
parallelism, the recipe default); PP 2 (1F1B, ``global batch / micro batch`` micro batches);
CP 2 (ring attention); EP 2 (MoE, ``dp_shard 2``, FSDP). All 2-rank layouts run in ONE torchrun
job (benchmarks/parallel_overheads_worker.py builds each layout in turn in the same process
group), the 1-process references in one plain process; ``OMP_NUM_THREADS=1`` everywhere.

Per layout: the median of rank 0's step times after warm-up (layouts stepped round-robin), and
profiled steps
(``torch.profiler``) split into compute, exposed communication, pipeline bubble and other (the
definitions are in the worker's docstring and in the notes written to docs/benchmarks.md). For
PP the measured bubble fraction (exposed ``gloo:recv`` wait / compute of the stage) is set
against the planner's ``bubble_fraction`` for the same recipe (``plan_recipe`` → validation →
:func:`llmtrain.plan.bubble.bubble_fraction`, i.e. ``(p - 1) / m`` for 1F1B).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import common  # noqa: E402

ROOT = common.ROOT
WORKER = ROOT / "benchmarks" / "parallel_overheads_worker.py"
DENSE, MOE = "recipes/debug.yaml", "recipes/debug-moe.yaml"
BASE = ["parallel.tp=1", "parallel.zero=0", "parallel.dp_shard=-1", "train.precision=fp32"]
BEFORE_OVERLAP = {"overlap": False}  # zero 0/1: the all-reduce after backward (the path before issue 16)
WITH_PREFETCH = {"prefetch": True}  # FSDP2 with explicit prefetch (measured, not adopted: data_parallel.py)
LAYOUTS = [  # (name, recipe, overrides, world[, variant]) — variant: the worker's Harness switches
    ("1 process", DENSE, [], 1),
    ("dp 2 (zero 0, all-reduce)", DENSE, [], 2),
    ("dp 2 (zero 0), before: all-reduce after backward", DENSE, [], 2, BEFORE_OVERLAP),
    ("zero 1 dp 2", DENSE, ["parallel.zero=1"], 2),
    ("zero 1 dp 2, before: all-reduce after backward", DENSE, ["parallel.zero=1"], 2, BEFORE_OVERLAP),
    ("dp 2 (zero 0), bf16 reduction", DENSE, ["parallel.reduce_dtype=bf16"], 2),
    ("zero 3 (FSDP2) dp 2", DENSE, ["parallel.zero=3"], 2),
    ("zero 3 (FSDP2) dp 2, explicit prefetch (not adopted)", DENSE, ["parallel.zero=3"], 2, WITH_PREFETCH),
    ("tp 2 (+SP)", DENSE, ["parallel.tp=2"], 2),
    ("pp 2 (1f1b)", DENSE, ["parallel.pp=2", "parallel.pp_schedule=1f1b"], 2),
    ("cp 2 (ring)", DENSE, ["parallel.cp=2", "parallel.cp_method=ring"], 2),
    ("MoE 1 process", MOE, ["parallel.zero=3"], 1),
    ("MoE ep 2 (dp_shard 2, zero 3)", MOE, ["parallel.zero=3", "parallel.ep=2"], 2),
]
PP_DP = ["parallel.pp=2", "parallel.pp_schedule=interleaved-1f1b", "parallel.pp_virtual_stages=2"]
COMPARE = [  # --compare-overlap: (name, recipe, overrides, world, variant), each pair stepped round-robin
    ("dp 2 (zero 0), overlapped", DENSE, [], 2, {}),
    ("dp 2 (zero 0), before", DENSE, [], 2, BEFORE_OVERLAP),
    ("zero 1 dp 2, overlapped", DENSE, ["parallel.zero=1"], 2, {}),
    ("zero 1 dp 2, before", DENSE, ["parallel.zero=1"], 2, BEFORE_OVERLAP),
    ("pp 2 interleaved x dp 2, overlapped", DENSE, PP_DP, 4, {}),
    ("pp 2 interleaved x dp 2, before", DENSE, PP_DP, 4, BEFORE_OVERLAP),
]
COMPARE_STEPS = dict(warmup=2, steps=11, profiled_steps=7)
FULL = dict(size=["train.seq_len=256", "train.micro_batch_size=4", "train.global_batch_size=16"], warmup=2, steps=7, profiled_steps=3)
TINY = dict(size=["train.seq_len=32", "train.micro_batch_size=2", "train.global_batch_size=8"], warmup=0, steps=1, profiled_steps=1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_worker(tmp: Path, world: int, cases: list[dict], cfg: dict) -> dict:
    out = tmp / f"out-{world}.json"
    spec = tmp / f"spec-{world}.json"
    spec.write_text(json.dumps({"cases": cases, "set": cfg["size"], "warmup": cfg["warmup"], "steps": cfg["steps"],
                                "profiled_steps": cfg["profiled_steps"], "out": str(out)}))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LLMTRAIN_TENSORBOARD": "0", "PYTHONPATH": str(ROOT)}
    if world == 1:  # one plain process: no torchrun agent to start
        env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(free_port()))
        cmd = [sys.executable, str(WORKER), str(spec)]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
               str(WORKER), str(spec)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=ROOT)
    if proc.returncode != 0:
        sys.exit(f"worker failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return json.loads(out.read_text())


def planned_bubble(recipe_path: str, overrides: list[str], world: int) -> tuple[float, int]:
    from llmtrain.plan.api import plan_recipe
    from llmtrain.plan.bubble import bubble_fraction
    from llmtrain.recipe.load import load_recipe

    plan = plan_recipe(load_recipe(ROOT / recipe_path, overrides), None, 1, world)
    assert plan.valid, plan.validation.errors
    p, m = plan.recipe.parallel, plan.validation.batch.microbatches
    v = p.pp_virtual_stages
    return bubble_fraction(p.pp_schedule, plan.validation.dims.pp, v, m), m


def compare_overlap(args, cfg: dict) -> None:
    """The before/after measurement of issue 16: each pair (the bucketed reduction started in
    backward vs the all-reduce after backward, ``build_optimizer(overlap=False)``) is built in
    the same process group and stepped round-robin with everything else of its world size;
    per layout the median over timed steps of the step time and of the main thread's wait in
    ``grad_sync`` (the DP reduction backward did not hide, plus the write-back), and the median
    over profiled steps of the exposed communication (the profiler split of :func:`main`)."""
    sys.path.insert(0, str(ROOT))
    layouts = [lay for lay in COMPARE if not args.only or any(k in lay[0] for k in args.only.split(","))]
    measured: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        for world in sorted({lay[3] for lay in layouts}):
            cases = [{"name": n, "recipe": str(ROOT / r), "set": BASE + o, "variant": v} for n, r, o, w, v in layouts
                     if w == world]
            measured.update(run_worker(Path(tmp), world, cases, cfg))
    tokens = None
    rows = []
    for name, recipe, over, world, _variant in layouts:
        r0 = measured[name][0]
        step = common.median(r0["step_times_s"])
        if tokens is None:
            from llmtrain.recipe.load import load_recipe
            t = load_recipe(ROOT / recipe, cfg["size"] + BASE).train
            tokens = t.global_batch_size * t.seq_len
        rows.append({"layout": name, "ranks": world, "microbatches": r0["microbatches"], "step_s": step,
                     "step_min_s": min(r0["step_times_s"]), "tokens_per_s": tokens / step,
                     "sync_s": common.median(r0["sync_times_s"]), "comm_s": r0["comm_median_s"],
                     "per_rank": [{k: r[k] for k in ("rank", "step_times_s", "sync_times_s", "comm_median_s")}
                                  for r in measured[name]]})
    by = {r["layout"]: r for r in rows}
    pairs = []
    for r in rows:
        if r["layout"].endswith(", overlapped") and r["layout"].replace("overlapped", "before") in by:
            b = by[r["layout"].replace("overlapped", "before")]
            pairs.append({"layout": r["layout"].rsplit(",", 1)[0], "comm_ratio": r["comm_s"] / max(b["comm_s"], 1e-12),
                          "sync_ratio": r["sync_s"] / max(b["sync_s"], 1e-12), "tokens_ratio": r["tokens_per_s"] / b["tokens_per_s"]})
    columns = [("layout", "layout"), ("ranks", "ranks"), ("microbatches", "micro batches / rank"),
               ("step_s", "step s (median)"), ("step_min_s", "step s (min)"), ("tokens_per_s", "tokens/s (median)"),
               ("comm_s", "exposed comm s / step (profiler, median)"), ("sync_s", "grad_sync wait s / step (median)")]
    table = common.md_table(rows, columns) + "\n" + common.md_table(pairs, [
        ("layout", "pair"), ("comm_ratio", "exposed comm: overlapped / before"),
        ("sync_ratio", "grad_sync wait: overlapped / before"), ("tokens_ratio", "tokens/s: overlapped / before")])
    notes = (f"Recipe sizes: {', '.join(cfg['size'])}; {cfg['steps']} timed steps after {cfg['warmup']} warm-up, "
             f"{cfg['profiled_steps']} profiled steps; rank 0's numbers; all layouts of one world size stepped "
             "round-robin in one process group. *exposed comm*: the profiler split of the table above (time in gloo "
             "collectives that no compute op overlaps, waiting for the slower peer included); *grad_sync wait*: "
             "wall time of the trainer's gradient-sync call (zero 0/1: waiting for the reductions backward did not "
             "hide, and writing the averages back). The acceptance of issue 16 reads the first ratio (<= 30 %) and "
             "the tokens/s ratio (>= 1).")
    common.publish(args, "parallel_overheads_overlap",
                   "Overlapped DP reduction: before/after (CPU/gloo, parallel_overheads.py --compare-overlap)",
                   {"config": cfg, "rows": rows, "pairs": pairs}, table, notes)


def main() -> None:
    ap = common.parser(__doc__.split("\n\n")[0])
    ap.add_argument("--only", default=None, help="comma-separated substrings: run only the layouts whose name has one")
    ap.add_argument("--profiled-steps", type=int, default=None, help="profiled steps per layout (default 3)")
    ap.add_argument("--compare-overlap", action="store_true",
                    help="only the zero 0/1 before/after pairs (dp 2, zero 1 dp 2, pp 2 interleaved x dp 2): "
                         "more steps, medians, exposed DP seconds per step; its own docs section")
    args = ap.parse_args()
    cfg = dict(TINY if args.tiny else FULL)
    if args.compare_overlap and not args.tiny:
        cfg.update(COMPARE_STEPS)
    if args.profiled_steps:
        cfg["profiled_steps"] = args.profiled_steps
    if args.compare_overlap:
        compare_overlap(args, cfg)
        return
    # --tiny: one 2-rank layout (PP: all code paths), no 1-process run (each process start costs ~10 s on busy cores)
    layouts = [(*lay, {})[:5] for lay in LAYOUTS if not args.tiny or lay[0] == "pp 2 (1f1b)"]
    if args.only:
        layouts = [lay for lay in layouts if any(k in lay[0] for k in args.only.split(","))]
    sys.path.insert(0, str(ROOT))
    measured: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        worlds = sorted({lay[3] for lay in layouts})
        # the 1-process references run before AND after the 2-rank job, so that a drift of the
        # machine's load during the run does not favour one side of the comparison
        for i, world in enumerate(worlds + ([1] if 1 in worlds else [])):
            cases = [{"name": n, "recipe": str(ROOT / r), "set": BASE + o, "variant": v} for n, r, o, w, v in layouts
                     if w == world]
            got = run_worker(Path(tmp), world, cases, cfg)
            if i < len(worlds):
                measured.update(got)
            else:
                for name, ranks in got.items():
                    measured[name][0]["step_times_s"] += ranks[0]["step_times_s"]
    rows = []
    for name, recipe, over, world, _variant in layouts:
        ranks = measured[name]
        r0 = ranks[0]
        step = common.median(r0["step_times_s"])
        ref_name = "MoE 1 process" if recipe == MOE else "1 process"
        ref = common.median(measured[ref_name][0]["step_times_s"]) if ref_name in measured else None
        row = {"layout": name, "ranks": world, "microbatches": r0["microbatches"], "step_s": step,
               "step_min_s": min(r0["step_times_s"]),
               "ideal_s": (ref / world) if ref and world > 1 else None,
               "speedup": (ref / step) if ref and world > 1 else None,
               "compute_s": r0["compute_s"], "comm_s": r0["comm_s"], "bubble_s": r0["bubble_s"], "other_s": r0["other_s"],
               "profiled_step_s": r0["profiled_step_s"]}
        if "parallel.pp=2" in over:
            planned, _ = planned_bubble(recipe, cfg["size"] + BASE + over, world)
            fracs = [r["bubble_s"] / r["compute_s"] for r in ranks if r["compute_s"] > 0]
            row.update(bubble_planned=planned, bubble_measured=sum(fracs) / len(fracs),
                       bubble_per_stage=[round(f, 4) for f in fracs])
        row["per_rank"] = [{k: r[k] for k in ("rank", "compute_s", "comm_s", "bubble_s", "other_s", "profiled_step_s",
                                             "step_times_s")} for r in ranks]
        rows.append(row)
    columns = [("layout", "layout"), ("ranks", "ranks"), ("microbatches", "micro batches / rank"),
               ("step_s", "step s (median)"), ("step_min_s", "step s (min)"), ("ideal_s", "ideal s (1-proc / 2)"), ("speedup", "speed-up vs 1 proc"),
               ("compute_s", "compute s"), ("comm_s", "comm s"), ("bubble_s", "bubble s"), ("other_s", "other s"),
               ("bubble_measured", "bubble fraction measured"), ("bubble_planned", "bubble fraction planned")]
    size = ", ".join(cfg["size"])
    spread = [max(r["per_rank"][0]["step_times_s"]) / min(r["per_rank"][0]["step_times_s"]) for r in rows]
    noise = (f"Repeatability of this run: the slowest of a layout's timed steps was {min(spread):.1f}x to "
             f"{max(spread):.1f}x its fastest (load average at the end in the line above); ratios between layouts "
             f"are only as good as that — on a shared machine read the min column too, and rerun on a quiet one.")
    notes = f"""Recipe sizes: {size} (same global batch in every layout); median of {cfg['steps']} steps after {cfg['warmup']} warm-up steps (the 1-process references: {2 * cfg['steps']}, half run before and half after the 2-rank job), the 2-rank layouts stepped round-robin in one process group (`common.interleaved`) so that load changes hit them alike; `OMP_NUM_THREADS=1`; the 2-rank layouts share the machine's 2 cores (which other jobs were also using).

Definitions. *step s*: rank 0's wall time of one optimizer step (forward, backward, gradient sync, clipping, AdamW), barrier before each step. *ideal s*: the 1-process step time / 2 (each rank does half the work; with 1 thread per rank, 2 ranks use 2 cores while the reference uses 1, so ideal is reachable only if the cores are free). *speed-up*: 1-process time / layout time. The split is rank 0's, averaged over {cfg['profiled_steps']} further steps under `torch.profiler` (which adds overhead: the parts sum to the profiled step, longer than the median): *compute* = main-thread `aten::` ops that contain no collective; *comm* = time inside a gloo collective, waiting for the slower peer included (`gloo:*` events of gloo's threads, main-thread `c10d::`/`_c10d_functional::` ops, DTensor redistributions included) not overlapped by compute; *bubble* (PP only) = the part of that exposed communication spent in `gloo:recv`, i.e. a stage waiting for its neighbour (the transfer itself included, small next to the wait), plus the wait in the loss all-reduce over the pipeline group right after the schedule (where the last stage waits for the first stage's final backward: the drain); *other* = the rest (Python, autograd and FSDP hooks, the pipeline scheduler, idle). Bubble fraction measured = bubble / compute of the stage (the planner's convention: idle over ideal compute time), averaged over the 2 stages (per stage in the JSON); planned = `llmtrain.plan.bubble.bubble_fraction` for the same recipe, (p - 1) / m for 1F1B. The MoE row's speed-up is against its own 1-process run (recipes/debug-moe.yaml, 1 process).

{noise}"""
    by_name = {r["layout"]: r for r in rows}
    pairs = [("dp 2 (zero 0, all-reduce)", "dp 2 (zero 0), before: all-reduce after backward"),
             ("zero 1 dp 2", "zero 1 dp 2, before: all-reduce after backward"),
             ("zero 3 (FSDP2) dp 2, explicit prefetch (not adopted)", "zero 3 (FSDP2) dp 2")]
    lines = []
    for after, before in pairs:
        if after in by_name and before in by_name:
            a, b = by_name[after], by_name[before]
            lines.append(f"*{after}* vs *{before}*: exposed comm {a['comm_s']:.4g} s vs {b['comm_s']:.4g} s "
                         f"({a['comm_s'] / max(b['comm_s'], 1e-12):.0%} of before), step median {a['step_s']:.4g} s vs "
                         f"{b['step_s']:.4g} s (tokens/s {b['step_s'] / a['step_s']:.3f}x before)")
    if lines:
        notes += "\n\nBefore/after (issue 16; the before rows run the previous code path in the same job, interleaved): " + \
            "; ".join(lines) + "."
    table = common.md_table(rows, columns)
    common.publish(args, "parallel_overheads", "Parallel overheads: 1 process vs each dimension at 2 (CPU/gloo)",
                   {"config": cfg, "rows": rows}, table, notes)


if __name__ == "__main__":
    main()
