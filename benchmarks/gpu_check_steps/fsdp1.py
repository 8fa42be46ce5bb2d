"""FSDP2 on a 1-rank group, built from the engine's own pieces.

The engine's trainer wraps with FSDP2 only when there is something to shard
(``parallelize.uses_fsdp``: zero >= 2 and dp x cp > 1); on one GPU it trains the plain model
under bf16 autocast. The issue asks for the FSDP2 path (bf16 ``MixedPrecisionPolicy``, fp32
master weights, fp32 reduce) on the GPU as well, so this module builds it the way the engine
does on many ranks — meta-device model, ``to_empty``, ``init_weights``, per-block
``apply_compile``, ``apply_fsdp`` (zero 3) on a 1-rank mesh — and trains it with the engine's
``make_adamw`` (fused) on a fixed batch: the same code as benchmarks/gpu_throughput.py.
"""

from __future__ import annotations

import time


def build(cfg, device, precision: str, compile_: bool, fsdp: bool = True):
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from llmtrain.engine.models.init import init_weights
    from llmtrain.engine.models.llama import Transformer
    from llmtrain.engine.parallel.checkpointing import apply_compile
    from llmtrain.engine.parallel.data_parallel import apply_fsdp

    with torch.device("meta"):
        model = Transformer(cfg)
    model.to_empty(device=device)
    init_weights(model, 0)
    if compile_:
        apply_compile(model)
    if fsdp:
        apply_fsdp(model, init_device_mesh(device.type, (1,)), zero=3, pp_enabled=False, precision=precision)
    return model


def train_fixed(model, cfg, device, steps: int, micro: int, seq: int, lr: float = 3e-3, autocast: bool = False,
                after_step=None) -> tuple[list[float], list[float]]:
    """``steps`` optimizer steps on one fixed batch (the loss must fall); returns (losses, step seconds).
    ``autocast``: the forward under bf16 autocast (the trainer's path for fp32 weights without FSDP);
    ``after_step``: called after each step, outside its timing (profiling.py steps its profiler)."""
    import torch
    import torch.nn.functional as F

    from llmtrain.engine.optim import make_adamw
    from llmtrain.recipe.schema import TrainConfig

    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (micro, seq + 1), generator=g).to(device)
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    opt = make_adamw(TrainConfig(optimizer={"lr": lr, "weight_decay": 0.0}))([{"params": list(model.parameters())}])
    losses, times = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            logits = model(x)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(0, 1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())  # syncs the device, as the engine's loop does every step
        times.append(time.perf_counter() - t0)
        if after_step is not None:
            after_step()
    return losses, times
