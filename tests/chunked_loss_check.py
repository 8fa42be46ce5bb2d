"""The vocabulary-parallel chunked cross-entropy on a TP 2 mesh, run inside a torchrun job.

Called by tests/dist_worker.py for a case ``{"check": "tests.chunked_loss_check:tp2"}`` (every
rank); returns the worst differences against a 1-rank ``F.cross_entropy`` of the same full tensors
(every rank builds them from one seed), all-reduced (max) over the world. Asserted in
tests/test_engine_parity.py::test_chunked_loss_tp2_equals_cross_entropy.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from llmtrain.engine.parallel.loss import chunked_cross_entropy, chunked_token_losses


def tp2(device) -> dict:
    world = dist.get_world_size()
    mesh = init_device_mesh(device.type, (world // 2, 2), mesh_dim_names=("dp", "tp"))["tp"]
    g = torch.Generator().manual_seed(0)
    b, s, hid, vocab = 2, 24, 16, 64
    h = torch.randn(b, s, hid, generator=g)
    w = 0.3 * torch.randn(vocab, hid, generator=g)
    y = torch.randint(0, vocab, (b, s), generator=g)
    y[0, :4] = -100
    out = {"local_vocab": 0.0}
    for reduction in ("mean", "sum"):
        hr, wr = h.clone().requires_grad_(), w.clone().requires_grad_()
        ref = F.cross_entropy((hr @ wr.T).flatten(0, 1), y.flatten(), reduction=reduction)
        ref.backward()
        for sp in (False, True):  # sequence parallel: h is a Shard(1) DTensor, gathered by the loss
            wd = distribute_tensor(w, mesh, [Shard(0)]).requires_grad_()
            hd = (distribute_tensor(h, mesh, [Shard(1)]) if sp else h.clone()).requires_grad_()
            loss = chunked_cross_entropy(hd, wd, y, reduction=reduction, chunk_tokens=5)
            loss.backward()
            gh = hd.grad.full_tensor() if sp else hd.grad
            key = f"{reduction}_{'sp' if sp else 'nosp'}"
            out[f"{key}_loss"] = abs(loss.item() - ref.item()) / abs(ref.item())
            out[f"{key}_grad_h"] = ((gh - hr.grad).abs().max() / hr.grad.abs().max()).item()
            out[f"{key}_grad_w"] = ((wd.grad.full_tensor() - wr.grad).abs().max() / wr.grad.abs().max()).item()
            out["local_vocab"] = float(wd.to_local().shape[0])
    tokens = chunked_token_losses(distribute_tensor(h, mesh, [Shard(1)]), distribute_tensor(w, mesh, [Shard(0)]), y,
                                  chunk_tokens=7)
    ref_tokens = F.cross_entropy((h @ w.T).flatten(0, 1), y.flatten(), reduction="none").view(b, s)
    out["token_losses"] = ((tokens - ref_tokens).abs().max() / ref_tokens.max()).item()
    vals = torch.tensor([out[k] for k in sorted(out)], dtype=torch.float64)
    dist.all_reduce(vals, op=dist.ReduceOp.MAX)
    return dict(zip(sorted(out), vals.tolist()))
