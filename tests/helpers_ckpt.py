"""A DCP checkpoint as one flat ``{"model.x.weight": tensor, "optimizer.state.x.exp_avg": ...}`` dict (tests only)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch


def load_ckpt(path: Path, tmp: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint at ``path``, converted through ``dcp_to_torch_save`` into ``tmp``."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    tmp.mkdir(parents=True, exist_ok=True)
    out = tmp / f"{hashlib.sha256(str(path).encode()).hexdigest()[:12]}-{path.name}.pt"
    dcp_to_torch_save(str(path), str(out))

    def flat(d, pre=""):
        res = {}
        for k, v in d.items():
            res.update(flat(v, f"{pre}{k}.") if isinstance(v, dict) else {pre + k: v})
        return res

    return flat(torch.load(out, weights_only=False))
