"""Which dtype the matmuls inside pipeline stages compute in (a ``check`` case of tests/dist_worker.py).

docs/planner.md §8 reported that with PP, ``precision: bf16`` and zero 0/1 the stages computed in
fp32 (the pipelined step without autocast). :func:`stage_matmul_dtypes` is the check: a
TorchDispatchMode records every ``mm`` / SDPA kernel while :func:`train` runs one step of
``recipes/debug.yaml`` at bf16, pp 2, for each schedule and zero mode of :data:`LAYOUTS` (stage
forwards, their backward incl. the forwards re-run by activation checkpointing, the chunked
loss's head), and the same step without PP (``nopp_zero1``, the reference). A matmul of the
model in fp32 shows up as an fp32 ``mm`` whose operand shapes the reference does not have.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from llmtrain.engine.trainer import train
from llmtrain.recipe.load import load_recipe
from tests.distrun import ROOT

COMMON = ["train.seq_len=32", "train.micro_batch_size=1", "train.global_batch_size=4", "train.steps=1",
          "train.precision=bf16", "parallel.tp=1", "parallel.pp=2", "parallel.dp_shard=-1"]
LAYOUTS = {
    "nopp_zero1": ["parallel.pp=1", "parallel.zero=1"],  # the reference: autocast around the whole step
    "gpipe_zero1": ["parallel.pp_schedule=gpipe", "parallel.zero=1"],
    "1f1b_zero0": ["parallel.pp_schedule=1f1b", "parallel.zero=0"],
    "interleaved_zero1": ["parallel.pp_schedule=interleaved-1f1b", "parallel.pp_virtual_stages=2", "parallel.zero=1"],
    "zbv_zero0_full_ac": ["parallel.pp_schedule=zbv", "parallel.zero=0", "train.activation_checkpointing=full"],
}
KERNELS = {"mm", "addmm", "bmm", "_scaled_dot_product_flash_attention_for_cpu",
           "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention"}


class MatmulDtypes(TorchDispatchMode):
    """Records ``(op, output dtype)`` of every kernel in :data:`KERNELS`, and the operand shapes of fp32 ones."""

    def __init__(self):
        super().__init__()
        self.seen: set[str] = set()
        self.fp32_shapes: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name in KERNELS:
            first = out[0] if isinstance(out, (tuple, list)) else out
            self.seen.add(f"{name}:{str(first.dtype).removeprefix('torch.')}")
            if first.dtype == torch.float32:
                self.fp32_shapes.add(f"{name}{[tuple(a.shape) for a in args if isinstance(a, torch.Tensor)]}")
        return out


def stage_matmul_dtypes(device) -> dict:
    """{layout: {"kernels": sorted "op:dtype", "fp32": sorted fp32 kernels with operand shapes}}, every rank's."""
    out = {}
    for name, overrides in LAYOUTS.items():
        mode = MatmulDtypes()
        with mode:
            train(load_recipe(ROOT / "recipes/debug.yaml", COMMON + overrides), device, verbose=False)
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (sorted(mode.seen), sorted(mode.fp32_shapes)))
        out[name] = {"kernels": sorted({k for seen, _ in gathered for k in seen}),
                     "fp32": sorted({k for _, fp32 in gathered for k in fp32})}
    return out
