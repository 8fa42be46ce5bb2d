"""Lower bounds that prune ``plan --search`` (llmtrain/plan/search.py): each is a floor, never
above what :func:`llmtrain.plan.costmodel.estimate` prices for any layout it stands for, so a split
or a ZeRO mode skipped on a bound could not have won (tests/test_search.py compares the pruned
search with ``exhaustive=True``)."""

from __future__ import annotations

from llmtrain.plan.asynctp import tp_overlap_kind
from llmtrain.plan.costmodel import peak_bytes, probe_ranks
from llmtrain.plan.memory import compute_bytes
from llmtrain.cluster.placement import Placement
from llmtrain.plan.validate import validate
from llmtrain.recipe.schema import Recipe


def make_variant(recipe: Recipe, par: dict, train: dict) -> Recipe:
    return recipe.model_copy(update={"parallel": recipe.parallel.model_copy(update=par),
                                     "train": recipe.train.model_copy(update=train)})


def state_bytes(recipe: Recipe) -> float:
    """Model-state bytes per parameter: 16 (fp32 weight, gradient, AdamW); LoRA: 4, the frozen
    weights only (the adapters' states make the real number larger: still a lower bound)."""
    return 4.0 if recipe.train.lora is not None else 16.0


def state_lower_bound(recipe: Recipe, tp: int, pp: int, ep: int, dpcp: int) -> float:
    """Bytes of parameters + gradients + AdamW states per rank if everything were sharded over dp x cp."""
    m = recipe.model
    from llmtrain.plan.params import count_params  # noqa: PLC0415

    pc = count_params(m)
    per_rank = (pc.total - (pc.per_moe_block and (m.layers - m.moe.first_dense_layers) * m.moe.num_experts * pc.expert
                            * (1 - 1 / ep))) / (tp * pp)
    return state_bytes(recipe) * per_rank / max(1, dpcp)


def skipped_attention(recipe: Recipe, cp: int) -> float:
    """Attention FLOPs per token that causal SDPA never executes (see costmodel.estimate)."""
    from llmtrain.plan.flops import attention_executed  # noqa: PLC0415

    m, p = recipe.model, recipe.parallel
    return 12.0 * m.hidden * recipe.train.seq_len * m.layers * (1.0 - attention_executed(cp, p.cp_method))


def recompute_tok(recipe: Recipe, tp: int, cp: int) -> float:
    """Hardware FLOPs per token of full recomputation, summed over the TP group's ranks / tp."""
    from llmtrain.plan.flops import recompute_flops_per_token  # noqa: PLC0415

    m, seq = recipe.model, recipe.train.seq_len
    total = -skipped_attention(recipe, cp) / 3
    for layer in range(m.layers):
        split, rep = recompute_flops_per_token(m, layer, seq, "full", recipe.train.lora)
        total += split + rep * tp
    return total


def moe_flops_per_token(m, seq_len: int) -> float:
    """The MoE blocks' share of the model FLOPs per token (router and experts)."""
    from llmtrain.plan.flops import block_flops_per_token  # noqa: PLC0415

    if not m.is_moe:
        return 0.0
    return (m.layers - m.moe.first_dense_layers) * block_flops_per_token(m, m.layers - 1, seq_len)[1]


def ep_floor(recipe: Recipe, gpu, tp: int, pp: int, cp: int, dp: int, gbs: int, ep: int) -> float:
    """Seconds of EP all-to-all per step on one rank over NVLink (a lower bound)."""
    m, t = recipe.model, recipe.train
    if ep == 1 or not m.is_moe:
        return 0.0
    from llmtrain.plan.comm import link  # noqa: PLC0415

    e = compute_bytes(t.precision)
    tokens = gbs // dp * t.seq_len // cp
    moe_layers = (m.layers - m.moe.first_dense_layers) / pp
    return 4 * (ep - 1) / ep * e * tokens * m.moe.top_k * m.hidden * moe_layers / link(gpu, False).bandwidth


def needs_full_recompute(recipe: Recipe, placement: Placement, base: dict, gbs: int, dp: int, capacity: float) -> bool:
    """Whether even the most sharded state (zero 3, or 2 with pp > 1; no HSDP) with micro batch 1
    and the lightest partial recomputation (``selective_mm``, search.py RECOMPUTE) overflows: then
    every layout of the split recomputes fully (a kept mode other than full does not fit at all).

    With LoRA, selective recomputation can keep MORE than none (it saves the frozen projections'
    outputs and the adapters', which a frozen weight's backward does not need), so there every
    partial mode is tried."""
    zero = 2 if base["pp"] > 1 else 3
    for mode in ("selective_mm",) if recipe.train.lora is None else ("selective_mm", "selective", "none"):
        variant = make_variant(recipe, dict(base, zero=zero, dp_replicate=1, dp_shard=dp),
                           dict(micro_batch_size=1, global_batch_size=gbs, activation_checkpointing=mode))
        v = validate(variant, placement)
        if not v.valid:
            return False
        if peak_bytes(variant, v.dims, v.batch, probe_ranks(v.dims.pp)) <= capacity:
            return False
    return True


def zero_lower_bound(recipe: Recipe, tp: int, pp: int, ep: int, dp: int, cp: int, zero: int, rep: int) -> float:
    """Model-state bytes of an average rank for this zero mode (a lower bound for the worst rank)."""
    per = state_bytes(recipe)
    full = state_lower_bound(recipe, tp, pp, ep, 1) / per  # parameters per rank
    e = compute_bytes(recipe.train.precision)
    if zero == 0 or dp * cp == 1:
        return per * full
    if zero == 1:  # LoRA: frozen weights are never sharded by ZeRO-1
        return per * full if recipe.train.lora is not None else 8.0 * full + 8.0 * full / (dp * cp)
    shard = dp // rep * cp
    unsharded = e * full if (zero == 2 or pp > 1) else 0.0
    return per * full / shard + unsharded


def tp_floor(recipe: Recipe, gpu, tp: int, pp: int, cp: int, dp: int, gbs: int) -> float:
    """Seconds of exposed TP communication per step on one rank (no recomputation, NVLink): a lower
    bound. Per layer and micro batch 4 all-reduce equivalents stay in line (2 forward, 2 backward);
    where the recipe overlaps some (plan/comm.py), only those that never hide: the engine's async TP
    under SP leaves the backward's 2 input-gradient reduce-scatters (1 all-reduce equivalent),
    ``planner.tp_backward_overlap`` the forward's 2; ``planner.tp_overlap`` (Megatron-Core's, whose bulk
    overlap hides those 2 reduce-scatters too) none that must stay exposed: 0."""
    if tp == 1:
        return 0.0
    from llmtrain.plan.comm import link  # noqa: PLC0415

    m, t = recipe.model, recipe.train
    e = compute_bytes(t.precision)
    tokens = gbs // dp * t.seq_len // cp
    exposed = {"megatron": 0, "async": 1, "backward": 2, "none": 4}[tp_overlap_kind(recipe)]
    volume = exposed * 2 * (tp - 1) / tp * e * tokens * m.hidden * m.layers / pp
    return volume / link(gpu, False).bandwidth
