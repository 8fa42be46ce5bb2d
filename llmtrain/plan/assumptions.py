"""The recipe's planner-only settings in effect (``planner.*``, recipe/schema_plan.py): what ``plan``
prints on its "assumes" line, since the bundled engine does not do what they price. A setting is
listed only where it changes something for this recipe (a time-model-v2 setting under v2, the TP
overlap with TP and SP, the CP K/V with ring or all-gather CP, ...)."""

from __future__ import annotations

from llmtrain.plan.gqa import ulysses_kv_split
from llmtrain.plan.asynctp import tp_overlap_kind
from llmtrain.plan.memory import master_params, torch_ddp_grads
from llmtrain.recipe.schema import Recipe


def planner_assumptions(recipe: Recipe) -> list[str]:
    """The recipe's planner-only settings that differ from the engine's behaviour, as ``key value``
    (``plan`` prints them beside the time: the engine does not do what they price)."""
    pl = recipe.planner
    out = ["planner.assume_dp_overlap true"] if pl.assume_dp_overlap else []
    if pl.attention_kernel != "engine" and recipe.cluster.time_model == "v2":
        out.append(f"planner.attention_kernel {pl.attention_kernel}")
    if pl.fp8_casts != "engine" and recipe.cluster.time_model == "v2" and recipe.train.precision == "fp8":
        out.append(f"planner.fp8_casts {pl.fp8_casts}")
    tp_kind = tp_overlap_kind(recipe) if recipe.parallel.tp > 1 else "none"
    if tp_kind == "megatron":
        out.append("planner.tp_overlap true")
    if tp_kind == "backward":
        out.append("planner.tp_backward_overlap true")
    if pl.dp_optimizer != "engine" and recipe.parallel.zero == 1:
        out.append(f"planner.dp_optimizer {pl.dp_optimizer}")
    if (pl.cp_merge != "engine" and recipe.cluster.time_model == "v2" and recipe.parallel.cp > 1
            and recipe.parallel.cp_method != "ulysses"):
        out.append(f"planner.cp_merge {pl.cp_merge}")
    if pl.selective_recompute != "engine" and recipe.train.activation_checkpointing == "selective":
        out.append(f"planner.selective_recompute {pl.selective_recompute}")
    if pl.norm != "engine" and recipe.cluster.time_model == "v2" and not recipe.train.compile:
        out.append(f"planner.norm {pl.norm}")
    if pl.block_kernels != "engine" and recipe.cluster.time_model == "v2":
        out.append(f"planner.block_kernels {pl.block_kernels}")
    if pl.rope != "engine" and recipe.cluster.time_model == "v2" and recipe.train.compile:
        out.append(f"planner.rope {pl.rope}")
    if master_params(recipe):
        out.append(f"planner.param_memory {pl.param_memory}")
    if torch_ddp_grads(recipe):
        out.append("planner.torch_ddp_buckets true")
    if pl.grad_memory != "engine":
        out.append(f"planner.grad_memory {pl.grad_memory}")
    if pl.full_recompute != "engine" and recipe.train.activation_checkpointing == "full":
        out.append(f"planner.full_recompute {pl.full_recompute}")
    if pl.loss != "engine":
        out.append(f"planner.loss {pl.loss}")
    if pl.pp_p2p != "engine" and recipe.parallel.pp > 1:
        out.append(f"planner.pp_p2p {pl.pp_p2p}")
    p = recipe.parallel
    if pl.cp_kv != "engine" and p.cp > 1 and (p.cp_method in ("ring", "allgather") or ulysses_kv_split(recipe, p.tp, p.cp)):
        out.append(f"planner.cp_kv {pl.cp_kv}")
    if pl.gqa != "engine" and recipe.model.kv_heads < recipe.model.heads:
        out.append(f"planner.gqa {pl.gqa}")
    return out
