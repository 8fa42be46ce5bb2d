"""One rank of benchmarks/hf_load_memory.py: build the sharded model, load HF weights, report memory and time.

    python -m torch.distributed.run --standalone --nproc-per-node 4 benchmarks/hf_load_memory_worker.py \
        --recipe R.yaml --hf DIR --mode stream|whole --out OUT.json

Peak RSS of the load alone: after the model is built and initialized, the kernel's high-water
mark is reset (``echo 5 > /proc/self/clear_refs`` sets VmHWM to the current RSS), so the
reported peak is the highest resident memory during the load (file pages mapped by safetensors
included, as they are resident in this process).
"""

from __future__ import annotations

import argparse
import gc
import json
import time

import torch
import torch.distributed as dist


def status(field: str) -> int:
    """``/proc/self/status`` field in bytes (VmRSS, VmHWM)."""
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return -1


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--recipe", required=True)
    p.add_argument("--hf", required=True)
    p.add_argument("--mode", required=True, help="stream, whole, or both in turn (stream,whole: the --tiny run)")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    from llmtrain.engine.hf import load_hf_weights, load_hf_weights_whole
    from llmtrain.engine.main import shutdown
    from llmtrain.engine.mesh import build_meshes
    from llmtrain.engine.parallelize import build_parts
    from llmtrain.engine.trainer import resolve_dims
    from llmtrain.recipe.load import load_recipe

    recipe = load_recipe(a.recipe)
    meshes = build_meshes(resolve_dims(recipe, dist.get_world_size()), "cpu")
    parts = build_parts(recipe, meshes, torch.device("cpu"))
    shard = sum(t.to_local().numel() * t.element_size() if hasattr(t, "to_local") else t.numel() * t.element_size()
                for part in parts.parts for t in part.state_dict().values())
    results = {}
    for mode in a.mode.split(","):
        gc.collect()
        dist.barrier()
        before = status("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        t0 = time.perf_counter()
        stats = load_hf_weights(parts, a.hf, recipe.model) if mode == "stream" else \
            load_hf_weights_whole(parts, a.hf, recipe.model)
        seconds = time.perf_counter() - t0
        peak, after = status("VmHWM"), status("VmRSS")
        mine = {"rank": dist.get_rank(), "rss_before": before, "peak": peak, "rss_after": after, "seconds": seconds,
                "shard_bytes": shard, "read_bytes": getattr(stats, "bytes", None)}
        rows = [None] * dist.get_world_size()
        dist.all_gather_object(rows, mine)
        results[mode] = rows
    if dist.get_rank() == 0:
        open(a.out, "w").write(json.dumps(results))
    # The engine's clean exit (CPU facts note, trap 6: SIGABRT at exit otherwise): the FSDP
    # modules (reference cycles) freed first and collected, then barrier and destroy the group.
    del parts, meshes, stats, rows
    shutdown()


if __name__ == "__main__":
    main()
