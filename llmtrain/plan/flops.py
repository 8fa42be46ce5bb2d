"""Model FLOPs per token, shared by the planner and the engine's MFU.

``6 N + 12 L h s``: 6 FLOPs per parameter per token for forward + backward over the matmul
parameters ``N`` (active parameters for MoE, without the input embedding, which is a lookup;
the output layer counts even when it shares the embedding matrix), plus the attention score
and value matmuls, ``12 L h s`` for sequence length ``s`` (PaLM, Chowdhery et al. 2022,
appendix B). The attention term is counted WITHOUT the causal halving,
as PaLM and Megatron do, so MFU numbers compare across projects; recomputation is not counted
(these are model FLOPs, not hardware FLOPs).

**LoRA** (``train.lora``): the FLOPs actually executed, by the same convention. A frozen weight
of ``P`` parameters costs ``2P`` forward and ``2P`` backward for its input gradient -- only when
that input requires a gradient -- and no weight gradient; an adapter matrix costs ``6P`` (its
input gradient again only when needed). So, per token, ``4 N_frozen + 6 N_adapters + 12 L h s``
with two exact corrections that follow autograd's ``requires_grad`` propagation: the embedding
is frozen, so block 0's input needs no gradient (its q/k/v projections, their ``lora_a`` and its
attention norm run forward only; with targets that leave a whole branch frozen, that branch of
block 0 runs no backward at all), and the SDPA backward computes only the gradients of q, k, v
that are needed (``dV`` and ``dP``, ``dQ``, ``dK``: ``2 h s`` each; all of them from block 1 on).
The output layer is frozen: ``4 V h``. MFU is reported on these executed model FLOPs, so a LoRA
run's MFU compares with a full run's (the 1/3 of backward it skips is not credited to it).
"""

from __future__ import annotations

from functools import lru_cache

from llmtrain.plan.attnshare import (  # noqa: F401 (re-exported: the attention's executed share, split out)
    allgather_masked, attention_counted, attention_executed, cp_attention_shares, cp_exchange, exchanged,
    masked_layers, ring_layers_executed, ring_step_shares, runs_local, softcap_call_keys, windowed)
from llmtrain.plan.params import attention_params, count_params
from llmtrain.plan.shards import block_targets, lora_key
from llmtrain.recipe.schema import ModelConfig


def flops_per_token(model: ModelConfig, seq_len: int, lora=None) -> float:
    """Model FLOPs per token (``lora``: a :class:`~llmtrain.recipe.schema.LoRAConfig`, or its
    ``(rank, targets)`` key; None: full training)."""
    if lora is not None:
        key = _key(lora)
        return head_flops_per_token(model, key) + sum(sum(block_flops_per_token(model, i, seq_len, key))
                                                      for i in range(model.layers))
    params = count_params(model)
    matmul_params = params.active - params.embedding
    if model.tie_embeddings:  # the shared matrix is still a matmul in the output layer
        matmul_params += model.vocab_size * model.hidden
    return 6.0 * matmul_params + 12.0 * model.layers * model.hidden * seq_len


def window_uncounted(model: ModelConfig, seq_len: int) -> float:
    """Per token, the score FLOPs :func:`flops_per_token` counts beyond a sliding window: ``12 h (s - window)``
    per windowed layer. The model-FLOP convention counts each query against the keys it can see without
    causal halving (PaLM's ``12 h s``); a windowed layer's query sees ``min(s, window)`` of them, as MaxText
    counts Gemma 2/3's local layers (``4 b s min(window, s) heads d`` forward, before its causal halving)."""
    if model.sliding_window is None or seq_len <= model.sliding_window:
        return 0.0
    return 12.0 * model.hidden * (seq_len - model.sliding_window) * len(model.windowed_layers)


def model_flops_per_token(model: ModelConfig, seq_len: int, lora=None) -> float:
    """The model FLOPs per token MFU and TFLOP/s count (``plan``, the engine's metrics): :func:`flops_per_token`
    with a windowed layer's attention over its window (:func:`window_uncounted`). The per-layer FLOPs below
    keep every layer's whole ``12 h s``: they are the base the hardware FLOPs subtract the unexecuted scores from
    (costmodel.py, by the kernels' executed shares), and a window is one of those."""
    return flops_per_token(model, seq_len, lora) - window_uncounted(model, seq_len)


# ---- per-layer FLOPs (same convention), for per-stage compute and hardware FLOPs ------------------
# A transformer block's share of ``flops_per_token``: 6 x its parameters (norm weights included,
# as above) + 12 h s for the attention scores and values. Summed over the blocks and the head
# (6 x (output layer + final norm)) this is exactly ``flops_per_token``. ``replicated`` is the
# part the engine does not split over tensor parallelism: an MoE block's router (its routed and
# shared experts are expert-TP, split like the dense MLP: engine/parallel/expert.py).
def block_flops_per_token(model: ModelConfig, layer: int, seq_len: int, lora=None) -> tuple[float, float]:
    """(tp-split, tp-replicated) model FLOPs per token of block ``layer``, forward + backward."""
    if lora is not None:
        return _lora_block(model, layer, seq_len, _key(lora))
    h = model.hidden
    attn = attention_params(model) + 2 * h  # q, o, k, v (+ biases, q/k norms), two norms
    split = 6.0 * attn + 12.0 * h * seq_len
    if model.is_moe_layer(layer):
        experts = (model.moe.top_k + model.moe.shared_experts) * 3 * h * model.expert_ffn
        return split + 6.0 * experts, 6.0 * h * model.moe.num_experts
    return split + 6.0 * 3 * h * model.ffn_hidden, 0.0


def fp8_matmul_fraction(model: ModelConfig, seq_len: int) -> float:
    """Share of the model FLOPs that ``train.precision: fp8`` runs on FP8 tensor cores: the blocks'
    nn.Linear projections (attention q/k/v/o, the dense MLP), which engine/parallel/float8.py
    converts. Attention scores/values (SDPA), the output head (left bf16) and MoE experts
    (grouped matmuls over parameter tensors, not nn.Linear) stay at the bf16 peak."""
    h = model.hidden
    linear = sum(6.0 * attention_params(model) + (0.0 if model.is_moe_layer(i) else 18.0 * h * model.ffn_hidden)
                 for i in range(model.layers))
    return linear / flops_per_token(model, seq_len)


def head_flops_per_token(model: ModelConfig, lora=None) -> float:
    """Output layer and final norm, forward + backward (the embedding is a lookup: 0); frozen
    under LoRA: forward and input gradient only."""
    return (4.0 if lora is not None else 6.0) * (model.vocab_size * model.hidden + model.hidden)


def recompute_flops_per_token(model: ModelConfig, layer: int, seq_len: int, recompute: str,
                              lora=None, tp: int = 1, whole_block: bool = False) -> tuple[float, float]:
    """Extra hardware FLOPs per token of block ``layer`` from activation recomputation (``tp``:
    the tensor-parallel degree, which only ``selective_mm`` depends on).

    ``full`` re-runs the block's forward in backward: one third of its forward + backward FLOPs
    (the output layer is not checkpointed), minus the block's last matmul -- torch's
    non-reentrant checkpoint stops recomputing once every tensor backward needs exists again
    (``set_checkpoint_early_stop``, on by default), and the down projection's output feeds only
    the residual add, which saves nothing (dense: ``w2``; MoE: the shared experts' ``w2``).
    ``whole_block`` (``planner.full_recompute: whole_block``, another stack's checkpoint: Megatron-LM's
    ``CheckpointFunction``, torch's ``use_reentrant=True``) re-runs that last matmul too: one third of
    the block's forward + backward (LoRA recipes keep the engine's rule).
    ``selective`` keeps every matmul and SDPA output (``engine/parallel/checkpointing.py``) and
    recomputes only element-wise ops (norms, RoPE, SiLU, residual adds): no matmul FLOPs, 0.
    ``selective_mm`` (torchtitan's op policy) re-runs the forward GEMMs of ``wk``, the dense MLP's
    ``w3`` and, without TP, ``wo`` (under TP wo keeps selective's rule; MoE blocks have no dense
    ``w3``); under LoRA the frozen bases' GEMMs only (the adapters' outputs stay saved). Hardware
    FLOPs only: the model FLOPs do not change.
    ``core_attention`` (``selective`` under ``planner.selective_recompute: core_attention``, Megatron-LM's
    selective recomputation) re-runs the attention's scores and values forward (``Q K^T``, ``P V``:
    :func:`score_flops_per_token`, counted unmasked as the block's attention is; tp-split).
    """
    if recompute == "selective_mm":
        return _mm_recompute_flops(model, layer, tp), 0.0
    if recompute == "core_attention":  # selective under planner.selective_recompute core_attention
        return score_flops_per_token(model.heads * model.head_dim, seq_len), 0.0
    if recompute != "full":
        return 0.0, 0.0
    if lora is not None:
        # The block's forward again, up to the last tensor backward needs: without an adapter on
        # w2 that is the SwiGLU product (w2 is frozen: its output saves nothing); with one, w2's
        # lora_a output A x (LoRALinear runs the base w2 first, then lora_a; lora_b, replicated
        # over TP, is not re-run)
        key = _key(lora)
        split, replicated = _lora_block(model, layer, seq_len, key, forward_only=True)
        if model.is_moe_layer(layer):  # an MoE block's forward runs again whole (measured against the counter,
            # tests/test_costmodel.py; its routing and combine keep tensors to the end)
            return split, replicated
        if "w2" in key[1]:
            return split, replicated - 2.0 * model.hidden * key[0]
        return split - 2.0 * model.hidden * model.ffn_hidden, replicated
    split, replicated = block_flops_per_token(model, layer, seq_len)
    h = model.hidden
    if whole_block:
        return split / 3.0, replicated / 3.0
    if model.is_moe_layer(layer):
        return split / 3.0 - 2.0 * h * model.moe.shared_experts * model.expert_ffn, replicated / 3.0
    return split / 3.0 - 2.0 * h * model.ffn_hidden, replicated / 3.0


def _mm_recompute_flops(m: ModelConfig, layer: int, tp: int) -> float:
    """Forward FLOPs per token of the GEMMs ``selective_mm`` recomputes (tp-split; biases as
    :func:`block_flops_per_token` counts them, 2 per element)."""
    kv = m.kv_heads * m.head_dim
    out = 2.0 * (kv * m.hidden + (kv if m.qkv_bias else 0))  # wk
    if tp == 1:
        out += 2.0 * m.hidden * m.heads * m.head_dim  # wo (no bias)
    if not m.is_moe_layer(layer):
        out += 2.0 * m.hidden * m.ffn_hidden  # w3
    return out


# ---- LoRA ---------------------------------------------------------------------------------------
def forward_flops_per_token(model: ModelConfig, layer: int, seq_len: int, lora) -> tuple[float, float]:
    """(tp-split, tp-replicated) forward FLOPs per token of block ``layer`` under LoRA."""
    return _lora_block(model, layer, seq_len, _key(lora), forward_only=True)


def _key(lora) -> tuple[int, tuple[str, ...]]:
    return lora if isinstance(lora, tuple) else lora_key(lora)


def _lora_block(m: ModelConfig, layer: int, seq_len: int, lora: tuple[int, tuple[str, ...]],
                forward_only: bool = False) -> tuple[float, float]:
    """(tp-split, tp-replicated) FLOPs per token of block ``layer`` under LoRA (module docstring).

    Column-wise bases keep ``lora_a`` replicated over TP and row-wise ones ``lora_b``: those are
    the replicated part. ``forward_only``: the forward FLOPs (for recomputation)."""
    moe = (m.moe.num_experts, m.moe.top_k, m.moe.shared_experts, m.expert_ffn) if m.is_moe_layer(layer) else None
    return _lora_block_cached(_shape_key(m), layer == 0, seq_len, lora, forward_only, moe)


def _shape_key(m: ModelConfig) -> tuple:
    return (m.hidden, m.heads, m.kv_heads, m.head_dim, m.ffn_hidden, m.qkv_bias, m.qk_norm)


@lru_cache(maxsize=1024)
def _lora_block_cached(shape: tuple, first: bool, seq_len: int, lora: tuple[int, tuple[str, ...]],
                       forward_only: bool, moe: tuple[int, int, int, int] | None = None) -> tuple[float, float]:
    """``moe``: (experts, routed experts per token, shared experts, expert width) of an MoE block, whose
    router and shared experts are frozen: their forward, and their input gradients where the block's MLP
    input needs one, as frozen projections; its routed experts too, unless ``train.lora.experts`` gave
    them adapters (``e1 e2 e3`` in the key, engine/finetune/lora_experts.py): then each routed slot's
    three GEMMs count as the dense MLP's, with its adapters."""
    h, heads, kv, hd, f, qkv_bias, qk_norm = shape
    rank, targets = lora
    own, experts = block_targets(targets, moe is not None)
    targets = own + experts  # an MoE block's routed experts adapt as w1 / w2 / w3, its dense names do not occur
    bwd = 0.0 if forward_only else 1.0
    split = rep = 0.0

    def proj(name: str, rows: int, cols: int, column_wise: bool, input_grad: bool, bias: bool = False,
             times: int = 1) -> bool:
        """Add one frozen projection and its adapter (``times`` per token: an MoE block's routed slots);
        returns whether its output needs a gradient."""
        nonlocal split, rep
        base = rows * cols + (rows if bias else 0)
        split += times * 2.0 * base * (1 + bwd * input_grad)
        if name not in targets:
            return input_grad
        a, b = 2.0 * rank * cols * (1 + bwd * (1 + input_grad)), 6.0 * rows * rank if bwd else 2.0 * rows * rank
        split, rep = (split + times * b, rep + times * a) if column_wise else (split + times * a, rep + times * b)
        return True

    x_grad = not first  # the frozen embedding: block 0's input needs no gradient
    split += 2.0 * h * (1 + bwd * x_grad)  # attention norm (frozen weight)
    q = proj("wq", heads * hd, h, True, x_grad, qkv_bias)
    k = proj("wk", kv * hd, h, True, x_grad, qkv_bias)
    v = proj("wv", kv * hd, h, True, x_grad, qkv_bias)
    if qk_norm:
        split += 2.0 * 2 * hd * (1 + bwd * (q or k))
    # scores and values: 4 h s forward; backward dV, dP (for dQ or dK), dQ, dK, 2 h s each
    split += score_flops_per_token(h, seq_len) + bwd * 2.0 * h * seq_len * (v + (q or k) + q + k)
    attn = q or k or v
    o = proj("wo", h, heads * hd, False, attn)
    r_grad = x_grad or o
    split += 2.0 * h * (1 + bwd * r_grad)  # ffn norm
    if moe is not None:  # the router (replicated over TP, as without LoRA), the shared and routed experts' GEMMs
        experts, top_k, shared, ef = moe
        rep += 2.0 * h * experts * (1 + bwd * r_grad)
        split += shared * 3 * 2.0 * h * ef * (1 + bwd * r_grad)
        g = proj("w1", ef, h, True, r_grad, times=top_k)
        u = proj("w3", ef, h, True, r_grad, times=top_k)
        proj("w2", h, ef, False, g or u, times=top_k)
        return split, rep
    g = proj("w1", f, h, True, r_grad)
    u = proj("w3", f, h, True, r_grad)
    proj("w2", h, f, False, g or u)
    return split, rep


def score_flops_per_token(width: int, seq_len: int) -> float:
    """Forward FLOPs per token of attention's scores and values (``Q K^T`` and ``P V``, unmasked) over
    ``width`` = heads x head_dim query features: 2 x 2 x width x seq_len."""
    return 4.0 * width * seq_len
