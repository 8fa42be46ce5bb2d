"""What a checkpoint holds, as a DCP state dict keyed by layout-independent names.

``{"model": {fqn: tensor}, "optimizer": {"state": {fqn: {"exp_avg", "exp_avg_sq", "step"}}}}``

* The model part merges ``get_model_state_dict`` of every local chunk (one per pipeline stage).
  Parameter names are global, so a PP/TP/FSDP layout and one process produce the same keys;
  tensors are DTensors where the layout shards them, and DCP reshards them on load.
* The optimizer part is AdamW's per-parameter state keyed by the same names. Parameter groups
  are not saved: they follow from the recipe, and the learning rate from the step. With ZeRO-1
  only the owner of a parameter holds (and saves) its state, whole (or its TP shard); DCP merges
  what the ranks hold, and on load each rank asks only for the parameters it owns in the new
  layout. So zero 0/1/2/3, TP and PP checkpoints are interchangeable.
* LoRA (``train.lora``): the optimizer part holds only the adapters' state (nothing else
  trains). The model part holds the adapters and the frozen base, **except** when the run starts
  from ``checkpoint.init_from_hf`` (``adapters_only``): then it holds only the adapters (a few MB
  instead of the whole model per checkpoint), because the base can be read again from that
  directory — the trainer loads it before restoring, and ``metadata.json`` records its
  fingerprint so that a changed base is refused (:mod:`llmtrain.engine.finetune.base`). Without
  ``init_from_hf`` the base came from the seed's initialization, and the checkpoint is the only
  record of it, so it is saved.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from llmtrain.engine.finetune.lora import is_adapter_key

WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")
ADAM_KEYS = ("exp_avg", "exp_avg_sq")


def clean_fqn(name: str) -> str:
    """A parameter name without activation-checkpointing / compile wrapper segments."""
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def param_names(parts) -> dict[int, str]:
    """``id(param) -> global name`` over all local model chunks."""
    return {id(p): clean_fqn(n) for part in parts.parts for n, p in part.named_parameters()}


def model_state(parts, adapters_only: bool = False) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for part in parts.parts:
        full = get_model_state_dict(part)
        state.update({k: v for k, v in full.items() if is_adapter_key(k)} if adapters_only else full)
    return state


def load_model_state(parts, state: dict[str, torch.Tensor], adapters_only: bool = False) -> None:
    for part in parts.parts:
        keys = [k for k in get_model_state_dict(part) if not adapters_only or is_adapter_key(k)]
        set_model_state_dict(part, {k: state[k] for k in keys}, options=StateDictOptions(strict=not adapters_only))


def inner_optimizers(optimizer) -> list[torch.optim.Optimizer]:
    """The torch optimizers behind the engine's optimizer (CombinedOptimizer / ZeRO1Optimizer / AdamW)."""
    if hasattr(optimizer, "optimizers"):
        return [o for inner in optimizer.optimizers for o in inner_optimizers(inner)]
    if hasattr(optimizer, "inner"):
        return [optimizer.inner] if optimizer.inner is not None else []
    return [optimizer]


def _own_params(optimizer) -> list[nn.Parameter]:
    return [p for o in inner_optimizers(optimizer) for g in o.param_groups for p in g["params"]]


def optimizer_state(optimizer, names: dict[int, str]) -> dict[str, dict[str, torch.Tensor]]:
    """This rank's AdamW state by parameter name (only parameters it steps)."""
    out = {}
    for o in inner_optimizers(optimizer):
        for p, st in o.state.items():
            if st:
                out[names[id(p)]] = {k: v for k, v in st.items() if isinstance(v, torch.Tensor)}
    return out


def optimizer_template(optimizer, names: dict[int, str]) -> dict[str, dict[str, torch.Tensor]]:
    """Empty tensors of the right (sharded) shapes for DCP to load this rank's optimizer state into."""
    out = {}
    for p in _own_params(optimizer):
        entry = {k: torch.zeros_like(p.detach(), memory_format=torch.preserve_format) for k in ADAM_KEYS}
        entry["step"] = torch.zeros((), dtype=torch.float32)
        out[names[id(p)]] = entry
    return out


def load_optimizer_state(optimizer, names: dict[int, str], state: dict[str, dict[str, torch.Tensor]]) -> None:
    for o in inner_optimizers(optimizer):
        for g in o.param_groups:
            for p in g["params"]:
                o.state[p] = dict(state[names[id(p)]])


def full_state(parts, optimizer, adapters_only: bool = False) -> dict:
    """The state dict that is saved (tensors shared with the live model: DCP's stager copies them).
    ``adapters_only``: LoRA with an HF base, leave the frozen base out (module docstring)."""
    names = param_names(parts)
    return {"model": model_state(parts, adapters_only), "optimizer": {"state": optimizer_state(optimizer, names)}}


def template_state(parts, optimizer, adapters_only: bool = False) -> dict:
    names = param_names(parts)
    return {"model": model_state(parts, adapters_only), "optimizer": {"state": optimizer_template(optimizer, names)}}


def apply_state(parts, optimizer, state: dict, adapters_only: bool = False) -> None:
    names = param_names(parts)
    load_model_state(parts, state["model"], adapters_only)
    load_optimizer_state(optimizer, names, state["optimizer"]["state"])
