"""Deterministic, layout-independent weight initialization.

``init_weights(model, seed)`` gives every parameter the same values whatever the parallel
layout (FSDP/TP/EP shards as DTensors, pipeline stages holding a subset of the layers,
activation-checkpoint or compile wrappers) and whatever device the model was built on
(including meta-device construction followed by ``to_empty``):

* Each tensor is keyed by its **canonical name**: the ``named_parameters`` name with the
  wrapper fragments ``_checkpoint_wrapped_module.``, ``_orig_mod.`` and
  ``_fsdp_wrapped_module.`` removed. Layers are keyed by their global index (see
  :mod:`.llama`), so a pipeline stage's ``layers.7.attention.wq.weight`` is the same tensor
  as in the unsplit model.
* The **full** tensor is drawn from a CPU ``torch.Generator`` seeded with
  ``zlib.crc32(f"{seed}:{name}")`` (stable across processes, unlike ``hash()``) and, for a
  DTensor, the local shard is cut out with ``distribute_tensor(..., src_data_rank=None)``
  (pure local chunking, no communication). Trade-off: every rank materializes each full
  tensor once, transiently, in fp32 on CPU (the largest, the embedding of a 128k-vocab
  16k-wide model, is 8 GiB), and CPU generation is slower than on-device; in exchange the
  weights are bit-identical across layouts, devices, and resumes with a different shape,
  and multi-rank tests can compare against a single process directly.

Distributions (GPT-2 / Megatron "scaled init"):

* embeddings, q/k/v, w1/w3 (dense, shared and routed experts), the router and the output
  layer: normal(0, 0.02);
* residual-branch output projections ``wo`` and ``w2``: normal(0, 0.02 / sqrt(2 * layers)),
  since each block adds two residual contributions, this keeps the residual stream's
  variance roughly independent of depth at initialization;
* LoRA adapters (:mod:`llmtrain.engine.finetune.lora`): ``lora_a`` kaiming-uniform with
  ``a = sqrt(5)`` (PEFT's default, i.e. U(-1/sqrt(in), 1/sqrt(in))) from the same per-name
  generator, ``lora_b`` zeros, so the adapted model starts as the base model; the routed experts'
  stacked ``lora_a`` ``[E, r, in]`` (:mod:`llmtrain.engine.finetune.lora_experts`) with the same bound
  per expert, U(-1/sqrt(in), 1/sqrt(in));
* RMSNorm weights (block norms and Qwen3's per-head ``q_norm``/``k_norm``): ones (zeros for
  Gemma's offset norms, ``model.norm_offset``: the same identity scale); linear
  biases (Qwen2's q/k/v biases): zeros, as in transformers; buffers (``expert_bias``,
  ``tokens_per_expert``): zeros.

Tied embeddings share one Parameter, which ``named_parameters`` yields once (under
``tok_embeddings.weight``), so it is initialized once. Under pipeline parallelism the last
stage's ``output.weight`` is a separate copy of the embedding (:mod:`llmtrain.engine.parallel.tied`):
it is keyed as ``tok_embeddings.weight`` (same generator, same normal(0, 0.02), same full shape),
so both copies start identical whichever ranks hold them. Unknown parameters or floating
buffers raise instead of being silently left uninitialized.
"""

from __future__ import annotations

import math
import zlib

import torch
from torch import nn

from llmtrain.engine.models.moe import GroupedExperts
from llmtrain.engine.models.norm import OffsetRMSNorm

INIT_STD = 0.02
WRAPPER_FRAGMENTS = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")
ZERO_BUFFERS = ("expert_bias", "tokens_per_expert")
RESIDUAL_OUTPUTS = ("wo", "w2")
TIED_COPY, TIED_SOURCE = "output.weight", "tok_embeddings.weight"


def canonical_name(name: str) -> str:
    """Strip activation-checkpoint, compile and FSDP1 wrapper fragments from a parameter name."""
    for fragment in WRAPPER_FRAGMENTS:
        name = name.replace(fragment, "")
    return name


def name_seed(seed: int, name: str) -> int:
    """Generator seed for tensor ``name``: ``crc32(f"{seed}:{name}")``, stable across processes.

    The CPU generator (mt19937) uses only the low 32 bits of its seed, so seed and name are
    hashed *together* into 32 bits (``(seed << 32) ^ crc32(name)`` would ignore the seed).
    """
    return zlib.crc32(f"{seed}:{name}".encode("utf-8"))


def _num_layers(model: nn.Module) -> int:
    for module in model.modules():
        cfg = getattr(module, "cfg", None)
        if cfg is not None and hasattr(cfg, "layers"):
            return cfg.layers  # the global depth, also on a pipeline stage holding a few layers
    raise ValueError("init_weights: no module with a ModelConfig `cfg` found (expected a Transformer)")


def _init_kind(module: nn.Module, leaf: str, name: str = "") -> str:
    if name.endswith(".lora_a.weight"):
        return "kaiming"
    if name.endswith(".lora_b.weight"):
        return "zeros"
    if ".experts.lora_a." in name:  # LoRA on the routed experts: [E, r, in], each expert's slice as a Linear's A
        return "kaiming_stacked"
    if ".experts.lora_b." in name:
        return "zeros"
    if isinstance(module, nn.RMSNorm):
        return "ones"
    if isinstance(module, OffsetRMSNorm):  # Gemma's x * (1 + w): 0 is the identity, as transformers starts it
        return "zeros"
    if isinstance(module, (nn.Linear, nn.Embedding)) and leaf == "weight":
        return "normal"
    if isinstance(module, nn.Linear) and leaf == "bias":
        return "zeros"
    if isinstance(module, GroupedExperts) and leaf in ("w1", "w2", "w3"):
        return "normal"
    return "unknown"


def _full_tensor(name: str, kind: str, shape: torch.Size, seed: int, residual_std: float) -> torch.Tensor:
    if kind == "ones":
        return torch.ones(shape)
    if kind == "zeros":
        return torch.zeros(shape)
    generator = torch.Generator(device="cpu").manual_seed(name_seed(seed, name))
    if kind == "kaiming":  # LoRA A, as PEFT (and nn.Linear): U(-1/sqrt(fan_in), 1/sqrt(fan_in))
        return nn.init.kaiming_uniform_(torch.empty(shape), a=math.sqrt(5), generator=generator)
    if kind == "kaiming_stacked":  # the same bound with fan_in = the last dim (kaiming_ would take r x in)
        bound = 1.0 / math.sqrt(shape[-1])
        return torch.empty(shape).uniform_(-bound, bound, generator=generator)
    parts = name.split(".")
    is_residual_out = parts[-1] in RESIDUAL_OUTPUTS or (
        len(parts) >= 2 and parts[-1] == "weight" and parts[-2] in RESIDUAL_OUTPUTS
    )
    std = residual_std if is_residual_out else INIT_STD
    return torch.empty(shape).normal_(0.0, std, generator=generator)


def _copy_full(target: torch.Tensor, full: torch.Tensor) -> None:
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(target, DTensor):
        local = distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=None).to_local()
        target.to_local().copy_(local)
    else:
        target.copy_(full)


@torch.no_grad()
def init_weights(model: nn.Module, seed: int) -> None:
    """Initialize every parameter and floating buffer of ``model`` from ``seed`` (see module doc)."""
    residual_std = INIT_STD / math.sqrt(2 * _num_layers(model))
    done: set[int] = set()
    for module_name, module in model.named_modules():
        prefix = f"{module_name}." if module_name else ""
        for leaf, param in module.named_parameters(recurse=False):
            if id(param) in done:  # tied weights: initialize once
                continue
            done.add(id(param))
            name = canonical_name(prefix + leaf)
            if name == TIED_COPY and getattr(model, "tie_embeddings", False):
                name = TIED_SOURCE  # the copy of a tied embedding on a pipeline's last stage
            kind = _init_kind(module, leaf, name)
            if kind == "unknown":
                raise ValueError(f"init_weights: no rule for parameter {name!r} of {type(module).__name__}")
            _copy_full(param, _full_tensor(name, kind, param.shape, seed, residual_std).to(param.dtype))
        for leaf, buf in module.named_buffers(recurse=False):
            if buf is None or not buf.is_floating_point():
                continue
            name = canonical_name(prefix + leaf)
            if leaf not in ZERO_BUFFERS:
                raise ValueError(f"init_weights: no rule for floating buffer {name!r}")
            _copy_full(buf, torch.zeros(buf.shape, dtype=buf.dtype))
