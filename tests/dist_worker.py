"""Run several layouts of one recipe inside ONE torchrun job and save their results.

Process start-up dominates multi-rank tests on CPU (5-10 s per job), so every layout that fits
the same world size shares one process group: each case builds its own DeviceMesh from the
global group, trains, and rank 0 stores the losses and the full (unsharded) final weights.

    python -m torch.distributed.run --standalone --nproc-per-node 4 tests/dist_worker.py SPEC.json
"""

from __future__ import annotations

import gc
import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from llmtrain.engine.main import init_distributed, shutdown
from llmtrain.engine.trainer import train
from llmtrain.recipe.load import load_recipe


def main() -> None:
    spec = json.loads(open(sys.argv[1]).read())
    device = init_distributed()
    results = {}
    for case in spec["cases"]:
        recipe = load_recipe(spec["recipe"], spec.get("set", []) + case["set"])
        res = train(recipe, device, steps=spec["steps"], verbose=False)
        state = {}
        for part in res.parts.parts:  # PP: each rank holds its stages; gather them all on rank 0
            full = get_model_state_dict(part, options=StateDictOptions(full_state_dict=True))
            state.update({k: v.detach().clone() for k, v in full.items()})
        gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(state, gathered, dst=0)
        if dist.get_rank() == 0:
            merged = {}
            for part_state in gathered:
                merged.update(part_state)
            results[case["name"]] = {"losses": res.losses, "grad_norms": res.grad_norms, "state": merged}
        del res, state, gathered
        gc.collect()
    if dist.get_rank() == 0:
        torch.save(results, spec["out"])
    shutdown()


if __name__ == "__main__":
    main()
