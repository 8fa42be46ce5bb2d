"""GQA's K/V handed to SDPA as they are (``enable_gqa``) against repeated to the query heads first.

    python benchmarks/gqa_attention.py            # 4 shapes x fp32 / bf16, 20 calls each, 2 threads
    python benchmarks/gqa_attention.py --tiny     # the smallest shape, 2 calls (smoke test)

Causal SDPA forward + backward on CPU, CPU time per call (``time.process_time``: less sensitive to a
busy machine than wall time), interleaved per shape, at the debug model's shape (b 4, 8 heads, 4 K/V
heads, 128 tokens, head_dim 16) and at larger ones. The engine passes ``enable_gqa`` (``engine/models/
llama.py`` ``causal_sdpa``); this is the measurement behind docs/engine.md "Performance" (an earlier
session found the flag slower on CPU and kept the repeat)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
import common  # noqa: E402

SHAPES = ((4, 8, 4, 128, 16), (2, 8, 2, 512, 64), (1, 32, 8, 1024, 64), (2, 16, 4, 512, 128))  # b, heads, kv, s, d


def make_step(b: int, heads: int, kv: int, s: int, d: int, dtype: torch.dtype, native: bool):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(b, heads, s, d, generator=gen).to(dtype).requires_grad_()
    k = torch.randn(b, kv, s, d, generator=gen).to(dtype).requires_grad_()
    v = torch.randn(b, kv, s, d, generator=gen).to(dtype).requires_grad_()

    def step() -> float:
        start = time.process_time()
        if native:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            rep = heads // kv
            out = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                                 is_causal=True)
        out.sum().backward()
        return time.process_time() - start

    return step


def main() -> None:
    ap = common.parser(__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    shapes, reps = (SHAPES[:1], 2) if args.tiny else (SHAPES, 20)
    rows = []
    for shape in shapes:
        for dtype in (torch.float32, torch.bfloat16):
            fns = {"enable_gqa": make_step(*shape, dtype, True), "repeated": make_step(*shape, dtype, False)}
            times = common.interleaved(fns, reps, warmup=2)
            native, repeat = (1e3 * common.median(times[k]) for k in fns)
            rows.append({"b, heads, kv_heads, s, d": str(shape), "dtype": str(dtype).removeprefix("torch."),
                         "enable_gqa ms": round(native, 2), "repeated ms": round(repeat, 2),
                         "ratio": round(native / repeat, 2)})
    common.publish(args, "gqa_attention", f"GQA's K/V as they are vs repeated: causal SDPA on CPU ({args.threads} threads)",
                   {"rows": rows}, common.md_table(rows),
                   notes="CPU milliseconds per forward + backward (median of interleaved calls); ratio < 1: enable_gqa faster.")


if __name__ == "__main__":
    main()
