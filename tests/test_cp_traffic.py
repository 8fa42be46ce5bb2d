"""Time model v2's bytes for the engine's ring and all-gather CP outside their kernels, and for
torch's ``context_parallel`` (plan/cpmerge.py), against the code's own ops, counted under a dispatch
mode (tests/traffic.py).

One process plays one cp rank: the ring's P2P (``start_rotate`` / ``finish_rotate``) and the
all-gather's collective are replaced by stand-ins that hand back this rank's own tensors (their
values do not matter to the byte count; what the real ones move is communication, priced apart),
everything else is the engine's code. bf16 on CPU, the model's layout (q/k/v transposes of
``[b, s, h, d]``), GQA and not."""

from __future__ import annotations

import pytest
import torch

from llmtrain.engine.parallel import context, context_ring
from llmtrain.plan.cpmerge import cp_attention_bytes
from llmtrain.plan.ops import membound_seconds
from llmtrain.recipe.gpus import GPUS
from tests.helpers_plan import stack_cost, stack_recipe
from tests.traffic import Traffic

B, D, S_LOCAL = 1, 64, 256


def _qkv(heads: int, kv_heads: int):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(B, S_LOCAL, heads, D, generator=gen).to(torch.bfloat16).transpose(1, 2)
    k, v = (torch.randn(B, S_LOCAL, kv_heads, D, generator=gen).to(torch.bfloat16).transpose(1, 2) for _ in range(2))
    return [t.requires_grad_() for t in (q, k, v)]


def _check(traffic: Traffic, attention, method: str, cp: int, heads: int, kv_heads: int) -> None:
    """Count ``attention(q, k, v)``'s forward, then its backward (``autograd.grad``: no accumulation
    into leaves' ``.grad``, which the model's q/k/v are not), against the price."""
    q, k, v = _qkv(heads, kv_heads)
    with traffic:
        out = attention(q, k, v)
        forward = traffic.bytes
        torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    _assert_priced(forward, traffic.bytes - forward, method, cp, heads, kv_heads)


def _assert_priced(forward: int, backward: int, method: str, cp: int, heads: int, kv_heads: int) -> None:
    """Counted forward and backward bytes within 0.5 % of plan/cpmerge.py's price."""
    want_f, want_b = cp_attention_bytes(method, cp, B, heads, kv_heads, S_LOCAL, D, 2)
    assert forward == pytest.approx(want_f, rel=0.005), (forward, backward, want_f, want_b)
    assert backward == pytest.approx(want_b, rel=0.005), (forward, backward, want_f, want_b)


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("heads, kv_heads", [(8, 8), (8, 2)])
def test_ring_bytes_are_the_engines_ops(monkeypatch, cp, heads, kv_heads):
    """The ring on its last rank (every block after the diagonal one merges all of its rows): the
    forward and backward bytes of its merges, copies, GQA repeats and accumulators equal the price
    within 0.5 %."""
    traffic = Traffic()

    def start(tensors, group, rank, n):
        return [t.contiguous() for t in tensors], None, None

    monkeypatch.setattr(context_ring, "start_rotate", start)
    monkeypatch.setattr(context_ring, "finish_rotate", lambda pending: pending[0])
    monkeypatch.setattr(context_ring.dist, "get_rank", lambda group=None: cp - 1)
    _check(traffic, lambda q, k, v: context_ring.RingAttention.apply(q, k, v, None, cp), "ring", cp, heads, kv_heads)


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("heads, kv_heads", [(8, 8), (8, 2)])
def test_allgather_bytes_are_the_engines_ops(monkeypatch, cp, heads, kv_heads):
    """The all-gather on cp rank 1 (two zigzag chunks, each a diagonal block and a prefix block):
    the permute into the gather's layout, the reorder of the gathered K/V into global order and
    back, the merges, GQA repeats and accumulators equal the price within 0.5 %."""
    traffic = Traffic()

    def gather(flat, gather_dim, group):  # stands in for the collective: cp copies of this rank's K or V
        traffic.paused = True
        full = torch.cat([flat.detach()] * cp, dim=gather_dim).requires_grad_()
        traffic.paused = False
        return _Gathered.apply(flat, full)

    monkeypatch.setattr(context, "all_gather_autograd", gather)
    monkeypatch.setattr(context, "wait_tensor", lambda t: t)
    _check(traffic, lambda q, k, v: context.allgather_attention(q, k, v, None, cp, 1), "allgather", cp, heads, kv_heads)


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_torch_context_parallel_bytes_are_torchs_ops(monkeypatch, cp):
    """torch's own ring attention (``_templated_ring_attention`` and its backward, the loop
    torchtitan's ``context_parallel`` runs, with load balancing and fp32 merging, torch's defaults) on
    its last cp rank, K/V with the query heads as torchtitan passes them: the bytes of its merges,
    concatenations, partial updates and accumulators equal ``planner.cp_merge: torch``'s price within
    0.5 %. Its rotater is replaced by one that hands back what it was given (the sends are
    communication); the process group is a bare one (torch checks its type, the stand-ins answer
    for its rank and size)."""
    import torch.distributed as dist  # noqa: PLC0415
    import torch.distributed.tensor.experimental._context_parallel._attention as cpa  # noqa: PLC0415

    class Rotater:
        def __init__(self):
            self.buffer = None

        def exchange_buffers(self, buffer):
            self.buffer = buffer

        def next_buffer(self):
            return self.buffer

    monkeypatch.setattr(cpa, "_create_rotater", lambda group, seq_dim, method=None: Rotater())
    monkeypatch.setattr(cpa.dist, "get_rank", lambda group=None: cp - 1)
    monkeypatch.setattr(cpa.dist, "get_world_size", lambda group=None: cp)
    group = dist.ProcessGroup(dist.HashStore(), 0, 1)
    aten = torch.ops.aten
    q, k, v = (t.detach() for t in _qkv(8, 8))
    traffic = Traffic()
    with traffic:
        out, lse, *_ = cpa._templated_ring_attention(group, 2, aten._scaled_dot_product_flash_attention_for_cpu,
                                                     q, k, v, is_causal=True)
        forward = traffic.bytes
        cpa._templated_ring_attention_backward(group, 2, aten._scaled_dot_product_flash_attention_for_cpu_backward,
                                               torch.ones_like(out), "grad_out", q, k, v, out, lse, is_causal=True,
                                               dropout_p=0.0)
    _assert_priced(forward, traffic.bytes - forward, "torch", cp, 8, 8)


class _Gathered(torch.autograd.Function):
    """The gathered tensor in autograd, with the collective's backward (a reduce-scatter: this
    rank's share of the gradient, communication) left out of the count: returns a fresh zero
    gradient of the local shape without touching the incoming one."""

    @staticmethod
    def forward(ctx, flat, full):
        ctx.shape = flat.shape
        return full.detach()

    @staticmethod
    def backward(ctx, grad):
        return grad.new_empty(ctx.shape), None


def test_no_bytes_without_ring_or_allgather():
    assert cp_attention_bytes("ulysses", 4, 1, 8, 8, 256, 64, 2) == (0.0, 0.0)
    assert cp_attention_bytes("ring", 1, 1, 8, 8, 256, 64, 2) == (0.0, 0.0)
    assert cp_attention_bytes("torch", 1, 1, 8, 8, 256, 64, 2) == (0.0, 0.0)


@pytest.mark.parametrize("method", ["ring", "allgather"])
def test_cp_merge_prices_the_engines_cp_bytes_and_fused_leaves_them_out(method):
    """Time model v2 adds the engine's CP work between its attention kernels (plan/cpmerge.py, counted
    against the engine's ops in tests/test_cp_traffic.py) to every block: the compute of a CP 2 step
    (8B, 1 node, no recomputation, every GPU at the same pace) is exactly layers x micro batches x
    those bytes at the element-wise rate longer than with planner.cp_merge fused (Transformer
    Engine's CP: kernels only), which plan names, and ``torch`` by torch's context_parallel loop's bytes;
    without CP the setting changes nothing."""
    over = dict(parallel__cp=2, parallel__cp_method=method, parallel__zero=1, train__precision="bf16",
                train__activation_checkpointing="none", cluster__gpu_variability=0.0)
    engine, fused = stack_cost(stack_recipe(**over)), stack_cost(stack_recipe(**over, planner__cp_merge="fused"))
    f, b = cp_attention_bytes(method, 2, 2, 32, 8, 4096, 128, 2)  # micro batch 2 x 8,192 / 2 tokens, 32 / 8 heads
    gpu = GPUS["h100-sxm"]
    # 32 layers, 2 micro batches (16 sequences over dp 4 = 8 GPUs / cp 2, 2 per micro batch)
    extra = 32 * 2 * (membound_seconds(f, gpu) + membound_seconds(b, gpu))
    got = engine.time.breakdown["compute"] - fused.time.breakdown["compute"]
    assert got == pytest.approx(extra, rel=1e-9)
    assert "planner.cp_merge fused" in fused.assumptions and not engine.assumptions
    no_cp = dict(over, parallel__cp=1)
    without = stack_cost(stack_recipe(**no_cp)).time.step_s
    assert stack_cost(stack_recipe(**no_cp, planner__cp_merge="fused")).time.step_s == without
    # torch's context_parallel: its own loop's bytes for either rotation (K/V as the recipe moves them)
    torch_cp = stack_cost(stack_recipe(**over, planner__cp_merge="torch"))
    tf, tb = cp_attention_bytes("torch", 2, 2, 32, 8, 4096, 128, 2)
    got = torch_cp.time.breakdown["compute"] - fused.time.breakdown["compute"]
    assert got == pytest.approx(32 * 2 * (membound_seconds(tf, gpu) + membound_seconds(tb, gpu)), rel=1e-9)
    assert "planner.cp_merge torch" in torch_cp.assumptions
