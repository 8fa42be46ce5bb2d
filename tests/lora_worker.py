"""LoRA layouts in ONE torchrun job: per case, rank 0 stores the losses, the full final weights,
and which parameters have optimizer state on any rank (tests/test_lora.py).

    python -m torch.distributed.run --standalone --nproc-per-node 4 tests/lora_worker.py SPEC.json

Like tests/dist_worker.py, plus ``trainable`` (global names of the parameters with requires_grad,
the union over ranks) and, with a case's ``run_dir``, a checkpoint saved there at the end (whose
DCP index tells which parameters have optimizer state).
"""

from __future__ import annotations

import gc
import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from llmtrain.engine.checkpoint_state import param_names
from llmtrain.engine.main import init_distributed, shutdown
from llmtrain.engine.trainer import train
from llmtrain.recipe.load import load_recipe
from tests.dist_worker import check_layout


def main() -> None:
    spec = json.loads(open(sys.argv[1]).read())
    device = init_distributed()
    results = {}
    for case in spec["cases"]:
        recipe = load_recipe(spec["recipe"], spec.get("set", []) + case["set"])
        res = train(recipe, device, run_dir=case.get("run_dir"), steps=spec["steps"], verbose=False)
        errors = check_layout(res.meshes)
        state = {}
        for part in res.parts.parts:
            full = get_model_state_dict(part, options=StateDictOptions(full_state_dict=True))
            state.update({k: v.detach().clone() for k, v in full.items()})
        names = param_names(res.parts)
        trainable = sorted(names[id(p)] for p in res.parts.parameters())
        gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object((state, errors, trainable), gathered, dst=0)
        if dist.get_rank() == 0:
            merged, all_errors, all_trainable = {}, [], set()
            for part_state, part_errors, part_trainable in gathered:
                merged.update(part_state)
                all_errors += part_errors
                all_trainable.update(part_trainable)
            results[case["name"]] = {"losses": res.losses, "state": merged, "layout_errors": all_errors,
                                     "trainable": sorted(all_trainable)}
        del res, state, gathered
        gc.collect()
    if dist.get_rank() == 0:
        torch.save(results, spec["out"])
    shutdown()


if __name__ == "__main__":
    main()
