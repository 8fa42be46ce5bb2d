"""Run several layouts of one recipe inside ONE torchrun job and save their results.

Process start-up dominates multi-rank tests on CPU (5-10 s per job), so every layout that fits
the same world size shares one process group: each case builds its own DeviceMesh from the
global group, trains, and rank 0 stores the losses and the full (unsharded) final weights.

    python -m torch.distributed.run --standalone --nproc-per-node 4 tests/dist_worker.py SPEC.json
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from llmtrain.engine.checkpoint_state import param_names
from llmtrain.engine.main import init_distributed, shutdown
from llmtrain.engine.trainer import train
from llmtrain.recipe.load import load_recipe


def check_layout(meshes) -> list[str]:
    """This rank's mesh coordinates and groups must be exactly what ParallelDims (and so
    ``llmtrain plan``) says; returns the mismatches."""
    dims, rank, errors = meshes.dims, dist.get_rank(), []
    if tuple(meshes.root.get_coordinate()) != dims.coords(rank):
        errors.append(f"rank {rank}: mesh coordinate {meshes.root.get_coordinate()} != plan {dims.coords(rank)}")
    for name in ("pp", "dp_replicate", "dp_shard", "cp", "tp"):
        ranks = dist.get_process_group_ranks(meshes.root[name].get_group())
        if sorted(ranks) != dims.group(rank, name):
            errors.append(f"rank {rank}: {name} group {sorted(ranks)} != plan {dims.group(rank, name)}")
    if dims.ep > 1:
        ep_ranks = sorted(dist.get_process_group_ranks(meshes.ep.get_group()))
        if ep_ranks != dims.ep_group(rank):
            errors.append(f"rank {rank}: ep group {ep_ranks} != plan {dims.ep_group(rank)}")
        edp_ranks = sorted(dist.get_process_group_ranks(meshes.ep_root["edp"].get_group()))
        if edp_ranks != dims.edp_group(rank):
            errors.append(f"rank {rank}: edp group {edp_ranks} != plan {dims.edp_group(rank)}")
    return errors


def eval_rows(run_dir: str | None) -> list[dict]:
    """The eval rows of a case's ``metrics.jsonl`` (cases with a ``run_dir``; rank 0 wrote it)."""
    if run_dir is None or not os.path.exists(f"{run_dir}/metrics.jsonl"):
        return []
    with open(f"{run_dir}/metrics.jsonl") as f:
        rows = [json.loads(line) for line in f.read().splitlines()]
    return [r for r in rows if "eval_loss" in r]


def main() -> None:
    spec = json.loads(open(sys.argv[1]).read())
    device = init_distributed()
    results = {}
    for case in spec["cases"]:
        if "check" in case:  # a function "module:name" run on every rank (shares the job's process group)
            module, name = case["check"].split(":")
            found = getattr(importlib.import_module(module), name)(device)
            if dist.get_rank() == 0:
                results[case["name"]] = found
            continue
        recipe = load_recipe(spec["recipe"], spec.get("set", []) + case["set"])
        res = train(recipe, device, run_dir=case.get("run_dir"), steps=case.get("steps", spec["steps"]), verbose=False,
                    resume=case.get("resume"))
        layout_errors = check_layout(res.meshes)
        state = {}
        for part in res.parts.parts:  # PP: each rank holds its stages; gather them all on rank 0
            full = get_model_state_dict(part, options=StateDictOptions(full_state_dict=True))
            state.update({k: v.detach().clone() for k, v in full.items()})
        names = param_names(res.parts)
        trainable = sorted(names[id(p)] for p in res.parts.parameters())  # LoRA: the adapters only
        gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object((state, layout_errors, trainable), gathered, dst=0)
        if dist.get_rank() == 0:
            merged, errors, all_trainable = {}, [], set()
            for part_state, part_errors, part_trainable in gathered:
                merged.update(part_state)
                errors += part_errors
                all_trainable.update(part_trainable)
            results[case["name"]] = {"losses": res.losses, "grad_norms": res.grad_norms, "state": merged,
                                     "layout_errors": errors, "trainable": sorted(all_trainable),
                                     "evals": eval_rows(case.get("run_dir"))}
        del res, state, gathered
        gc.collect()
    if dist.get_rank() == 0:
        torch.save(results, spec["out"])
    shutdown()


if __name__ == "__main__":
    main()
