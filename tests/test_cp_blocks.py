"""Single-process checks of the kernel blocks behind ring / all-gather CP (engine/parallel/context_blocks.py).

The multi-rank parity of the CP methods is tests/test_engine_5d.py (cp_attention_worker.py and
the cp cases of the matrix); these cover what one process can: the bottom-right causal prefix
attention of the all-gather method against SDPA with an explicit mask (one chunk, and the two
zigzag chunks of a rank, also with GQA K/V of fewer heads, as the all-gather moves them), the same
under selective recomputation (whose policy caches the kernels' outputs: an in-place merge into a
cached output once made the recomputation fail), the all-gather's reorder of the gathered chunks
into global order and back, that its per-rank work is balanced (counted exactly from the blocks
the attention runs), and the plain-matmul fallback block (fp64 on CUDA) against the CPU flash kernel. fp64 throughout: tolerance 1e-12, ~1e4 x
machine epsilon for sums over a few hundred keys; the selective run replays the very same
kernels, so it must be bit-identical; the reorder and the work counts are exact.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from torch.utils.checkpoint import checkpoint  # noqa: E402

from llmtrain.engine.parallel.checkpointing import _selective_context  # noqa: E402
from llmtrain.engine.parallel.context import ChunkOrder, allgather_offsets, cp_positions, zigzag_order  # noqa: E402
from llmtrain.engine.parallel.context_blocks import (PrefixCausalAttention, block_backward, block_forward,  # noqa: E402
                                                     prefix_blocks)
from llmtrain.plan.flops import attention_executed  # noqa: E402

S, TOL = 96, 1e-12


def _inputs(seed: int, s_q: int, s_k: int, kv_heads: int = 3):
    gen = torch.Generator().manual_seed(seed)
    # the model's layout: a transpose of [b, s, h, d]; GQA: K/V with kv_heads (not repeated)
    q = torch.randn(2, s_q, 3, 16, generator=gen, dtype=torch.float64).transpose(1, 2)
    k, v = (torch.randn(2, s_k, kv_heads, 16, generator=gen, dtype=torch.float64).transpose(1, 2) for _ in range(2))
    return q, k, v


def _against_masked_sdpa(q0, k0, v0, mask, offsets, tail=lambda out: out):
    """PrefixCausalAttention(offsets), plain and under selective recomputation, against masked SDPA:
    the plain run within TOL of the reference, the recomputed one bitwise equal to the plain one;
    returns the plain run's [output, dq, dk, dv]."""
    runs = {}
    for mode in ("reference", "plain", "selective"):
        q, k, v = (t.clone().requires_grad_() for t in (q0, k0, v0))
        if mode == "reference":  # GQA: K/V repeated to the query heads (autograd sums their gradients)
            n_rep = q.shape[1] // k.shape[1]
            kr, vr = k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1)
            out = tail(torch.nn.functional.scaled_dot_product_attention(q, kr, vr, attn_mask=mask))
        elif mode == "plain":
            out = tail(PrefixCausalAttention.apply(q, k, v, offsets))
        else:
            out = checkpoint(lambda a, b, c: tail(PrefixCausalAttention.apply(a * 1.0, b * 1.0, c * 1.0, offsets)),
                             q, k, v, use_reentrant=False, context_fn=_selective_context)
        out.pow(2).sum().backward()
        runs[mode] = [out.detach(), q.grad, k.grad, v.grad]
    for got, ref in zip(runs["plain"], runs["reference"]):
        assert (got - ref).abs().max().item() < TOL
    for got, ref in zip(runs["selective"], runs["plain"]):
        assert torch.equal(got, ref)
    return runs["plain"]


@pytest.mark.parametrize("offset", [0, S, 2 * S])
def test_prefix_causal_attention_matches_masked_sdpa_also_under_selective_recompute(offset):
    q0, k0, v0 = _inputs(offset, S, 3 * S)
    w = torch.randn(16, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    mask = torch.arange(3 * S)[None, :] <= offset + torch.arange(S)[:, None]  # key j visible to query i iff j <= offset + i
    plain = _against_masked_sdpa(q0, k0, v0, mask, offset, tail=lambda out: out @ w)
    assert plain[2][:, :, offset + S:].abs().sum().item() == 0  # keys after the chunk: untouched


@pytest.mark.parametrize("cp, rank, kv_heads", [(2, 0, 3), (2, 1, 3), (3, 1, 3), (2, 0, 1), (3, 1, 1)])
def test_two_zigzag_chunks_match_masked_sdpa_also_under_selective_recompute(cp, rank, kv_heads):
    # one rank of all-gather CP: its two chunks (global r and 2cp-1-r of 2cp) against the whole sequence;
    # kv_heads 1 of 3 query heads: GQA K/V as all-gather CP moves them, repeated per kernel block
    seq = 2 * cp * 16
    pos = cp_positions(seq, cp, rank, "allgather")
    q0, k0, v0 = _inputs(cp + rank, seq // cp, seq, kv_heads)
    offsets = allgather_offsets(seq // cp, cp, rank)
    assert offsets == (pos[0].item(), pos[seq // cp // 2].item())
    mask = torch.arange(seq)[None, :] <= pos[:, None]  # key j visible to a local query iff j <= its global position
    plain = _against_masked_sdpa(q0, k0, v0, mask, offsets)
    assert plain[0].transpose(1, 2).is_contiguous()  # [b, s, h, d] memory: the model's reshape is a view


def _executed_share(blocks, s_local: int, seq: int) -> float:
    """Scores the blocks execute (a causal diagonal block half of its own) over a full [s_local, seq] block."""
    area = sum((r.stop - r.start) * (k.stop - k.start) * (0.5 if causal else 1.0) for r, k, causal in blocks)
    return area / (s_local * seq)


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_allgather_work_is_balanced_over_ranks(cp):
    # Counted from the very blocks PrefixCausalAttention runs: every rank executes exactly half of
    # a full [s_local, S] block and reads the same (2 cp + 1) c keys over its two chunks, and the
    # planner's step time (flops.attention_executed) prices that share. The contiguous shards
    # before were not balanced.
    c = 16
    seq, s_local = 2 * cp * c, 2 * c
    executed, keys_read = set(), set()
    for rank in range(cp):
        blocks = prefix_blocks(allgather_offsets(s_local, cp, rank), s_local)
        executed.add(_executed_share(blocks, s_local, seq))
        keys_read.add(sum(k.stop for r, k, causal in blocks if causal))  # a chunk's keys: [0, its diagonal's end)
        for i in range(2):  # each chunk's key ranges tile [0, offset + c) without overlap
            ranges = sorted((k.start, k.stop) for r, k, _ in blocks if r.start == i * c)
            assert ranges[0][0] == 0 and all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    assert executed == {0.5} and keys_read == {(2 * cp + 1) * c}
    assert attention_executed(cp, "allgather") == max(executed)  # what the planner's step time uses
    contiguous = [_executed_share(prefix_blocks((rank * s_local,), s_local), s_local, seq) for rank in range(cp)]
    assert max(contiguous) == (cp - 0.5) / cp  # what all-gather CP's last rank ran before


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_gathered_chunks_reordered_into_global_order_and_gradients_back(cp):
    seq = 2 * cp * 4
    # the global positions of the rows the all-gather returns (rank order)
    rank_order = torch.cat([cp_positions(seq, cp, r, "allgather") for r in range(cp)])
    assert torch.equal(cp_positions(seq, cp, cp - 1, "allgather"), cp_positions(seq, cp, cp - 1, "ring"))
    x = rank_order.to(torch.float64)[:, None, None].expand(seq, 2, 3).contiguous().requires_grad_()
    out = ChunkOrder.apply(x, zigzag_order(cp))
    assert torch.equal(out[:, 0, 0], torch.arange(seq, dtype=torch.float64))
    grad = torch.randn(seq, 2, 3, dtype=torch.float64)
    out.backward(grad)
    assert torch.equal(x.grad, grad.index_select(0, rank_order))  # row i of the gathered = global position rank_order[i]


@pytest.mark.parametrize("causal", [True, False])
def test_math_fallback_block_equals_the_cpu_flash_kernel(causal):
    q, k, v = _inputs(7, S, S if causal else 2 * S)
    dout = torch.randn_like(q)
    results = {}
    for kind in ("cpu", "math"):
        out, lse, aux = block_forward(q, k, v, causal, 0.25, kind=kind)
        results[kind] = [out, lse, *block_backward(dout, q, k, v, out, lse, causal, 0.25, aux)]
    for got, ref in zip(results["math"], results["cpu"]):
        assert got.shape == ref.shape and (got - ref).abs().max().item() < TOL
