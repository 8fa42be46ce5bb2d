"""torchrun worker of the GPU check's ``async_tp`` step (options.py): 2 ranks, tp 2 with sequence
parallelism, per-block torch.compile, the tiny model, bf16, 6 steps; argv[1] "1" switches on
``parallel.async_tp``. Rank 0 prints ``LOSSES`` and the per-step losses on one line."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from gpu_check_steps import TINY_MODEL  # noqa: E402

from llmtrain.engine.main import init_distributed, shutdown  # noqa: E402
from llmtrain.engine.trainer import train  # noqa: E402
from llmtrain.recipe.schema import Recipe  # noqa: E402


def main() -> None:
    on = sys.argv[1] == "1"
    device = init_distributed()
    recipe = Recipe.model_validate(dict(
        name="gpu-check-async-tp", model=TINY_MODEL,
        parallel=dict(tp=2, dp_shard=1, zero=0, sequence_parallel=True, async_tp=on),
        train=dict(seq_len=64, micro_batch_size=4, global_batch_size=4, steps=6, precision="bf16", seed=0, compile=True,
                   grad_clip=1.0, optimizer=dict(lr=3e-3, weight_decay=0.0), schedule=dict(warmup_steps=0)),
        data=dict(source="synthetic"), cluster=dict(nodes=1, gpus_per_node=2, gpu="h100-sxm")))
    res = train(recipe, device, steps=6, verbose=False)
    if int(os.environ.get("RANK", "0")) == 0:
        print("LOSSES " + " ".join(f"{x:.6f}" for x in res.losses), flush=True)
    shutdown()


if __name__ == "__main__":
    main()
