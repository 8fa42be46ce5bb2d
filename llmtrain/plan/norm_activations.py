"""What the model's RMSNorms keep for backward, per micro batch (:mod:`llmtrain.plan.activations` adds
them up): the block's two norms, Gemma's two post norms and the q/k norms of Qwen3 / Gemma 3. One
concept of its own because the rule depends on the kernel: CUDA's fused RMSNorm and the engine's
``OffsetRMSNorm`` (Gemma, every device) keep the input and the fp32 rstd; the composite op on CPU
keeps an fp32 upcast of the input and the fp32 normalized tensor too. ``x`` is an
:class:`~llmtrain.plan.activations.ActShape`."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from llmtrain.plan.activations import ActShape

LSE = 4  # fp32 log-sum-exp / rstd bytes


def _norm_bytes(x: ActShape) -> int:
    """Bytes per element of what an RMSNorm saves: its input in the residual stream's dtype (CUDA's
    fused kernel; Gemma's OffsetRMSNorm on every device), or on CPU the composite op's fp32 upcast of
    it (4 bytes whatever the input's dtype)."""
    return x.e if x.fused_norm or x.offset_norm else 4


def _norm(x: ActShape) -> dict[str, int]:
    rows = x.b * x.s // x.n
    out = {"norm_input": rows * x.h * _norm_bytes(x), "norm_rstd": rows * LSE}
    if not (x.fused_norm or x.offset_norm):
        out["norm_normalized"] = rows * x.h * 4
    return out


def qk_norm_terms(x: ActShape, recompute: str) -> dict[str, int]:
    """Qwen3's / Gemma 3's q and k norms (``model.qk_norm``): each keeps what the block's norms keep,
    per head of its TP shard over the whole sequence (attention runs on the gathered sequence under
    SP): its input (wq's / wk's output), the fp32 rstd per head and token, and on CPU the composite
    op's fp32 normalized tensor. Measured: the missing 811,008 bytes of a 4-layer debug model with
    qk_norm (tests/test_costmodel.py qk_norm_zero1; 13.7 % of its activations, planned low before).
    Under selective recomputation wq's and wk's outputs are kept anyway and the norms recomputed."""
    if not x.qk_norm or recompute in ("selective", "selective_mm"):
        return {}
    rows = x.b * x.s * (x.heads + x.kv_heads) // x.tp
    out = {"qk_norm_input": rows * x.head_dim * _norm_bytes(x), "qk_norm_rstd": rows * LSE}
    if x.qk_norm_all:  # OLMo 2: one rstd per token for q and one for k (the same inputs)
        out["qk_norm_rstd"] = 2 * x.b * x.s * LSE
        if x.tp > 1:  # engine/models/norm.py SplitRMSNorm's eager ops: the fp32 input and the normalized shard
            out["qk_norm_input"] = rows * x.head_dim * 4
            out["qk_norm_normalized"] = rows * x.head_dim * x.e
    if not (x.fused_norm or x.offset_norm):
        out["qk_norm_normalized"] = rows * x.head_dim * 4
    return out


def post_norm_terms(x: ActShape, recompute: str) -> dict[str, int]:
    """Gemma's two post norms (``model.post_norms``): each keeps its input (wo's and w2's reduced
    outputs, [b, s/t, h] under SP) and rstd, like the block's other norms. Under selective
    recomputation they keep nothing: both are recomputed with the block's other non-matmul ops, from
    wo's kept output and w2's recomputed one (measured: tests/test_costmodel.py gemma_tp2_selective,
    engine / plan 0.997; counting w2's output as kept planned 8 % high)."""
    if not x.post_norms or recompute in ("selective", "selective_mm"):
        return {}
    return {f"post_{k}": 2 * v for k, v in _norm(x).items()}
