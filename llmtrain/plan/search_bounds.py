"""Lower bounds that prune ``plan --search`` (llmtrain/plan/search.py): each is a floor, never
above what :func:`llmtrain.plan.costmodel.estimate` prices for any layout it stands for, so a split
or a ZeRO mode skipped on a bound could not have won (tests/test_search.py compares the pruned
search with ``exhaustive=True``)."""

from __future__ import annotations

from dataclasses import dataclass

from llmtrain.plan.asynctp import tp_overlap_kind
from llmtrain.plan.costmodel import peak_bytes, planned_gpu, probe_ranks, v2_priced
from llmtrain.plan.memory import compute_bytes
from llmtrain.cluster.placement import Placement
from llmtrain.plan.validate import validate
from llmtrain.recipe.gpus import GPUSpec
from llmtrain.recipe.schema import Recipe


@dataclass(frozen=True)
class StepFloor:
    """A split's step-time floor before its bubble (``search`` multiplies by ``1 + bubble``): the
    compute of a rank at the fastest rate any priced GEMM runs, plus the TP and EP communication
    no layout of the split can hide. ``rate`` and ``tokens_gpu`` also price recomputation's floor."""

    recipe: Recipe
    gpu: GPUSpec  # as the cluster has it (power cap, network share)
    gbs: int
    rate: float  # FLOP/s
    tokens_gpu: float  # tokens per GPU per step
    moe_tok: float  # the MoE blocks' replicated-over-TP FLOPs per token (routers)
    dense_tok: float  # the other FLOPs per token
    node_slots: int  # GPUs of node 0 (where rank 0's groups start: plan/links.py)

    @classmethod
    def of(cls, recipe: Recipe, placement: Placement, gbs: int) -> StepFloor:
        from llmtrain.plan.flops import flops_per_token, fp8_matmul_fraction  # noqa: PLC0415
        from llmtrain.plan.steptime import efficiency, matmul_peak  # noqa: PLC0415
        from llmtrain.plan.stragglers import straggler_factor  # noqa: PLC0415

        m, t = recipe.model, recipe.train
        gpu = planned_gpu(recipe, placement)
        # the compute floor at the rate the cost model uses (fp8: the blended FP8/bf16 peak); at the bf16
        # peak an fp8 recipe's floor overstates its compute and prunes splits that would win
        fp8 = fp8_matmul_fraction(m, t.seq_len) if t.precision == "fp8" else 0.0
        rate = matmul_peak(gpu, t.precision, fp8) * efficiency(gpu)
        if recipe.cluster.time_model == "v2":  # v2 never runs a FLOP faster than the measured matmul ceiling
            from llmtrain.plan.ops import mamf  # noqa: PLC0415

            # bf16's fitted fraction (MAMF x GEMM_FIT), and the FP8 one where FP8 GEMMs run: the fastest
            # any priced GEMM goes (the unfitted MAMF left the floor 12 % low on H100: 27 % more layouts priced)
            ceiling = max(mamf(gpu), mamf(gpu, gpu.peak_flops_fp8) if fp8 else 0.0)
            rate = matmul_peak(gpu, t.precision, fp8) * max(efficiency(gpu), ceiling)
            if v2_priced(recipe):  # every rank's compute runs at the slowest GPU's pace (plan/stragglers.py)
                rate /= straggler_factor(placement.world_size, recipe.cluster.gpu_variability)
        moe_tok = moe_flops_per_token(m, t.seq_len)
        dense_tok = flops_per_token(m, t.seq_len, t.lora) - moe_tok  # LoRA: fewer FLOPs, the floor must stay a lower bound
        return cls(recipe, gpu, gbs, rate, gbs * t.seq_len / placement.world_size, moe_tok, dense_tok,
                   placement.nodes[0].slots)

    def compute_and_tp(self, tp: int, cp: int, pp: int, dp: int) -> float:
        """Compute (MoE routers are replicated over TP ranks; causal SDPA skips half the scores, as in
        the step-time model) and TP communication, per GPU and step."""
        flops = self.dense_tok - skipped_attention(self.recipe, cp) + self.moe_tok * tp
        return flops * self.tokens_gpu / self.rate + tp_floor(self.recipe, self.gpu, tp, pp, cp, dp, self.gbs)

    def recompute(self, tp: int, cp: int) -> float:
        """The forward that full recomputation runs again, per GPU and step, at the floor's rate."""
        return recompute_tok(self.recipe, tp, cp) * self.tokens_gpu / self.rate

    def ep(self, tp: int, cp: int, pp: int, dp: int, ep: int) -> float:
        return ep_floor(self.recipe, self.gpu, tp, pp, cp, dp, self.gbs, ep, self.node_slots)


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
    from llmtrain.plan.flops import cp_attention_shares  # noqa: PLC0415

    m, seq = recipe.model, recipe.train.seq_len
    return 12.0 * m.hidden * seq * m.layers * (1.0 - cp_attention_shares(recipe, cp)[1])


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


def ep_floor(recipe: Recipe, gpu, tp: int, pp: int, cp: int, dp: int, gbs: int, ep: int, node_slots: int) -> float:
    """Seconds of EP all-to-all per step on one rank (a lower bound): 4 all-to-alls per MoE layer and
    micro batch (dispatch and combine, forward and backward; recomputation adds more), each rank's
    ``(ep - 1) / ep`` share over NVLink, and, where rank 0's EP group leaves its node (``node_slots``
    GPUs: :func:`llmtrain.plan.links.ep_group_leaves_node`, the cost model's test), the share sent to members on other nodes over the
    rank's NIC: at most ``slots // tp`` members share a node, so at least ``(ep - slots // tp) / ep``
    of the data leaves it, which both time models price at the NIC's bandwidth or slower (v1: all of
    it; v2, ``commtime.collective_seconds``: the slower of the NVLink and the NIC shares). Without
    the NIC term the floor of a layout whose experts talk across nodes was 10-15x below its price
    (DeepSeek-V3, tp 8 x ep 2: 9 s against 136 s), and the search priced nearly every split."""
    m, t = recipe.model, recipe.train
    if ep == 1 or not m.is_moe:
        return 0.0
    from llmtrain.plan.comm import link  # noqa: PLC0415
    from llmtrain.plan.links import ep_group_leaves_node  # noqa: PLC0415
    from llmtrain.plan.steptime import EP_EXPOSED  # noqa: PLC0415

    e = compute_bytes(t.precision)
    tokens = gbs // dp * t.seq_len // cp
    moe_layers = (m.layers - m.moe.first_dense_layers) / pp
    volume = 4 * e * tokens * m.moe.top_k * m.hidden * moe_layers
    seconds = (ep - 1) / ep * volume / link(gpu, False).bandwidth
    if ep_group_leaves_node(ep, tp, node_slots):
        off_node = (ep - min(ep, max(1, node_slots // tp))) / ep
        seconds = max(seconds, off_node * volume / link(gpu, True).bandwidth)
    return EP_EXPOSED * seconds  # the step-time model's exposed share of EP (all of it)


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
