"""AdamW with low-precision moments (``train.optimizer.states``: bf16 | 8bit), from torchao.

* ``8bit``: ``torchao.optim.AdamW8bit`` (block-wise dynamic-map quantization, Dettmers et al.
  2021, block 256). torchao quantizes only a tensor whose LOCAL shard has >= 4096 elements and a
  multiple of the block size; smaller ones keep plain fp32 moments (bitsandbytes' rule). Each
  quantized moment holds uint8 codes (1 byte per element), one fp32 scale per block and a
  256-entry fp32 code map (``plan/memory.moment_bytes`` counts exactly that).
  DTensor parameters (TP, FSDP2) get DTensor-wrapped moments (torchao's ``_new_buffer``).
* ``bf16``: torch's AdamW keeps moments in the parameter's dtype, so fp32 parameters cannot
  have bf16 moments there; torchao's ``_AdamW`` is the same single-parameter kernel (fp32 math,
  ``copy_`` into the stored moments), so we keep that kernel and only allocate its moments in
  bf16 (round-to-nearest on each store). torchao's ``bf16_stochastic_round`` is for bf16
  PARAMETERS, not moments, so it does not apply (our master weights are fp32).
* torchao runs its kernel under ``torch.compile(fullgraph=True, dynamic=False)``: one compile
  per distinct parameter shape, ~10 s each on this CPU and a C++ toolchain required. On CPU we
  call the same kernel (``torchao.optim.adam.single_param_adam``) eagerly instead — identical
  math, the quantized moments dispatch through the tensor subclass; on CUDA torchao's own
  compiled step runs.
* The learning rate is a tensor in torchao's groups; :func:`set_group_lr` fills it in place.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from llmtrain.engine.torchao_import import import_torchao
from llmtrain.errors import LLMTrainError
from llmtrain.plan.memory import Q8_BLOCK as BLOCK  # the planner counts the same rule
from llmtrain.plan.memory import moment_bytes, q8_quantized  # noqa: F401  (re-exported for the tests)


def _torchao():
    try:
        optim = import_torchao("torchao.optim")
    except ImportError as e:  # pragma: no cover - torchao is a dependency
        raise LLMTrainError(f"train.optimizer.states needs torchao (pip install torchao): {e}") from None
    return optim.AdamW8bit, optim.adam


def _eager_step(opt) -> None:
    """torchao's ``_AdamBase.step`` loop with the kernel called eagerly (CPU; module docstring)."""
    _, adam = _torchao()
    for group in opt.param_groups:
        for p in group["params"]:
            if p.grad is None:
                continue
            state = opt.state[p]
            if len(state) == 0:
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = opt._new_buffer(p, True)
                state["exp_avg_sq"] = opt._new_buffer(p, False)
            state["step"] += 1
            adam.single_param_adam(p.detach(), p.grad, state["step"], state["exp_avg"], state["exp_avg_sq"], None,
                                   group["lr"], group["betas"][0], group["betas"][1], group["weight_decay"],
                                   group["eps"], True, False)


def _on_cpu(opt) -> bool:
    return all(p.device.type == "cpu" for g in opt.param_groups for p in g["params"])


def make_state_optimizer(states: str, groups: list[dict], lr: float, betas, eps: float, weight_decay: float):
    """An AdamW over ``groups`` with ``states`` moments (``bf16`` | ``8bit``)."""
    AdamW8bit, adam = _torchao()

    class EagerOnCPU:
        """torchao's compiled step on CUDA; on CPU its kernel runs eagerly (see the module docstring)."""

        @torch.no_grad()
        def step(self, closure=None):
            if closure is not None:
                raise LLMTrainError("train.optimizer.states: closures are not supported")
            if _on_cpu(self):
                return _eager_step(self)
            return super().step()

    class AdamW8bitStates(EagerOnCPU, AdamW8bit):
        pass

    class AdamWBf16States(EagerOnCPU, adam._AdamW):
        def _new_buffer(self, p, signed: bool):
            local = p.to_local() if isinstance(p, DTensor) else p
            out = torch.zeros(local.shape, dtype=torch.bfloat16, device=local.device)
            if isinstance(p, DTensor):
                out = DTensor.from_local(out, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                         stride=p.stride()).to(p.device)
            return out

    cls = AdamW8bitStates if states == "8bit" else AdamWBf16States
    kwargs = {"block_size": BLOCK} if states == "8bit" else {}
    return cls(groups, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, **kwargs)


def set_group_lr(group: dict, lr: float) -> None:
    """torchao keeps ``lr`` as a tensor (its compiled kernel would recompile on a new float)."""
    if isinstance(group["lr"], torch.Tensor):
        group["lr"].fill_(lr)
    else:
        group["lr"] = lr


# ---- checkpoints (engine/checkpoint_state.py) -------------------------------------------------------
def moment_mode(opt) -> str:
    """``8bit`` | ``bf16`` | ``fp32``: how ``opt`` (one torch optimizer) stores its moments."""
    name = type(opt).__name__
    return "8bit" if name == "AdamW8bitStates" else "bf16" if name == "AdamWBf16States" else "fp32"


def _qmap(signed: bool, device) -> torch.Tensor:
    q8 = import_torchao("torchao.optim.subclass_8bit")
    return torch.tensor(q8.get_qmap_signed() if signed else q8.get_qmap_unsigned(), dtype=torch.float32, device=device)


def _like(p, local: torch.Tensor) -> torch.Tensor:
    """``local`` (the shape of p's local shard) as a tensor in p's layout (DTensor where p is)."""
    if isinstance(p, DTensor):
        return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())
    return local


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def export_moments(p, state: dict) -> dict[str, torch.Tensor]:
    """8bit moments as checkpointable plain tensors in the parameter's layout (so DCP can reshard
    them): ``K.codes`` (uint8) and ``K.scale`` (fp32, each element its block's scale), with
    ``value = qmap[codes] * scale`` exactly. A moment torchao kept in fp32 (small shard) is
    saved as code 255 (qmap value 1.0 in both maps) and scale = the value. 5 bytes per element
    per moment (fp32: 4), the price of an exact resume."""
    out = {"step": state["step"]}
    for key, signed in (("exp_avg", True), ("exp_avg_sq", False)):
        v = _local(state[key])
        if hasattr(v, "codes"):
            codes, scale = v.codes, v.scale.repeat_interleave(v.codes.numel() // v.scale.numel()).view(v.shape)
        else:
            codes, scale = torch.full(v.shape, 255, dtype=torch.uint8, device=v.device), v
        out[key + ".codes"], out[key + ".scale"] = _like(p, codes), _like(p, scale.contiguous())
    return out


def moments_template(p, mode: str) -> dict[str, torch.Tensor]:
    """What DCP loads one parameter's optimizer state into, for ``mode`` moments."""
    entry = {"step": torch.zeros((), dtype=torch.float32)}
    d = p.detach()
    if mode == "8bit":
        for key in ("exp_avg", "exp_avg_sq"):
            entry[key + ".codes"] = torch.zeros_like(d, dtype=torch.uint8)
            entry[key + ".scale"] = torch.zeros_like(d)
        return entry
    dtype = torch.bfloat16 if mode == "bf16" else d.dtype
    for key in ("exp_avg", "exp_avg_sq"):
        entry[key] = torch.zeros_like(d, dtype=dtype, memory_format=torch.preserve_format)
    return entry


def import_moments(opt, p, entry: dict) -> dict:
    """The live 8bit state of ``p`` from a loaded :func:`moments_template` entry: bitwise the saved
    codes and scales when this shard's blocks have one scale each (the same layout); otherwise
    (another layout regrouped the blocks) requantized from the exact saved values."""
    state = {"step": entry["step"]}
    for key, signed in (("exp_avg", True), ("exp_avg_sq", False)):
        codes, scale = _local(entry[key + ".codes"]), _local(entry[key + ".scale"])
        buf = opt._new_buffer(p, signed)
        live = _local(buf)
        if hasattr(live, "codes"):
            blocks = scale.reshape(-1, BLOCK)
            if bool((blocks == blocks[:, :1]).all()):
                live.codes.copy_(codes)
                live.scale.copy_(blocks[:, 0])
            else:
                live.copy_(_qmap(signed, codes.device)[codes.int()] * scale)
        else:
            live.copy_(_qmap(signed, codes.device)[codes.int()] * scale)
        state[key] = buf
    return state
