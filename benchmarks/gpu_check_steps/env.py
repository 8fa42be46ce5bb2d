"""Step (a): what the machine is, and the 1-rank process group (NCCL on CUDA) really reducing."""

from __future__ import annotations

import platform
import subprocess
import time
from importlib import metadata

from . import CheckFailed, step


def versions() -> dict:
    import torch

    out = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda}
    for dist in ("transformers", "pydantic", "pydantic_core", "torchao", "safetensors", "tokenizers", "triton"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


def driver_version() -> str | None:
    try:
        got = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20, check=False)
        return got.stdout.strip().splitlines()[0] if got.returncode == 0 and got.stdout.strip() else None
    except (OSError, subprocess.SubprocessError, IndexError):
        return None


@step("env_nccl", est_s=5)
def env_nccl(ctx) -> dict:
    """Versions, the device, and one all-reduce on the default 1-rank group (NCCL on CUDA,
    gloo on CPU): initialisation is what has never run on a GPU here."""
    import torch
    import torch.distributed as dist

    out = {"versions": versions(), "backend": str(dist.get_backend()), "device": str(ctx.device)}
    if ctx.cuda:
        props = torch.cuda.get_device_properties(ctx.device)
        out.update(device_name=props.name, capability=list(torch.cuda.get_device_capability(ctx.device)),
                   memory_gib=round(props.total_memory / 2**30, 1), sms=props.multi_processor_count,
                   driver=driver_version(), nccl=".".join(map(str, torch.cuda.nccl.version())))
    t0 = time.perf_counter()
    x = torch.arange(4, dtype=torch.float32, device=ctx.device)
    dist.all_reduce(x)
    if ctx.cuda:
        torch.cuda.synchronize()
    out["all_reduce_s"] = time.perf_counter() - t0
    if x.tolist() != [0.0, 1.0, 2.0, 3.0]:
        raise CheckFailed(f"1-rank all_reduce changed its input: {x.tolist()}")
    return out
