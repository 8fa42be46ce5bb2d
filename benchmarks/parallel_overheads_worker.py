"""Worker of benchmarks/parallel_overheads.py: time one training step per layout, on every rank.

Run by torchrun (or, for the 1-process reference, as one plain process with RANK=0 WORLD_SIZE=1)::

    python -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/parallel_overheads_worker.py SPEC.json

Every layout of the spec is built in turn inside ONE process group (:class:`Harness`: the
trainer's own building blocks — ``build_parts``, ``build_optimizer``, ``build_schedule``,
``accumulation_step`` / ``pipelined_step``, gradient sync, clipping, AdamW — on fixed random
micro batches), then per layout:

- ``warmup`` rounds, then ``steps`` timed steps, the layouts stepped round-robin
  (``common.interleaved``; a barrier before each step; each rank's wall time);
- per timed step also the main thread's wait in the gradient sync (``grad_sync``: zero 0/1,
  the DP reduction that backward did not hide, plus writing the averages back);
- ``profiled_steps`` more steps under ``torch.profiler`` (CPU activity), whose timelines are
  split per rank (and averaged over those steps) into
  **compute** (main-thread ``aten::`` ops that contain no collective), **comm** (time inside a
  gloo collective — ``gloo:*`` events of gloo's threads, or main-thread ``c10d::`` /
  ``_c10d_functional::`` ops — that no compute op overlaps), **bubble** (PP only: the part of
  that exposed comm spent in ``gloo:recv`` — a stage waiting for its neighbour's activations or
  gradients, transfer included — or in the loss all-reduce over the pipeline right after the
  schedule, where the last stage waits for the first one's final backward: the drain) and
  **other** (the rest: Python, hooks, the scheduler).

Results of all ranks are gathered to rank 0, which writes the JSON named in the spec.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import sys
import time
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from llmtrain.engine.dp_optimizer import build_optimizer  # noqa: E402
from llmtrain.engine.main import init_distributed, shutdown  # noqa: E402
from llmtrain.engine.mesh import build_meshes  # noqa: E402
from llmtrain.engine.models.moe import set_aux_loss_scale, update_expert_bias  # noqa: E402
from llmtrain.engine.parallel.clip import clip_grads  # noqa: E402
from llmtrain.engine.parallel.context import cp_positions, shard_sequence  # noqa: E402
from llmtrain.engine.parallel.pipeline import build_schedule, stage_io_shapes  # noqa: E402
from llmtrain.engine.parallelize import build_parts, uses_fsdp  # noqa: E402
from llmtrain.engine.step import accumulation_step, cross_entropy, pipelined_step  # noqa: E402
from llmtrain.engine.trainer import dp_rank_of, resolve_dims  # noqa: E402
from llmtrain.recipe.load import load_recipe  # noqa: E402

DRAIN = "pipeline_drain"
MESHES: dict = {}  # layouts with the same degrees share one set of process groups


class Harness:
    """One layout built exactly as :func:`llmtrain.engine.trainer.train` builds it; :meth:`step`
    is the trainer's loop body (without lr schedule, metrics and checkpoints) on this rank's
    fixed random micro batches (the same global batch in every layout)."""

    def __init__(self, recipe, device, variant: dict | None = None):
        """``variant`` selects the previous code paths for before/after rows in one run:
        ``overlap: false`` = zero 0/1 gradient all-reduce after backward (no bucket hooks),
        ``prefetch: true`` = FSDP2 with explicit prefetch (not adopted by the engine)."""
        from llmtrain.engine.parallel import data_parallel

        variant = variant or {}
        self.overlap = variant.get("overlap", True)
        data_parallel.PREFETCH = variant.get("prefetch", False)
        rank = dist.get_rank()
        self.recipe, self.device = recipe, device
        dims = self.dims = resolve_dims(recipe, dist.get_world_size())
        meshes = self.meshes = MESHES.get(dims) or MESHES.setdefault(dims, build_meshes(dims, device.type))
        t = recipe.train
        torch.manual_seed(t.seed)
        self.parts = build_parts(recipe, meshes, device)
        for part in self.parts.parts:
            part.train()
        self.params = self.parts.parameters()
        self.fsdp = uses_fsdp(recipe, meshes)
        data_parallel.PREFETCH = False
        self.optimizer, self.grad_sync = build_optimizer(self.parts, recipe, meshes, self.fsdp, overlap=self.overlap)
        self.dp_group, self.dp_size = meshes.dp_cp.get_group(), meshes.dp_cp.size()
        self.pp_group = meshes.pp.get_group() if dims.pp > 1 else None
        gbs = t.global_batch_size or t.micro_batch_size * dims.dp
        self.grad_accum = gbs // (t.micro_batch_size * dims.dp)
        gen = torch.Generator().manual_seed(1000 + dp_rank_of(dims, rank))
        shape = (t.micro_batch_size, t.seq_len)
        self.batches = [(torch.randint(0, recipe.model.vocab_size, shape, generator=gen),
                         torch.randint(0, recipe.model.vocab_size, shape, generator=gen)) for _ in range(self.grad_accum)]
        self.schedule = None
        if dims.pp > 1:
            p, m = recipe.parallel, recipe.model
            sp_shards = dims.tp if dims.tp > 1 and p.sequence_parallel else 1
            shapes = partial(stage_io_shapes, n_stages=self.parts.n_stages, micro=t.micro_batch_size,
                             seq=t.seq_len // dims.cp, hidden=m.hidden, vocab=m.vocab_size, sp_shards=sp_shards)
            self.schedule, self._stages = build_schedule(self.parts.parts, self.parts.stage_ids, self.parts.n_stages,
                                                         p.pp_schedule, self.grad_accum, cross_entropy, device,
                                                         self.pp_group, shapes=shapes, dtype=torch.float32)
        for part in self.parts.parts:
            set_aux_loss_scale(part, 1.0 if self.schedule else 1.0 / self.grad_accum)
        if dims.cp > 1 or dims.pp > 1:
            positions = cp_positions(t.seq_len, dims.cp, meshes.cp.get_local_rank(), recipe.parallel.cp_method)
            for part in self.parts.parts:
                part.positions = positions
            if dims.cp > 1:
                self.batches = [(shard_sequence(x, positions), shard_sequence(y, positions)) for x, y in self.batches]
        self.tp = dims.tp > 1
        self.sync_times: list[float] = []  # seconds in grad_sync per step (every step run)
        self.bias_reduce = (lambda x: dist.all_reduce(x, group=self.dp_group)) if self.dp_size > 1 else None

    def forward_backward(self):
        if self.grad_sync is not None and self.overlap:  # as the trainer: arm the bucket hooks
            self.grad_sync.expect_backwards(len(self.batches), self.schedule)
        if self.schedule is None:
            delay_sync = self.fsdp and not self.recipe.parallel.fsdp_reduce_each_microbatch  # as the trainer
            return accumulation_step(self.parts, self.batches, self.device, delay_sync, self.tp, contextlib.nullcontext())
        loss = pipelined_step(self.parts, self.schedule, self.batches, self.device, self.tp, contextlib.nullcontext())
        loss = loss if loss is not None else torch.zeros((), device=self.device)
        with torch.profiler.record_function(DRAIN):  # the last stage waits here for the first one to finish
            dist.all_reduce(loss, group=self.pp_group)
        return loss

    def step(self) -> float:
        loss = self.forward_backward()
        t0 = time.perf_counter()
        if self.grad_sync is not None:  # zero 0/1: what the main thread waits for the DP reduction
            self.grad_sync(self.params)
        self.sync_times.append(time.perf_counter() - t0)
        clip_grads(self.params, self.recipe.train.grad_clip, self.pp_group)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        for part in self.parts.parts:
            update_expert_bias(part, all_reduce=self.bias_reduce)
        dist.all_reduce(loss, group=self.dp_group)
        return loss.item() / self.dp_size

    def close(self) -> None:
        self.schedule = self._stages = None
        del self.parts, self.optimizer, self.params
        gc.collect()


# ---- the profiled step's timeline ------------------------------------------------------------------
COMM_MARKS = ("c10d::", "_c10d_functional::", "record_param_comms", "gloo:")


def is_comm(name: str) -> bool:
    return any(m in name for m in COMM_MARKS)


def union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def length(intervals) -> float:
    return sum(b - a for a, b in intervals)


def subtract(xs, ys):
    """Union ``xs`` minus union ``ys`` (both sorted, disjoint)."""
    out, j = [], 0
    for a, b in xs:
        cur = a
        while j < len(ys) and ys[j][1] <= cur:
            j += 1
        k = j
        while k < len(ys) and ys[k][0] < b:
            if ys[k][0] > cur:
                out.append((cur, ys[k][0]))
            cur = max(cur, ys[k][1])
            k += 1
        if cur < b:
            out.append((cur, b))
    return out


def intersect(xs, ys):
    return subtract(xs, subtract(xs, ys))


def split_timeline(events, main_thread: int, step_s: float, pipeline: bool) -> dict:
    """Seconds of compute / comm / bubble / other in one profiled step (see the module docstring)."""
    pure, comm, recv, drain = [], [], [], []
    holds_comm = set()  # ids of main-thread events with a collective inside (DTensor ops, autograd nodes)
    for e in events:
        if e.thread == main_thread and is_comm(e.name):
            p = e.cpu_parent
            while p is not None and id(p) not in holds_comm:
                holds_comm.add(id(p))
                p = p.cpu_parent
    for e in events:
        iv = (e.time_range.start / 1e6, e.time_range.end / 1e6)
        if is_comm(e.name):
            if e.thread == main_thread or e.name.startswith("gloo:"):
                comm.append(iv)
            if pipeline and e.name.startswith("gloo:recv"):
                recv.append(iv)
        elif e.thread == main_thread and e.name.startswith("aten::") and id(e) not in holds_comm:
            pure.append(iv)
        elif e.name == DRAIN:
            drain.append(iv)
    pure = union(pure)
    exposed = subtract(union(comm), pure)
    waiting = union(subtract(union(recv), pure) + intersect(exposed, union(drain)))
    compute, comm_s, bubble = length(pure), length(exposed), length(waiting)
    return {"compute_s": compute, "comm_s": comm_s - bubble, "bubble_s": bubble,
            "other_s": max(0.0, step_s - compute - comm_s)}


def profile_step(h: Harness) -> dict:
    from torch.profiler import ProfilerActivity, profile

    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        h.step()
        step_s = time.perf_counter() - t0
    events = prof.events()
    main = max({e.thread for e in events if e.name.startswith("aten::")},
               key=lambda th: sum(1 for e in events if e.thread == th and e.name.startswith("aten::")))
    return {"profiled_step_s": step_s, **split_timeline(events, main, step_s, h.schedule is not None)}


def timed_step(h: Harness) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    h.step()
    return time.perf_counter() - t0


def main() -> None:
    """All layouts are built first and stepped round-robin (common.interleaved), so that a change
    of the machine's load hits every layout alike; then each one's profiled steps are averaged."""
    import common

    spec = json.loads(Path(sys.argv[1]).read_text())
    device = init_distributed()
    torch.set_num_threads(1)
    harnesses = {c["name"]: Harness(load_recipe(c["recipe"], spec.get("set", []) + c["set"]), device, c.get("variant"))
                 for c in spec["cases"]}
    times = common.interleaved({n: partial(timed_step, h) for n, h in harnesses.items()}, spec["steps"], spec["warmup"])
    results = {}
    for name, h in harnesses.items():
        sync = h.sync_times[spec["warmup"]:]  # the timed steps' (warm-up steps come first)
        profiled = [profile_step(h) for _ in range(spec["profiled_steps"])]
        mine = {"rank": dist.get_rank(), "coords": h.dims.coord_dict(dist.get_rank()), "step_times_s": times[name],
                "sync_times_s": sync, "microbatches": h.grad_accum, "profiled": profiled,
                "comm_median_s": common.median([p["comm_s"] for p in profiled]),
                **{k: sum(p[k] for p in profiled) / len(profiled) for k in profiled[0]}}
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        results[name] = gathered
    if dist.get_rank() == 0:
        Path(spec["out"]).write_text(json.dumps(results))
    shutdown()


if __name__ == "__main__":
    os.environ.setdefault("LLMTRAIN_TENSORBOARD", "0")
    main()
