"""Context-parallel attention against full causal attention on a long sequence, CP 4 and CP 2.

One 4-rank job covers both degrees: the 4 ranks form one CP 4 group, and also two CP 2 groups
({0, 1} and {2, 3}) that each run the whole sequence independently. Every rank builds the same
random fp64 q, k, v for the whole sequence, runs full causal SDPA as the reference, then runs
each CP method on its own shard (zigzag for ring and allgather, contiguous for ulysses) and
compares its outputs and the gradients of its shard of q, k, v. The report holds the worst error
over all ranks per (degree, method), and for ring and allgather also a bf16 run (the kernels'
half-precision path: bf16 blocks, fp32 lse and merge; allgather also adds its two chunks' dK/dV
of the shared prefix in bf16) next to plain bf16 SDPA's error, all against fp64. GQA (``gqa_*``,
ring and allgather at CP 4 and CP 2): the same q against K/V of half the heads, which these methods
take un-repeated and exchange so (engine/parallel/context.py); the reference is SDPA on the K/V
repeated to the query heads, whose K/V gradients are summed over each KV head's copies.

    python -m torch.distributed.run --standalone --nproc-per-node 4 tests/cp_attention_worker.py OUT.json SEQ

The suite runs :func:`long_sequence` inside tests/test_engine_5d.py's 4-rank job instead.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

from llmtrain.engine.parallel.context import cp_positions, make_cp_attention

METHODS = ("ring", "ulysses", "allgather")


def _reference(q, k, v, dout):
    """Full causal SDPA (K/V repeated to the query heads for GQA): output and q/k/v gradients."""
    ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
    n_rep = q.shape[1] // k.shape[1]
    kr, vr = (t.repeat_interleave(n_rep, dim=1) for t in ref_in[1:])
    ref_out = F.scaled_dot_product_attention(ref_in[0], kr, vr, is_causal=True)
    ref_out.backward(dout)
    return ref_out.detach(), [t.grad for t in ref_in]


def _errors(method, group, cp, cp_rank, seq, inputs, ref_out, ref_grads, dtype=None):
    """Worst |difference| of the output and the q/k/v gradients of this rank's shard."""
    q, k, v, dout = inputs
    pos = cp_positions(seq, cp, cp_rank, method)
    cast = (lambda t: t.to(dtype)) if dtype else (lambda t: t)
    local = [cast(t.index_select(2, pos)).requires_grad_() for t in (q, k, v)]
    out = make_cp_attention(method, group, cp, cp_rank, seq)(*local)
    out.backward(cast(dout.index_select(2, pos)))
    errors = [(out.double() - ref_out.index_select(2, pos)).abs().max().item()]
    errors += [(t.grad.double() - g.index_select(2, pos)).abs().max().item() for t, g in zip(local, ref_grads)]
    return max(errors)


def _worst(value: float) -> float:
    t = torch.tensor(value, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def report(seq: int) -> dict[str, float]:
    """Every method's worst error over all ranks (see the module docstring), on every rank of the
    job's default process group, which must have 4 ranks (CP 4 and two CP 2 groups)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    groups = {world: (dist.new_group(list(range(world))), rank)}
    pairs = [dist.new_group([r, r + 1]) for r in range(0, world, 2)]  # every rank creates every group
    groups[2] = (pairs[rank // 2], rank % 2)
    gen = torch.Generator().manual_seed(0)
    b, h, d = 1, 4, 16  # ulysses needs heads divisible by cp
    inputs = [torch.randn(b, h, seq, d, generator=gen, dtype=torch.float64) for _ in range(4)]
    ref_out, ref_grads = _reference(*inputs)
    found = {}
    for cp, (group, cp_rank) in sorted(groups.items(), reverse=True):
        for method in METHODS:
            found[f"cp{cp}_{method}"] = _worst(_errors(method, group, cp, cp_rank, seq, inputs, ref_out, ref_grads))
    gqa = [inputs[0], inputs[1][:, :h // 2], inputs[2][:, :h // 2], inputs[3]]  # 2 KV heads for 4 query heads
    gqa_ref = _reference(*gqa)
    for cp, (group, cp_rank) in sorted(groups.items(), reverse=True):
        for method in ("ring", "allgather"):
            found[f"gqa_cp{cp}_{method}"] = _worst(_errors(method, group, cp, cp_rank, seq, gqa, *gqa_ref))
    group, cp_rank = groups[world]
    for method in ("ring", "allgather"):
        found[f"bf16_{method}"] = _worst(_errors(method, group, world, cp_rank, seq, inputs, ref_out, ref_grads,
                                                 torch.bfloat16))
    plain = [t.to(torch.bfloat16).requires_grad_() for t in inputs[:3]]
    out = F.scaled_dot_product_attention(*plain, is_causal=True)
    out.backward(inputs[3].to(torch.bfloat16))
    errors = [(out.double() - ref_out).abs().max().item()]
    errors += [(t.grad.double() - g).abs().max().item() for t, g in zip(plain, ref_grads)]
    found["bf16_sdpa"] = max(errors)
    return found


def long_sequence(device) -> dict[str, float]:
    """:func:`report` on 4,096 tokens, as a ``check`` case of a 4-rank tests/dist_worker.py job
    (tests/test_engine_5d.py runs it beside the 4-rank layouts: no job of its own to start)."""
    return report(4096)


def main() -> None:
    out_path, seq = sys.argv[1], int(sys.argv[2])
    dist.init_process_group("gloo")
    found = report(seq)
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(found, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
