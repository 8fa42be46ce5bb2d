"""One rank of benchmarks/checkpoint_io.py (run by torchrun, 2 ranks, gloo; not a benchmark itself).

    python -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/checkpoint_io_worker.py \\
        --hidden 256 --layers 12 --ffn 704 --interval 4 --saves 3 --reps 2 --dir /tmp/x --out result.json

Calls the engine's own ``train()`` (llmtrain/engine/trainer.py), so the loop, the Checkpointer
and the commit are exactly the engine's. Two things are wrapped, in this process only:

* ``trainer.MetricsWriter`` by one that notes ``time.perf_counter()`` at every ``log()`` (rank 0,
  ``log_interval`` 1: right after each step's loss is known, before that step's save). The gap
  between two notes is one full iteration: the previous step's save/poll/commit plus this step.
* ``trainer.Checkpointer`` by a subclass that times ``save()`` (the call the loop blocks in),
  ``poll()`` / ``wait()`` (which run the commit: rank 0 checksums every file) and ``restore()``.
  (This benchmark found that the engine's ``poll()`` all-reduced its flag on the group the async
  save's background thread was still using, which can deadlock; the engine now gives the flag
  a group of its own, as the first full run of this benchmark did by overriding ``poll``.)

Per repetition, round-robin: no checkpoint / ``checkpoint.async: false`` / ``async: true``, each
``(saves + 1) * interval`` steps with a save every ``interval`` steps (plus the engine's final
save at the last step, not measured); then ``restore("latest")`` of the synchronous run's
checkpoint into the same layout (dp_shard 2, FSDP, zero 3) and into another (tp 2, zero 0).
Rank 0 writes the raw timings as JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path

import torch.distributed as dist

from llmtrain.engine import trainer
from llmtrain.engine.checkpoint import Checkpointer
from llmtrain.engine.main import init_distributed, shutdown
from llmtrain.recipe.load import validate_recipe_dict

EVENTS: dict[str, list] = {}


class TimedWriter:
    """Stands in for MetricsWriter: only the time of each step's log call (rank 0)."""

    def __init__(self, run_dir, enabled: bool):
        self.enabled = enabled
        EVENTS["steps"] = []

    def log(self, record: dict) -> None:
        if self.enabled:
            EVENTS["steps"].append((record["step"], time.perf_counter()))

    def close(self) -> None:
        pass


class TimedCheckpointer(Checkpointer):
    def _timed(self, kind: str, fn, *args, **kwargs):
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        EVENTS.setdefault(kind, []).append((t0, time.perf_counter() - t0, args[0] if kind == "save" else None))
        return out

    def save(self, step, *rest):
        return self._timed("save", super().save, step, *rest)

    def poll(self):
        return self._timed("poll", super().poll)

    def wait(self):
        return self._timed("wait", super().wait)

    def _commit(self):
        step = self.pending[0]
        super()._commit()
        EVENTS.setdefault("commit", []).append((step, time.perf_counter()))

    def restore(self, spec, *rest, **kwargs):
        return self._timed("restore", super().restore, spec, *rest, **kwargs)


def recipe_for(a, ckpt_dir: str | None, async_: bool, steps: int, interval: int, layout: str = "fsdp"):
    par = {"tp": 1, "dp_shard": -1, "zero": 3} if layout == "fsdp" else {"tp": 2, "dp_shard": -1, "zero": 0}
    data = {"name": "ckptbench",
            "model": {"layers": a.layers, "hidden": a.hidden, "heads": 8, "kv_heads": 4, "ffn_hidden": a.ffn,
                      "vocab_size": 512, "max_seq_len": 512, "rope_theta": 10000.0, "norm_eps": 1e-5,
                      "tie_embeddings": False},
            "parallel": par,
            "train": {"seq_len": 32, "micro_batch_size": 1, "global_batch_size": 2, "steps": steps, "precision": "fp32",
                      "seed": 0, "log_interval": 1, "optimizer": {"lr": 0.001, "weight_decay": 0.0},
                      "schedule": {"warmup_steps": 1, "decay": "constant"}},
            "data": {"source": "synthetic"},
            "cluster": {"nodes": 1, "gpus_per_node": 2, "gpu": "cpu"}}
    if ckpt_dir:
        data["checkpoint"] = {"dir": ckpt_dir, "interval": interval, "keep": 1, "async": async_}
    return validate_recipe_dict(data)


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def run_mode(a, device, mode: str, rep: int) -> dict:
    steps = (a.saves + 1) * a.interval
    ckpt_dir = None if mode == "none" else os.path.join(a.dir, f"{mode}-{rep}")
    EVENTS.clear()
    dist.barrier()
    trainer.train(recipe_for(a, ckpt_dir, mode == "async", steps, a.interval), device, steps=steps, verbose=False)
    dist.barrier()
    out = {"mode": mode, "rep": rep, "steps": EVENTS.get("steps", []), "save": EVENTS.get("save", []),
           "poll": EVENTS.get("poll", []), "wait": EVENTS.get("wait", []), "commit": EVENTS.get("commit", [])}
    if ckpt_dir and dist.get_rank() == 0:
        latest = Path(ckpt_dir) / (Path(ckpt_dir) / "latest").read_text().strip()
        out["checkpoint_bytes"] = dir_bytes(latest)
    return out


def run_load(a, device, src: str, layout: str) -> float:
    steps = (a.saves + 1) * a.interval
    EVENTS.clear()
    dist.barrier()
    trainer.train(recipe_for(a, src, False, steps, a.interval, layout), device, steps=steps, verbose=False,
                  resume="latest")
    dist.barrier()
    return EVENTS["restore"][0][1]


def main() -> None:
    p = argparse.ArgumentParser()
    for name in ("hidden", "layers", "ffn", "interval", "saves", "reps"):
        p.add_argument(f"--{name}", type=int, required=True)
    p.add_argument("--dir", required=True)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    os.environ["LLMTRAIN_TENSORBOARD"] = "0"
    trainer.MetricsWriter = TimedWriter
    trainer.Checkpointer = TimedCheckpointer
    device = init_distributed()
    runs, loads = [], []
    for rep in range(a.reps):
        for mode in ("none", "sync", "async"):
            runs.append(run_mode(a, device, mode, rep))
        src = os.path.join(a.dir, f"sync-{rep}")
        for layout in ("fsdp", "tp2"):
            loads.append({"rep": rep, "layout": layout, "seconds": run_load(a, device, src, layout)})
        if dist.get_rank() == 0:  # keep the disk small: this repetition's checkpoints are done
            for mode in ("sync", "async"):
                shutil.rmtree(os.path.join(a.dir, f"{mode}-{rep}"), ignore_errors=True)
        dist.barrier()
    if dist.get_rank() == 0:
        Path(a.out).write_text(json.dumps({"runs": runs, "loads": loads, "world_size": dist.get_world_size()}))
    shutdown()


if __name__ == "__main__":
    main()
