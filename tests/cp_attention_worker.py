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
repeated to the query heads, whose K/V gradients are summed over each KV head's copies. Masked
(``masked_*``, all-gather, Ulysses and ring at CP 4 and CP 2, on the first 512 tokens, GQA): packed
rows' document mask, a sliding window of 150 and of 40 (the ring runs only the chunk pairs inside the
window: plan/ringwindow.py), Gemma 2's soft-cap alone and with both, each rank's
mask built by the model's own ``models/masks.forward_masks`` (all-gather: its zigzag rows; ring: the
same rows against the keys in ring order, whose blocks then hold rows that see no key); the
reference is the model's attention without CP over the whole row (masked SDPA or the soft-capped
kernel).

    python -m torch.distributed.run --standalone --nproc-per-node 4 tests/cp_attention_worker.py OUT.json SEQ

The suite runs :func:`long_sequence` inside tests/test_engine_5d.py's 4-rank job instead.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

from llmtrain.engine.models.masks import forward_masks, ring_keys, zigzag_rows
from llmtrain.engine.models.softcap import softcap_attention
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


MASKED_SEQ = 512
MASKS = {"doc": (True, None, None), "window": (False, 150, None), "softcap": (False, None, 50.0),
         "softcap_doc_window": (True, 150, 50.0),
         # a window under one chunk pair's reach (64 tokens per chunk at CP 4): the ring runs fewer pairs
         "narrow_window": (False, 40, None), "softcap_doc_narrow": (True, 40, 50.0)}  # (packed rows, window, soft-cap)


def _segments(seq: int) -> torch.Tensor:
    """Sample ids of one packed row: samples of uneven lengths, the last one padding (-1)."""
    bounds = [0, 50, 219, 220, 350, 495, seq]
    ids = torch.empty(1, seq, dtype=torch.long)
    for i, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
        ids[:, lo:hi] = i if hi < seq else -1
    return ids


def _masked_errors(method, group, cp, cp_rank, inputs, kind) -> float:
    """One masked case (module docstring): worst |difference| of this rank's output and q/k/v gradients."""
    packed, window, cap = MASKS[kind]
    seq = MASKED_SEQ
    q, k, v, dout = (t[:, :, :seq] for t in inputs)
    segments = _segments(seq) if packed else None
    full_mask, full_band = forward_masks(torch.arange(seq), segments, window, seq, 1, None, False, q.dtype)
    whole = full_mask if window is None else full_band  # what the model's layers get without CP
    ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
    n_rep = q.shape[1] // k.shape[1]
    kr, vr = (t.repeat_interleave(n_rep, dim=1) for t in ref_in[1:])
    if cap is not None:
        ref_out = softcap_attention(ref_in[0], kr, vr, whole, cap)
    else:
        ref_out = F.scaled_dot_product_attention(ref_in[0], kr, vr, attn_mask=whole)
    ref_out.backward(dout)
    pos = cp_positions(seq, cp, cp_rank, method)
    rows = zigzag_rows(seq, cp, cp_rank) if method in ("allgather", "ring") else None
    keys = ring_keys(seq, cp) if method == "ring" else None  # the ring's mask columns: K/V in rank order
    mask, banded = forward_masks(pos, segments, window, seq, cp, rows, cap is not None, q.dtype, keys)
    local = [t.index_select(2, pos).requires_grad_() for t in (q, k, v)]
    fn = make_cp_attention(method, group, cp, cp_rank, seq, window)  # the ring runs the chunk pairs inside the window
    out = fn(*local, banded if window is not None else mask, softcap=cap)
    out.backward(dout.index_select(2, pos))
    errors = [(out - ref_out.detach().index_select(2, pos)).abs().max().item()]
    errors += [(t.grad - g.grad.index_select(2, pos)).abs().max().item() for t, g in zip(local, ref_in)]
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
    for cp, (group, cp_rank) in sorted(groups.items(), reverse=True):
        for method in ("allgather", "ulysses", "ring"):
            for kind in MASKS:
                found[f"masked_{kind}_cp{cp}_{method}"] = _worst(_masked_errors(method, group, cp, cp_rank, gqa, kind))
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
