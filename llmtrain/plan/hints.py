"""What to change when a layout does not fit: try each single change, keep those that validate.

The candidates are the usual levers, in the order an experienced user reaches for them:
shard more state (``parallel.zero`` + 1), recompute more (``none`` -> ``selective`` -> ``full``),
split the model wider or deeper (``tp`` x 2 inside a node, ``pp`` x 2) and run smaller micro
batches (the global batch stays, gradient accumulation grows). Each is re-validated with
:func:`llmtrain.plan.validate.validate` and re-estimated; the result says which fit, by how
much, and at what modeled step time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from llmtrain.cluster.placement import Placement
from llmtrain.plan.validate import validate
from llmtrain.recipe.schema import Recipe

if TYPE_CHECKING:
    from llmtrain.plan.costmodel import CostModel

RECOMPUTE = ("none", "selective", "full")


def _variants(recipe: Recipe, placement: Placement) -> list[tuple[str, Recipe]]:
    p, t = recipe.parallel, recipe.train
    out = []

    def par(**kw):
        return recipe.model_copy(update={"parallel": p.model_copy(update=kw)})

    def tr(**kw):
        return recipe.model_copy(update={"train": t.model_copy(update=kw)})

    if p.zero < 3:
        out.append((f"parallel.zero={p.zero + 1}", par(zero=p.zero + 1)))
    # selective_mm (not on the ladder) sits between selective and full: the next step is full
    rung = "selective" if t.activation_checkpointing == "selective_mm" else t.activation_checkpointing
    for mode in RECOMPUTE[RECOMPUTE.index(rung) + 1:]:
        out.append((f"train.activation_checkpointing={mode}", tr(activation_checkpointing=mode)))
    if p.tp * 2 <= min(n.slots for n in placement.nodes):
        out.append((f"parallel.tp={p.tp * 2}", par(tp=p.tp * 2, dp_shard=-1)))
    if p.pp == 1:
        out.append(("parallel.pp=2 (1f1b)", par(pp=2, dp_shard=-1, pp_schedule="1f1b", pp_virtual_stages=1,
                                                  pp_layers_per_stage=None)))
    else:
        out.append((f"parallel.pp={p.pp * 2}", par(pp=p.pp * 2, dp_shard=-1, pp_layers_per_stage=None)))
    if t.micro_batch_size > 1:
        out.append((f"train.micro_batch_size={t.micro_batch_size // 2}", tr(micro_batch_size=t.micro_batch_size // 2)))
    return out


def memory_hints(recipe: Recipe, placement: Placement, cost: CostModel) -> list[dict]:
    from llmtrain.plan.costmodel import GIB, estimate  # noqa: PLC0415

    results = []
    for change, variant in _variants(recipe, placement):
        v = validate(variant, placement)
        if not v.valid or v.dims is None or v.batch is None:
            continue
        c = estimate(variant, v.dims, v.batch, placement, fast=True, hints=False)
        results.append({"change": change, "peak_gib": round(c.worst.peak / GIB, 2), "fits": c.fits,
                        "step_s": round(c.time.step_s, 4), "mfu": round(c.time.mfu, 4)})
    results.sort(key=lambda h: (not h["fits"], h["step_s"] if h["fits"] else h["peak_gib"]))
    return results
