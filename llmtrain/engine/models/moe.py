"""Mixture-of-experts block: router, routed SwiGLU experts, shared experts, load balancing.

Shapes: ``T`` tokens (batch x sequence, flattened), ``E`` routed experts, ``k`` = top_k,
``H`` = hidden, ``F`` = expert FFN width.

Routing (:func:`route_tokens`)
    ``router`` is a bias-free ``Linear(H, E)``; its logits are scored in fp32 with softmax
    (Mixtral, Switch) or sigmoid (DeepSeek-V3). Top-k experts are selected per token. Mixtral
    weights are the softmax probabilities of the selected experts renormalized to sum 1;
    ``moe.norm_topk_prob: false`` keeps the raw selected probabilities instead (Qwen3-MoE's
    ``norm_topk_prob``; Qwen3-30B-A3B itself renormalizes). This is transformers' math
    (``MixtralTopKRouter``, ``Qwen3MoeTopKRouter``): fp32 softmax of the logits, ``topk``,
    optional division by the sum; the weights stay fp32 until they scale the expert outputs
    (cast to the activation dtype there, as Qwen3-MoE does; Mixtral multiplies in fp32 and
    casts after, a bf16 rounding difference only). DeepSeek-V3 weights are the selected
    sigmoid scores normalized to sum 1 (no routed scaling factor). With ``top_k == 1`` and a
    renormalizing softmax router the weight is always 1, so the router then learns only
    through the auxiliary loss, exactly as in Mixtral's formula.

Load balancing, ``moe.balance``
    * ``aux_loss``: Switch-Transformer loss (arXiv:2101.03961)
      ``coef * E * sum_e f_e * P_e``, ``f_e`` = fraction of the ``T*k`` token slots routed to
      ``e`` (not differentiable), ``P_e`` = mean router probability of ``e`` (softmax probs;
      for a sigmoid router the scores normalized per token). A perfectly balanced router
      gives exactly ``coef``. It is computed per forward call (per micro-batch, on the local
      tokens of this rank), as in Megatron-Core.
    * ``bias``: DeepSeek-V3's auxiliary-loss-free balancing (arXiv:2412.19437, §2.1.2). A
      buffer ``expert_bias`` [E] (in the state dict only with ``balance: bias``, where it is
      learned state; Hugging Face checkpoints have no such tensor) is added to the scores
      **for selection only**; the combine
      weights come from the unbiased scores. ``tokens_per_expert`` [E] (fp32) counts routed
      slots in training-mode forwards; :func:`update_expert_bias` turns the counts into
      ``bias += rate * sign(mean - count)`` and zeroes them. The bias learns no gradient.
      Under activation recomputation a block's forward runs twice, doubling every count of
      that step alike; since the update uses only the sign of ``mean - count`` this changes
      nothing. The DeepSeek-V3 sequence-wise auxiliary loss is not implemented: with
      ``balance: bias`` no auxiliary loss is used, whatever ``aux_loss_coef`` says.

How the aux loss reaches the gradients (:class:`AuxLossAutoScaler`)
    The loss is attached to the autograd graph instead of being returned: an autograd
    Function returns the MoE output unchanged and, in backward, also sends a gradient of
    ``aux_loss_scale`` (default 1) into the aux-loss graph (Megatron-Core's "aux loss auto
    scaler"). The trainer therefore never collects per-layer losses, and pipeline stages
    (whose ``forward`` must return only hidden states) need no extra outputs: the gradient
    reaches the router whenever the stage's output receives one. Set ``aux_loss_scale``
    (:func:`set_aux_loss_scale`) to the factor the trainer applies to the main loss before
    ``backward`` (e.g. ``1 / grad_accum``); leave it 1 if gradients are scaled after backward.
    ``last_aux_loss`` keeps the detached value (coef included, scale not) for logging.

Experts and capacity
    Routed experts are stacked parameters ``w1``/``w3`` [E, F, H] and ``w2`` [E, H, F], so
    expert parallelism can shard dim 0 and expert tensor parallelism the F dim (1 / 2). The computation sorts token slots by expert
    (:func:`dispatch_order`), gathers them (``index_select``), runs one SwiGLU per expert on
    its contiguous chunk (:func:`grouped_swiglu`: on CUDA in bf16, also fp32 under bf16 autocast,
    three ``torch._grouped_mm`` calls; elsewhere a Python loop, simple and exact; EP can wrap an
    all-to-all around this function), weights the results and
    scatters them back with ``index_add``. All steps are differentiable. With
    ``capacity_factor``, each expert keeps at most ``ceil(factor * T * k / E)`` slots, the
    earliest by flat token index (batch row, then position) of this forward call; dropped
    slots contribute zero (the token still gets its other experts and the shared ones).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from llmtrain.engine.models.grouped_experts import (  # noqa: F401  (re-exported: the experts' SwiGLU lives there)
    GROUP_ALIGN,
    GradScale,
    GroupedExperts,
    grouped_mm_dtype,
    grouped_swiglu,
    grouped_swiglu_autocast,
    grouped_swiglu_gemm,
    use_grouped_mm,
)
from llmtrain.engine.models.swiglu import gated, swiglu
from llmtrain.recipe.schema import ModelConfig


class FeedForward(nn.Module):
    """SwiGLU MLP ``w2(silu(w1 x) * w3 x)`` without biases: the dense block MLP and the shared experts;
    ``activation`` gelu_tanh makes it Gemma's GeGLU (dense MLPs only: validation refuses it with MoE)."""

    def __init__(self, hidden: int, ffn_hidden: int, activation: str = "silu"):
        super().__init__()
        self.w1 = nn.Linear(hidden, ffn_hidden, bias=False)  # gate
        self.w3 = nn.Linear(hidden, ffn_hidden, bias=False)  # up
        self.w2 = nn.Linear(ffn_hidden, hidden, bias=False)  # down
        self.activation = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(gated(self.w1(x), self.w3(x), self.activation))

    def local_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The same on this rank's weight shards as plain tensors (the shared experts inside an
        expert-TP region, :mod:`llmtrain.engine.parallel.expert`: a partial sum over TP)."""
        w1, w2, w3 = (_local(lin.weight) for lin in (self.w1, self.w2, self.w3))
        return F.linear(swiglu(F.linear(x, w1), F.linear(x, w3)), w2)


def _local(w: torch.Tensor) -> torch.Tensor:
    return w.to_local() if hasattr(w, "to_local") else w


@dataclass
class Routing:
    """Result of :func:`route_tokens` for ``T`` tokens."""

    expert_idx: torch.Tensor  # [T, k] int64, selected experts
    weights: torch.Tensor  # [T, k] fp32 combine weights (rows sum to 1 unless norm_topk_prob is off)
    probs: torch.Tensor  # [T, E] fp32 per-token router distribution used by the aux loss


def route_tokens(
    logits: torch.Tensor, top_k: int, score_fn: str, expert_bias: torch.Tensor | None = None,
    normalize: bool = True,
) -> Routing:
    """Select ``top_k`` experts per token from router ``logits`` [T, E] and compute combine weights.

    ``expert_bias`` (if given) shifts the scores used for selection only. ``normalize`` (softmax
    only; sigmoid scores are always normalized) divides the selected probabilities by their sum.
    """
    logits = logits.float()
    if score_fn == "softmax":
        scores = logits.softmax(dim=-1)
        probs = scores
    elif score_fn == "sigmoid":
        scores = logits.sigmoid()
        probs = scores / scores.sum(dim=-1, keepdim=True)
    else:
        raise ValueError(f"unknown router score function {score_fn!r}; use 'softmax' or 'sigmoid'")
    selection = scores if expert_bias is None else scores + expert_bias.detach().float()
    expert_idx = selection.topk(top_k, dim=-1).indices
    chosen = scores.gather(-1, expert_idx)
    if score_fn == "softmax" and not normalize:
        return Routing(expert_idx, chosen, probs)
    weights = chosen / chosen.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(chosen.dtype).tiny)
    return Routing(expert_idx, weights, probs)


def load_balancing_loss(probs: torch.Tensor, expert_idx: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Switch-Transformer balance loss ``E * sum_e f_e * P_e`` (without the coefficient).

    ``f_e``: fraction of the ``T * k`` token slots in ``expert_idx`` routed to ``e`` (constant);
    ``P_e``: mean of ``probs[:, e]`` over tokens (differentiable). Balanced routing gives 1.
    """
    counts = torch.bincount(expert_idx.reshape(-1), minlength=num_experts).to(probs.dtype)
    fraction = counts / expert_idx.numel()
    return num_experts * (fraction * probs.mean(dim=0)).sum()


def expert_capacity(num_tokens: int, top_k: int, num_experts: int, factor: float | None) -> int | None:
    """Slots per expert, ``ceil(factor * tokens * top_k / experts)``; None (no limit) without a factor."""
    if factor is None:
        return None
    return math.ceil(factor * num_tokens * top_k / num_experts)


def dispatch_order(
    expert_idx: torch.Tensor, num_experts: int, capacity: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token slots grouped by expert, ascending token index inside each group.

    Returns ``(token_ids, slot_ids, counts)``: ``token_ids[j]`` is the token of the j-th kept
    slot, ``slot_ids[j]`` its column in ``expert_idx``, and ``counts[e]`` how many kept slots
    belong to expert ``e`` (they are consecutive). Slots beyond ``capacity`` are dropped.
    """
    top_k = expert_idx.shape[-1]
    flat = expert_idx.reshape(-1)
    order = torch.argsort(flat, stable=True)  # stable: token order is kept inside each expert
    counts = torch.bincount(flat, minlength=num_experts)
    if capacity is not None:
        starts = torch.cumsum(counts, 0) - counts
        rank_in_expert = torch.arange(flat.numel(), device=flat.device) - starts[flat[order]]
        order = order[rank_in_expert < capacity]
        counts = counts.clamp(max=capacity)
    return order // top_k, order % top_k, counts


class AuxLossAutoScaler(torch.autograd.Function):
    """Identity on the MoE output whose backward also seeds ``d aux_loss = scale``.

    Megatron-Core's auxiliary-loss trick (Shoeybi et al., arXiv:1909.08053, codebase
    ``MoEAuxLossAutoScaler``): the loss joins the graph through the output it rides on.
    """

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux_loss: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.save_for_backward(aux_loss)
        ctx.scale = scale
        return output

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (aux_loss,) = ctx.saved_tensors
        return grad_output, torch.full_like(aux_loss, ctx.scale), None


class MoE(nn.Module):
    """Routed + shared SwiGLU experts for one transformer block (see the module docstring)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        m = cfg.moe
        hidden, ffn = cfg.hidden, cfg.expert_ffn
        self.num_experts, self.top_k = m.num_experts, m.top_k
        self.score_fn, self.balance = m.router, m.balance
        self.norm_topk_prob = m.norm_topk_prob
        self.aux_loss_coef = m.aux_loss_coef if m.balance == "aux_loss" else 0.0
        self.aux_loss_scale = 1.0
        self.bias_update_rate = m.bias_update_rate
        self.capacity_factor = m.capacity_factor
        self.router = nn.Linear(hidden, m.num_experts, bias=False)
        self.experts = GroupedExperts(m.num_experts, hidden, ffn)
        self.shared = FeedForward(hidden, m.shared_experts * ffn) if m.shared_experts > 0 else None
        # Persistent with balance "bias": learned state that must survive checkpoint/resume.
        # Otherwise it stays zero and unused, so it is left out of the state dict (and thus out
        # of checkpoints and the Hugging Face tensor map, which has no counterpart).
        self.register_buffer("expert_bias", torch.zeros(m.num_experts), persistent=m.balance == "bias")
        # Non-persistent: zeroed after every optimizer step, so a checkpoint never needs it.
        self.register_buffer("tokens_per_expert", torch.zeros(m.num_experts), persistent=False)
        self.last_aux_loss: torch.Tensor | None = None
        # Expert tensor parallelism (engine/parallel/expert.py) sets both: the block becomes a TP
        # region whose outputs and gradients are partial sums over the TP ranks; the aux loss,
        # computed identically on each, is then seeded with a 1 / tp share on each.
        self.tp_region = None
        self.aux_grad_share = 1.0

    def route(self, x_flat: torch.Tensor) -> Routing:
        """Route ``x_flat`` [T, H]; the bias is used for selection only when balance is 'bias'."""
        bias = self.expert_bias if self.balance == "bias" else None
        if self.tp_region is None:
            logits = self.router(x_flat)
        else:  # replicated weight inside the region: its gradient is summed over TP
            logits = F.linear(x_flat, self.tp_region.replicated(self.router.weight))
        return route_tokens(logits, self.top_k, self.score_fn, bias, self.norm_topk_prob)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_region is not None:
            x = self.tp_region.enter(x)  # every TP rank: the same full token set
        x_flat = x.reshape(-1, x.shape[-1])
        routing = self.route(x_flat)
        if self.training and self.balance == "bias":
            with torch.no_grad():
                counts = torch.bincount(routing.expert_idx.reshape(-1), minlength=self.num_experts)
                self.tokens_per_expert.add_(counts.to(self.tokens_per_expert.dtype))
        capacity = expert_capacity(x_flat.shape[0], self.top_k, self.num_experts, self.capacity_factor)
        token_ids, slot_ids, counts = dispatch_order(routing.expert_idx, self.num_experts, capacity)
        y = self.experts(x_flat.index_select(0, token_ids), counts)
        y = y * routing.weights[token_ids, slot_ids].unsqueeze(-1).to(y.dtype)
        # y.to: the experts' output in the token stream's dtype (bf16 under autocast too, models/llama.py;
        # an fp32 stream, e.g. precision fp32, gets fp32); index_add needs one dtype
        out = torch.zeros_like(x_flat).index_add(0, token_ids, y.to(x_flat.dtype))
        if self.shared is not None:
            out = out + (self.shared(x_flat) if self.tp_region is None else self.shared.local_forward(x_flat))
        if self.aux_loss_coef > 0:
            aux = self.aux_loss_coef * load_balancing_loss(routing.probs, routing.expert_idx, self.num_experts)
            self.last_aux_loss = aux.detach()
            if torch.is_grad_enabled() and aux.requires_grad:
                out = AuxLossAutoScaler.apply(out, aux, self.aux_loss_scale * self.aux_grad_share)
        out = out.view_as(x)
        return out if self.tp_region is None else self.tp_region.exit(out)


def set_aux_loss_scale(model: nn.Module, scale: float) -> None:
    """Set the backward seed of every MoE aux loss (match the trainer's main-loss scaling)."""
    for module in model.modules():
        if isinstance(module, MoE):
            module.aux_loss_scale = float(scale)


@torch.no_grad()
def update_expert_bias(
    model: nn.Module, all_reduce: Callable[[torch.Tensor], object] | None = None
) -> list[torch.Tensor]:
    """DeepSeek-V3 bias update for every MoE block of ``model`` with ``balance == 'bias'``.

    Call once per optimizer step, **after** ``optimizer.step()`` (i.e. after all micro-batches
    of the step have run forward, so the counts cover the whole step) and before the next
    forward. ``all_reduce``, if given, must sum a tensor in place (or return the sum) over the
    ranks that route *different* tokens through the same layers: the data-parallel ranks
    (dp_replicate x dp_shard, which include the EP ranks) and cp. Every such rank must call
    this with the same set of blocks (true within one pipeline stage). All layers' counts
    travel in one concatenated tensor, so there is a single collective per call.

    Returns the (summed) counts of each updated block, for logging.
    """
    blocks = [m for m in model.modules() if isinstance(m, MoE) and m.balance == "bias"]
    if not blocks:
        return []
    counts = torch.cat([m.tokens_per_expert for m in blocks])
    if all_reduce is not None:
        result = all_reduce(counts)
        if isinstance(result, torch.Tensor):
            counts = result
    per_block = list(torch.split(counts, [m.num_experts for m in blocks]))
    for module, c in zip(blocks, per_block):
        module.expert_bias.add_(module.bias_update_rate * torch.sign(c.mean() - c))
        module.tokens_per_expert.zero_()
    return [c.clone() for c in per_block]
