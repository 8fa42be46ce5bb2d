"""What the last stage keeps for the loss, and the loss's transients, per micro batch (split out of
:mod:`llmtrain.plan.activations`, which re-exports these; ``x`` is its
:class:`~llmtrain.plan.activations.ActShape`).

The loss (``engine/parallel/loss.py``, chunked cross-entropy, on by default): the head's matmul
and the cross-entropy run ``loss_chunk_tokens`` tokens at a time with the gradients computed in
forward, so the last stage keeps the fp32 ``dL/dh`` of its (TP: full) sequence and, when the
head trains, the fp32 ``dL/dW`` of its vocabulary shard, instead of the head's input, the
``[b, s, vocab/tp]`` logits and log-probabilities; one chunk's fp32 logits are the transient.
``ActShape.chunked_loss=False`` models the unchunked loss (``F.cross_entropy`` over full
logits) for comparisons; ``compiled_loss`` that loss under torch.compile and the one-kernel fused
losses (``planner.loss: fused``, which keep the logits and a log-sum-exp per token);
``megatron_loss`` Megatron's (``planner.loss: megatron`` / ``megatron_fused``: the fp32 softmax kept,
the low-precision logits freed after the upcast).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from llmtrain.plan.norm_activations import _norm

if TYPE_CHECKING:
    from llmtrain.plan.activations import ActShape


def last_stage_terms(x: ActShape) -> dict[str, int]:
    """Final norm and the loss, per micro batch on the stage holding the output head.

    Chunked loss (default): the fp32 ``dL/dh`` over the full sequence (TP gathers it; each rank
    holds its vocabulary shard's partial sum) and, when the head trains (not LoRA), the fp32
    ``dL/dW`` of the local ``[vocab/tp, hidden]`` weight. Unchunked: the output layer's (gathered)
    input, the loss's fp32 ``[b, s, vocab/tp]`` tensor (log-probabilities; under ``loss_parallel``
    its fp32 input logits) and the int64 labels; compiled (``planner.loss: compiled``, the same
    ``F.cross_entropy(logits.float(), ...)`` under ``torch.compile``): Inductor fuses the upcast,
    log-softmax and gather into reductions over the bf16 logits, so it saves the fp32 log-sum-exp
    per token instead of the fp32 log-probabilities."""
    out = _norm(x)
    if x.lora is not None:  # frozen final norm weight: no normalized input for its gradient
        out.pop("norm_normalized", None)
    if x.chunked_loss:
        out["loss_grad_hidden"] = 4 * x.b * x.s * x.h
        if x.lora is None:
            out["loss_grad_weight"] = 4 * (x.vocab // x.tp) * x.h
        return out
    if x.lora is None:  # a frozen output layer does not save its input
        out["output_input"] = x.b * x.s * x.h * x.e
    if x.compiled_loss:  # Inductor's fused cross-entropy saves the per-token log-sum-exp, not log-probs
        out["loss_lse"] = 4 * x.b * x.s
    else:
        out["log_probs"] = 4 * x.b * x.s * x.vocab // x.tp
    out["labels"] = 8 * x.b * x.s
    return out


def logits_bytes(x: ActShape) -> int:
    """Logits alive from the forward to the end of backward (``[b, s, vocab/tp]`` in compute dtype).
    With TP in fp32 the vocabulary-parallel loss keeps the logits themselves: nothing extra. The
    chunked loss keeps none."""
    if x.chunked_loss or x.megatron_loss or (x.tp > 1 and x.e == 4):
        return 0
    return x.b * x.s * x.vocab // x.tp * x.e


def loss_backward_bytes(x: ActShape) -> int:
    """Transient memory of the loss. Unchunked: the fp32 gradients of the log-softmax and of the
    upcast logits during loss backward (compiled: the logits' gradient, written once in their dtype). Chunked: one chunk's fp32 logits (turned into their
    gradient in place), in bf16 also the matmul's output and the gradient's cast, and the bf16
    weight-gradient product of a chunk before its fp32 accumulation."""
    v = x.vocab // x.tp
    if not x.chunked_loss:  # compiled (and Megatron's, in place): the logits' gradient written in their dtype
        return x.b * x.s * v * x.e if x.compiled_loss or x.megatron_loss else 2 * 4 * x.b * x.s * v
    low = x.e != 4
    slope = 4 * x.loss_chunk * v if x.logit_softcap else 0  # soft-capped logits: 1 - tanh^2, fp32 (parallel/loss.py)
    return x.loss_chunk * v * (4 + 2 * x.e * low) + (v * x.h * x.e if low and x.lora is None else 0) + slope
