"""A windowed layer's attention without CP: its score boxes against the dense band mask, on CPU.

    python benchmarks/window_attention.py            # 4 shapes, fp32, 5 calls each, 2 threads
    python benchmarks/window_attention.py --tiny     # one toy shape, 2 calls (smoke test)

Forward + backward of one layer's core attention (b 1, 8 heads, head_dim 64, the model's additive band
mask from ``models/masks.py``): ``masked_sdpa`` (SDPA with the dense ``[S, S]`` mask, what every windowed
layer ran before the forty-second session) against ``local_window_attention`` (engine/models/
window_attention.py: the boxes of ``plan/localwindow.py``), CPU time per call (``time.process_time``),
interleaved. ``executed`` is the boxes' share of the square the planner prices (``local_window_work``):
the dense call runs all of it."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import common  # noqa: E402

from llmtrain.engine.models.masks import forward_masks, masked_sdpa  # noqa: E402
from llmtrain.engine.models.window_attention import local_window_attention  # noqa: E402
from llmtrain.plan.localwindow import local_chunk, local_window_work  # noqa: E402

SHAPES = ((2048, 512), (4096, 512), (4096, 1024), (8192, 1024))  # (seq, window)


def make_step(s: int, window: int, boxes: bool):
    gen = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(1, 8, s, 64, generator=gen) for _ in range(4))
    _, band = forward_masks(torch.arange(s), None, window, s, 1, None, False, torch.float32)

    def step() -> float:
        ins = [t.clone().requires_grad_() for t in (q, k, v)]
        start = time.process_time()
        out = local_window_attention(*ins, band, window) if boxes else masked_sdpa(*ins, band)
        out.backward(dout)
        return time.process_time() - start

    return step


def main() -> None:
    ap = common.parser(__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    shapes, reps = (((256, 64),), 2) if args.tiny else (SHAPES, 5)
    rows = []
    for s, window in shapes:
        fns = {"dense": make_step(s, window, False), "boxes": make_step(s, window, True)}
        times = common.interleaved(fns, reps, warmup=1)
        dense, boxes = (1e3 * common.median(times[k]) for k in fns)
        rows.append({"seq": s, "window": window, "chunk": local_chunk(s, window),
                     "executed": round(local_window_work(s, window)[0], 3), "dense band ms": round(dense, 1),
                     "boxes ms": round(boxes, 1), "speedup": round(dense / boxes, 2)})
    common.publish(args, "window_attention",
                   f"A windowed layer's attention: score boxes vs the dense band, CPU fp32 ({args.threads} threads)",
                   {"rows": rows}, common.md_table(rows),
                   notes="CPU milliseconds per forward + backward (median of interleaved calls), b 1, 8 heads, head_dim 64; "
                         "executed: the boxes' share of the [S, S] scores (the dense call runs all of them).")


if __name__ == "__main__":
    main()
