"""The model's own cross-field rules, and what its features allow of the layout (split out of
:mod:`llmtrain.plan.validate`, which calls :func:`check_model` with its ``err`` / ``warn`` collectors):
head and RoPE shapes, layer-index lists, the q/k-norm and sliding-window switches, and the
context-parallel methods a window or soft-capped attention cannot run."""

from __future__ import annotations

from llmtrain.errors import Problem
from llmtrain.plan.divisors import choices as _choices
from llmtrain.plan.divisors import divisors
from llmtrain.recipe.schema import Recipe


def check_model(recipe: Recipe, err, warn) -> None:
    m, t = recipe.model, recipe.train
    if m.hidden % m.heads and not m.explicit_head_dim:
        err(Problem("model.hidden", f"hidden ({m.hidden}) not divisible by heads ({m.heads})",
                    f"use heads in {_choices(divisors(m.hidden))}, or set model.head_dim"))
    if m.heads % m.kv_heads:
        err(Problem("model.kv_heads", f"heads ({m.heads}) not divisible by kv_heads ({m.kv_heads})",
                    f"use kv_heads in {_choices(divisors(m.heads))}"))
    if m.head_dim % 2 and (m.hidden % m.heads == 0 or m.explicit_head_dim):
        err(Problem("model.head_dim", f"head_dim ({m.head_dim}) is odd; RoPE rotates pairs",
                    "choose an even head_dim (or hidden and heads with an even quotient)"))
    for name in ("full_attention_layers", "nope_layers"):  # layer indices
        bad_layers = sorted({i for i in getattr(m, name) or () if not 0 <= i < m.layers})
        if bad_layers:
            err(Problem(f"model.{name}", f"layers {bad_layers} do not exist (the model has {m.layers}: "
                        f"0..{m.layers - 1})", f"use layer indices 0..{m.layers - 1}"))
    if m.qk_norm_width == "all" and not m.qk_norm:
        err(Problem("model.qk_norm_width", "qk_norm_width all is set but model.qk_norm is false",
                    "set model.qk_norm: true, or drop model.qk_norm_width"))
    if m.qk_norm and m.qk_norm_width == "all" and m.norm_offset:
        err(Problem("model.qk_norm_width", "q/k norms over all heads with offset norms (model.norm_offset): no "
                    "family has both, and the split norm (engine/models/norm.py SplitRMSNorm) has no offset",
                    "set model.qk_norm_width: head, or model.norm_offset: false"))
    if m.sliding_window is None and (m.full_attention_layers is not None or m.local_rope_theta is not None):
        name = "full_attention_layers" if m.full_attention_layers is not None else "local_rope_theta"
        err(Problem(f"model.{name}", f"{name} is set but model.sliding_window is not: no layer is windowed",
                    f"set model.sliding_window, or drop model.{name}"))
    if m.mlp_activation != "silu" and m.is_moe:
        err(Problem("model.mlp_activation", f"mlp_activation {m.mlp_activation} with MoE: the experts are SwiGLU "
                    "(engine/models/grouped_experts.py)", "use mlp_activation: silu, or a dense model"))
    if m.rotary_dim is not None and (m.rotary_dim > m.head_dim or m.rotary_dim % 2):
        err(Problem("model.rotary_dim", f"rotary_dim ({m.rotary_dim}) must be even and at most head_dim ({m.head_dim})",
                    f"use an even rotary_dim <= {m.head_dim}, or drop it (all of head_dim)"))
    r = m.rope_scaling
    if r is not None and r.type == "longrope":
        for name in ("short_factor", "long_factor"):
            if len(getattr(r, name)) != m.rope_dim // 2:
                err(Problem(f"model.rope_scaling.{name}", f"{len(getattr(r, name))} factors; RoPE has "
                            f"{'rotary_dim' if m.rotary_dim else 'head_dim'} / 2 = {m.rope_dim // 2} frequency pairs",
                            f"give {m.rope_dim // 2} factors"))
    if m.is_moe and not any(m.is_moe_layer(i) for i in range(m.layers)):
        warn(Problem("model.moe", f"{m.moe.num_experts} experts but no layer is MoE (first_dense_layers, "
                     "sparse_step, dense_layers exclude all)", "check model.moe's layer selection"))
    if t.seq_len > m.max_seq_len:
        err(Problem("train.seq_len", f"seq_len ({t.seq_len}) exceeds model.max_seq_len ({m.max_seq_len})",
                    f"use seq_len <= {m.max_seq_len} or raise model.max_seq_len"))
