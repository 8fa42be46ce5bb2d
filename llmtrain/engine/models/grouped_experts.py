"""The routed experts' SwiGLU (:class:`GroupedExperts`): stacked weights ``w1``/``w3`` [E, F, H] and
``w2`` [E, H, F], run over token rows grouped by expert, either as three ``torch._grouped_mm``
calls (CUDA, bf16 or bf16 autocast) or as a per-expert loop (everywhere else; exact); with LoRA on
the experts (``train.lora.experts``, :mod:`llmtrain.engine.finetune.lora_experts`) each adapted
projection adds ``scale * (x A_e^T) B_e^T`` per expert, in factored form (the rank-r intermediate,
never a merged ``[E, F, H]`` weight: that would be saved for backward like an activation). Split from
:mod:`llmtrain.engine.models.moe` (which re-exports these names) by concept: the router, load
balancing and dispatch stay there, the expert GEMMs are here."""

from __future__ import annotations

import os

import torch
from torch import nn

from llmtrain.engine.models.swiglu import swiglu

GROUP_ALIGN = 16  # rows per expert group are padded to this for the CUDA grouped GEMM


def grouped_mm_dtype(x: torch.Tensor) -> torch.dtype | None:
    """The dtype the grouped GEMM runs ``x``'s experts in, or None (the per-expert loop): bf16
    inputs as they are (FSDP2's bf16 MixedPrecisionPolicy, and the trainer's zero 0/1 autocast path,
    whose residual stream is bf16: models/llama.py), and fp32 inputs under a bf16 autocast of their
    device type (an fp32 stream, as that path had before: autocast leaves ``_grouped_mm`` uncast,
    seen on CPU with torch 2.13, so the loop ran).
    bf16 here computes what the loop does under autocast: bf16 inputs, fp32 accumulation, bf16 out."""
    if not hasattr(torch, "_grouped_mm") or os.environ.get("LLMTRAIN_GROUPED_MM", "1") != "1":
        return None
    if x.dtype == torch.bfloat16:
        return torch.bfloat16
    kind = x.device.type
    if x.dtype == torch.float32 and torch.is_autocast_enabled(kind) and torch.get_autocast_dtype(kind) == torch.bfloat16:
        return torch.bfloat16
    return None


# LoRA factors of the routed experts that expert-TP leaves whole on every TP rank: A of the column-wise w1 / w3
# (their F rows split), B of the row-wise w2 (its F columns split); their gradients are partial sums over TP
TP_REPLICATED = (("a", "w1"), ("a", "w3"), ("b", "w2"))


class ExpertAdapters:
    """The routed experts' LoRA factors on this rank: ``pairs[target] = (A [E_local, r, in], B
    [E_local, out, r])`` (local tensors, gradient hooks applied) and the update's ``scale``."""

    def __init__(self, pairs: dict[str, tuple[torch.Tensor, torch.Tensor]], scale: float):
        self.pairs, self.scale = pairs, scale

    @property
    def rank(self) -> int:
        return next(iter(self.pairs.values()))[0].shape[1]

    def cast(self, dtype: torch.dtype) -> ExpertAdapters:
        return ExpertAdapters({t: (a.to(dtype), b.to(dtype)) for t, (a, b) in self.pairs.items()}, self.scale)


def use_grouped_mm(x: torch.Tensor) -> bool:
    """Grouped GEMM where torch offers it: CUDA, ``torch._grouped_mm`` present (Hopper+), bf16
    inputs or fp32 ones under bf16 autocast (:func:`grouped_mm_dtype`). On CPU torch 2.13's
    ``_grouped_mm`` runs forward but its backward fails, so CPU loops."""
    return x.is_cuda and grouped_mm_dtype(x) is not None


def grouped_swiglu_autocast(
    x_grouped: torch.Tensor, counts: list[int], w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor,
    adapters: ExpertAdapters | None = None,
) -> torch.Tensor:
    """:func:`grouped_swiglu_gemm` in bf16 for fp32 inputs under bf16 autocast: inputs and weights
    cast explicitly (differentiable: fp32 weights get fp32 gradients, as under autocast) inside an
    autocast-disabled region, so a torch that one day lists ``_grouped_mm`` cannot cast it again."""
    bf16 = torch.bfloat16
    with torch.autocast(x_grouped.device.type, enabled=False):
        return grouped_swiglu_gemm(x_grouped.to(bf16), counts, w1.to(bf16), w2.to(bf16), w3.to(bf16),
                                   None if adapters is None else adapters.cast(bf16))


def grouped_swiglu_gemm(
    x_grouped: torch.Tensor, counts: list[int], w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor,
    adapters: ExpertAdapters | None = None,
) -> torch.Tensor:
    """All experts in three ``torch._grouped_mm`` calls (two more per adapted projection, the
    factored LoRA update). Each group is zero-padded to a multiple of :data:`GROUP_ALIGN` rows (the
    kernel's alignment), and the padding is dropped after."""
    padded = [-(-c // GROUP_ALIGN) * GROUP_ALIGN for c in counts]
    starts = [sum(padded[:e]) for e in range(len(counts))]
    rows = torch.cat([torch.arange(s, s + c, device=x_grouped.device) for s, c in zip(starts, counts)]) \
        if sum(counts) else torch.zeros(0, dtype=torch.long, device=x_grouped.device)
    xp = x_grouped.new_zeros(max(sum(padded), GROUP_ALIGN), x_grouped.shape[1]).index_copy(0, rows, x_grouped)
    offs = torch.tensor([sum(padded[: e + 1]) for e in range(len(counts))], dtype=torch.int32, device=x_grouped.device)
    def project(x: torch.Tensor, w: torch.Tensor, target: str) -> torch.Tensor:
        y = torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)
        if adapters is not None and target in adapters.pairs:
            a, b = adapters.pairs[target]
            u = torch._grouped_mm(x, a.transpose(-2, -1), offs=offs)
            y = y + adapters.scale * torch._grouped_mm(u, b.transpose(-2, -1), offs=offs)
        return y

    gate, up = project(xp, w1, "w1"), project(xp, w3, "w3")
    out = project(swiglu(gate, up), w2, "w2")
    return out.index_select(0, rows)


def grouped_swiglu(
    x_grouped: torch.Tensor, counts: list[int], w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor,
    adapters: ExpertAdapters | None = None,
) -> torch.Tensor:
    """Run expert ``e``'s SwiGLU on the ``counts[e]`` consecutive rows of ``x_grouped`` [N, H].
    The grouped GEMM takes adapters of a rank that keeps its rows 16-byte aligned (a multiple of 8
    in bf16); others run the loop."""
    if use_grouped_mm(x_grouped) and (adapters is None or adapters.rank % 8 == 0):
        if any(t.dtype != torch.bfloat16 for t in (x_grouped, w1, w2, w3)):  # under bf16 autocast: fp32 weights
            return grouped_swiglu_autocast(x_grouped, counts, w1, w2, w3, adapters)
        return grouped_swiglu_gemm(x_grouped, counts, w1, w2, w3, adapters)
    pairs = {} if adapters is None else adapters.pairs

    def project(x: torch.Tensor, w: torch.Tensor, e: int, target: str) -> torch.Tensor:
        y = x @ w[e].t()
        if target in pairs:
            a, b = pairs[target]
            y = y + adapters.scale * ((x @ a[e].t()) @ b[e].t())
        return y

    outputs = []
    for e, chunk in enumerate(torch.split(x_grouped, counts)):
        if chunk.shape[0] == 0:
            outputs.append(chunk.new_zeros(0, w2.shape[1]))
            continue
        gate, up = project(chunk, w1, e, "w1"), project(chunk, w3, e, "w3")
        outputs.append(project(swiglu(gate, up), w2, e, "w2"))
    return torch.cat(outputs, dim=0)


class GradScale(torch.autograd.Function):
    """Identity in forward; multiplies the gradient by ``scale`` in backward.

    With expert parallelism an expert's weight gradient sums the tokens of its whole EP group
    (they were sent to it), while the data-parallel reduction afterwards averages only over the
    ``edp`` ranks holding the same expert. Scaling by ``1 / ep`` here makes the result the mean
    over all data ranks, like every other weight, on any backend (gloo has no pre-multiplied
    reduce-scatter for FSDP's divide factor).
    """

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


class GroupedExperts(nn.Module):
    """The routed experts' stacked SwiGLU weights ``w1``/``w3`` [E, ffn, hidden], ``w2`` [E, hidden, ffn].

    A module of their own so that expert parallelism can shard exactly these (dim 0) and FSDP
    can wrap them on the expert-data-parallel mesh, apart from the router and shared experts,
    which are data-parallel over all ranks. ``dispatcher`` (None = all experts local) is set by
    expert parallelism: it moves token rows to the ranks owning their experts and back, calling
    :meth:`local_forward` in between.
    """

    def __init__(self, num_experts: int, hidden: int, ffn: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num_experts, ffn, hidden))
        self.w3 = nn.Parameter(torch.empty(num_experts, ffn, hidden))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, ffn))
        self.dispatcher = None
        self.grad_scale = 1.0  # set by expert parallelism, see GradScale
        # LoRA on the experts (engine/finetune/lora_experts.py) registers ParameterDicts ``lora_a`` /
        # ``lora_b`` keyed by target and sets these: the update's scale, and with expert-TP the
        # hook that sums a TP-replicated factor's gradient over TP (:data:`TP_REPLICATED`)
        self.lora_scale = 0.0
        self.lora_tp_sum = None

    def _local(self, w: torch.Tensor, replicated: bool = False) -> torch.Tensor:
        w = w.to_local() if hasattr(w, "to_local") else w
        if replicated and self.lora_tp_sum is not None:
            w = self.lora_tp_sum(w)
        return GradScale.apply(w, self.grad_scale) if self.grad_scale != 1.0 else w

    def adapters(self) -> ExpertAdapters | None:
        """This rank's adapter factors (None without LoRA on the experts)."""
        lora_a, lora_b = getattr(self, "lora_a", None), getattr(self, "lora_b", None)
        if lora_a is None:
            return None
        pairs = {t: (self._local(lora_a[t], ("a", t) in TP_REPLICATED),
                     self._local(lora_b[t], ("b", t) in TP_REPLICATED)) for t in lora_a.keys()}
        return ExpertAdapters(pairs, self.lora_scale)

    def local_forward(self, x_grouped: torch.Tensor, counts: list[int]) -> torch.Tensor:
        w1, w2, w3 = (self._local(w) for w in (self.w1, self.w2, self.w3))
        return grouped_swiglu(x_grouped, counts, w1, w2, w3, self.adapters())

    def forward(self, x_grouped: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Rows of ``x_grouped`` [N, H] grouped by global expert id, ``counts`` [E] rows each."""
        if self.dispatcher is not None:
            return self.dispatcher(self, x_grouped, counts)
        return self.local_forward(x_grouped, counts.tolist())
