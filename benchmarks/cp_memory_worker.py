"""One torchrun job of benchmarks/cp_memory.py: ring attention's extra memory, kernel blocks vs the old fp32 blocks.

Each rank holds its zigzag shard of q, k, v and the output gradient; per implementation it runs
one forward + backward of ring attention over the cp group and records, from /proc/self/status,
the resident set before (``VmRSS``, inputs allocated) and the high-water mark during the call
(``VmHWM``, reset just before it with ``echo 5 > /proc/self/clear_refs``). The launcher sets
``MALLOC_MMAP_THRESHOLD_`` low so every large tensor is its own mmap, returned to the kernel when
freed: RSS then follows the live tensor bytes (no allocator cache hides or inflates them), which is
the method used here instead of tracemalloc (blind to torch's allocations) or torch.profiler.
``extra`` = peak − before − the results that must exist at the end (output, dq, dk, dv).

    (started by benchmarks/cp_memory.py)
"""

from __future__ import annotations

import gc
import json
import math
import sys
import time

import torch
import torch.distributed as dist

from llmtrain.engine.parallel.context import cp_positions
from llmtrain.engine.parallel.context_ring import ring_attention, rotate


def status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


# ---- BEFORE: a copy of the ring attention the engine had until issue 16, for the "old" number only ----
# fp32 [s_local, s_local] score blocks with explicit masks, one full block per step. Not used by the engine.
class OldRingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, cp: int, seq_len: int):
        rank = dist.get_rank(group)
        scale = 1.0 / math.sqrt(q.shape[-1])
        acc = torch.promote_types(q.dtype, torch.float32)
        qf = q.to(acc)
        q_pos = cp_positions(seq_len, cp, rank, "ring")
        out = torch.zeros_like(qf)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=acc)
        kv = [k, v]
        for step in range(cp):
            src = (rank - step) % cp
            k_pos = cp_positions(seq_len, cp, src, "ring")
            mask = q_pos[:, None] >= k_pos[None, :]
            scores = (qf @ kv[0].to(acc).transpose(-1, -2)) * scale
            scores = scores.masked_fill(~mask, float("-inf"))
            blk_lse = torch.logsumexp(scores, dim=-1)
            probs = torch.exp(scores - _finite(blk_lse)[..., None])
            blk_out = probs @ kv[1].to(acc)
            new_lse = torch.logaddexp(lse, blk_lse)
            out = out * _weight(lse, new_lse)[..., None] + blk_out * _weight(blk_lse, new_lse)[..., None]
            lse = new_lse
            if step < cp - 1:
                kv = rotate(kv, group, rank, cp)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.cp, ctx.seq_len, ctx.scale = group, cp, seq_len, scale
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group, cp, seq_len, scale = ctx.group, ctx.cp, ctx.seq_len, ctx.scale
        rank = dist.get_rank(group)
        acc = out.dtype
        qf, dout = q.to(acc), dout.to(acc)
        q_pos = cp_positions(seq_len, cp, rank, "ring")
        delta = (dout * out).sum(-1, keepdim=True)
        dq = torch.zeros_like(qf)
        travel = [k, v, torch.zeros_like(k, dtype=acc), torch.zeros_like(v, dtype=acc)]
        for step in range(cp):
            src = (rank - step) % cp
            kb, vb, dk_acc, dv_acc = travel
            k_pos = cp_positions(seq_len, cp, src, "ring")
            mask = q_pos[:, None] >= k_pos[None, :]
            scores = (qf @ kb.to(acc).transpose(-1, -2)) * scale
            probs = torch.exp(scores.masked_fill(~mask, float("-inf")) - lse[..., None])
            dv_acc = dv_acc + probs.transpose(-1, -2) @ dout
            dprobs = dout @ vb.to(acc).transpose(-1, -2)
            dscores = probs * (dprobs - delta)
            dq = dq + (dscores @ kb.to(acc)) * scale
            dk_acc = dk_acc + (dscores.transpose(-1, -2) @ qf) * scale
            travel = [kb, vb, dk_acc, dv_acc]
            if step < cp - 1:
                travel = rotate(travel, group, rank, cp)
            else:
                dk_acc, dv_acc = rotate([dk_acc, dv_acc], group, rank, cp)
        return dq.to(q.dtype), dk_acc.to(k.dtype), dv_acc.to(v.dtype), None, None, None


def _finite(x):
    return torch.where(torch.isfinite(x), x, torch.zeros_like(x))


def _weight(part_lse, total_lse):
    w = torch.exp(part_lse - _finite(total_lse))
    return torch.where(torch.isfinite(part_lse), w, torch.zeros_like(w))
# ---- end of the BEFORE copy ----


def measure(impl: str, group, cp: int, seq: int, heads: int, dim: int, dtype) -> dict:
    rank = dist.get_rank(group)
    gen = torch.Generator().manual_seed(rank)
    s_local = seq // cp
    # the model hands attention a transpose of [b, s, h, d]: the same layout here
    q, k, v, dout = (torch.randn(1, s_local, heads, dim, generator=gen).to(dtype).transpose(1, 2) for _ in range(4))
    for t in (q, k, v):
        t.requires_grad_()
    fn = {"new": lambda *qkv: ring_attention(*qkv, group, cp),
          "old": lambda *qkv: OldRingAttention.apply(*qkv, group, cp, seq)}[impl]
    gc.collect()
    dist.barrier(group)
    before = status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    t0 = time.perf_counter()
    out = fn(q, k, v)
    out.backward(dout)
    seconds = time.perf_counter() - t0
    peak = status("VmHWM")
    results = sum(t.numel() * t.element_size() for t in (out, q.grad, k.grad, v.grad))
    row = {"impl": impl, "rank": rank, "before": before, "peak": peak, "results": results,
           "extra": peak - before - results, "seconds": seconds,
           "inputs": 4 * q.numel() * q.element_size()}
    del out, q, k, v, dout
    gc.collect()
    dist.barrier(group)
    return row


def main() -> None:
    out_path, seq, heads, dim, dtype_name = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    dtype = getattr(torch, dtype_name)
    dist.init_process_group("gloo")
    group, cp = dist.group.WORLD, dist.get_world_size()
    for impl in ("new", "old"):  # warm-up at a toy size: kernels, thread pools, gloo pairs
        measure(impl, group, cp, 16 * cp, 1, dim, dtype)
    rows = [measure(impl, group, cp, seq, heads, dim, dtype) for impl in ("new", "old")]
    gathered = [None] * cp
    dist.all_gather_object(gathered, rows)
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump([r for per_rank in gathered for r in per_rank], f)
    gc.collect()  # as the engine's shutdown() does before its barrier (CPU facts note, trap 6)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
