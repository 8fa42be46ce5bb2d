"""Time model v2: the output layer's GEMMs and the cross-entropy, as each stack runs them.

``planner.loss`` says which loss a recipe's stack runs; each is counted kernel by kernel in HBM
bytes per element of the rank's logits ``[tokens, vocab/tp]`` (``e`` = the logits' bytes; an
upcast to fp32 reads ``e`` and writes 4, and so does the cast of the fp32 gradient back, ``cast``
below; both vanish when the logits are already fp32):

- ``engine`` (``engine/parallel/loss.py``): the head's matmul and the loss run one chunk of
  :func:`llmtrain.plan.losschunk.loss_chunk_tokens` tokens at a time, the gradients computed in
  the forward. Per logit: upcast, ``amax`` 4, ``sub_`` 8, ``exp_`` 8, ``sum`` 4, the softmax's
  ``mul_`` 8 and the gradient's cast to the compute dtype: ``32 + 2 cast`` forward, nothing in
  the backward. Per chunk three GEMMs (logits; ``dL/dh`` of the chunk's rows; ``dL/dW`` with the
  chunk's tokens as ``k``, so the roofline sees its ``[vocab/tp, hidden]`` output written once per
  chunk), and in a low-precision compute dtype the weight gradient's product upcast and added to
  the fp32 accumulator (``cast + 12`` bytes per weight element per chunk; fp32: ``addmm_`` in
  place, in the GEMM) and ``dL/dh``'s rows upcast into their fp32 buffer (``cast + 8`` per
  ``[tokens, hidden]`` element). Backward: both stored fp32 gradients scaled and cast (``8 + cast``
  per element).
- ``unchunked`` (``F.cross_entropy(logits.float())``): forward upcast and ``log_softmax`` (two
  reading passes for the row's max and sum, one reading and writing: 16); backward
  ``nll_loss``'s zero-filled fp32 gradient 4, ``log_softmax``'s backward 16 (a pass for the
  gradient's row sum, one reading gradient and output and writing), the cast back.
- ``compiled`` (that loss under ``torch.compile``): Inductor reduces over the low-precision logits
  (two passes, ``2e``) and writes their gradient in one kernel (``2e``).
- ``megatron`` (Megatron-LM / Megatron-Core's ``vocab_parallel_cross_entropy`` without
  ``--cross-entropy-loss-fusion``: NVIDIA/Megatron-LM ``megatron/core/tensor_parallel/
  cross_entropy.py``, the same ops in 2021's ``mpu/cross_entropy.py``): forward ``.float()``,
  ``max`` 4, in-place subtract 8, ``exp`` 8, ``sum`` 4, in-place divide 8: ``32 + cast``; backward
  the in-place multiply 8 and the cast back: ``8 + cast``.
- ``megatron_fused`` (``cross_entropy_loss_fusion``: the same functions under ``torch.compile``,
  ``megatron/core/fusions/fused_cross_entropy.py``; NeMo's Llama / Nemotron configs and
  Megatron-Bridge's ``GPTModelProvider`` turn it on): forward the fp32 copy with its max
  (``e + 4``), subtract-exp-sum 8, divide 8; backward one kernel reading the softmax and writing the
  gradient: ``4 + e``.
- ``fused`` (one fused cross-entropy kernel over the low-precision logits, e.g. flash-attn's
  ``CrossEntropyLoss``, llm-foundry's default ``loss_fn: fused_crossentropy``): forward one
  reading pass ``e``, backward reading the logits and writing their gradient ``2e``.

The non-engine stacks run the output layer as one linear layer over the micro batch. An
estimate of the memory traffic counted from the code, not a measurement: a kernel that keeps a
row in registers moves less.
"""

from __future__ import annotations

from llmtrain.plan.losschunk import loss_chunk_tokens
from llmtrain.plan.gemmtime import gemm_fwd_bwd, gemm_seconds, membound_seconds
from llmtrain.recipe.gpus import GPUSpec


def cast_bytes(e: int) -> int:
    """An fp32 copy of ``e``-byte elements (read ``e``, write 4), or back: none when ``e`` is 4."""
    return e + 4 if e < 4 else 0


def logit_bytes(kind: str, e: int) -> tuple[int, int]:
    """(forward, backward) HBM bytes per logit element of the loss ``kind`` (module docstring)."""
    c = cast_bytes(e)
    return {
        "engine": (32 + 2 * c, 0),
        "unchunked": (16 + c, 20 + c),
        "compiled": (2 * e, 2 * e),
        "megatron": (32 + c, 8 + c),
        "megatron_fused": (20 + e if e < 4 else 20, 4 + e if e < 4 else 8),
        "fused": (e, 2 * e),
    }[kind]


def head_loss_seconds(kind: str, tokens: int, vocab_local: float, hidden: int, e: int, gpu: GPUSpec,
                      weight_trains: bool = True, sms: int | None = None, chunk: int | None = None) -> tuple[float, float]:
    """(forward, backward) seconds of the output layer's GEMMs and the loss ``kind`` for ``tokens``
    tokens on one rank (its ``vocab_local`` rows of the output weight). ``weight_trains``: False
    when the output layer is frozen (LoRA): no weight gradient, only the input's. ``chunk``: the
    engine's tokens per chunk (default: its rule, :func:`loss_chunk_tokens`)."""
    f, b = head_gemm_seconds(kind, tokens, vocab_local, hidden, gpu, weight_trains, sms, chunk)
    if kind != "engine":
        fwd_b, bwd_b = logit_bytes(kind, e)
        logits = tokens * vocab_local
        return f + membound_seconds(logits * fwd_b, gpu), b + membound_seconds(logits * bwd_b, gpu)
    chunk = chunk or loss_chunk_tokens(tokens, int(vocab_local), hidden)
    moved, back = engine_loss_bytes(tokens, vocab_local, hidden, e, chunk, weight_trains)
    return f + membound_seconds(moved, gpu), b + membound_seconds(back, gpu)


def head_gemm_seconds(kind: str, tokens: int, vocab_local: float, hidden: int, gpu: GPUSpec,
                      weight_trains: bool = True, sms: int | None = None, chunk: int | None = None) -> tuple[float, float]:
    """(forward, backward) seconds of the output layer's GEMMs alone (:func:`head_loss_seconds`): the
    engine's chunked loss runs all three in its forward, chunk by chunk."""
    if kind != "engine":
        f, b = gemm_fwd_bwd(tokens, vocab_local, hidden, gpu, sms=sms)
        if not weight_trains:
            b = gemm_seconds(tokens, hidden, vocab_local, gpu, sms=sms)
        return f, b
    chunk = chunk or loss_chunk_tokens(tokens, int(vocab_local), hidden)
    f = gemm_seconds(tokens, vocab_local, hidden, gpu, sms=sms)  # the logits, chunk by chunk (m = tokens)
    f += gemm_seconds(tokens, hidden, vocab_local, gpu, sms=sms)  # dL/dh of each chunk's rows
    if weight_trains:  # dL/dW, k = one chunk's tokens
        f += tokens / chunk * gemm_seconds(vocab_local, hidden, chunk, gpu, sms=sms)
    return f, 0.0


def engine_loss_bytes(tokens: int, vocab_local: float, hidden: int, e: int, chunk: int,
                      weight_trains: bool = True) -> tuple[float, float]:
    """(forward, backward) HBM bytes of the engine's chunked loss beside its GEMMs (module
    docstring), ``chunk`` tokens at a time: what tests/test_losstime.py counts op by op."""
    moved = tokens * vocab_local * logit_bytes("engine", e)[0] + tokens * hidden * (cast_bytes(e) + 8 if e < 4 else 0)
    back = tokens * hidden * (8 + cast_bytes(e))  # dL/dh scaled by the incoming gradient, cast
    if weight_trains:
        moved += tokens / chunk * vocab_local * hidden * (cast_bytes(e) + 12 if e < 4 else 0)
        back += vocab_local * hidden * (8 + cast_bytes(e))
    return moved, back
