"""Attention blocks through the fused SDPA kernels that return the log-sum-exp, and their merge.

Context-parallel attention (``context.py``, ``context_ring.py``) splits one causal attention into
blocks — a query range against a key range, either fully visible or causal on the diagonal — and
combines them exactly with the online-softmax rule: with per-block outputs ``o_i`` and
log-sum-exps ``l_i``, ``l = log sum_i exp(l_i)`` and ``o = sum_i exp(l_i - l) o_i``. Every block
runs a fused kernel, so nothing of size ``[s_q, s_k]`` ever exists in memory: the working memory of
a block is its output and lse, ``O(s_q d)``.

Backward uses the standard flash trick: the kernel's backward, given the *merged* output and lse
of the whole row (not the block's own), recomputes the block's probabilities as
``exp(q k^T scale - l)`` — exactly the full softmax restricted to the block — and ``delta =
rowsum(dout * o)`` from the full output, so the gradients it returns for the block's q, k and v
are the block's exact share of the full attention's gradients. Summing them over blocks gives the
full gradients.

Kernel per device and dtype (:func:`backend`), all with ``is_causal`` aligned top-left (query i
sees keys j <= i of the block), which the callers arrange to be the right mask:

- CPU: ``aten._scaled_dot_product_flash_attention_for_cpu`` (+ ``_backward``). On torch 2.13 it
  takes fp64, fp32, bf16 and fp16 (checked here); its lse is fp32, fp64 for fp64 inputs.
- CUDA, fp16/bf16, head_dim a multiple of 8 up to 256, sm80+: ``_scaled_dot_product_flash_attention``
  (+ ``_backward``), lse fp32 ``[b, h, s]``.
- CUDA otherwise in fp32/fp16/bf16 (flash has no fp32 kernel): the memory-efficient kernel
  ``_scaled_dot_product_efficient_attention`` (+ ``_backward``); its lse is padded to a multiple
  of 32 queries: sliced for the merge, padded again for its backward.
- anything else (fp64 on CUDA, odd head dims): a plain-matmul block that materializes the block's
  scores — O(s_q s_k) for that block only, a debugging path with no kernel to use. Said here
  rather than refused, so fp64 parity checks run on any device.

The CUDA paths follow the aten schemas of torch 2.13 and pass the forward's auxiliary outputs
(sequence lengths, philox state; dropout is 0) back to the backward the way torch's own autograd
formula does. They have not been run on a GPU in the session that wrote them (no device then).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from llmtrain.engine.models.softcap import softcap_attention_backward, softcap_attention_op

aten = torch.ops.aten


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype of merged outputs, lse and gradient accumulators: fp32 at least, fp64 stays fp64."""
    return torch.promote_types(dtype, torch.float32)


def backend(q: torch.Tensor) -> str:
    """Which kernel runs blocks of ``q``'s device and dtype (module docstring)."""
    d = q.shape[-1]
    if q.device.type == "cpu":
        return "cpu"
    if q.device.type == "cuda":
        half = q.dtype in (torch.float16, torch.bfloat16)
        if half and d % 8 == 0 and d <= 256 and torch.cuda.get_device_capability(q.device) >= (8, 0):
            return "flash"
        if (half or q.dtype == torch.float32) and d % 8 == 0:
            return "efficient"
    return "math"


def block_forward(q, k, v, causal: bool, scale: float, kind: str | None = None,
                  mask: torch.Tensor | None = None, softcap: float | None = None):
    """One block: ``(out [b, h, s_q, d] in q's dtype, lse [b, h, s_q] in acc dtype, aux)``;
    ``aux`` is what this block's backward needs besides the tensors. ``kind`` overrides
    :func:`backend` (tests run the math path on CPU). ``mask`` / ``softcap``: a masked block
    (:func:`masked_block_forward`)."""
    if mask is not None or softcap is not None:
        return masked_block_forward(q, k, v, mask, softcap, scale, kind)
    kind = kind or backend(q)
    if kind == "cpu":
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
        return out, lse, (kind,)
    if kind == "flash":
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, causal, False, scale=scale)
        return out, lse, (kind, cum_q, cum_k, max_q, max_k, seed, offset)
    if kind == "efficient":
        out, lse, seed, offset = aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal,
                                                                              scale=scale)
        return out, lse[..., :q.shape[2]], (kind, lse.shape[-1], seed, offset)
    scores = _math_scores(q, k, causal, scale)
    lse = torch.logsumexp(scores, dim=-1)
    out = (torch.exp(scores - lse[..., None]) @ v.to(scores.dtype)).to(q.dtype)
    return out, lse, (kind,)


def block_backward(dout, q, k, v, out, lse, causal: bool, scale: float, aux, mask: torch.Tensor | None = None):
    """Gradients of the block's q, k, v (in their dtype), given the merged ``out``/``lse`` of the
    block's query rows (module docstring); ``mask``: the forward's, for a masked block."""
    kind = aux[0]
    dout, out = dout.to(q.dtype), out.to(q.dtype)
    if kind in MASKED_KINDS:
        return masked_block_backward(dout, q, k, v, out, lse, mask, scale, aux)
    if kind == "cpu":
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(dout, q, k, v, out, lse, 0.0, causal,
                                                                         scale=scale)
    if kind == "flash":
        _, cum_q, cum_k, max_q, max_k, seed, offset = aux
        return aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse.contiguous(), cum_q, cum_k, max_q, max_k, 0.0, causal, seed, offset, scale=scale)
    if kind == "efficient":
        _, padded, seed, offset = aux
        lse = F.pad(lse, (0, padded - lse.shape[-1])).contiguous()
        dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
            dout, q, k, v, None, out, lse, seed, offset, 0.0, [True, True, True, False], causal, scale=scale)
        return dq, dk, dv
    probs = torch.exp(_math_scores(q, k, causal, scale) - lse[..., None])
    return _math_grads(dout, q, k, v, out, probs, lse.dtype, scale)


# -- masked blocks (ring CP with packed rows, a sliding window or Gemma 2's soft-cap) --------------------------
MASKED_KINDS = ("cpu_masked", "efficient_masked", "math_masked", "softcap")
EFFICIENT_ALIGN = 16  # the memory-efficient kernel's bias rows start on 16-element boundaries (SDPA pads so too)


def masked_backend(q: torch.Tensor, softcap: float | None) -> str:
    """The kernel of a masked block: the soft-capped kernel for Gemma 2 (models/softcap.py); else CPU's
    flash kernel (it takes a mask), on CUDA the memory-efficient one (flash takes no mask), else math."""
    if softcap is not None:
        return "softcap"
    kind = backend(q)
    return {"cpu": "cpu_masked", "flash": "efficient_masked", "efficient": "efficient_masked"}.get(kind, "math_masked")


def masked_block_forward(q, k, v, mask: torch.Tensor, softcap: float | None, scale: float, kind: str | None = None):
    """A block under an additive ``mask`` of its rows and keys (0 / -inf, ``[s_q, s_k]`` or ``[b, 1, s_q,
    s_k]``, a view of the model's mask: ``models/masks.py``), soft-capped when ``softcap`` (the mask then
    holds the causal part too): ``(out, lse, aux)`` as :func:`block_forward`.

    Rows that see no key of this block (another sample, outside the window, later positions) come
    back with ``lse = -inf`` and a zero output whatever the kernel returns for them (CPU's flash kernel
    returns lse 0 and output 0, so its output is kept; the soft-capped one NaN; the others are zeroed
    too), so :func:`merge_` adds nothing for them. Which rows: the mask's row maxima (no ``[s_q, s_k]``
    temporary). The caller starts from a block that gives every row a key (the ring's own K/V hold
    each row's diagonal), so merged rows are never empty and every backward gets a finite lse."""
    if mask is None:
        raise ValueError("a soft-capped block needs its mask (the causal part as rows of keys)")
    kind = "math_masked" if kind == "math" else kind or masked_backend(q, softcap)
    if kind == "softcap":
        out, lse = softcap_attention_op(q, k, v, mask, float(softcap))
        aux = (kind, float(softcap))
    elif kind == "cpu_masked":
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, attn_mask=mask, scale=scale)
        aux = (kind,)
    elif kind == "efficient_masked":
        out, lse, seed, offset = aten._scaled_dot_product_efficient_attention(
            q, k, v, efficient_bias(mask, q, k), True, 0.0, False, scale=scale)
        aux = (kind, lse.shape[-1], seed, offset)
        lse = lse[..., :q.shape[2]]
    else:
        scores = _math_scores(q, k, False, scale) + mask
        lse = torch.logsumexp(scores, dim=-1)
        out = (torch.exp(scores - lse[..., None]) @ v.to(scores.dtype)).to(q.dtype)
        aux = ("math_masked",)
    empty = mask.amax(-1).isneginf()  # rows with no visible key here: [s_q] or [b, 1, s_q]
    # out of place: selective recomputation caches the kernels' outputs (start_accumulators' reason)
    lse = lse.to(acc_dtype(q.dtype)).masked_fill(empty, float("-inf"))
    if kind != "cpu_masked":
        out = out.masked_fill(empty.unsqueeze(-1), 0.0)
    return out, lse, aux


def masked_block_backward(dout, q, k, v, out, lse, mask: torch.Tensor, scale: float, aux):
    """Gradients of a :func:`masked_block_forward` block given the merged ``out`` / ``lse`` (finite: every
    merged row saw a key), the same mask: masked keys get probability ``exp(-inf) = 0``."""
    kind = aux[0]
    if kind == "softcap":
        return softcap_attention_backward(dout.contiguous(), q, k, v, mask, out, lse.contiguous(), aux[1])
    if kind == "cpu_masked":
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(dout, q, k, v, out, lse, 0.0, False,
                                                                         attn_mask=mask, scale=scale)
    if kind == "efficient_masked":
        _, padded, seed, offset = aux
        lse = F.pad(lse, (0, padded - lse.shape[-1])).contiguous()
        dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
            dout, q, k, v, efficient_bias(mask, q, k), out, lse, seed, offset, 0.0, [True, True, True, False],
            False, scale=scale)
        return dq, dk, dv
    acc = lse.dtype
    probs = torch.exp(_math_scores(q, k, False, scale) + mask - lse[..., None])
    return _math_grads(dout, q, k, v, out, probs, acc, scale)


def efficient_bias(mask: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """``mask`` as the memory-efficient kernel's bias: q's dtype, rows starting on
    :data:`EFFICIENT_ALIGN`-element boundaries (copied into a padded buffer otherwise, as SDPA's own
    ``preprocess_mask`` pads), expanded to ``[b, heads, s_q, s_k]`` (a view). Not yet run on a GPU
    (benchmarks/gpu_check_steps/kernels.py checks it there)."""
    bias = mask.to(q.dtype)
    if bias.stride(-1) != 1 or bias.stride(-2) % EFFICIENT_ALIGN:
        sk = bias.shape[-1]
        wide = -(-sk // EFFICIENT_ALIGN) * EFFICIENT_ALIGN
        padded = torch.zeros(*bias.shape[:-1], wide, dtype=bias.dtype, device=bias.device)
        padded[..., :sk].copy_(bias)
        bias = padded[..., :sk]
    while bias.dim() < 4:
        bias = bias.unsqueeze(0)
    return bias.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])


def _math_grads(dout, q, k, v, out, probs, acc, scale):
    dout_a = dout.to(acc)
    dv = probs.transpose(-1, -2) @ dout_a
    dscores = probs * (dout_a @ v.to(acc).transpose(-1, -2) - (dout_a * out.to(acc)).sum(-1, keepdim=True))
    dq = (dscores @ k.to(acc)) * scale
    dk = (dscores.transpose(-1, -2) @ q.to(acc)) * scale
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _math_scores(q, k, causal: bool, scale: float) -> torch.Tensor:
    acc = acc_dtype(q.dtype)
    scores = (q.to(acc) @ k.to(acc).transpose(-1, -2)) * scale
    if causal:
        sq, sk = scores.shape[-2:]
        hidden = torch.ones(sq, sk, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(hidden, float("-inf"))
    return scores


def start_accumulators(blk_out: torch.Tensor, blk_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Fresh acc-dtype copies of the first block's output and lse, which :func:`merge_` then
    updates in place. Always copies, never mutating a kernel's output: selective recomputation
    caches the kernels' outputs and refuses (rightly) a cached tensor that was changed."""
    acc = acc_dtype(blk_out.dtype)
    return blk_out.to(acc, copy=True), blk_lse.to(acc, copy=True)


def merge_(out: torch.Tensor, lse: torch.Tensor, blk_out: torch.Tensor, blk_lse: torch.Tensor) -> None:
    """Fold one block into the running (``out``, ``lse``) of the same query rows, in place.

    ``out``/``lse`` are acc-dtype accumulators (or views of their rows). No merged row is ever
    empty (every caller starts from a block that gives each row at least one key), so no -inf
    guards: a masked block's empty rows (``blk_lse = -inf``, output 0) add nothing."""
    new = torch.logaddexp(lse, blk_lse.to(lse.dtype))
    out.mul_(torch.exp(lse - new).unsqueeze(-1))
    out.add_(blk_out * torch.exp(blk_lse - new).unsqueeze(-1))
    lse.copy_(new)


def box_slices(box: tuple[int, ...], chunk: int) -> tuple[slice, slice]:
    """The rows and key positions of box ``(i, j, r0, r1, k0, k1)``: rows ``r0 .. r1`` of query chunk ``i``, keys
    ``k0 .. k1`` of key chunk ``j``, chunks of ``chunk`` tokens (``plan/ringwindow.py`` ``pair_box``; the ring's
    local chunks, or the row's chunks without CP: ``plan/localwindow.py``)."""
    i, j, r0, r1, k0, k1 = box
    return slice(i * chunk + r0, i * chunk + r1), slice(j * chunk + k0, j * chunk + k1)


def box_forward_(out, lse, q, k, v, rows: slice, mask, first: bool, scale: float, softcap):
    """One box of a windowed layer (ring CP's pairs, the neighbour exchange's, or without CP): its kernel call
    on q's ``rows`` against ``k``/``v`` (the box's keys, repeated for GQA), under ``mask`` (its view of the
    model's, or None), folded into ``out``/``lse``'s rows: copied when ``first`` (a diagonal box, first for
    its rows: every row sees itself; causal when unmasked), else merged. Returns the block's aux."""
    blk_out, blk_lse, aux = block_forward(q[:, :, rows], k, v, first and mask is None, scale, mask=mask, softcap=softcap)
    if first:
        out[:, :, rows].copy_(blk_out)
        lse[:, :, rows].copy_(blk_lse)
    else:
        merge_(out[:, :, rows], lse[:, :, rows], blk_out, blk_lse)
    return aux


def box_backward_(dq, dout, q, k, v, out, lse, rows: slice, mask, first: bool, scale: float, aux):
    """:func:`box_forward_`'s backward with the merged ``out``/``lse``: the rows' dq added into ``dq``;
    returns the box keys' (dK, dV) with the repeated heads (:func:`add_kv_grad_` sums them)."""
    dqb, dkb, dvb = block_backward(dout[:, :, rows], q[:, :, rows], k, v, out[:, :, rows], lse[:, :, rows],
                                   first and mask is None, scale, aux, mask)
    dq[:, :, rows].add_(dqb)
    return dkb, dvb


def repeat_kv(k: torch.Tensor, v: torch.Tensor, keys: slice, n_rep: int) -> tuple[torch.Tensor, torch.Tensor]:
    """GQA: the key range ``keys`` of ``k`` and ``v`` (``[b, kv_heads, s, d]``) repeated to
    ``[b, kv_heads * n_rep, len, d]``, query head ``j`` reading KV head ``j // n_rep`` (the model's
    ``repeat_interleave`` order), for one kernel call. Copies unless ``n_rep == 1``;
    :func:`add_kv_grad_` is their backward."""
    k, v = k[:, :, keys], v[:, :, keys]
    return (k, v) if n_rep == 1 else (k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1))


def add_kv_grad_(acc: torch.Tensor, grad: torch.Tensor, n_rep: int) -> None:
    """The backward of :func:`repeat_kv` into an accumulator: ``acc [b, kv_heads, s, d] +=`` the
    gradients of each KV head's ``n_rep`` copies in ``grad [b, kv_heads * n_rep, s, d]``, added one
    copy at a time in ``acc``'s dtype (no temporary, no bf16 partial sums)."""
    if n_rep == 1:
        acc.add_(grad)
        return
    copies = grad.unflatten(1, (acc.shape[1], n_rep))
    for i in range(n_rep):
        acc.add_(copies[:, :, i])


def default_scale(q: torch.Tensor) -> float:
    return 1.0 / math.sqrt(q.shape[-1])


def prefix_blocks(offsets: tuple[int, ...], s: int) -> list[tuple[slice, slice, bool]]:
    """The kernel blocks of :class:`PrefixCausalAttention`: ``(query rows, key range, causal)``.

    The ``s`` local queries are ``len(offsets)`` equal consecutive chunks; chunk ``i`` sits at
    global positions ``[offsets[i], offsets[i] + c)``, ``c = s / len(offsets)``, and sees keys
    ``[0, offsets[i] + c)``: its diagonal chunk (causal, first: it gives every row a key) and,
    unless the chunk starts the sequence, the keys before it (fully visible). Pure: the
    balance test counts the work from it."""
    c = s // len(offsets)
    blocks = []
    for i, off in enumerate(offsets):
        rows = slice(i * c, (i + 1) * c)
        blocks.append((rows, slice(off, off + c), True))
        if off:
            blocks.append((rows, slice(0, off), False))
    return blocks


class PrefixCausalAttention(torch.autograd.Function):
    """Query chunks at global offsets against the gathered K/V (global order): each chunk's
    causal mask is aligned bottom-right on its keys ``[0, offset + c)``. SDPA's ``is_causal`` is
    aligned top-left, so each chunk runs two kernel blocks (:func:`prefix_blocks`) — the keys
    before the chunk, fully visible, and the diagonal chunk, causal — merged with their lse into
    that chunk's rows of one output; keys after a chunk are never touched by it (their gradient
    is zero). ``offsets`` is an int (one chunk: all of ``q``) or a tuple (the all-gather method's
    two zigzag chunks, ``context.allgather_offsets``). Chosen over a dense ``[s, S]`` boolean mask
    (what the all-gather method used before: O(s S) memory, and SDPA on CPU then runs its masked
    path), over padding the queries (wasted work), and over one Function call per chunk (which
    would save K/V once but the output twice — the chunks' and their concatenation, wo's input —
    and return a full-size dK/dV per call for autograd to add).

    GQA: ``k``/``v`` may have fewer heads than ``q`` (``[b, kv_heads, S, d]``, un-repeated, as the
    all-gather moved them); each block repeats its key range to the query heads
    (:func:`repeat_kv`) just for its kernel call, and backward sums the block's repeated heads'
    gradients into dK/dV of kv_heads (:func:`add_kv_grad_`).

    Saved for backward: q, k, v (kv_heads), the output (in q's dtype, returned to the model as
    well, in the ``[b, s, h, d]`` memory layout so the model's ``out.transpose(1, 2).reshape`` is a
    view) and the acc-dtype lse: the same as plain SDPA, with K/V of the whole sequence, not
    repeated. Backward accumulates dK/dV of overlapping key ranges (two chunks see the same
    prefix) in k's dtype, as autograd would sum two uses of one tensor."""

    @staticmethod
    def forward(ctx, q, k, v, offsets):
        offsets = (offsets,) if isinstance(offsets, int) else tuple(offsets)
        (b, h, s, d), scale, acc = q.shape, default_scale(q), acc_dtype(q.dtype)
        n_rep = h // k.shape[1]
        blocks = prefix_blocks(offsets, s)
        # fresh accumulators (never a kernel's output mutated: start_accumulators' reason)
        out = torch.empty(b, s, h, d, dtype=acc, device=q.device).transpose(1, 2)
        lse = torch.empty(b, h, s, dtype=acc, device=q.device)
        aux = []
        for rows, keys, causal in blocks:
            kr, vr = repeat_kv(k, v, keys, n_rep)
            blk_out, blk_lse, a = block_forward(q[:, :, rows], kr, vr, causal, scale)
            del kr, vr
            aux.append(a)
            if causal:  # each chunk's first block
                out[:, :, rows].copy_(blk_out)
                lse[:, :, rows].copy_(blk_lse)
            else:
                merge_(out[:, :, rows], lse[:, :, rows], blk_out, blk_lse)
            del blk_out, blk_lse
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.blocks, ctx.aux, ctx.scale = blocks, aux, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        n_rep = q.shape[1] // k.shape[1]
        dq = torch.zeros_like(q, dtype=acc_dtype(q.dtype))
        dk, dv = torch.zeros_like(k), torch.zeros_like(v)
        for (rows, keys, causal), aux in zip(ctx.blocks, ctx.aux):
            kr, vr = repeat_kv(k, v, keys, n_rep)
            dqb, dkb, dvb = block_backward(dout[:, :, rows], q[:, :, rows], kr, vr,
                                           out[:, :, rows], lse[:, :, rows], causal, ctx.scale, aux)
            del kr, vr
            dq[:, :, rows].add_(dqb)
            add_kv_grad_(dk[:, :, keys], dkb, n_rep)
            add_kv_grad_(dv[:, :, keys], dvb, n_rep)
            del dqb, dkb, dvb
        return dq.to(q.dtype), dk, dv, None
