"""Async tensor parallelism (``parallel.async_tp``): torch's micro-pipelined TP under ``torch.compile``.

With sequence parallelism every column-parallel matmul (wq/wk/wv, w1/w3) is preceded by an
all-gather of the sequence-sharded activations over ``tp``, and every row-parallel matmul (wo, w2)
is followed by a reduce-scatter. Inductor's ``micro_pipeline_tp`` pass (torch 2.13:
``torch/_inductor/fx_passes/micro_pipeline_tp.py``, switched on by
``torch._inductor.config._micro_pipeline_tp``) finds those all-gather -> matmul and matmul ->
reduce-scatter pairs in the compiled graph and replaces them with
``torch.ops.symm_mem.fused_all_gather_matmul`` / ``fused_matmul_reduce_scatter``: the collective
is split into tp chunks moved through CUDA symmetric memory while the matmul runs on the chunks
that have arrived, so the TP communication of a block hides behind its own matmuls (the planner
models this: plan/comm.py marks those collectives overlapped).

Decisions:
- The switch is a global inductor flag; it is set before the blocks are compiled
  (engine/parallelize.py calls :func:`enable_async_tp` between TP and ``apply_compile``), and only
  affects graphs that contain the pattern, so other compiled code is unchanged.
- No ``enable_symm_mem_for_group``: torch 2.13 deprecates it ("There is no need to call this
  function anymore"): symmetric memory is set up for a group on first use. TorchTitan's older
  apply called it; we do not.
- Requirements are checked twice: plan/validate.py refuses the recipe without CUDA, compile,
  tp >= 2 or sequence parallelism (every reason at once); here the engine refuses a run whose
  device or process-group backend is not CUDA/NCCL, or whose torch build lacks the fused ops
  (a recipe validated for ``cluster.gpu: h100-sxm`` but started on CPU), in one line naming the
  field.
- CPU: not runnable (the fused ops are CUDA kernels on symmetric memory; gloo has none). The GPU
  check runs it at its smallest where two GPUs exist (benchmarks/gpu_check_steps/options.py).
"""

from __future__ import annotations

import importlib

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from llmtrain.errors import LLMTrainError

HINT = "set parallel.async_tp false"


def async_tp_blocker(tp_mesh: DeviceMesh | None) -> str | None:
    """Why async TP cannot run on this process's device, backend and torch build (None: it can)."""
    if tp_mesh is None or tp_mesh.size() < 2:
        return "parallel.tp >= 2"
    if tp_mesh.device_type != "cuda" or not torch.cuda.is_available():
        return f"CUDA devices (this rank's TP mesh is on {tp_mesh.device_type})"
    backend = dist.get_backend(tp_mesh.get_group())
    if "nccl" not in str(backend):
        return f"the NCCL backend for the tp group (it is {backend})"
    try:
        importlib.import_module("torch.distributed._symmetric_memory")  # registers the symm_mem ops
    except ImportError as exc:
        return f"a torch build with symmetric memory ({exc})"
    if not hasattr(torch.ops.symm_mem, "fused_all_gather_matmul"):
        return "a torch build with torch.ops.symm_mem.fused_all_gather_matmul"
    return None


def enable_async_tp(tp_mesh: DeviceMesh | None, compile_: bool) -> None:
    """Switch on inductor's micro-pipelined TP for the blocks compiled afterwards, or refuse."""
    if not compile_:
        raise LLMTrainError("async TP needs train.compile: true (the overlap is a torch.compile pass)", HINT,
                            path="parallel.async_tp")
    why = async_tp_blocker(tp_mesh)
    if why is not None:
        raise LLMTrainError(f"async TP needs {why}", HINT, path="parallel.async_tp")
    import torch._inductor.config as inductor_config

    inductor_config._micro_pipeline_tp = True
