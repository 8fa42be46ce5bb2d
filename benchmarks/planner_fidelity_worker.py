"""Worker of benchmarks/planner_fidelity.py: what each rank really holds, computes and sends.

    python -m torch.distributed.run --standalone --nproc-per-node 4 benchmarks/planner_fidelity_worker.py SPEC.json

For every layout of the spec, in ONE process group:

1. model state and activations: :func:`tests.costmodel_worker.run_case` (the engine's own
   ``build_parts`` / ``build_optimizer``; local shard bytes of parameters, gradients and AdamW
   states after one step; bytes alive after one micro batch's forward, parameters excluded);
2. one full training step (benchmarks/parallel_overheads_worker.py :class:`Harness`: the
   trainer's loop body with all micro batches, gradient sync, clipping, AdamW) under
   ``torch.utils.flop_counter.FlopCounterMode`` (SDPA forced to the math backend so attention
   matmuls are visible) and :class:`CommCounter`, a ``TorchDispatchMode`` that sees every
   ``c10d`` and ``_c10d_functional`` op (DTensor redistributions included: like
   ``CommDebugMode`` it steps aside for tensor subclasses so they desugar into collectives first).

Each collective is attributed to a dimension by the code that issued it (the innermost matching
Python frame: llmtrain's context.py → cp, expert.py → ep, data_parallel.py / zero1.py / FSDP →
dp, DTensor → tp, torch.distributed.pipelining → pp, clipping / MoE bias update / loss logging
→ other; expert.py's collectives other than all-to-all → tp, the MoE block's expert-TP region;
an all-to-all issued from autograd's C++ backward → ep, or cp without EP; a reduce-scatter from
there → cp with CP, the all-gather CP's dK/dV), because on
small meshes torch reuses one process group for several dimensions. Its message bytes follow
the planner's convention (llmtrain/plan/comm.py): the full, unsharded message — all-reduce and
broadcast: the tensor; all-gather: the gathered output; reduce-scatter: the input; all-to-all:
the rank's input; P2P: each send (receives are counted apart).
"""

from __future__ import annotations

import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import parallel_overheads_worker as pow_  # noqa: E402
from llmtrain.engine.main import init_distributed, shutdown  # noqa: E402
from llmtrain.recipe.load import load_recipe  # noqa: E402
from tests import costmodel_worker  # noqa: E402

costmodel_worker.MESHES = pow_.MESHES  # one set of process groups per set of degrees

OPS = {  # op name -> (kind, how to get the message bytes)
    "allreduce_": ("all-reduce", lambda a: _sum(a[0])),
    "allreduce_coalesced_": ("all-reduce", lambda a: _sum(a[0])),
    "broadcast_": ("broadcast", lambda a: _sum(a[0])),
    "_allgather_base_": ("all-gather", lambda a: _sum(a[0])),
    "allgather_": ("all-gather", lambda a: _sum(a[0])),
    "allgather_into_tensor_coalesced_": ("all-gather", lambda a: _sum(a[0])),
    "_reduce_scatter_base_": ("reduce-scatter", lambda a: _sum(a[1])),
    "reduce_scatter_": ("reduce-scatter", lambda a: _sum(a[1])),
    "reduce_scatter_tensor_coalesced_": ("reduce-scatter", lambda a: _sum(a[1])),
    "alltoall_base_": ("all-to-all", lambda a: _sum(a[1])),
    "send": ("p2p", lambda a: _sum(a[0])),
    "recv_": ("recv", lambda a: _sum(a[0])),
    # functional collectives (DTensor, funcol autograd)
    "all_reduce": ("all-reduce", lambda a: _sum(a[0])),
    "all_reduce_coalesced": ("all-reduce", lambda a: _sum(a[0])),
    "all_gather_into_tensor": ("all-gather", lambda a: _sum(a[0]) * a[1]),
    "all_gather_into_tensor_coalesced": ("all-gather", lambda a: _sum(a[0]) * a[1]),
    "reduce_scatter_tensor": ("reduce-scatter", lambda a: _sum(a[0])),
    "reduce_scatter_tensor_coalesced": ("reduce-scatter", lambda a: _sum(a[0])),
    "all_to_all_single": ("all-to-all", lambda a: _sum(a[0])),
    "broadcast": ("broadcast", lambda a: _sum(a[0])),
}
FRAMES = [  # (path fragment, function or None, dimension), checked innermost frame first
    ("llmtrain/engine/parallel/clip.py", None, "other"),
    ("llmtrain/engine/models/moe.py", "update_expert_bias", "other"),
    ("llmtrain/engine/parallel/context.py", None, "cp"),
    ("llmtrain/engine/parallel/context_ring.py", None, "cp"),  # the ring's P2P, backward's too
    ("llmtrain/engine/parallel/context_exchange.py", None, "cp"),  # a windowed layer's chunk exchange
    ("llmtrain/engine/parallel/expert.py", None, "ep"),
    ("llmtrain/engine/parallel/data_parallel.py", None, "dp"),
    ("llmtrain/engine/parallel/grad_buckets.py", None, "dp"),  # the bucketed gradient all-reduce (zero 0/1)
    ("llmtrain/engine/parallel/zero1.py", None, "dp"),
    ("torch/distributed/fsdp/", None, "dp"),
    ("torch/distributed/tensor/", None, "tp"),
    ("torch/distributed/pipelining/", None, "pp"),
    ("benchmarks/parallel_overheads_worker.py", None, "other"),
]


def _group_size(func, args) -> int:
    """Ranks of the collective's process group: one on a group of one moves nothing (the engine
    issues some, e.g. ZeRO-1's expert broadcast over an expert-DP group of 1), so it is not counted."""
    for arg, spec in zip(args, func._schema.arguments):
        if spec.name == "process_group":  # the boxed ScriptObject the op receives
            return (arg if isinstance(arg, dist.ProcessGroup) else dist.ProcessGroup.unbox(arg)).size()
        if spec.name == "group_name":
            return dist.distributed_c10d._resolve_process_group(arg).size()
    return 2  # P2P and anything else: between two ranks


def _sum(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    return sum(_sum(t) for t in x) if isinstance(x, (list, tuple)) else 0


class CommCounter(TorchDispatchMode):
    """Counts collectives and their message bytes per (dimension, kind) while active."""

    def __init__(self, ep: bool, cp: bool = False):
        super().__init__()
        self.ep, self.cp = ep, cp
        self.bytes: dict[tuple[str, str], int] = defaultdict(int)
        self.count: dict[tuple[str, str], int] = defaultdict(int)

    def classify(self, kind: str) -> str:
        f = sys._getframe(2)
        frames = []
        while f is not None:
            frames.append(f)
            f = f.f_back
        for f in frames:  # bookkeeping first, even when it runs through DTensor (the TP norm)
            if any(frag in f.f_code.co_filename and func in (None, f.f_code.co_name) for frag, func, _ in FRAMES[:2]):
                return "other"
        for f in frames:
            path, fn = f.f_code.co_filename.replace("\\", "/"), f.f_code.co_name
            for frag, func, dim in FRAMES:
                if frag in path and (func is None or func == fn):
                    # autograd's C++ backward of a collective has no engine frame: the caller's is the
                    # harness's backward, or under PP the pipeline stage's
                    caller = dim == "other" or (dim == "pp" and kind not in ("p2p", "recv"))
                    if caller and kind == "all-to-all":  # the backward of an all-to-all
                        return "ep" if self.ep else "cp"
                    if caller and kind == "reduce-scatter" and self.cp:  # ... of the CP K/V all-gather
                        return "cp"
                    if dim == "ep" and kind != "all-to-all":  # the MoE block's expert-TP region (SP gather, reduction)
                        return "tp"
                    return dim
        if kind == "all-to-all":
            return "ep" if self.ep else "cp"
        return "cp" if kind == "reduce-scatter" and self.cp else "other"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, FakeTensor) for t in types):  # DTensor's sharding propagation on a cache
            return func(*args, **(kwargs or {}))  # miss (e.g. the first clipping step): no real op
        if any(t is not torch.Tensor and issubclass(t, torch.Tensor) for t in types):
            return NotImplemented  # let DTensor & co. desugar into plain collectives we then see
        ns = func.namespace
        name = func._schema.name.split("::")[-1]
        if ns in ("c10d", "_c10d_functional") and name in OPS and _group_size(func, args) > 1:
            kind, size = OPS[name]
            key = (self.classify(kind), kind)
            self.bytes[key] += int(size(args))
            self.count[key] += 1
        return func(*args, **(kwargs or {}))

    def to_dict(self) -> dict:
        return {f"{d}/{k}": {"bytes": self.bytes[(d, k)], "count": self.count[(d, k)]} for d, k in sorted(self.bytes)}


class GlobalOnly:
    """Stands in FlopCounterMode's ModuleTracker: every FLOP goes to its "Global" total."""

    parents = {"Global"}

    def __enter__(self):
        return self

    def __exit__(self, *args):
        return False


def measure_step(recipe, device) -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    h = pow_.Harness(recipe, device)
    h.step()  # warm-up: lazy state (AdamW, FSDP, the pipeline's buffers) outside the counted step
    comm = CommCounter(h.dims.ep > 1, h.dims.cp > 1)
    flops = FlopCounterMode(display=False)
    # totals only: its ModuleTracker's multi-grad hooks fail inside a split backward's autograd.grad
    # ("A leaf node was passed to _will_engine_execute_node ..."), and no per-module count is used
    flops.mod_tracker = GlobalOnly()
    dist.barrier()
    # the CP blocks call the CPU flash kernel directly, which FlopCounterMode has no formula for:
    # count them on the math path, as plain SDPA is counted (forced to SDPBackend.MATH)
    from llmtrain.engine.parallel import context_blocks  # noqa: PLC0415
    cpu_backend, context_blocks.backend = context_blocks.backend, lambda q: "math"
    try:
        with sdpa_kernel(SDPBackend.MATH), flops, comm:
            h.step()
    finally:
        context_blocks.backend = cpu_backend
    out = {"flops": flops.get_total_flops(), "comm": comm.to_dict()}
    h.close()
    return out


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    device = init_distributed()
    torch.set_num_threads(1)
    results = {}
    for case in spec["cases"]:
        recipe = load_recipe(case["recipe"], spec.get("set", []) + case["set"])
        start = time.perf_counter()
        mine = costmodel_worker.run_case(recipe, device)
        mine.update(measure_step(recipe, device))
        mine["seconds"] = time.perf_counter() - start
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        results[case["name"]] = gathered
    if dist.get_rank() == 0:
        Path(spec["out"]).write_text(json.dumps(results))
    shutdown()


if __name__ == "__main__":
    main()
