"""HBM traffic of eager PyTorch code, counted op by op under a dispatch mode: the bytes every op
that is not a GEMM, an attention kernel or a view reads and writes (its tensor inputs and
outputs; an expanded input counted once per distinct element; an in-place op's tensor as read and
written, but ``copy_``'s destination as written only). Time model v2 prices the engine's memory-bound work in these bytes
(plan/ops.py, plan/losstime.py); tests/test_losstime.py and tests/test_block_traffic.py check it."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

GEMMS = {"mm", "addmm", "addmm_", "bmm"}
ATTENTION = {"_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward"}
# views, allocations, and per-token index ops (a few elements of a large tensor each)
NOT_TRAFFIC = {"t", "view", "_unsafe_view", "reshape", "slice", "select", "unsqueeze", "squeeze", "expand",
               "detach", "alias", "as_strided", "transpose", "permute", "split", "unbind", "view_as_real",
               "view_as_complex", "_conj", "complex", "empty", "zeros", "empty_like", "zeros_like", "ones_like",
               "new_empty", "new_zeros", "new_empty_strided", "lift_fresh", "_local_scalar_dense", "promote_types",
               "index", "index_put_", "index_put", "gather", "nonzero", "clamp", "arange"}


def distinct_bytes(t: torch.Tensor) -> int:
    """Bytes of the distinct elements a tensor addresses (an expanded dimension counts once)."""
    n = 1
    for size, stride in zip(t.shape, t.stride()):
        n *= size if stride else 1
    return n * t.element_size()


class Traffic(TorchDispatchMode):
    """``with Traffic() as tr: ...``; ``tr.bytes`` the total, ``tr.by_op`` per op name; ops run
    while ``tr.paused`` is set are not counted (a stand-in for a fused kernel counts its own)."""

    def __init__(self):
        super().__init__()
        self.by_op: dict[str, int] = {}
        self.paused = False

    @property
    def bytes(self) -> int:
        return sum(self.by_op.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func._overloadpacket.__name__
        if not self.paused and name not in GEMMS | ATTENTION | NOT_TRAFFIC:
            # copy_ writes its destination without reading it: the destination once (as its output)
            leaves = torch.utils._pytree.tree_leaves((args[1:], kwargs, out) if name == "copy_" else (args, kwargs, out))
            self.by_op[name] = self.by_op.get(name, 0) + sum(distinct_bytes(t) for t in leaves
                                                             if isinstance(t, torch.Tensor))
        return out
