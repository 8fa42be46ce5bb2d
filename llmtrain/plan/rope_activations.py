"""What RoPE keeps for backward, per micro batch (:mod:`llmtrain.plan.activations` adds it up).

The engine's eager RoPE (``engine/models/rope.py`` ``apply_rope``) builds the complex rotation
``cos + i sin`` (complex64, ``[b|1, s, 1, rope_dim / 2]``) in each call and multiplies q's (k's)
pairs by it; the multiply saves the rotation for the input's gradient. So every block that rotates
q and k and needs their gradients keeps two rotations of its own, 8 bytes per position and pair:
measured 8 storages on the 4-layer debug model where the plan counted one set of cos/sin for the
stage (tests/test_costmodel.py, every case 0.5-0.9 % low before the thirty-eighth session). The
cos / sin tensors themselves (fp32, shared by the stage's layers) are kept only where recomputation
holds them as a block's input (selective, selective_mm, full: the checkpoint re-runs the block with
them) or under ``train.compile``, whose formula path multiplies by them directly (views of the same
storages in every layer): one set per RoPE base in use (Gemma's ``local_rope_theta``: two).
Packed rows rotate by per-sample positions: ``b`` rows of each instead of one. NoPE layers
(``model.nope_layers``) rotate nothing (:mod:`llmtrain.plan.rankmem` counts them per stage)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from llmtrain.plan.activations import ActShape


def _positions(x: ActShape) -> int:
    """Rotated positions per tensor: the local sequence, per row when packed rows restart them."""
    return (x.b if x.packed else 1) * x.s


def rotation_bytes(x: ActShape) -> int:
    """One complex64 rotation: 8 bytes per position and rotated pair."""
    return 8 * _positions(x) * x.rope_pairs


def layer_rope_terms(x: ActShape, recompute: str, q_grad: bool = True, k_grad: bool = True) -> dict[str, int]:
    """One block's rotations: one for q and one for k where their gradients are needed (eager only;
    recomputation recomputes them)."""
    if recompute != "none" or not x.rope_eager or not (q_grad or k_grad):
        return {}
    return {"rope_rotation": (int(q_grad) + int(k_grad)) * rotation_bytes(x)}


def stage_rope_terms(x: ActShape, recompute: str) -> dict[str, int]:
    """cos and sin (fp32) of each RoPE base, once per stage, where something holds them (module docstring)."""
    if recompute == "none" and x.rope_eager:
        return {}
    return {"rope": x.rope_sets * 2 * 4 * _positions(x) * x.rope_pairs}
