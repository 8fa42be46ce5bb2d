"""Whether a recipe's attention takes grouped-query K/V with their own heads (``planner.gqa``).

The engine's causal attention (``engine/models/llama.py`` ``causal_sdpa``) passes K/V with their
``kv_heads`` to SDPA's flash kernel (``enable_gqa``) where that kernel takes them: on CPU always
(torch's CPU flash kernel), on CUDA where FlashAttention is eligible (16-bit, head_dim <= 256 on
Ampere or later: the catalog's GPUs all are). It then keeps K/V at ``kv_heads`` for backward and
writes no repeated copy. Everywhere else K/V are repeated to the query heads first: an attention
mask (packed rows; the windowed layers of a sliding window shorter than the sequence), the
soft-capped kernel (Gemma 2). Ulysses CP exchanges K/V with their heads when the rank's
``kv_heads / tp`` split over ``cp`` (:func:`ulysses_kv_split`; else it repeats them first) and then
runs the same causal attention on its heads; ring and all-gather CP take the K/V heads themselves
(``planner.cp_kv``). :func:`native_gqa` is the whole model's rule;
:func:`repeating_layers` names the windowed layers that repeat in a model whose other layers do not.
``planner.gqa: repeat`` prices a stack that always repeats (torchtitan)."""

from __future__ import annotations


def ulysses_kv_split(recipe, tp: int, cp: int) -> bool:
    """Ulysses exchanges GQA's K/V with their own heads: the rank's ``kv_heads / tp`` split over ``cp``
    (engine/parallel/context.py ``ulysses_attention``). The engine's memory; what a stack moves is
    ``planner.cp_kv`` (plan/comm.py)."""
    m = recipe.model
    return (cp > 1 and recipe.parallel.cp_method == "ulysses" and m.kv_heads < m.heads
            and (m.kv_heads // tp) % cp == 0)


def native_gqa(recipe, gpu_name: str, cp: int, tp: int = 1) -> bool:
    """K/V with their own heads in the layers without a mask (module docstring)."""
    m, t = recipe.model, recipe.train
    if recipe.planner.gqa != "engine" or m.heads == m.kv_heads or (cp > 1 and not ulysses_kv_split(recipe, tp, cp)):
        return False
    if recipe.data.packing or m.attention_softcap is not None:
        return False
    if gpu_name == "cpu":
        return True
    return t.precision != "fp32" and m.head_dim <= 256


def repeating_layers(recipe) -> frozenset[int]:
    """The windowed layers whose band mask makes them repeat K/V (a window shorter than the sequence)."""
    m = recipe.model
    if m.sliding_window is None or recipe.train.seq_len <= m.sliding_window:
        return frozenset()
    return frozenset(m.windowed_layers)
