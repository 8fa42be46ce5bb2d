"""Chunked (and, under TP, vocabulary-parallel) cross-entropy over the output head.

The loss takes the final norm's output ``h`` [b, s, hidden] and the output weight [vocab, hidden]
instead of the logits: the head's matmul and the cross-entropy run one chunk of tokens at a
time, so the fp32 logits of at most ONE chunk are ever alive and no ``[b, s, vocab]`` tensor
(logits, log-probabilities, their gradients) exists at any point, in forward or backward.

Decisions:

* **Gradients in the forward** (the "fused linear cross-entropy" of Liger-Kernel,
  arXiv:2410.10989): each chunk's ``softmax - onehot`` is turned into its gradients at once —
  ``dL/dh`` of the chunk's rows and ``dL/dW`` accumulated over chunks in fp32 — and the chunk's
  logits are freed. Backward only scales the two stored gradients by the incoming scalar. The
  other choice, recomputing each chunk's logits in backward (checkpointing per chunk, Cut
  Cross-Entropy), costs one more head matmul per step (+1/3 of the head's FLOPs, ~+30 % step time
  for a small model with a 32K vocabulary); what this one holds from forward to backward is
  ``dL/dh`` (fp32 [tokens, hidden], instead of the head input autograd would keep) and ``dL/dW``
  (fp32, the local weight's size, only when the weight trains). That is why the Function returns
  the **sum** of the token losses (a scalar: the incoming gradient is one number for every token);
  the mean, ``StepLoss``'s factor and the pipeline's ``1 / n_microbatches`` are scalars applied
  outside by autograd. Per-token losses (eval) come from :func:`chunked_token_losses`, no grad.
* **Exact:** the same math as ``F.cross_entropy`` in fp32 (``lse - z[target]``, gradient
  ``softmax - onehot``); only the summation order differs (tests/test_chunked_loss.py: <= 1e-6).
  Labels of -100 (``IGNORE``) give no loss and a zero gradient row.
* **Precision:** the matmuls run in the compute dtype (the autocast dtype under autocast, else the
  weight's: bf16 under FSDP mixed precision), logits are upcast to fp32 per chunk and all loss math
  is fp32, as ``F.cross_entropy(logits.float())`` does; gradients are accumulated in fp32 and cast
  to the input dtypes at the end.
* **Tensor parallelism:** the output weight is vocabulary-sharded (``Shard(0)`` DTensor, rows
  ``[rank * V/tp, (rank+1) * V/tp)``). ``h`` is gathered to the full sequence (sequence
  parallelism: an all-gather, what ``ColwiseParallel`` did on the output layer's input) and made
  local with ``grad_placements=Partial``: each rank's ``dL/dh`` covers only its vocabulary shard,
  and DTensor sums it in backward (all-reduce, or reduce-scatter back to the sequence shards).
  Per chunk, each rank's local log-sum-exp is all-gathered over the TP group (``tp x chunk``
  floats) and merged exactly (``logsumexp`` over ranks); the target logits are summed over the
  group once after the loop. ``loss_parallel`` is not used: per chunk it would redistribute a
  DTensor of logits, and its backward needs the chunk's logits again.
* **Chunk size** (:func:`llmtrain.plan.losschunk.loss_chunk_tokens`, shared with the planner):
  as many tokens as keep one chunk's fp32 logits at most 128 MiB per rank, a multiple of 128
  tokens and at least 128, but never fewer than half the hidden size: each chunk also adds its
  ``[V_local, H]`` weight-gradient product to the fp32 accumulator, which in bf16 moves ~20 bytes
  per weight element against ~44 per logit of the chunk's loss, so smaller chunks would spend more
  time on the accumulator than on the loss (plan/losstime.py). 1024 tokens at a 32K local
  vocabulary and hidden <= 2048, 2048 at Llama 3 8B's 128K and 4096.
* **FSDP:** the weight is read from the module after the model's forward, when FSDP2 has it
  unsharded (the root is never resharded after forward, :mod:`.data_parallel`); the gradient
  lands in the unsharded parameter's ``.grad`` like any other and FSDP reduce-scatters it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from llmtrain.plan.losschunk import loss_chunk_tokens

IGNORE = -100  # label of a token that carries no loss (prompt, padding): F.cross_entropy's ignore_index


def _compute_dtype(weight: torch.Tensor) -> torch.dtype:
    device_type = weight.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return weight.dtype


# torch 2.13 names it all_gather_single and deprecates all_gather_into_tensor (older: only the latter)
_all_gather_fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _all_gather(out: torch.Tensor, inp: torch.Tensor, group) -> None:
    _all_gather_fn(out, inp, group=group)


def _chunk_loop(h: torch.Tensor, w: torch.Tensor, labels: torch.Tensor, vocab_start: int, group, chunk: int,
                grad_h: bool, grad_w: bool, softcap: float | None = None):
    """Per-token losses [N] (fp32, 0 where ignored) and the fp32 gradients of their SUM w.r.t.
    ``h`` [N, H] and ``w`` [V_local, H] (None where not wanted). ``h`` and ``w`` are in the compute
    dtype; ``labels`` [N] are global vocabulary ids or -100. ``softcap``: the logits are
    ``cap * tanh(z / cap)`` (Gemma 2's final_logit_softcapping), whose derivative ``1 - tanh^2``
    takes one more chunk-sized fp32 buffer while gradients are computed."""
    n, v_local = h.shape[0], w.shape[0]
    acc = torch.promote_types(h.dtype, torch.float32)  # the loss math's dtype: fp32 (fp64 for fp64 inputs)
    lse_all = torch.empty(n, dtype=acc, device=h.device)
    target_all = torch.empty(n, dtype=acc, device=h.device)
    gh = torch.empty(n, h.shape[1], dtype=acc, device=h.device) if grad_h else None
    gw = torch.zeros(w.shape, dtype=acc, device=w.device) if grad_w else None
    tp = 1 if group is None else dist.get_world_size(group)
    for lo in range(0, n, chunk):
        hi = min(n, lo + chunk)
        h_c, y = h[lo:hi], labels[lo:hi]
        z = torch.mm(h_c, w.t()).to(acc)  # [C, V_local]: the only vocabulary-sized tensor (one chunk)
        slope = None
        if softcap is not None:  # capped logits (elementwise: each TP rank caps its own shard)
            z.div_(softcap).tanh_()
            slope = z.square().neg_().add_(1.0) if (grad_h or grad_w) else None  # d(capped) / d(z)
            z.mul_(softcap)
        local = y - vocab_start
        in_shard = (local >= 0) & (local < v_local)  # ignored labels (-100) are never in a shard
        idx = local.clamp(0, v_local - 1)
        target_all[lo:hi] = z.gather(1, idx.unsqueeze(1)).squeeze(1) * in_shard
        m = z.amax(dim=1)
        z.sub_(m.unsqueeze(1)).exp_()  # in place: exp(z - max), no second [C, V] buffer
        lse = m + z.sum(dim=1).log()  # this rank's log-sum-exp over its vocabulary shard
        if tp > 1:
            parts = torch.empty(tp * (hi - lo), dtype=acc, device=h.device)  # flat: what gloo accepts
            _all_gather(parts, lse.contiguous(), group)
            glob = torch.logsumexp(parts.view(tp, hi - lo), dim=0)
        else:
            glob = lse
        lse_all[lo:hi] = glob
        if not (grad_h or grad_w):
            continue
        valid = (y != IGNORE).to(acc)
        # softmax over the whole vocabulary, restricted to this shard; ignored rows scaled to 0
        z.mul_(((m - glob).exp() * valid).unsqueeze(1))
        rows = in_shard.nonzero().squeeze(1)
        z[rows, idx[rows]] -= 1.0  # - onehot(target) where the target is in this shard
        if slope is not None:
            z.mul_(slope)
            del slope
        g = z if z.dtype == h.dtype else z.to(h.dtype)
        del z
        if grad_h:
            if g.dtype == acc:
                torch.mm(g, w, out=gh[lo:hi])
            else:
                gh[lo:hi] = torch.mm(g, w).to(acc)
        if grad_w:
            if g.dtype == acc:
                gw.addmm_(g.t(), h_c)
            else:
                gw += torch.mm(g.t(), h_c).to(acc)
        del g
    if tp > 1:  # exactly one rank holds each non-ignored target's logit
        dist.all_reduce(target_all, group=group)
    losses = (lse_all - target_all) * (labels != IGNORE)
    return losses, gh, gw


class _ChunkedCrossEntropy(torch.autograd.Function):
    """Sum over tokens of the cross-entropy of ``h @ w.T`` (gradients computed in forward)."""

    @staticmethod
    def forward(ctx, h, w, labels, vocab_start, group, chunk, cdtype, softcap):
        with torch.autocast(h.device.type, enabled=False):
            losses, gh, gw = _chunk_loop(h.to(cdtype), w.to(cdtype), labels, vocab_start, group, chunk,
                                         ctx.needs_input_grad[0], ctx.needs_input_grad[1], softcap)
        ctx.dtypes = (h.dtype, w.dtype)
        ctx.save_for_backward(gh, gw)  # through save_for_backward: saved-tensor hooks (and the planner's check) see them
        return losses.sum()

    @staticmethod
    def backward(ctx, grad):
        gh, gw = ctx.saved_tensors
        dh = None if gh is None else (gh * grad).to(ctx.dtypes[0])
        dw = None if gw is None else (gw * grad).to(ctx.dtypes[1])
        return dh, dw, None, None, None, None, None, None


def _local_operands(h: torch.Tensor, weight: torch.Tensor):
    """(local h [.., H] over the full sequence, local weight, first vocabulary row, TP group or None)."""
    if not isinstance(weight, DTensor):
        if isinstance(h, DTensor):
            h = h.full_tensor()
        return h, weight, 0, None
    mesh = weight.device_mesh
    if mesh.ndim != 1 or tuple(weight.placements) != (Shard(0),):
        raise RuntimeError(f"chunked cross-entropy: the output weight must be vocabulary-sharded over one mesh "
                           f"dimension (Shard(0)), got {weight.placements} on a {mesh.ndim}-D mesh")
    if not isinstance(h, DTensor):  # no sequence parallelism: h is the same on every TP rank
        h = DTensor.from_local(h, mesh, [Replicate()], run_check=False)
    h = h.redistribute(mesh, [Replicate()]).to_local(grad_placements=[Partial()])
    w_local = weight.to_local()
    rows = -(-weight.shape[0] // mesh.size())  # torch's Shard(0) chunking: ceil(V / tp) rows per rank
    return h, w_local, mesh.get_local_rank() * rows, mesh.get_group()


def chunked_cross_entropy(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, reduction: str = "mean",
                          chunk_tokens: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """Cross-entropy of ``h @ weight.T`` against ``labels`` (-100 ignored), one token chunk at a time.

    ``h`` [b, s, H] (a DTensor under sequence parallelism), ``weight`` [V, H] (a ``Shard(0)``
    DTensor under TP), ``labels`` [b, s]. ``reduction``: ``"mean"`` over non-ignored tokens (as
    ``F.cross_entropy``; NaN when all are ignored), ``"sum"``, or ``"none"`` (per-token losses
    [b, s], computed without gradients). ``chunk_tokens``: tokens per chunk (default: the shared
    rule :func:`~llmtrain.plan.losschunk.loss_chunk_tokens`). ``softcap``: of the logits
    (``model.logit_softcap``). Returns a plain fp32 tensor, the same on every TP rank."""
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be mean, sum or none, not {reduction!r}")
    h_local, w_local, vocab_start, group = _local_operands(h, weight)
    h2 = h_local.reshape(-1, h_local.shape[-1])
    y = labels.reshape(-1)
    if y.shape[0] != h2.shape[0]:
        raise ValueError(f"chunked cross-entropy: {h2.shape[0]} hidden rows but {y.shape[0]} labels")
    chunk = chunk_tokens or loss_chunk_tokens(h2.shape[0], w_local.shape[0], h2.shape[1])
    cdtype = _compute_dtype(w_local)
    if reduction == "none" or not torch.is_grad_enabled():
        with torch.no_grad(), torch.autocast(h2.device.type, enabled=False):
            losses, _, _ = _chunk_loop(h2.detach().to(cdtype), w_local.detach().to(cdtype), y, vocab_start, group,
                                       chunk, False, False, softcap)
        if reduction == "none":
            return losses.view(labels.shape)
        total = losses.sum()
    else:
        total = _ChunkedCrossEntropy.apply(h2, w_local, y, vocab_start, group, chunk, cdtype, softcap)
    return total if reduction == "sum" else total / (y != IGNORE).sum()


def chunked_token_losses(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                         chunk_tokens: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """Per-token losses [b, s] (fp32, 0 where the label is -100), no gradients: for evaluation."""
    return chunked_cross_entropy(h, weight, labels, reduction="none", chunk_tokens=chunk_tokens, softcap=softcap)
