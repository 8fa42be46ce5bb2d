"""Ring context parallelism: extra memory of one attention forward + backward, kernel blocks vs the old fp32 blocks.

    python benchmarks/cp_memory.py           # 32K tokens on 2 ranks (16K per rank), 1 head of 64, fp32
    python benchmarks/cp_memory.py --tiny    # 1K tokens (CI smoke test)

One torchrun job of 2 ranks (gloo, CPU; benchmarks/cp_memory_worker.py) runs ring attention on
its zigzag shards, first the engine's (``engine/parallel/context_ring.py``: every block a fused
SDPA kernel that returns its log-sum-exp, no masks; O(s_local d) working memory), then a copy of
the implementation it replaced, kept only inside the worker for this "before" number (fp32
``[s_local, s_local]`` score blocks with explicit masks). Memory per rank is the resident set:
the high-water mark during the call minus the RSS before it (inputs allocated), minus the results
that must exist afterwards (output, dq, dk, dv); the worker explains why RSS is exact here
(``MALLOC_MMAP_THRESHOLD_``). "planner" is ``plan/cp_transient.cp_transient_bytes`` for the same
shape: the planner's working memory of one ring call. Acceptance (issue 16): >= 4x less.
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

WORKER = Path(__file__).with_name("cp_memory_worker.py")
FULL = dict(seq=32768, heads=1, dim=64)
TINY = dict(seq=1024, heads=2, dim=16)
CP = 2
MIB = 2**20


def planner_bytes(seq: int, heads: int, dim: int, e: int) -> int:
    sys.path.insert(0, str(common.ROOT))
    from llmtrain.plan.activations import ActShape, cp_transient_bytes

    x = ActShape(b=1, s=seq // CP, h=heads * dim, heads=heads, kv_heads=heads, ffn=4 * heads * dim, vocab=256, tp=1,
                 sp=False, e=e, cp=CP, cp_method="ring")
    return cp_transient_bytes(x)


def main() -> None:
    args = common.parser(__doc__.split("\n\n")[0]).parse_args()
    shape = TINY if args.tiny else FULL
    dtype = "float32"
    env = dict(os.environ, OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="65536", LLMTRAIN_TENSORBOARD="0")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(common.ROOT), env.get("PYTHONPATH")]))
    with tempfile.TemporaryDirectory(prefix="llmtrain-cp-mem-") as tmp:
        out = Path(tmp) / "rows.json"
        load_before = os.getloadavg()[0]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(CP), str(WORKER),
               str(out), str(shape["seq"]), str(shape["heads"]), str(shape["dim"]), dtype]
        done = subprocess.run(cmd, cwd=common.ROOT, env=env, capture_output=True, text=True, timeout=1800)
        if done.returncode != 0 or not out.is_file():
            raise SystemExit(f"worker failed ({done.returncode}):\n{(done.stdout + done.stderr)[-6000:]}")
        per_rank = json.loads(out.read_text())
    load = round((load_before + os.getloadavg()[0]) / 2, 1)
    planned = planner_bytes(shape["seq"], shape["heads"], shape["dim"], 4) / MIB
    rows = []
    for impl in ("old", "new"):
        mine = [r for r in per_rank if r["impl"] == impl]
        rows.append({"impl": {"old": "before (fp32 masked score blocks)", "new": "kernel blocks (now)"}[impl],
                     "extra": max(r["extra"] for r in mine) / MIB,
                     "growth": max(r["peak"] - r["before"] for r in mine) / MIB,
                     "inputs": mine[0]["inputs"] / MIB, "seconds": max(r["seconds"] for r in mine),
                     "planner": planned if impl == "new" else None, "load1": load})
        print(json.dumps(rows[-1]), flush=True)
    old, new = rows
    ratio = old["extra"] / max(new["extra"], 1e-9)
    for r in rows:
        r["ratio"] = old["extra"] / max(r["extra"], 1e-9)
    table = common.md_table(rows, [("impl", "ring attention"), ("extra", "**extra MiB** (max over ranks)"),
                                   ("ratio", "before / this"), ("growth", "peak − before MiB"),
                                   ("inputs", "q, k, v, dout MiB"), ("planner", "planner MiB"),
                                   ("seconds", "fwd+bwd s"), ("load1", "machine load avg")])
    notes = (f"{shape['seq']} tokens over {CP} ranks ({shape['seq'] // CP} per rank, zigzag), {shape['heads']} head(s) of "
             f"{shape['dim']}, fp32, one forward + backward; \"extra\" = peak RSS − RSS before − (output, dq, dk, dv). "
             f"The old ring held fp32 [s_local, s_local] scores, masked scores, probabilities and their gradients "
             f"per step ({4 * shape['heads'] * (shape['seq'] // CP) ** 2 / MIB:.0f} MiB each here); the kernel blocks hold "
             f"only O(s_local d) buffers: {ratio:.0f}x less. \"planner MiB\" is plan/cp_transient.ring_transient_bytes "
             f"(the ring overlaps each hop with a block since the thirteenth session, so K/V and dK/dV in flight "
             f"coexist with a block's gradients): at cp 2 the larger of step 0's block (dq accumulator, fresh dK/dV "
             f"accumulators, the contiguous copies of k, v sent and the K/V received, the block's dq, dK, dV: "
             f"(3 acc + 7 e) x one q-sized tensor) and the last step's half block (accumulators sent and received: "
             f"(5 acc + 4.5 e)); compare it with \"peak − before\", which also holds the output (one q-sized tensor, an "
             f"activation to the planner) and, at {shape['heads']} head(s), no k/v copies (the model's transposed "
             f"layout is already contiguous there; two q-sized tensors less, so the last step's half block is the "
             f"peak). Times are of a shared 2-core machine (see the load average) and only indicative.")
    common.publish(args, "cp_memory", "Ring context parallelism: attention working memory, kernel blocks vs fp32 score blocks",
                   {"shape": shape, "cp": CP, "dtype": dtype, "rows": rows, "per_rank": per_rank, "ratio": ratio},
                   table, notes)


if __name__ == "__main__":
    main()
