"""Attention masks of packed rows and sliding windows, built once per forward and shared by the layers.

Without context parallelism, or under Ulysses (each rank attends over the whole row of its heads),
a mask spans the whole row, ``[S, S]`` (a window's band) or ``[b, 1, S, S]`` (packed rows' samples).
Under all-gather context parallelism a rank's queries are its two zigzag chunks of the row
(:func:`zigzag_rows`; ``engine/parallel/context.py``) and its keys the whole gathered row, so its
masks are those rows only, ``[s, S]`` / ``[b, 1, s, S]`` with ``s = S / cp`` (Llama 3's reason for
all-gather CP: "support different types of attention masks, such as the document mask",
arXiv:2407.21783, sec. 3.3.2); soft-capped attention (Gemma 2) there takes its causal mask as rows too,
since its kernel's implicit causal mask assumes square scores. Ring CP's masks are the same rows, with
the keys in ring order (:func:`ring_keys`): each K/V block the ring passes around is then a contiguous
range of columns, and each step's block mask a view (``engine/parallel/context_ring.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def zigzag_rows(seq_len: int, cp: int, cp_rank: int, device=None) -> torch.Tensor:
    """Row indices (global token positions) that cp rank ``cp_rank`` holds under the load-balanced
    split of ring and all-gather CP: chunks ``r`` and ``2 cp - 1 - r`` of ``2 cp``, in local order."""
    chunk = seq_len // (2 * cp)
    first, second = cp_rank, 2 * cp - 1 - cp_rank
    return torch.cat([torch.arange(first * chunk, (first + 1) * chunk, device=device),
                      torch.arange(second * chunk, (second + 1) * chunk, device=device)])


def ring_keys(seq_len: int, cp: int, device=None) -> torch.Tensor:
    """Global positions of the keys in ring order: every cp rank's zigzag rows (:func:`zigzag_rows`) in
    rank order, the K/V of rank ``j`` at columns ``j s_local ... (j + 1) s_local``."""
    return torch.cat([zigzag_rows(seq_len, cp, j, device) for j in range(cp)])


def packed_mask(segments: torch.Tensor) -> torch.Tensor:
    """Block-diagonal causal mask [b, 1, s, s] (True = may attend) of packed rows.

    ``segments`` [b, s] numbers the samples of each row (padding has its own id, -1): a token
    attends to earlier tokens of its own sample only, so no sample sees another. Every row of
    the mask keeps its diagonal, so no softmax is over an empty set (no NaN, padding included).
    """
    s = segments.shape[-1]
    causal = torch.ones(s, s, dtype=torch.bool, device=segments.device).tril()
    return (segments.unsqueeze(-1) == segments.unsqueeze(-2)).logical_and(causal).unsqueeze(1)


def window_mask(positions: torch.Tensor, window: int) -> torch.Tensor:
    """Sliding-window causal mask (True = may attend) of global ``positions`` [s] or [b, s]:
    ``[s, s]`` or ``[b, 1, s, s]``; the query at position ``p`` sees keys at ``p - window < q <= p``,
    itself included (transformers' ``sliding_window_overlay``: ``kv_idx > q_idx - window``). In
    packed rows positions restart per sample, and :func:`packed_mask` keeps samples apart; within
    a sample the position difference is the index difference, as transformers counts it."""
    d = positions.unsqueeze(-1) - positions.unsqueeze(-2)
    mask = (d >= 0).logical_and(d < window)
    return mask if mask.dim() == 2 else mask.unsqueeze(1)


def longest_sample(segments: torch.Tensor) -> torch.Tensor:
    """Tokens of the longest sample in packed rows ``segments`` [b, s] (runs of one sample id;
    padding, id -1, counts as none), a 0-d tensor: no host sync. Under context parallelism a rank
    holds a shard of each row's positions but the whole row's sample ids (Ulysses, all-gather)."""
    idx = torch.arange(segments.shape[-1], device=segments.device)
    new = torch.ones_like(segments, dtype=torch.bool)
    new[..., 1:] = segments[..., 1:] != segments[..., :-1]
    start = torch.cummax(torch.where(new, idx, 0), dim=-1).values
    return ((idx - start + 1) * (segments >= 0)).max()


def attention_bias(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask as SDPA's additive float mask (0 where visible, -inf elsewhere) in the
    queries' dtype, built once per forward and shared by every layer. Why not the boolean mask:
    SDPA converts a boolean mask to this form inside every call, and the fused kernels save
    their mask for backward, so each layer would keep its own ``s x s`` copy in the compute
    dtype until its backward (32 layers at s = 4096 in bf16: 1 GiB per microbatch); given the
    float mask, every layer saves the same tensor."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(mask.logical_not(), float("-inf"))


def masked_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Core attention of packed rows or a sliding window: SDPA with an explicit mask
    (:func:`packed_mask`, :func:`window_mask`, as :func:`attention_bias`).

    Why SDPA with a dense mask and not FlexAttention: it is one code path that runs, and is
    verified, on CPU/gloo and on CUDA alike (CUDA dispatches a masked SDPA to the
    memory-efficient kernel; flash attention takes no mask). The mask costs ``b * s * s`` bytes
    per forward (8 MiB at s = 4096, micro 1 per microbatch, shared by all layers and heads).
    FlexAttention's block-sparse kernel, which skips the masked blocks, needs
    ``torch.compile``, and compiled flex attention on CPU is not what our CPU tests run, so it
    is left to the engine-speed work (docs/finetune.md).
    """
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def forward_masks(positions: torch.Tensor, segments: torch.Tensor | None, window: int | None, full: int,
                  seq_shards: int, rows: torch.Tensor | None, causal_rows: bool,
                  dtype: torch.dtype, keys: torch.Tensor | None = None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The additive masks of one forward: ``(full-attention layers', windowed layers')``, either None
    where those layers run plain causal attention (module docstring).

    ``positions``: this rank's RoPE positions (used for the band without CP); ``segments`` [b, S]: the
    whole row's sample ids of packed rows; ``window``: the window when it is shorter than the row
    ``full`` and this stage has windowed layers, else None; ``seq_shards``: cp (a band over the whole
    row for Ulysses); ``rows``: this rank's query rows under all-gather or ring CP (:func:`zigzag_rows`),
    else None; ``causal_rows``: with ``rows``, give unmasked layers an explicit causal mask of those rows
    (the soft-capped kernel); ``keys``: with ``rows``, the key positions in the order of the mask's
    columns (ring CP: :func:`ring_keys`), else the row in order."""
    if rows is None:
        base = None if segments is None else packed_mask(segments)  # boolean, True = may attend
        band = None
        if window is not None:
            band = window_mask(positions if seq_shards == 1 else torch.arange(full, device=positions.device), window)
            band = band if base is None else base.logical_and(band)
    else:
        keys = torch.arange(full, device=rows.device) if keys is None else keys
        d = rows.unsqueeze(-1) - keys.unsqueeze(0)  # [s, S]: query - key position
        causal = d >= 0
        base = causal if causal_rows else None
        if segments is not None:  # the rows' sample ids against the whole row's keys
            same = segments.index_select(1, rows).unsqueeze(-1) == segments.index_select(1, keys).unsqueeze(-2)
            base = same.logical_and(causal).unsqueeze(1)
        band = None
        if window is not None:
            band = (causal if base is None else base).logical_and(d < window)
    mask = None if base is None else attention_bias(base, dtype)
    return mask, (mask if band is None else attention_bias(band, dtype))
