"""torchrun worker of the GPU check's ``fp8_tp`` step (options.py): the engine's recipe path with
``train.precision`` argv[1] (fp8 or bf16) at tp 2 with sequence parallelism (2 ranks: zero 0), or at
tp 2 x dp_shard 2, zero 3, ``parallel.fp8_all_gather`` (4 ranks, fp8 only), the tiny model, eager, 6
steps of 8 sequences (the same samples in both layouts). Rank 0 prints ``LOSSES`` and the per-step losses on one line.

With SP torchao's Float8 styles cast the sequence-sharded activations to float8 before the TP
all-gather, which NCCL moves and gloo cannot (no float8 dtype): this is the only place that path runs."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from gpu_check_steps import TINY_MODEL  # noqa: E402

from llmtrain.engine.main import init_distributed, shutdown  # noqa: E402
from llmtrain.engine.trainer import train  # noqa: E402
from llmtrain.recipe.schema import Recipe  # noqa: E402


def main() -> None:
    precision = sys.argv[1]
    world = int(os.environ["WORLD_SIZE"])
    device = init_distributed()
    parallel = dict(tp=2, dp_shard=world // 2, zero=3 if world > 2 else 0, sequence_parallel=True,
                    fp8_all_gather=precision == "fp8" and world > 2)
    recipe = Recipe.model_validate(dict(
        name="gpu-check-fp8-tp", model=TINY_MODEL, parallel=parallel,
        train=dict(seq_len=64, micro_batch_size=4, global_batch_size=8, steps=6, precision=precision,
                   seed=0, grad_clip=1.0, optimizer=dict(lr=3e-3, weight_decay=0.0), schedule=dict(warmup_steps=0)),
        data=dict(source="synthetic"), cluster=dict(nodes=1, gpus_per_node=world, gpu="h100-sxm")))
    res = train(recipe, device, steps=6, verbose=False)
    if int(os.environ.get("RANK", "0")) == 0:
        print("LOSSES " + " ".join(f"{x:.6f}" for x in res.losses), flush=True)
    shutdown()


if __name__ == "__main__":
    main()
