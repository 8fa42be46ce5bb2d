"""2-rank check of parallel.grad_compression on the debug recipe (run by tests/dist_worker.py as
a ``check`` case from tests/test_grad_compression.py): trains plain, PowerSGD and top-k (and
top-k at ratio 1.0), records the bytes each compressed ``grad_sync`` call sent, and the
planner's bytes for the same recipe."""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist

from llmtrain.engine.parallel import compression
from llmtrain.engine.trainer import train
from llmtrain.plan.api import plan_recipe
from llmtrain.plan.costmodel import estimate
from llmtrain.recipe.load import load_recipe

RECIPE = Path(__file__).resolve().parent.parent / "recipes" / "debug.yaml"
BASE = ["parallel.tp=1", "parallel.dp_shard=2", "parallel.zero=0", "cluster.gpus_per_node=2",
        "train.global_batch_size=8", "train.micro_batch_size=2", "train.seq_len=64", "train.schedule.warmup_steps=0"]
CASES = {
    "none": [],
    "powersgd": ["parallel.grad_compression=powersgd", "parallel.powersgd_rank=2"],
    "topk": ["parallel.grad_compression=topk", "parallel.topk_ratio=0.05"],
    "topk_full": ["parallel.grad_compression=topk", "parallel.topk_ratio=1.0"],
    "powersgd_zero1": ["parallel.grad_compression=powersgd", "parallel.zero=1"],
}
STEPS = 6


def planned_bytes(recipe) -> float:
    plan = plan_recipe(recipe)
    v = plan.validation
    cm = estimate(recipe, v.dims, v.batch, plan.placement, hints=False)
    return sum(c.message_bytes * c.count for c in cm.comms if c.dim == "dp" and c.op != "broadcast")


def run(device) -> dict:
    out = {}
    sent: list[int] = []
    originals = {cls: cls.__call__ for cls in (compression.PowerSGDReducer, compression.TopKReducer)}

    def recording(original):
        def call(self, _params=None):
            original(self, _params)
            sent.append(self.sent_bytes)
        return call

    try:
        for cls, original in originals.items():
            cls.__call__ = recording(original)
        for name, extra in CASES.items():
            sent.clear()
            recipe = load_recipe(RECIPE, BASE + extra)
            res = train(recipe, device, steps=STEPS, verbose=False)
            out[name] = {"losses": res.losses, "sent": list(sent), "planned": planned_bytes(recipe),
                         "world": dist.get_world_size()}
    finally:
        for cls, original in originals.items():
            cls.__call__ = original
    return out
