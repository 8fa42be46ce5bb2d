"""Rotary position embeddings (RoPE, Su et al. 2021, arXiv:2104.09864).

Convention: **interleaved pairs**. The head dimension is read as ``d/2`` pairs
``(x[2i], x[2i+1])`` and pair ``i`` at position ``p`` is rotated by the angle
``p * theta ** (-2i / d)``::

    out[2i]   = x[2i] * cos - x[2i+1] * sin
    out[2i+1] = x[2i] * sin + x[2i+1] * cos

This is the convention of Meta's reference Llama code and of torchtitan (which write it
as a complex multiplication), so their checkpoints load without permuting ``wq``/``wk``.
Hugging Face checkpoints use the "half split" convention (pairs ``(i, i + d/2)``); loading
them needs the usual row permutation of ``wq`` and ``wk``, not a different RoPE.

Design choices:

* cos/sin are computed **on the fly from explicit positions**, not read from a cached
  table sliced by ``arange(s)``. Context parallelism hands each rank a non-contiguous set
  of global positions (e.g. the load-balanced "zigzag" chunks), and pipeline stages need no
  shared buffer. The cost is ``O(s * d/2)`` transcendental evaluations per forward, which
  is negligible next to attention; and there is no buffer to materialize after meta-device
  construction.
* Math is in fp32 (angles, cos/sin and the rotation itself), whatever the activation
  dtype; the result is cast back to the input dtype. As in the reference implementations,
  angles are formed in fp32, so at position ``p`` the angle carries an absolute error of
  roughly ``p * 2**-24`` radians; that is part of the model's definition, identical on
  every layout since it depends only on the (global) position value.
* **Llama 3.1 frequency scaling** (``model.rope_scaling``, type ``llama3``) rescales the
  per-pair inverse frequencies once, before the angles: wavelengths ``2 pi / f`` shorter than
  ``original_max_seq_len / high_freq_factor`` are kept, those longer than
  ``original_max_seq_len / low_freq_factor`` are divided by ``factor``, and the band between
  is interpolated linearly in ``original_max_seq_len / wavelength``. The same fp32 operations
  in the same order as transformers' ``_compute_llama3_parameters`` (so the frequencies are
  bit-identical, and with them the angles); the attention scaling of that rule is 1.
* **Linear scaling** (type ``linear``, Gemma 3's full-attention layers): every frequency divided
  by ``factor`` (positions interpolated), transformers' ``_compute_linear_scaling_rope_parameters``.
* **Partial rotary** (``model.rotary_dim`` < ``head_dim``, Phi-4-mini): only the first
  ``rotary_dim`` features of each head are rotated, their frequencies are those of a head of
  ``rotary_dim`` (``theta ** (-2i / rotary_dim)``, as transformers' ``partial_rotary_factor``),
  and the other features pass unchanged.
* **LongRoPE** (type ``longrope``, Phi-3 128k / Phi-3.5): each pair's inverse frequency is
  divided by its ``short_factor`` (transformers' ``1 / (factor_i * theta ** (2i / d))``, the
  same fp32 operations), and cos and sin are multiplied by ``attention_factor``. A forward whose
  longest row (largest position + 1) exceeds ``original_max_seq_len`` uses ``long_factor`` for
  every position instead, as transformers' ``longrope_frequency_update`` does (``torch.where`` on
  the length: no host sync). The length is the whole row's, not a rank's shard
  (``rope_cos_sin``'s ``longest``, given by the model): under context parallelism a rank's
  positions are a shard of the row.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from llmtrain.recipe.schema import RopeScaling


def rope_inv_freq(head_dim: int, theta: float, device: torch.device | str | None = None,
                  scaling: RopeScaling | None = None, longest: int | torch.Tensor | None = None) -> torch.Tensor:
    """The per-pair frequencies ``theta ** (-2i / head_dim)`` for ``i in range(head_dim // 2)`` (fp32),
    rescaled by ``scaling`` (the llama3 or longrope rule, see the module docstring) when given.
    ``longest``: the longest row of the forward (an int, or a 0-d tensor: no host sync), which
    selects longrope's long factors past ``original_max_seq_len``; None = the short ones."""
    if head_dim % 2:
        raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
    exponents = torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim
    if scaling is not None and scaling.type == "longrope":
        def scaled(factors: list[float]) -> torch.Tensor:
            return 1.0 / (torch.tensor(factors, dtype=torch.float32, device=device) * theta**exponents)
        if longest is None:
            return scaled(scaling.short_factor)
        if not isinstance(longest, torch.Tensor):
            return scaled(scaling.long_factor if longest > scaling.original_max_seq_len else scaling.short_factor)
        return torch.where(longest > scaling.original_max_seq_len, scaled(scaling.long_factor),
                           scaled(scaling.short_factor))
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None:
        return inv_freq
    if scaling.type == "linear":  # transformers' _compute_linear_scaling_rope_parameters: inv_freq / factor
        return inv_freq / scaling.factor
    return llama3_scaled(inv_freq, scaling.factor, scaling.low_freq_factor, scaling.high_freq_factor,
                         scaling.original_max_seq_len)


def llama3_scaled(inv_freq: torch.Tensor, factor: float, low: float, high: float, original: int) -> torch.Tensor:
    """Llama 3.1's rescaled inverse frequencies (``rope_type: llama3``)."""
    low_wavelen, high_wavelen = original / low, original / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float,
                 scaling: RopeScaling | None = None,
                 longest: int | torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotation angles for integer ``positions`` of shape ``[..., S]``.

    Returns two fp32 tensors of shape ``[..., S, head_dim // 2]``, on ``positions.device``.
    Positions need not be contiguous or sorted (context parallel passes global positions).
    ``longest``: the forward's longest row (longrope's regime, :func:`rope_inv_freq`); None: the
    largest of ``positions`` + 1, which is right when they cover whole rows (no CP).
    """
    if scaling is not None and scaling.type == "longrope" and longest is None:
        longest = positions.max() + 1
    inv_freq = rope_inv_freq(head_dim, theta, device=positions.device, scaling=scaling, longest=longest)
    angles = positions.to(torch.float32).unsqueeze(-1) * inv_freq
    if scaling is not None and scaling.type == "longrope" and scaling.attention_factor not in (None, 1.0):
        return torch.cos(angles) * scaling.attention_factor, torch.sin(angles) * scaling.attention_factor
    return torch.cos(angles), torch.sin(angles)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` of shape ``[b, s, heads, head_dim]`` by the interleaved-pairs convention.

    ``cos``/``sin`` come from :func:`rope_cos_sin`, shaped ``[s, head_dim // 2]`` (one set of
    positions for the whole batch) or ``[b, s, head_dim // 2]`` (per-sequence positions).
    They broadcast over heads. Computed as one complex multiplication per pair,
    ``(x[2i] + i x[2i+1]) * (cos + i sin)``: the same products and sums as the formula in the
    module docstring, equal up to fp32 rounding (the complex kernel may fuse multiply-adds), but
    one kernel forward and one backward instead of strided selects, four multiplies, a stack and
    their backward (about 3x faster on CPU, see docs/engine.md "Performance").

    Under ``torch.compile`` (``train.compile``) the formula itself runs instead: inductor does not
    generate code for complex operators (it falls back to the eager kernel and warns, on every
    rank), while the four multiplies and two adds fuse with the cast and the copy around them.
    """
    rotated = 2 * cos.shape[-1]
    if rotated < x.shape[-1]:  # partial rotary (model.rotary_dim): the first features turn, the rest pass
        return torch.cat((apply_rope(x[..., :rotated], cos, sin), x[..., rotated:]), dim=-1)
    if cos.dim() == 2:
        cos, sin = cos.unsqueeze(0), sin.unsqueeze(0)
    if torch.compiler.is_compiling():
        c, s = cos.float().unsqueeze(2), sin.float().unsqueeze(2)  # [b|1, s, 1, d/2]
        pairs = x.to(torch.float32).unflatten(-1, (-1, 2))
        even, odd = pairs[..., 0], pairs[..., 1]
        return torch.stack((even * c - odd * s, even * s + odd * c), dim=-1).flatten(-2).to(x.dtype)
    # .float(): FSDP2's bf16 MixedPrecisionPolicy casts a block's floating inputs, cos/sin included.
    rotation = torch.complex(cos.float(), sin.float()).unsqueeze(2)  # [b|1, s, 1, d/2], complex64
    pairs = torch.view_as_complex(x.to(torch.float32).contiguous().unflatten(-1, (-1, 2)))
    return torch.view_as_real(pairs * rotation).flatten(-2).to(x.dtype)
