"""Worker of tests/test_peak_memory.py: the engine's trainer on one CPU rank, its peak live bytes
beside ``llmtrain plan``'s peak for the same recipe.

    python tests/peak_memory_worker.py  # prints one JSON object: case -> {measured, planned, phase}

:class:`LiveBytes` is a ``TorchDispatchMode`` that adds every storage an op creates to a running
total and takes it off when the storage dies (a ``weakref.finalize``; torch keeps one Python
object per storage), so its ``peak`` is the most bytes alive at once: parameters, gradients,
optimizer states, activations and every temporary, as the CPU allocator would see them. The
whole run is inside the mode (the model is built there too). The trainer runs two steps, so
its second step holds the optimizer states and starts with the first step's gradients freed."""

from __future__ import annotations

import json
import os
import sys
import weakref
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llmtrain.engine import trainer  # noqa: E402
from llmtrain.plan.api import plan_recipe  # noqa: E402
from llmtrain.plan.report import cost_dict  # noqa: E402
from llmtrain.recipe.schema import Recipe  # noqa: E402

# name -> (micro batch, global batch, activation checkpointing, sequence)
CASES = {
    "one_microbatch": (4, 4, "none", 512),  # gradients made in the step's only backward: peak at the loss
    "two_microbatches": (4, 8, "none", 512),  # the second backward finds the first one's gradients
    "full_ac_short": (1, 1, "full", 128),  # gradients outweigh the activations: peak at the end of backward
}


class LiveBytes(TorchDispatchMode):
    """Bytes of the CPU storages created under the mode that are still alive, and their peak."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, int] = {}
        self.now = 0
        self.peak = 0

    def _free(self, key: int) -> None:
        self.now -= self.live.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if key and key not in self.live:
                    self.live[key] = storage.nbytes()
                    self.now += storage.nbytes()
                    weakref.finalize(storage, self._free, key)
                    self.peak = max(self.peak, self.now)
        return out


def recipe(micro: int, gbs: int, ac: str, seq: int) -> Recipe:
    return Recipe.model_validate(dict(
        name="peak-memory",
        model=dict(layers=4, hidden=512, heads=8, kv_heads=4, ffn_hidden=1408, vocab_size=8192, max_seq_len=seq,
                   rope_theta=10000.0, norm_eps=1e-5, tie_embeddings=False),
        parallel=dict(tp=1, dp_shard=1, zero=3),
        train=dict(seq_len=seq, micro_batch_size=micro, global_batch_size=gbs, steps=2, precision="bf16", seed=0,
                   activation_checkpointing=ac, grad_clip=1.0, optimizer=dict(lr=3e-4, weight_decay=0.0),
                   schedule=dict(warmup_steps=0, decay="constant")),
        data=dict(source="synthetic"), cluster=dict(nodes=1, gpus_per_node=1, gpu="cpu")))


def main() -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29000 + os.getpid() % 1000))
    dist.init_process_group("gloo", rank=0, world_size=1)
    out = {}
    for name, args in CASES.items():
        r = recipe(*args)
        memory = cost_dict(plan_recipe(r, nodes=1, gpus_per_node=1))["memory"]
        mode = LiveBytes()
        with mode:
            trainer.train(r, torch.device("cpu"), verbose=False)
        out[name] = {"measured": mode.peak, "planned": memory["peak_gib"] * 2**30, "phase": memory["phase"],
                     "grads_gib": memory["breakdown_gib"]["grads"]}
    dist.destroy_process_group()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
