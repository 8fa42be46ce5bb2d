"""torchrun worker of benchmarks/grad_compression.py: trains each case of the debug recipe on
this job's ranks and writes, on rank 0, its losses, the bytes every compressed ``grad_sync`` call
sent (engine/parallel/compression.py ``sent_bytes``; PowerSGD's warm-up calls apart), the
planner's DP bytes per step (steady state) and of the plain all-reduce, and the seconds per step.

    torchrun --nproc-per-node 2 benchmarks/grad_compression_worker.py OUT.json STEPS CASES.json
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch.distributed as dist  # noqa: E402

from llmtrain.engine.main import init_distributed, shutdown  # noqa: E402
from llmtrain.engine.parallel import compression  # noqa: E402
from llmtrain.engine.trainer import train  # noqa: E402
from llmtrain.plan.api import plan_recipe  # noqa: E402
from llmtrain.plan.costmodel import estimate  # noqa: E402
from llmtrain.recipe.load import load_recipe  # noqa: E402


def planned_dp_bytes(recipe) -> float:
    """The planner's gradient-averaging bytes per step (the ZeRO-1 broadcast excluded)."""
    plan = plan_recipe(recipe)
    v = plan.validation
    cm = estimate(recipe, v.dims, v.batch, plan.placement, hints=False)
    return sum(c.message_bytes * c.count for c in cm.comms if c.dim == "dp" and c.op != "broadcast")


def main() -> None:
    out, steps, cases = sys.argv[1], int(sys.argv[2]), json.loads(Path(sys.argv[3]).read_text())
    device = init_distributed()
    sent: list[tuple[int, bool]] = []  # (bytes, a warm-up call)
    for cls in (compression.PowerSGDReducer, compression.TopKReducer):
        original = cls.__call__

        def call(self, _params=None, _original=original):
            _original(self, _params)
            sent.append((self.sent_bytes, self.calls <= getattr(self, "start_step", 0)))
        cls.__call__ = call
    rows = []
    for case in cases:
        sent.clear()
        recipe = load_recipe(ROOT / "recipes" / "debug.yaml", case["set"])
        dist.barrier()
        start = time.perf_counter()
        res = train(recipe, device, steps=steps, verbose=False)
        seconds = (time.perf_counter() - start) / steps
        rows.append({"case": case["name"], "losses": res.losses, "sent": sorted({b for b, w in sent if not w}),
                     "sent_warm": sorted({b for b, w in sent if w}), "warm_calls": sum(w for _, w in sent),
                     "calls": len(sent), "planned": planned_dp_bytes(recipe),
                     "planned_full": planned_dp_bytes(load_recipe(ROOT / "recipes" / "debug.yaml", case["base"])),
                     "s_per_step": seconds})
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(rows))
    shutdown()


if __name__ == "__main__":
    main()
