"""Checkpoint I/O: the training loop's stall per save (synchronous vs asynchronous), load and resharded load.

    python benchmarks/checkpoint_io.py           # checkpoints of ~10 MB, ~100 MB and ~1 GB
    python benchmarks/checkpoint_io.py --tiny    # ~10 MB, one short repetition (CI smoke test)

Each size is one torchrun job of 2 ranks on CPU/gloo (benchmarks/checkpoint_io_worker.py) that
runs the engine's own ``train()``: FSDP over both ranks (dp_shard 2, zero 3), fp32, a toy batch
(2 sequences of 32 tokens) so that the step is short next to the save. The model is the Llama
block at the sizes below; a checkpoint holds the weights and AdamW's two moments, fp32, so
~12 bytes per parameter (the size column is what was on disk).

What is measured (rank 0's clock; both ranks are in lock-step through the step's collectives):

* **step** — the median iteration of a run without checkpoints (time between two consecutive
  steps' metric records), the first iteration left out.
* **save call** — the duration of ``Checkpointer.save()``, the call the loop blocks in (sync:
  the whole DCP write and the commit, which checksums every file on rank 0; async: waiting for
  the previous save, the RNG files, DCP's planning and its staging copy of the tensors).
* **stall** — for a save after step s, with a save every k steps: (the k iterations after it) −
  k × step. It counts everything the save costs the loop: the call, the ``poll()`` all-reduce
  at each later step, the commit when the write is done (rank 0 checksums; the other rank waits
  for it in the next collective) and, for the async write, the background thread's competition
  with training for the CPU and the GIL. Median over 3 saves per run and the repetitions; the
  runs (no save / sync / async) are interleaved.
* **async written after** — from the start of an async save until its commit.
* **load** — ``Checkpointer.restore("latest")`` (rank 0 verifies every file's sha256, then
  every rank DCP-loads its shards and sets model and optimizer) into the same layout;
  **resharded load** — the same checkpoint into tp 2 (zero 0), which DCP reshards.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import common  # noqa: E402

WORKER = Path(__file__).with_name("checkpoint_io_worker.py")
SIZES = {"10 MB": (128, 4, 352), "100 MB": (256, 12, 704), "1 GB": (1024, 8, 2816)}  # hidden, layers, ffn
VOCAB = 512


def n_params(hidden: int, layers: int, ffn: int) -> int:
    per_layer = hidden * hidden * 2 + 2 * hidden * hidden // 2 + 3 * hidden * ffn + 2 * hidden  # heads 8, kv 4
    return layers * per_layer + 2 * VOCAB * hidden + hidden


def run_worker(hidden: int, layers: int, ffn: int, interval: int, saves: int, reps: int, work: Path) -> dict:
    out = work / "result.json"
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), LLMTRAIN_TENSORBOARD="0")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(common.ROOT), env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(WORKER),
           "--hidden", str(hidden), "--layers", str(layers), "--ffn", str(ffn), "--interval", str(interval),
           "--saves", str(saves), "--reps", str(reps), "--dir", str(work / "ckpt"), "--out", str(out)]
    done = subprocess.run(cmd, cwd=common.ROOT, env=env, capture_output=True, text=True, timeout=3000)
    if done.returncode != 0 or not out.is_file():
        raise SystemExit(f"worker failed ({done.returncode}):\n{(done.stdout + done.stderr)[-6000:]}")
    return json.loads(out.read_text())


def intervals(run: dict) -> dict[int, float]:
    """step j -> seconds from step j-1's record to step j's."""
    steps = run["steps"]
    return {b[0]: b[1] - a[1] for a, b in zip(steps, steps[1:])}


def analyse(data: dict, interval: int) -> dict:
    runs = data["runs"]
    base = [d for r in runs if r["mode"] == "none" for j, d in intervals(r).items() if j > 2]
    step = common.median(base)
    out = {"step_s": step, "baseline_intervals_s": base}
    for mode in ("sync", "async"):
        calls, stalls, lags = [], [], []
        for r in (r for r in runs if r["mode"] == mode):
            gaps = intervals(r)
            last = max(gaps)
            commits = {s: t for s, t in r["commit"]}
            for t0, dt, s in r["save"]:
                if s + interval > last:  # the final save (after the last record) is not measured
                    continue
                calls.append(dt)
                stalls.append(sum(gaps[j] for j in range(s + 1, s + interval + 1)) - interval * step)
                if s in commits:
                    lags.append(commits[s] - t0)
        out[mode] = {"save_call_s": common.median(calls), "stall_s": common.median(stalls), "stalls_s": stalls,
                     "save_calls_s": calls, "written_after_s": common.median(lags) if lags else None}
        out[mode]["checkpoint_bytes"] = max(r.get("checkpoint_bytes", 0) for r in runs if r["mode"] == mode)
    for layout, key in (("fsdp", "load_s"), ("tp2", "resharded_load_s")):
        xs = [x["seconds"] for x in data["loads"] if x["layout"] == layout]
        out[key], out[key[:-2] + "_all_s"] = common.median(xs), xs
    return out


def render(rows: list[dict], sizes: dict, interval: int) -> tuple[str, str]:
    """The table and the notes of docs/benchmarks.md (the stall numbers stated plainly)."""
    table = common.md_table(rows, [("size", "checkpoint"), ("mb", "on disk MB"), ("params", "params"),
                                   ("step", "step s (no save)"), ("sync_call", "sync: save() s"),
                                   ("sync_stall", "**sync: stall s**"), ("async_call", "async: save() s"),
                                   ("async_stall", "**async: stall s**"), ("async_written", "async: written after s"),
                                   ("load", "load s"), ("reshard", "resharded load s"),
                                   ("load1", "machine load avg")])

    def spread(name: str, mode: str) -> str:
        xs = sizes[name][mode]["stalls_s"]
        return f"{min(xs):.2f}-{max(xs):.2f} over {len(xs)} saves"

    plain = "; ".join(f"{r['size']}: synchronous {r['sync_stall']:.2f} s ({spread(r['size'], 'sync')}), asynchronous "
                      f"{r['async_stall']:.2f} s ({spread(r['size'], 'async')})" for r in rows)
    worse = [r["size"] for r in rows if r["async_stall"] > 1.5 * r["sync_stall"]]
    notes = (f"**Stall of the training loop per save** (median, range): {plain}. Stall = the {interval} iterations after "
             f"a save minus {interval} × the median step without saves; it includes the `save()` call, the per-step "
             "`poll()`, the commit (rank 0 checksums every file) and, for async, the background write running while "
             "training goes on. 2 ranks (FSDP dp_shard 2, zero 3) on CPU/gloo, local disk, on a shared 2-core VM: "
             "the two ranks already use both cores, so each rank's background writer thread takes CPU time (and the GIL) "
             "from its own training steps; "
             + (f"at {', '.join(worse)} that made the asynchronous save cost the loop more than the synchronous one. "
                if worse else "")
             + "A node whose training runs on GPUs, with idle host cores, was not measured here. *Machine load avg* = "
             "the 1-minute load average around that size's job (other users' jobs shared the machine): compare numbers "
             "within a row. Load = `restore(\"latest\")` into the same layout (including rank 0's sha256 check); "
             "resharded = into tp 2, zero 0. The first run of this benchmark found that the engine's `poll()` "
             "all-reduced its flag on the group the async writer thread still used, which can deadlock; the engine "
             "now gives the flag a gloo group of its own (these numbers were measured with that change).")
    return table, notes


def main() -> None:
    args = common.parser(__doc__.split("\n\n")[0]).parse_args()
    if args.tiny:
        plan, interval, saves = {"10 MB": 1}, 2, 1
    else:
        plan, interval, saves = {"10 MB": 3, "100 MB": 3, "1 GB": 2}, 4, 3
    rows, raw = [], {}
    for name, reps in plan.items():
        hidden, layers, ffn = SIZES[name]
        load_before = os.getloadavg()[0]
        with tempfile.TemporaryDirectory(prefix="llmtrain-ckpt-bench-") as tmp:
            data = run_worker(hidden, layers, ffn, interval, saves, reps, Path(tmp))
        load = round((load_before + os.getloadavg()[0]) / 2, 1)
        a = analyse(data, interval)
        raw[name] = {"hidden": hidden, "layers": layers, "ffn_hidden": ffn, "params": n_params(hidden, layers, ffn),
                     "reps": reps, "interval": interval, "saves_per_run": saves, **a, "raw": data}
        rows.append({"size": name, "mb": a["sync"]["checkpoint_bytes"] / 1e6, "params": f"{n_params(hidden, layers, ffn) / 1e6:.1f}M",
                     "step": a["step_s"], "sync_call": a["sync"]["save_call_s"], "sync_stall": a["sync"]["stall_s"],
                     "async_call": a["async"]["save_call_s"], "async_stall": a["async"]["stall_s"],
                     "async_written": a["async"]["written_after_s"], "load": a["load_s"],
                     "reshard": a["resharded_load_s"], "load1": load})
        print(json.dumps(rows[-1]), flush=True)
    table, notes = render(rows, raw, interval)
    common.publish(args, "checkpoint_io", "Checkpoint save stall (sync vs async), load and resharded load",
                   {"interval": interval, "saves_per_run": saves, "rows": rows, "sizes": raw}, table, notes)


if __name__ == "__main__":
    main()
