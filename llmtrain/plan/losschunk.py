"""Tokens per chunk of the engine's chunked cross-entropy (``engine/parallel/loss.py``), one rule
shared by the engine and the planner (its memory, plan/activations.py; its time, plan/losstime.py)."""

from __future__ import annotations

LOSS_CHUNK_BYTES = 128 << 20  # fp32 logits of one loss chunk, per rank
LOSS_CHUNK_MAX_BYTES = 1 << 30  # ... and the most that the half-hidden floor may take (loss_chunk_tokens)
LOSS_CHUNK_ALIGN = 128  # tokens: chunk sizes are multiples of this (matmul tiles), and at least this


def loss_chunk_tokens(tokens: int, vocab_local: int, hidden: int = 0) -> int:
    """Tokens per chunk of the chunked cross-entropy (``engine/parallel/loss.py``), shared by the
    engine and the planner: as many as keep one chunk's fp32 logits ``[chunk, vocab_local]`` within
    ``LOSS_CHUNK_BYTES`` (128 MiB), rounded down to a multiple of 128, but at least half the hidden
    size ``hidden`` (rounded up to a multiple of 128) as far as ``LOSS_CHUNK_MAX_BYTES`` (1 GiB of
    fp32 logits) allows, at least 128, at most ``tokens``.

    The floor at ``hidden / 2`` is for time: each chunk also adds its ``[vocab_local, hidden]``
    weight-gradient product to the fp32 accumulator (in a bf16 compute dtype written, upcast and
    added: 20 bytes per weight element) against 44 bytes per logit of the chunk's own loss
    (plan/losstime.py), so chunks of fewer than ``~hidden / 2`` tokens spend more HBM traffic on
    the accumulator than on the loss. 1024 tokens at a 32K local vocabulary and hidden <= 2048; at
    Llama 3's 128K, 256 for hidden <= 512 and 2048 for 8B's 4096 (1 GiB of fp32 logits: the price
    of 166 -> 67 ms per 8K-token micro batch on an H100, planned; DeepSeek-V3's 129K x 7168: 2048)."""
    fit = LOSS_CHUNK_BYTES // (4 * max(1, vocab_local)) // LOSS_CHUNK_ALIGN * LOSS_CHUNK_ALIGN
    most = LOSS_CHUNK_MAX_BYTES // (4 * max(1, vocab_local)) // LOSS_CHUNK_ALIGN * LOSS_CHUNK_ALIGN
    wide = min(most, -(-(hidden // 2) // LOSS_CHUNK_ALIGN) * LOSS_CHUNK_ALIGN)
    return max(1, min(tokens, max(LOSS_CHUNK_ALIGN, fit, wide)))
