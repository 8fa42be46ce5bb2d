"""Context-parallel attention against full causal attention on a long sequence (4 ranks).

Every rank builds the same random fp64 q, k, v for the whole sequence, runs full causal SDPA
as the reference, then runs each CP method on its own shard (zigzag for ring, contiguous for
the others) and compares its outputs and the gradients of its shard of q, k, v.

    python -m torch.distributed.run --standalone --nproc-per-node 4 tests/cp_attention_worker.py OUT.json SEQ
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

from llmtrain.engine.parallel.context import cp_positions, make_cp_attention


def main() -> None:
    out_path, seq = sys.argv[1], int(sys.argv[2])
    dist.init_process_group("gloo")
    rank, cp = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(cp)))
    gen = torch.Generator().manual_seed(0)
    b, h, d = 1, 4, 16  # ulysses needs heads divisible by cp
    q, k, v, dout = (torch.randn(b, h, seq, d, generator=gen, dtype=torch.float64) for _ in range(4))
    ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_out = F.scaled_dot_product_attention(*ref_in, is_causal=True)
    ref_out.backward(dout)
    report = {}
    for method in ("ring", "ulysses", "allgather"):
        pos = cp_positions(seq, cp, rank, method)
        local = [t.index_select(2, pos).clone().requires_grad_() for t in (q, k, v)]
        fn = make_cp_attention(method, group, cp, rank, seq)
        out = fn(*local)
        out.backward(dout.index_select(2, pos))
        errors = [(out - ref_out.detach().index_select(2, pos)).abs().max().item()]
        errors += [(t.grad - r.grad.index_select(2, pos)).abs().max().item() for t, r in zip(local, ref_in)]
        worst = torch.tensor(max(errors), dtype=torch.float64)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        report[method] = worst.item()
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(report, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
