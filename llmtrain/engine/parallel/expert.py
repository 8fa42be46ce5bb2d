"""Expert parallelism (routed experts split over the ``ep`` ranks, tokens moved by all-to-all)
and expert tensor parallelism (each expert split over the ``tp`` ranks).

EP borrows ranks from ``dp_shard x cp`` (design note; :mod:`llmtrain.plan.dims`): the expert
weights ``w1/w2/w3`` [E, ...] become DTensors sharded on dim 0 over the ``ep`` mesh (each rank
owns ``E / ep`` consecutive experts) and are data-parallel over the ``edp = dp_shard x cp / ep``
ranks holding the same experts (FSDP on the ``edp`` mesh, or gradient all-reduce over it for
zero 0/1). The router stays an ordinary dense weight, data-parallel over all ranks.

Dispatch (:class:`AllToAllDispatcher`): each rank routes its own tokens; the rows, already
grouped by global expert id (so by owning rank), are exchanged with one uneven
``all_to_all_single`` (autograd version from ``_functional_collectives``; gloo accepts uneven
splits only in this form, CPU facts note trap 4). Received rows arrive ordered by (source rank,
local expert); they are regrouped by local expert, run through the local experts (a loop on
CPU), put back in source order and returned with the reverse all-to-all. Per-expert counts are
exchanged first with a small even all-to-all. Token dropping by capacity happens before dispatch,
on each rank's own tokens, exactly as without EP.

Expert tensor parallelism (:func:`apply_expert_tensor_parallel`, always on when ``tp > 1``)
    Each routed expert is split over the TP ranks like the dense MLP (Megatron layout): ``w1``/``w3``
    [E, F, H] column-parallel (``Shard(1)``: F / tp rows each), ``w2`` [E, H, F] row-parallel
    (``Shard(2)``); with EP the DTensors live on the 2-D ``(ep, tp)`` mesh, ``[Shard(0), Shard(1|2)]``,
    so DCP, resharding on resume, the HF exporter and the planner see the true shards. The shared
    experts (a dense SwiGLU) are split the same way (``Shard(0)`` / ``Shard(1)`` of their Linear
    weights): left replicated they would be the same waste. The router stays replicated.

    The MoE block is one TP region (:class:`ExpertTPRegion`): its input is the full token set on
    every TP rank (without sequence parallelism the residual stream is already replicated; with
    it the sequence is all-gathered, as the dense MLP does), every TP rank routes the same tokens
    identically (same input, same replicated router), computes its F / tp slice of every expert it
    routes to (and of the shared experts), and the partial outputs are summed over TP after the
    combine: one all-reduce of ``[tokens, H]`` per block forward (reduce-scatter with SP), the dense
    MLP's traffic, and the same in backward (Megatron's f/g pair, arXiv:1909.08053 §3; the SP
    variant arXiv:2205.05198 §4.2.2). With EP the all-to-all runs inside each TP slice (the ``ep``
    group holds one TP coordinate), each rank sending its rows to the peer with the same TP index.
    Inside the region every gradient is a TP partial sum, reduced once at the region's input. The
    two replicated pieces are made to fit that rule: the router weight's gradient is summed over
    TP in backward (:class:`_CopyToTP`, ``[E, H]`` per block), and the auxiliary loss is
    seeded with ``1 / tp`` on each TP rank (``MoE.aux_grad_share``).

    Why this and not "TP ranks as extra EP" (E / tp experts per TP rank, whole weights): both
    divide expert memory and FLOPs by tp with the same collective (the tokens are the same on the
    TP ranks, so extra EP would also end in a sum over TP), but with expert-TP every TP rank does
    exactly 1 / tp of the work whatever the routing, while extra EP puts each routing imbalance on
    one rank; it needs no extra divisibility of E (only ``expert_ffn`` by tp, already checked) and
    keeps EP borrowing ranks from ``dp_shard x cp`` only. Measured so far through the planner, which
    is checked exact against the engine's shards (tests/test_costmodel.py): mixtral-8x7b (tp 2,
    ep 8) goes from 120 GiB per GPU (does not fit) to 63.7 GiB and from 8.07 to 5.51 s/step; a
    timing benchmark of the two options on GPUs is still to be written. Megatron-Core defaults ``expert_tensor_parallel_size`` to the TP
    size, the same choice; its guides prefer ETP 1 with EP folded over the TP ranks for fine-grained
    experts on GPUs, where F / tp makes the expert GEMMs small: that folding is not implemented.
    Against the previous layout (experts replicated on the TP ranks) this is strictly better:
    expert parameters, gradients and optimizer states / tp, expert FLOPs / tp, for one reduction
    of the MoE output per block that the dense MLP pays as well.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import _functional_collectives as funcol
from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from llmtrain.engine.models.moe import MoE, GroupedExperts
from llmtrain.engine.parallel import funcol_names


class AllToAllDispatcher:
    def __init__(self, group: dist.ProcessGroup, ep: int, num_experts: int):
        self.group, self.ep, self.local_experts = group, ep, num_experts // ep

    def __call__(self, experts: GroupedExperts, x_grouped: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        ep, el = self.ep, self.local_experts
        send_counts = counts.reshape(ep, el).contiguous()  # rows for (destination rank, its local expert)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)  # [source rank, my local expert]
        in_splits = send_counts.sum(1).tolist()
        out_splits = recv_counts.sum(1).tolist()
        # waited at once, while the (temporary) send buffers are alive: see parallel/context.py
        received = wait_tensor(all_to_all_single_autograd(x_grouped.contiguous(), out_splits, in_splits, self.group))
        perm = _regroup_by_expert(recv_counts)
        y = experts.local_forward(received.index_select(0, perm), recv_counts.sum(0).tolist())
        y_source_order = y.index_select(0, torch.argsort(perm))
        return wait_tensor(all_to_all_single_autograd(y_source_order.contiguous(), in_splits, out_splits, self.group))


def _regroup_by_expert(recv_counts: torch.Tensor) -> torch.Tensor:
    """Row order that turns (source, expert)-ordered rows into (expert, source)-ordered rows."""
    flat = recv_counts.reshape(-1)
    starts = (torch.cumsum(flat, 0) - flat).reshape(recv_counts.shape)
    ep, el = recv_counts.shape
    pieces = [torch.arange(int(starts[s, e]), int(starts[s, e] + recv_counts[s, e])) for e in range(el) for s in range(ep)]
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long)


def apply_expert_parallel(model: nn.Module, mesh: DeviceMesh) -> None:
    """Shard every MoE's experts over ``ep`` (dim 0) and install the all-to-all dispatcher.

    ``mesh`` is the 1-D ``ep`` mesh, or the 2-D ``(ep, tp)`` mesh when the experts are already
    split over TP (:func:`apply_expert_tensor_parallel`): their TP placement is kept on the inner dim.
    """
    ep_mesh = mesh["ep"] if mesh.ndim == 2 else mesh
    group, ep = ep_mesh.get_group(), ep_mesh.size()
    for module in model.modules():
        if isinstance(module, GroupedExperts):
            for name in ("w1", "w2", "w3"):
                param = getattr(module, name)
                inner = list(param.placements) if isinstance(param, DTensor) else []
                if len(inner) + 1 != mesh.ndim:
                    raise ValueError(f"expert weight {name} on a {len(inner)}-D mesh cannot go on a {mesh.ndim}-D EP mesh")
                full = torch.empty(param.shape, dtype=param.dtype, device=param.device)  # global shape (meta)
                module.register_parameter(name, nn.Parameter(distribute_tensor(full, mesh, [Shard(0), *inner],
                                                                               src_data_rank=None)))
            module.dispatcher = AllToAllDispatcher(group, ep, module.w1.shape[0])
            module.grad_scale = 1.0 / ep  # see GradScale: the mean over all data ranks


# ---- expert tensor parallelism ----------------------------------------------------------------

def _sum(t: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return wait_tensor(funcol.all_reduce(t.contiguous(), "sum", group))


class _CopyToTP(torch.autograd.Function):
    """Megatron's ``f``: identity forward; backward sums the (partial) gradient over TP. Used at the
    region's entry (the input) and on the replicated router weight inside the region."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _sum(grad, ctx.group), None


class _SumOverTP(torch.autograd.Function):
    """Megatron's ``g``: forward sums the partial outputs over TP; backward passes the gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        return _sum(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class _GatherSequence(torch.autograd.Function):
    """SP entry: all-gather the sequence (dim 1); backward reduce-scatters the partial gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return wait_tensor(funcol_names.all_gather(x.contiguous(), 1, group))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return wait_tensor(funcol_names.reduce_scatter(grad.contiguous(), "sum", 1, ctx.group)), None


class _ScatterSequence(torch.autograd.Function):
    """SP exit: reduce-scatter the partial outputs along the sequence; backward all-gathers."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return wait_tensor(funcol_names.reduce_scatter(x.contiguous(), "sum", 1, group))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return wait_tensor(funcol_names.all_gather(grad.contiguous(), 1, ctx.group)), None


class ExpertTPRegion:
    """The MoE block as one TP region (module docstring): :meth:`enter` gives every TP rank the
    full local token set, :meth:`exit` sums the partial outputs (SP: back to sequence shards)."""

    def __init__(self, tp_mesh: DeviceMesh, sequence_parallel: bool):
        self.group, self.size, self.sp = tp_mesh.get_group(), tp_mesh.size(), sequence_parallel

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(x, DTensor):  # the SP norm's output: local sequence shard, Shard(1)
            x = x.to_local()
        return _GatherSequence.apply(x, self.group) if self.sp else _CopyToTP.apply(x, self.group)

    def exit(self, out: torch.Tensor) -> torch.Tensor:
        return _ScatterSequence.apply(out, self.group) if self.sp else _SumOverTP.apply(out, self.group)

    def replicated(self, w: torch.Tensor) -> torch.Tensor:
        return _CopyToTP.apply(w, self.group)


def apply_expert_tensor_parallel(moe: MoE, tp_mesh: DeviceMesh, sequence_parallel: bool) -> None:
    """Split ``moe``'s routed experts (w1/w3 ``Shard(1)``, w2 ``Shard(2)``) and shared experts
    (w1/w3 ``Shard(0)``, w2 ``Shard(1)``) over ``tp_mesh`` and make the block a TP region."""
    def shard(module: nn.Module, name: str, dim: int) -> None:
        param = getattr(module, name)
        module.register_parameter(name, nn.Parameter(distribute_tensor(param, tp_mesh, [Shard(dim)], src_data_rank=None)))

    for name, dim in (("w1", 1), ("w3", 1), ("w2", 2)):
        shard(moe.experts, name, dim)
    if moe.shared is not None:
        for name, dim in (("w1", 0), ("w3", 0), ("w2", 1)):
            shard(getattr(moe.shared, name), "weight", dim)
    moe.tp_region = ExpertTPRegion(tp_mesh, sequence_parallel)
    moe.aux_grad_share = 1.0 / tp_mesh.size()
