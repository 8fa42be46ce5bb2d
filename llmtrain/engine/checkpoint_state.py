"""What a checkpoint holds, as a DCP state dict keyed by layout-independent names.

``{"model": {fqn: tensor}, "optimizer": {"state": {fqn: {"exp_avg", "exp_avg_sq", "step"}}}}``

* The model part merges ``get_model_state_dict`` of every local chunk (one per pipeline stage).
  Parameter names are global, so a PP/TP/FSDP layout and one process produce the same keys;
  tensors are DTensors where the layout shards them, and DCP reshards them on load.
* Tied embeddings (``model.tie_embeddings``) have one key, ``tok_embeddings.weight``: the
  output layer's ``output.weight`` (the same Parameter without PP, the last stage's copy with
  PP, :mod:`llmtrain.engine.parallel.tied`) is never saved, and on load it is filled from that
  key, so PP and non-PP checkpoints are interchangeable (older non-PP checkpoints that also hold
  ``output.weight`` still load: extra keys are not read). Its AdamW state is keyed by the same
  name; a rank that holds only the copy saves nothing for it (the first stage's ranks save the
  same values) but loads it.
* The optimizer part is AdamW's per-parameter state keyed by the same names. Parameter groups
  are not saved: they follow from the recipe, and the learning rate from the step. With ZeRO-1
  only the owner of a parameter holds (and saves) its state, whole (or its TP shard); DCP merges
  what the ranks hold, and on load each rank asks only for the parameters it owns in the new
  layout. So zero 0/1/2/3, TP and PP checkpoints are interchangeable.
* 8-bit moments (``train.optimizer.states: 8bit``) are saved as plain ``exp_avg.codes`` /
  ``exp_avg.scale`` tensors in the parameter's layout (:func:`llmtrain.engine.quant_optim.export_moments`):
  an exact resume in the same layout, resharded values in another; bf16 moments load into bf16.
* LoRA (``train.lora``): the optimizer part holds only the adapters' state (nothing else
  trains). The model part holds the adapters and the frozen base, **except** when the run starts
  from ``checkpoint.init_from_hf`` (``adapters_only``): then it holds only the adapters (a few MB
  instead of the whole model per checkpoint), because the base can be read again from that
  directory — the trainer loads it before restoring, and ``metadata.json`` records its
  fingerprint so that a changed base is refused (:mod:`llmtrain.engine.finetune.base`). Without
  ``init_from_hf`` the base came from the seed's initialization, and the checkpoint is the only
  record of it, so it is saved.
* Gradient compression (``parallel.grad_compression``): a third part, ``grad_compression``, holds
  each rank's error-feedback residuals and PowerSGD's warm-start Q by global rank; it is loaded
  only in the same layout and setting (:mod:`llmtrain.engine.parallel.compression_state`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from llmtrain.engine.finetune.lora import is_adapter_key
from llmtrain.engine.parallel import compression_state
from llmtrain.engine.parallel.tied import COPY, SOURCE, checkpoint_name, copy_params
from llmtrain.engine.quant_optim import export_moments, import_moments, moment_mode, moments_template

WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")
ADAM_KEYS = ("exp_avg", "exp_avg_sq")


def clean_fqn(name: str) -> str:
    """A parameter name without activation-checkpointing / compile wrapper segments."""
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def param_names(parts) -> dict[int, str]:
    """``id(param) -> global name`` over all local model chunks (a tied copy: the embedding's)."""
    return {id(p): checkpoint_name(part, clean_fqn(n)) for part in parts.parts for n, p in part.named_parameters()}


def model_state(parts, adapters_only: bool = False, for_load: bool = False) -> dict[str, torch.Tensor]:
    """The model part (module docstring). ``for_load``: a template to load into, where a rank
    holding only a tied copy asks for ``tok_embeddings.weight`` in its copy's shape."""
    state: dict[str, torch.Tensor] = {}
    for part in parts.parts:
        full = get_model_state_dict(part)
        if getattr(part, "tie_embeddings", False) and COPY in full:
            copy = full.pop(COPY)
            if for_load and SOURCE not in full and not adapters_only:
                state.setdefault(SOURCE, copy)
        for k, v in full.items():
            if not adapters_only or is_adapter_key(k):
                state.setdefault(k, v)
    return state


def load_model_state(parts, state: dict[str, torch.Tensor], adapters_only: bool = False) -> None:
    for part in parts.parts:
        keys = [k for k in get_model_state_dict(part) if not adapters_only or is_adapter_key(k)]
        values = {k: state[checkpoint_name(part, k)] for k in keys}
        set_model_state_dict(part, values, options=StateDictOptions(strict=not adapters_only))


def inner_optimizers(optimizer) -> list[torch.optim.Optimizer]:
    """The torch optimizers behind the engine's optimizer (CombinedOptimizer / ZeRO1Optimizer / AdamW)."""
    if hasattr(optimizer, "optimizers"):
        return [o for inner in optimizer.optimizers for o in inner_optimizers(inner)]
    if hasattr(optimizer, "inner"):
        return [optimizer.inner] if optimizer.inner is not None else []
    return [optimizer]


def optimizer_state(optimizer, names: dict[int, str], skip: set[int] = frozenset()) -> dict[str, dict[str, torch.Tensor]]:
    """This rank's AdamW state by parameter name (only parameters it steps; not those in ``skip``,
    the ids of tied copies, whose state equals the embedding's)."""
    out = {}
    for o in inner_optimizers(optimizer):
        eight = moment_mode(o) == "8bit"  # quantized moments: exact plain parts (engine/quant_optim.py)
        for p, st in o.state.items():
            if st and id(p) not in skip:
                out[names[id(p)]] = export_moments(p, st) if eight else \
                    {k: v for k, v in st.items() if isinstance(v, torch.Tensor)}
    return out


def optimizer_template(optimizer, names: dict[int, str]) -> dict[str, dict[str, torch.Tensor]]:
    """Empty tensors of the right (sharded) shapes for DCP to load this rank's optimizer state into."""
    out = {}
    for o in inner_optimizers(optimizer):
        mode = moment_mode(o)  # fp32 | bf16 | 8bit moments (train.optimizer.states)
        for g in o.param_groups:
            for p in g["params"]:  # a tied embedding and its copy on one rank: one entry
                out.setdefault(names[id(p)], moments_template(p, mode))
    return out


def load_optimizer_state(optimizer, names: dict[int, str], state: dict[str, dict[str, torch.Tensor]]) -> None:
    used: set[str] = set()
    for o in inner_optimizers(optimizer):
        for g in o.param_groups:
            for p in g["params"]:
                name = names[id(p)]
                entry = state[name]  # the second user of a name (a tied copy) gets its own tensors
                if moment_mode(o) == "8bit":
                    o.state[p] = import_moments(o, p, entry)
                else:
                    o.state[p] = {k: v.clone() for k, v in entry.items()} if name in used else dict(entry)
                step_where_torch_keeps_it(o.state[p], g, p)
                used.add(name)


def step_where_torch_keeps_it(st: dict, group: dict, p: torch.Tensor) -> None:
    """Put a loaded ``step`` where torch's AdamW keeps it: on the parameter's device (fp32) when the
    group is ``fused`` or ``capturable``, else where it is (the CPU scalar DCP loaded it into).
    The template's step is a CPU scalar (quant_optim.moments_template), and the fused CUDA kernel
    refuses it ("state_steps is on cpu, different from other tensors on cuda:0": the GPU check's
    dcp_async_resume on an H100, twenty-fourth session; CPU runs have every tensor on the CPU).
    The same rule as ``torch.optim.Optimizer.load_state_dict``, which this loader does not go through."""
    step = st.get("step")
    if isinstance(step, torch.Tensor) and (group.get("fused") or group.get("capturable")):
        st["step"] = step.to(dtype=torch.float32, device=p.device)


def full_state(parts, optimizer, adapters_only: bool = False) -> dict:
    """The state dict that is saved (tensors shared with the live model: DCP's stager copies them).
    ``adapters_only``: LoRA with an HF base, leave the frozen base out (module docstring)."""
    names = param_names(parts)
    skip = {id(p) for p in copy_params(parts)}
    out = {"model": model_state(parts, adapters_only), "optimizer": {"state": optimizer_state(optimizer, names, skip)}}
    compressed = compression_state.state(optimizer, dist.get_rank())
    if compressed is not None:
        out[compression_state.KEY] = compressed
    return out


def template_state(parts, optimizer, adapters_only: bool = False) -> dict:
    names = param_names(parts)
    return {"model": model_state(parts, adapters_only, for_load=True),
            "optimizer": {"state": optimizer_template(optimizer, names)}}


def apply_state(parts, optimizer, state: dict, adapters_only: bool = False) -> None:
    names = param_names(parts)
    load_model_state(parts, state["model"], adapters_only)
    load_optimizer_state(optimizer, names, state["optimizer"]["state"])
    if compression_state.KEY in state:  # only asked for in the same layout and setting (checkpoint.py)
        compression_state.load(optimizer, dist.get_rank(), state[compression_state.KEY])
