"""AdamW with parameter groups and the learning-rate schedule.

Weight decay applies to matrices only: embeddings, norms (1-D weights) and biases get none,
as in GPT-3/Llama training practice — decaying an embedding row pulls rarely seen tokens to
zero, and decaying norm gains fights the normalization itself.

Schedule (multiplier of the peak lr at optimizer step ``s``, 0-based): linear warmup
``(s + 1) / warmup`` for ``s < warmup``, then over the remaining steps
``cosine``: min + (1 - min)(1 + cos(pi t)) / 2, ``linear``: 1 - (1 - min) t, ``constant``: 1,
``wsd`` (warmup-stable-decay): 1 until the last ``wsd_decay_fraction`` of the run, then linear
to min; where ``t`` in [0, 1] is the progress after warmup and ``min = min_lr_ratio``.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from llmtrain.engine.quant_optim import make_state_optimizer, set_group_lr
from llmtrain.recipe.schema import ScheduleConfig, TrainConfig


def is_expert_param(name: str) -> bool:
    """Routed-expert weights: sharded by EP, data-parallel over the expert-DP group only."""
    return ".experts." in name


def param_groups(model: nn.Module, weight_decay: float, select=None) -> list[dict]:
    """Decay / no-decay groups, further split by tensor kind (plain, or DTensor per mesh and
    placements): the foreach AdamW kernels cannot mix plain tensors and DTensors (e.g. TP
    without sequence parallelism leaves norm weights plain), so each group is homogeneous."""
    groups: dict[tuple, dict] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad or (select is not None and not select(name)):
            continue
        no_decay = p.ndim < 2 or "tok_embeddings" in name or name.endswith(".bias") or (
            name == "output.weight" and getattr(model, "tie_embeddings", False))  # a tied copy (PP): as the embedding
        kind = (id(p.device_mesh), p.placements) if isinstance(p, DTensor) else None
        group = groups.setdefault((no_decay, kind), {"params": [], "weight_decay": 0.0 if no_decay else weight_decay})
        group["params"].append(p)
    return list(groups.values())


def make_adamw(train: TrainConfig):
    o = train.optimizer

    def make(groups: list[dict]) -> torch.optim.Optimizer:
        if o.states != "fp32":  # bf16 / 8-bit moments: torchao's AdamW kernels (engine/quant_optim.py)
            return make_state_optimizer(o.states, groups, o.lr, o.betas, o.eps, o.weight_decay)
        # fused: one multi-tensor kernel per group (about 8x faster than foreach on CPU for a 60M
        # model, benchmarks/engine_throughput.py notes; the default of HF's Trainer on torch >= 2.8)
        return torch.optim.AdamW(groups, lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay,
                                 fused=True)

    return make


def lr_multiplier(step: int, steps: int, cfg: ScheduleConfig) -> float:
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    rest = max(1, steps - cfg.warmup_steps)
    t = min(1.0, (step - cfg.warmup_steps) / rest)
    lo = cfg.min_lr_ratio
    if cfg.decay == "constant":
        return 1.0
    if cfg.decay == "cosine":
        return lo + (1 - lo) * 0.5 * (1 + math.cos(math.pi * t))
    if cfg.decay == "linear":
        return 1 - (1 - lo) * t
    start = 1 - cfg.wsd_decay_fraction  # wsd
    return 1.0 if t < start else 1 - (1 - lo) * (t - start) / cfg.wsd_decay_fraction


def set_lr(optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        set_group_lr(group, lr)
