"""Low-rank adapters (LoRA, Hu et al. 2021, arXiv:2106.09685) on the engine's linear projections.

``y = W x + b + (alpha / r) * B A dropout(x)`` with ``A`` [r, in] and ``B`` [out, r]; only A and
B train, everything else (embeddings, norms, output head, biases, routers, experts) is frozen.

:func:`apply_lora` runs inside :func:`llmtrain.engine.parallelize.parallelize` on the meta-device
model, after tensor/context/expert parallelism and before activation checkpointing, compile
and FSDP2 (so those wrap the adapters like any other parameter). Decisions:

* **Class swap, not a wrapper.** Each target ``nn.Linear`` becomes a :class:`LoRALinear`
  (``module.__class__ = LoRALinear``, a subclass; FSDP2 swaps classes the same way). The module
  object stays, so the forward hooks tensor parallelism installed on it keep working, and the
  base keeps its names ``...wq.weight`` / ``...wq.bias`` that checkpoints, init and the HF tensor
  map rely on. The adapters are child modules: ``layers.N.attention.wq.lora_a.weight`` and
  ``...lora_b.weight`` (PEFT's ``lora_A``/``lora_B`` on export, :mod:`.peft_export`).
* **Tensor parallelism.** Inside the TP hooks the input and the base weight are DTensors; the
  adapters are DTensors on the same TP mesh, placed so that the adapter path has the base's
  output layout with no communication of its own: column-wise bases (``wq wk wv w1 w3``,
  weight ``Shard(0)``): ``A`` Replicate, ``B`` ``Shard(0)`` (output sharded on features like
  ``W x``); row-wise bases (``wo w2``, weight ``Shard(1)``, input sharded on features): ``A``
  ``Shard(1)``, ``B`` Replicate — ``A x`` is then a Partial sum, ``B (A x)`` too, like ``W x``,
  and TP's output hook reduces the sum once (all-reduce, or reduce-scatter with sequence
  parallelism). The rank-r intermediate is tiny, so replicating it costs nothing.
* **MoE.** The attention projections and dense ``feed_forward`` MLPs get adapters; the routed
  experts only with ``lora.experts`` (per-expert stacked adapters, :mod:`.lora_experts`); routers and
  shared experts stay frozen (plan/validate.py warns when MLP targets leave MoE layers unadapted).
* **Initialization** (:mod:`llmtrain.engine.models.init`, layout-independent like every weight):
  ``A`` kaiming-uniform(a=sqrt(5)) as PEFT's default, ``B`` zeros, so step 0 is the base model.
* **Dropout** on the adapter input uses torch's RNG on each rank (``nn.Dropout``; identity at 0,
  the default). The masks are not layout-independent: multi-rank parity is only claimed for 0.

:func:`merge_lora` folds adapters into full (unsharded) base tensors for the exports.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from llmtrain.recipe.schema import LoRAConfig

ATTENTION = ("wq", "wk", "wv", "wo")
MLP = ("w1", "w2", "w3")
ROW_WISE = ("wo", "w2")  # their TP weight is Shard(1); the others are column-wise, Shard(0)
ADAPTERS = ("lora_a", "lora_b")


def is_adapter_key(name: str) -> bool:
    """Whether a parameter / state-dict name is a LoRA adapter tensor."""
    return ".lora_a." in name or ".lora_b." in name or name.endswith((".lora_a", ".lora_b"))


def target_path(target: str) -> str:
    """``wq`` -> ``attention.wq``, ``w1`` -> ``feed_forward.w1`` (under ``layers.N.``)."""
    return f"attention.{target}" if target in ATTENTION else f"feed_forward.{target}"


class LoRALinear(nn.Linear):
    """An ``nn.Linear`` with a low-rank update; made by :func:`apply_lora` (class swap), never built directly."""

    lora_a: nn.Linear
    lora_b: nn.Linear
    lora_dropout: nn.Module
    lora_scale: float

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias) + self.lora_scale * self.lora_b(self.lora_a(self.lora_dropout(x)))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, lora_rank={self.lora_a.out_features}, lora_scale={self.lora_scale:g}"


def _adapter(in_features: int, out_features: int, like: torch.Tensor, placement) -> nn.Linear:
    """A bias-free Linear on ``like``'s device and dtype; a DTensor on ``like``'s mesh when it is one."""
    lin = nn.Linear(in_features, out_features, bias=False, device=like.device, dtype=like.dtype)
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(like, DTensor):
        w = distribute_tensor(lin.weight.detach(), like.device_mesh, [placement], src_data_rank=None)
        lin.weight = nn.Parameter(w)
    return lin


def _tp_placements(target: str):
    from torch.distributed.tensor import Replicate, Shard

    return (Shard(1), Replicate()) if target in ROW_WISE else (Replicate(), Shard(0))


def add_adapter(linear: nn.Linear, target: str, cfg: LoRAConfig) -> LoRALinear:
    """Turn ``linear`` into a :class:`LoRALinear` in place (see the module docstring)."""
    from torch.distributed.tensor import DTensor

    w = linear.weight
    if isinstance(w, DTensor) and (w.device_mesh.ndim != 1 or len(w.placements) != 1):
        raise ValueError(f"LoRA: {target} weight is a DTensor on a {w.device_mesh.ndim}-D mesh; apply LoRA after "
                         "tensor parallelism and before FSDP")
    out_features, in_features = w.shape
    place_a, place_b = _tp_placements(target)
    linear.lora_a = _adapter(in_features, cfg.rank, w, place_a)
    linear.lora_b = _adapter(cfg.rank, out_features, w, place_b)
    linear.lora_dropout = nn.Dropout(cfg.dropout) if cfg.dropout > 0 else nn.Identity()
    linear.lora_scale = float(cfg.scale)
    linear.__class__ = LoRALinear
    return linear


def apply_lora(model: nn.Module, cfg: LoRAConfig, tp_mesh=None) -> list[str]:
    """Add adapters to every target projection of every block of ``model`` (a pipeline chunk
    holds some blocks) and freeze every other parameter; returns the adapted module names.
    ``tp_mesh``: the TP mesh or None (the placements follow each base weight's own DTensor-ness;
    the argument documents the contract and is checked against it)."""
    from torch.distributed.tensor import DTensor

    from llmtrain.engine.finetune.lora_experts import add_expert_adapters

    adapted = []
    for p in model.parameters():
        p.requires_grad_(False)
    for layer_id, block in model.layers.items():
        if hasattr(block, "moe"):
            adapted += [f"layers.{layer_id}.{name}" for name in add_expert_adapters(block.moe, cfg)]
        for target in cfg.target_names:
            parent = block.attention if target in ATTENTION else getattr(block, "feed_forward", None)
            linear = getattr(parent, target, None) if parent is not None else None
            if not isinstance(linear, nn.Linear) or isinstance(linear, LoRALinear):
                continue  # MoE layers have no dense feed_forward
            w = linear.weight
            if tp_mesh is not None and isinstance(w, DTensor) and w.device_mesh != tp_mesh:
                raise ValueError(f"LoRA: layers.{layer_id}.{target_path(target)} is sharded on another mesh than tp")
            add_adapter(linear, target, cfg)
            adapted.append(f"layers.{layer_id}.{target_path(target)}")
    return adapted


# -- merging (full tensors, for the exports) ------------------------------------------------------

def adapter_keys(base_key: str) -> tuple[str, str]:
    """``layers.0.attention.wq.weight`` -> its ``lora_a`` and ``lora_b`` weight keys; a routed experts'
    stacked ``layers.N.moe.experts.w1`` -> ``layers.N.moe.experts.lora_a.w1`` / ``lora_b.w1``."""
    if ".experts." in base_key and not base_key.endswith(".weight"):
        stem, target = base_key.rsplit(".", 1)
        return f"{stem}.lora_a.{target}", f"{stem}.lora_b.{target}"
    stem = base_key.removesuffix(".weight")
    return f"{stem}.lora_a.weight", f"{stem}.lora_b.weight"


def merge_one(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """``W + scale * B @ A`` computed in fp64, returned in ``W``'s dtype or fp32 if that is narrower
    (a bf16 base keeps the update's precision until the export's own ``--dtype`` cast). Stacked routed
    experts (``W`` ``[E, out, in]``, ``A`` ``[E, r, in]``, ``B`` ``[E, out, r]``) merge per expert: ``@`` batches."""
    out = weight.double() + scale * (b.double() @ a.double())
    return out.to(torch.promote_types(weight.dtype, torch.float32))


def merge_lora(state: dict[str, torch.Tensor], cfg: LoRAConfig) -> dict[str, torch.Tensor]:
    """A full (unsharded) model state dict with adapters -> the merged one, adapter keys removed.

    Every ``X.lora_a.weight`` needs its ``X.lora_b.weight`` and ``X.weight``, every expert
    ``X.lora_a.t`` its ``X.lora_b.t`` and ``X.t``; a lone adapter is an error."""
    out = {k: v for k, v in state.items() if not is_adapter_key(k)}
    for key in [k for k in state if ".lora_a." in k]:
        stem, leaf = key.rsplit(".lora_a.", 1)  # X.lora_a.weight -> X.weight; ...experts.lora_a.w1 -> ...experts.w1
        base = f"{stem}.{leaf}"
        b_key = adapter_keys(base)[1]
        if base not in state or b_key not in state:
            raise KeyError(f"merge_lora: {key} without {base if base not in state else b_key}")
        out[base] = merge_one(state[base], state[key], state[b_key], cfg.scale)
    return out


def adapter_shapes(model_cfg, cfg: LoRAConfig) -> dict[str, tuple[int, ...]]:
    """``<our adapter key> -> shape`` for a model (no ``model.`` prefix); MoE layers get attention adapters,
    and their routed experts stacked ``[E, ...]`` ones with ``cfg.experts``."""
    head, h = model_cfg.head_dim, model_cfg.hidden
    dims = {"wq": (h, model_cfg.heads * head), "wk": (h, model_cfg.kv_heads * head),
            "wv": (h, model_cfg.kv_heads * head), "wo": (model_cfg.heads * head, h),
            "w1": (h, model_cfg.ffn_hidden), "w3": (h, model_cfg.ffn_hidden), "w2": (model_cfg.ffn_hidden, h)}
    out = {}
    for i in range(model_cfg.layers):
        for t in cfg.target_names:
            if t in MLP and model_cfg.is_moe_layer(i):
                continue
            fan_in, fan_out = dims[t]
            a, b = adapter_keys(f"layers.{i}.{target_path(t)}.weight")
            out[a], out[b] = (cfg.rank, fan_in), (fan_out, cfg.rank)
        if cfg.experts and model_cfg.is_moe_layer(i):
            e, f = model_cfg.moe.num_experts, model_cfg.expert_ffn
            for t in (t for t in cfg.target_names if t in MLP):
                fan_in, fan_out = (h, f) if t != "w2" else (f, h)
                stem = f"layers.{i}.moe.experts"
                out[f"{stem}.lora_a.{t}"], out[f"{stem}.lora_b.{t}"] = (e, cfg.rank, fan_in), (e, fan_out, cfg.rank)
    return out
