"""2-rank check of parallel.grad_compression on the debug recipe (run by tests/dist_worker.py as
a ``check`` case from tests/test_grad_compression.py): trains plain, PowerSGD (with a 2-step
warm-up) and top-k (and top-k at ratio 1.0), records the bytes each compressed ``grad_sync``
call sent, and the planner's bytes for the same recipe. The PowerSGD and top-k runs save
checkpoints at step 3 and are resumed from there (same layout and setting: the compression
state is restored; another ``powersgd_rank``: it starts afresh with one printed line).
:func:`resume_4` is the same resume check under TP and PP, a check case of the 4-rank job of
tests/test_engine_parity.py (which also runs top-k at ratio 1.0 at tp 2 x dp 2 and pp 2 x dp 2
against its 1-process reference)."""

from __future__ import annotations

import contextlib
import io
import shutil
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_model_state_dict

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
    "powersgd": ["parallel.grad_compression=powersgd", "parallel.powersgd_rank=2", "parallel.powersgd_start_step=2"],
    "topk": ["parallel.grad_compression=topk", "parallel.topk_ratio=0.05"],
    "topk_full": ["parallel.grad_compression=topk", "parallel.topk_ratio=1.0"],
    "powersgd_zero1": ["parallel.grad_compression=powersgd", "parallel.zero=1", "parallel.powersgd_start_step=0"],
}
STEPS = 6
RESUMED = ("powersgd", "topk")  # trained with checkpoints at step 3, then resumed from step-3
CKPT = ["checkpoint.interval=3", "checkpoint.keep=2"]


def planned_bytes(recipe) -> float:
    plan = plan_recipe(recipe)
    v = plan.validation
    cm = estimate(recipe, v.dims, v.batch, plan.placement, hints=False)
    return sum(c.message_bytes * c.count for c in cm.comms if c.dim == "dp" and c.op != "broadcast")


def _weights(res) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for part in res.parts.parts for k, v in get_model_state_dict(part).items()}


def _shared_tmp() -> str:
    made = [tempfile.mkdtemp(prefix="llmtrain-gc-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(made, src=0)
    return made[0]


def _resume(name: str, recipe, run_dir: str, device, weights: dict) -> dict:
    """Resume ``run_dir``'s step-3 checkpoint to step 6: the losses of steps 4-6 and whether the
    final weights are bitwise those of the uninterrupted run (``weights``)."""
    res = train(recipe, device, run_dir=run_dir, steps=STEPS, verbose=False, resume="step-3")
    final = _weights(res)
    same = torch.tensor([int(final.keys() == weights.keys() and all(torch.equal(final[k], weights[k]) for k in final))])
    dist.all_reduce(same, op=dist.ReduceOp.MIN)
    return {"losses": res.losses, "weights_equal": bool(same.item())}


def run(device) -> dict:
    out = {}
    tmp = _shared_tmp()
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
            recipe = load_recipe(RECIPE, BASE + extra + (CKPT if name in RESUMED else []))
            run_dir = str(Path(tmp) / name) if name in RESUMED else None
            res = train(recipe, device, run_dir=run_dir, steps=STEPS, verbose=False)
            out[name] = {"losses": res.losses, "sent": list(sent), "planned": planned_bytes(recipe),
                         "full": planned_bytes(load_recipe(RECIPE, BASE)), "world": dist.get_world_size()}
            if name in RESUMED:
                out[name]["resumed"] = _resume(name, recipe, run_dir, device, _weights(res))
        # another compression setting: the state starts afresh, said in one line (rank 0 prints it)
        other = load_recipe(RECIPE, BASE + CASES["powersgd"] + CKPT + ["parallel.powersgd_rank=3"])
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            res = train(other, device, run_dir=str(Path(tmp) / "powersgd"), steps=STEPS, verbose=False, resume="step-3")
        out["reset"] = {"losses": res.losses, "printed": printed.getvalue()}
    finally:
        for cls, original in originals.items():
            cls.__call__ = original
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
    return out


# -- under TP and PP: 4 ranks, a check case of tests/test_engine_parity.py's 4-rank job ---------------
LAYOUT_4 = {  # each 2 DP ranks x 2 ranks of the other dimension; top-k 5 % (error feedback on)
    "tp2": ["parallel.tp=2", "parallel.sequence_parallel=true"],
    "pp2": ["parallel.tp=1", "parallel.pp=2"],
}
RESUME_4 = ["parallel.zero=0", "parallel.dp_shard=2", "parallel.grad_compression=topk", "parallel.topk_ratio=0.05",
            "train.seq_len=64", "train.micro_batch_size=2", "train.global_batch_size=8", "train.steps=3",
            "checkpoint.interval=2", "checkpoint.keep=2"]


def resume_4(device) -> dict:
    """tp 2 x dp 2 and pp 2 x dp 2, top-k 5 %: 3 steps with a checkpoint at step 2, then a resume
    from step-2 to step 3 in the same layout and setting. Per layout: both runs' losses, whether the
    resumed final weights are bitwise the uninterrupted ones (every rank's local shards and stages
    compared, MIN over ranks), and the bytes each top-k call sent (so the test sees it ran)."""
    out = {}
    tmp = _shared_tmp()
    sent: list[int] = []
    original = compression.TopKReducer.__call__

    def recording(self, _params=None):
        original(self, _params)
        sent.append(self.sent_bytes)

    try:
        compression.TopKReducer.__call__ = recording
        for name, extra in LAYOUT_4.items():
            sent.clear()
            recipe = load_recipe(RECIPE, RESUME_4 + extra)
            run_dir = str(Path(tmp) / name)
            res = train(recipe, device, run_dir=run_dir, steps=3, verbose=False)
            weights, losses = _weights(res), res.losses
            res = None
            resumed = train(recipe, device, run_dir=run_dir, steps=3, verbose=False, resume="step-2")
            final = _weights(resumed)
            same = torch.tensor([int(final.keys() == weights.keys()
                                     and all(torch.equal(final[k], weights[k]) for k in final))])
            dist.all_reduce(same, op=dist.ReduceOp.MIN)
            out[name] = {"losses": losses, "resumed_losses": resumed.losses, "weights_equal": bool(same.item()),
                         "sent": list(sent), "plain": planned_bytes(load_recipe(RECIPE, RESUME_4[:2] + RESUME_4[4:] + extra))}
    finally:
        compression.TopKReducer.__call__ = original
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
    return out
