"""Worker of tests/test_hf_io.py: streaming HF loads and a training run with checkpoints, in ONE torchrun job.

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/hf_io_worker.py SPEC.json

For each ``load`` case (a recipe and an HF directory) every rank builds the model in the case's
layout, streams its own slices in (``load_hf_weights``), and then, into a second model, reads
the whole checkpoint and keeps its shard (``load_hf_weights_whole``, the reference). Rank 0
stores, per case, both full state dicts (gathered: pipeline ranks hold different stages) and
every rank's read statistics. The ``train`` case trains a few steps from an HF directory and
writes checkpoints (``checkpoint.dir``). ``python tests/hf_io_worker.py --single SPEC.json``
runs a spec in one process (world 1, no torchrun): the test's 1-rank resume.
"""

from __future__ import annotations

import gc
import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from llmtrain.engine.hf import load_hf_weights, load_hf_weights_whole
from llmtrain.engine.main import shutdown
from llmtrain.engine.mesh import build_meshes
from llmtrain.engine.parallelize import build_parts
from llmtrain.engine.trainer import resolve_dims, train
from llmtrain.recipe.load import load_recipe


def full_state(parts) -> dict[str, torch.Tensor]:
    """This rank's chunks' full tensors, merged over all ranks on rank 0 (others: {})."""
    state = {}
    for part in parts.parts:
        full = get_model_state_dict(part, options=StateDictOptions(full_state_dict=True))
        state.update({k: v.detach().clone() for k, v in full.items()})
    gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(state, gathered, dst=0)
    return {k: v for s in gathered for k, v in s.items()} if gathered else {}


def load_case(case: dict) -> dict:
    recipe = load_recipe(case["recipe"], case.get("set", []))
    meshes = build_meshes(resolve_dims(recipe, dist.get_world_size()), "cpu")
    parts = build_parts(recipe, meshes, torch.device("cpu"))
    stats = load_hf_weights(parts, case["hf"], recipe.model)
    streamed = full_state(parts)
    del parts
    whole_parts = build_parts(recipe, meshes, torch.device("cpu"))
    load_hf_weights_whole(whole_parts, case["hf"], recipe.model)
    whole = full_state(whole_parts)
    mine = {"rank": dist.get_rank(), "elements": stats.elements, "local_elements": stats.local_elements,
            "slices": stats.slices, "bytes": stats.bytes, "files": sorted(stats.files)}
    all_stats = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(mine, all_stats, dst=0)
    return {"streamed": streamed, "whole": whole, "stats": all_stats}


def main() -> None:
    single = sys.argv[1] == "--single"
    spec = json.loads(open(sys.argv[-1]).read())
    if single:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(spec.get("port", 29731)), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo")
    results = {}
    for case in spec["cases"]:
        if case["kind"] == "load":
            results[case["name"]] = load_case(case)
        else:  # train (and checkpoint) from the recipe, possibly resuming
            recipe = load_recipe(case["recipe"], case.get("set", []))
            res = train(recipe, torch.device("cpu"), steps=case["steps"], verbose=False, resume=case.get("resume"))
            results[case["name"]] = {"losses": res.losses}
            del res
        gc.collect()
    if dist.get_rank() == 0:
        torch.save(results, spec["out"])
    shutdown()


if __name__ == "__main__":
    main()
