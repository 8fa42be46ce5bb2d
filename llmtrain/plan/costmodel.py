"""The cost model's glue: memory per rank, FLOPs, communication, bubble and step time of a layout.

:func:`estimate` takes a validated recipe (its :class:`ParallelDims` and :class:`BatchMath`) and
the node placement and returns a :class:`CostModel`; :func:`llmtrain.plan.cost_json.cost_to_dict` is its ``plan --json``
form. Each concept lives in its own module (sources in their docstrings, the whole model in
docs/planner.md):

- what each rank holds: :mod:`llmtrain.plan.shards`; model state and buffers:
  :mod:`llmtrain.plan.memory`; activations and micro batches in flight:
  :mod:`llmtrain.plan.activations`;
- FLOPs: :mod:`llmtrain.plan.flops`; communication: :mod:`llmtrain.plan.comm`; bubble:
  :mod:`llmtrain.plan.bubble`; step time and MFU: :mod:`llmtrain.plan.steptime`.

Memory per rank is :mod:`llmtrain.plan.rankmem` (re-exported here: :class:`RankMemory`,
:func:`rank_memory`, :func:`peak_bytes`, :func:`probe_ranks`, :func:`act_shape`), evaluated for
every pipeline rank at its largest data-parallel shard and its smallest.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from llmtrain.plan import commtime, fp8time, ops
from llmtrain.plan.batch import BatchMath
from llmtrain.plan.bubble import bubble_fraction
from llmtrain.plan.asynctp import tp_overlap_kind
from llmtrain.plan.comm import Comm, CommSpec, fp8_gather_numel, group_spans, powersgd_start, step_comms
from llmtrain.plan.dims import ParallelDims
from llmtrain.plan.rankmem import (  # noqa: F401 (re-exported: callers import the memory side from here)
    GIB, RankMemory, act_shape, peak_bytes, probe_ranks, rank_memory,
)
from llmtrain.plan.stragglers import straggler_factor
from llmtrain.plan.flops import (
    block_flops_per_token, cp_attention_shares, cp_exchange, forward_flops_per_token, fp8_matmul_fraction,
    head_flops_per_token, model_flops_per_token, recompute_flops_per_token, ring_layers_executed, ring_step_shares,
    score_flops_per_token, softcap_call_keys,
)
from llmtrain.plan.inflight import split_backwards
from llmtrain.plan.memory import DPMode, best_dp_index, compute_bytes, dp_mode, model_state_bytes, worst_dp_index
from llmtrain.cluster.placement import Placement
from llmtrain.plan.ringtime import apply_ring_overlap, forward_passes, ring_grad_units
from llmtrain.plan.schedule import gradient_ready
from llmtrain.plan.shards import (expert_lora_tp, inventory, is_moe_layer, lora_key, lora_replicated_numel, rank_stages,
                                  stage_layers)
from llmtrain.plan.assumptions import planner_assumptions
from llmtrain.plan.steptime import RankWork, StepTime, efficiency, step_time
from llmtrain.recipe.gpus import GPUSpec, cluster_gpu
from llmtrain.recipe.schema import SPLIT_BACKWARD_SCHEDULES, V_SHAPED_SCHEDULES, Recipe

@dataclass
class CostModel:
    gpu: GPUSpec
    mode: DPMode
    worst: RankMemory
    per_pp: list[tuple[RankMemory, RankMemory, list[int], int]]  # (worst, best, stages, layers) per pp rank (fast: some)
    flops: dict
    comms: list[Comm]  # of the slowest pipeline rank
    bubble: float
    time: StepTime
    worst_rank: int
    hints: list[dict] = field(default_factory=list)
    time_model: str = "v1"  # cluster.time_model: v1 (FLOPs x one efficiency) or v2 (plan/ops.py, plan/commtime.py)
    assumptions: list[str] = field(default_factory=list)  # planner-only settings in effect (recipe/schema_plan.py)

    @property
    def fits(self) -> bool:
        return self.worst.peak <= self.gpu.memory_bytes


def grad_shapes(inv) -> tuple[tuple, tuple]:
    """(dense, expert) local gradient shapes of the rank's trainable parameters, for the compressed
    DP averaging (plan/comm.py)."""
    shapes: tuple[list, list] = ([], [])
    for q in inv.params:
        if q.trainable:
            shapes[q.kind == "expert"].append(q.shape)
    return tuple(shapes[0]), tuple(shapes[1])


def planned_gpu(recipe: Recipe, placement: Placement) -> GPUSpec:
    """``cluster.gpu`` as the recipe's cluster has it: power cap and the nodes' network
    (``cluster.network_gbps`` shared by the placement's GPUs per node; recipe/gpus.py)."""
    c = recipe.cluster  # the largest node's GPUs share its NICs (distinct_slots: cached, not O(nodes) per layout)
    return cluster_gpu(c.gpu, c.gpu_power_w, c.network_gbps, placement.distinct_slots[-1])


def estimate(recipe: Recipe, dims: ParallelDims, batch: BatchMath, placement: Placement, dp_overlap: bool = False,
             fast: bool = False, hints: bool = True) -> CostModel:
    m, p, t = recipe.model, recipe.parallel, recipe.train
    gpu = planned_gpu(recipe, placement)  # cluster.gpu_power_w scales the peaks, cluster.network_gbps sets the NIC
    # planner.assume_dp_overlap says in the recipe what dp_overlap=True says here (a published stack's
    # overlap the engine lacks), so `plan FILE` and `plan --search` price a published run as written
    dp_overlap = dp_overlap or recipe.planner.assume_dp_overlap
    mode = dp_mode(p.zero, dims)
    v = p.pp_virtual_stages if dims.pp > 1 else 1
    stages = stage_layers(m.layers, dims.pp, v, p.pp_layers_per_stage)
    per_pp = []
    for r in (probe_ranks(dims.pp) if fast else range(dims.pp)):
        worst = rank_memory(recipe, dims, batch, r, None, gpu, stages)
        best = worst
        if mode.kind != "plain" and not fast:
            inv = inventory(m, stages, rank_stages(r, dims.pp, v, p.pp_schedule), dims.tp, dims.ep, lora_key(t.lora))
            best = rank_memory(recipe, dims, batch, r, best_dp_index(inv.params, mode), gpu, stages)
        held = rank_stages(r, dims.pp, v, p.pp_schedule)
        per_pp.append((worst, best, held, sum(len(stages[s]) for s in held)))
    worst = max((w for w, *_ in per_pp), key=lambda w: w.peak)

    # -- FLOPs ---------------------------------------------------------------------------------------
    seq, tokens_step = t.seq_len, batch.tokens_per_step
    lk = lora_key(t.lora)
    model_tok = model_flops_per_token(m, seq, lk)  # a windowed layer's attention over its window (flops.py)
    recompute = t.activation_checkpointing
    whole = recipe.planner.full_recompute == "whole_block"  # another stack's checkpoint re-runs each block's last GEMM
    # what the recomputation re-runs, for the FLOPs (another stack's selective may re-run the attention instead)
    recomputed = ("core_attention" if recompute == "selective" and recipe.planner.selective_recompute == "core_attention"
                  else recompute)
    again_attention = recomputed in ("full", "core_attention")  # the recomputed forward runs the attention scores
    tp_kind = tp_overlap_kind(recipe)
    hw_tok = head_flops_per_token(m, lk)
    works: list[RankWork] = []
    comm_by_rank: list[list[Comm]] = []
    tokens_mb = t.micro_batch_size * seq // dims.cp
    spans = group_spans(dims, placement, fast)
    # The causal kernels never execute the masked score blocks: of the 12 h s attention FLOPs per
    # token only flops.attention_executed's share runs (1/2 for every method: causal SDPA, Ulysses,
    # the zigzag ring and the zigzag all-gather)
    # a mask (window, packing): all of them; the ring's windowed layers: the blocks it runs (flops.cp_attention_shares)
    counted, executed = cp_attention_shares(recipe, dims.cp)
    skipped_attention = 12.0 * m.hidden * seq * (1.0 - executed)
    v2 = v2_priced(recipe)
    shape = ops.shape_of(recipe, dims, gpu, executed) if v2 else None
    # v2: the step waits for the slowest of its GPUs (plan/stragglers.py; v1's constant was fitted on real runs)
    slow = straggler_factor(dims.world_size, recipe.cluster.gpu_variability) if v2 else 1.0
    again_share = recompute_again(recipe, dims, stages, batch.microbatches)
    for r in range(dims.pp):  # time: every pipeline rank (cheap; memory above may probe only some)
        held = rank_stages(r, dims.pp, v, p.pp_schedule)
        inv = inventory(m, stages, held, dims.tp, dims.ep, lk)
        fwd = bwd = 0.0
        for n, (split, rep, rs, rr), (fs, fr) in _layer_groups(m, inv.layers, seq, recomputed, lk, dims.tp, whole):
            # Time, not FLOP counting: causal SDPA kernels skip the masked half of the scores
            # (a third of them in the forward)
            split -= skipped_attention
            fs -= skipped_attention / 3
            rs -= skipped_attention / 3 if again_attention else 0.0
            fwd += n * (fs / dims.tp + fr)
            bwd += n * ((split - fs) / dims.tp + (rep - fr) + rs / dims.tp + rr)
        again = [(again_share[sid], stages[sid]) for sid in held if sid in again_share]
        for share, layers in again:  # the weight pass's recomputation (recompute_again)
            for n, (_, _, rs, rr), _ in _layer_groups(m, layers, seq, recomputed, lk, dims.tp, whole):
                bwd += share * n * ((rs - skipped_attention / 3) / dims.tp + rr)
        if inv.last:
            head = head_flops_per_token(m, lk) / dims.tp
            share = 1 / 3 if lk is None else 1 / 2
            fwd, bwd = fwd + head * share, bwd + head * (1 - share)
        spec = CommSpec(dims, mode.kind, p.zero, compute_bytes(t.precision), inv.dense_numel, inv.expert_numel,
                        inv.largest_block, batch.microbatches, tokens_mb, m.hidden, m.heads, m.head_dim, m.moe.top_k,
                        len(inv.layers), inv.moe_layers, inv.first, inv.last, p.sequence_parallel and dims.tp > 1,
                        recompute, p.cp_method, len(held), inv.root, inv.trainable,
                        lk is not None and inv.first and 0 in inv.layers,
                        lora_replicated=lora_replicated_numel(m, inv.layers, dims.tp, lk),
                        lora_expert_tp=expert_lora_tp(m, dims, lk, mode.kind == "fsdp" and t.precision != "fp32"),
                        trainable_expert=inv.trainable_expert_numel,
                        reduce_bytes=2 if p.reduce_dtype == "bf16" else 4, bucket_bytes=int(p.dp_bucket_mb * 2**20),
                        grad_ready=gradient_ready(p.pp_schedule if dims.pp > 1 else None, dims.pp, r, v),
                        fsdp_reduce_each=p.fsdp_reduce_each_microbatch,
                        compression=p.grad_compression, powersgd_rank=p.powersgd_rank, topk_ratio=p.topk_ratio,
                        powersgd_start_step=powersgd_start(recipe),
                        grad_shapes=grad_shapes(inv) if p.grad_compression != "none" else ((), ()),
                        async_tp=tp_kind in ("async", "megatron") and dims.tp > 1,
                        overlap_by_planner=tp_kind == "megatron",
                        tp_bwd_overlap=tp_kind == "backward",
                        dist_opt=recipe.planner.dp_optimizer == "distributed",
                        fp8_gather_numel=fp8_gather_numel(m, inv.layers, dims.tp) if p.fp8_all_gather else 0,
                        kv_heads=m.kv_heads, cp_kv=recipe.planner.cp_kv, cp_exchange=cp_exchange(recipe, dims.cp, inv.layers),
                        pp_blocking=recipe.planner.pp_p2p == "blocking",
                        recompute_whole=whole, v_shaped=p.pp_schedule in V_SHAPED_SCHEDULES)
        comms = step_comms(spec, gpu, spans)
        if recipe.cluster.time_model == "v2":
            commtime.retime(comms, gpu, dims, placement.nodes[0].slots)
        if dims.cp > 1 and p.cp_method == "ring":  # the engine's ring overlaps each hop with a block (ringtime.py)
            # the layers on the ring: all, or the full-attention ones when the windowed ones exchange their keys
            on_ring = ring_layers_executed(recipe, dims.cp)
            ring_executed = executed if on_ring is None else on_ring
            if shape is not None:  # v2: the kernel's price, as in the block's time
                ring_shape = shape if on_ring is None else replace(
                    shape, attn_executed=on_ring,
                    softcap_keys=shape.softcap_keys and softcap_call_keys(recipe, dims.cp, ring_only=True))
                a_f, a_b = (slow * a for a in ops.layer_attention_seconds(ring_shape, gpu))
            else:  # v1: the executed score FLOPs at v1's rate; flash backward runs 2.5x its forward
                a_f = (score_flops_per_token(max(1, m.heads // dims.tp) * m.head_dim, seq) * tokens_mb * ring_executed
                       / (gpu.peak_flops_bf16 * efficiency(gpu)))
                a_b = 2.5 * a_f
            apply_ring_overlap(comms, dims.cp, forward_passes(recompute), ring_grad_units(compute_bytes(t.precision)),
                               a_f, a_b, ring_step_shares(recipe, dims.cp))
        comm_by_rank.append(comms)
        stepped = model_state_bytes(inv.params, mode, worst_dp_index(inv.params, mode)).stepped
        works.append(RankWork(fwd * tokens_mb, bwd * tokens_mb, comms,
                              inv.largest_block / max(1, inv.dense_numel + inv.expert_numel), stepped))
        if v2:
            dense, moe = len(inv.layers) - inv.moe_layers, inv.moe_layers
            first = None  # LoRA: block 0's input needs no gradient (a dense or an MoE block)
            if lk is not None and inv.first and 0 in inv.layers:
                first = "moe" if m.is_moe_layer(0) else "dense"
            f_s, b_s = ops.rank_seconds(shape, gpu, dense, moe, inv.last, first_block=first)
            for share, layers in again:  # the weight pass's recomputation (recompute_again)
                moe_again = sum(1 for layer in layers if is_moe_layer(m, layer)) if m.is_moe else 0
                b_s += share * ops.recompute_seconds(shape, gpu, len(layers) - moe_again, moe_again)
            # fp8: torchao's scaling casts and layout copies beside the FP8 GEMMs (plan/fp8time.py)
            share = 1 / max(1, dims.dp_shard * dims.cp) if p.fp8_all_gather and mode.kind == "fsdp" else 1.0
            c_f, c_b = fp8time.cast_seconds(shape, gpu, dense, moe, t.compile or recipe.planner.fp8_casts == "fused", share)
            f_s, b_s = f_s + c_f, b_s + c_b
            copies = sum(2 * c.message_bytes * c.count for c in comms if c.phase.startswith("fsdp"))
            b_s += ops.membound_seconds(copies, gpu) / batch.microbatches
            # eager launches: a pass takes the longer of the GPU's work and the CPU's launches (ops.launch_seconds)
            cpu_f, cpu_b = ops.launch_seconds(shape, len(inv.layers), t.compile, mode.kind == "fsdp")
            works[-1].fwd_s, works[-1].bwd_s = max(f_s, cpu_f), max(b_s, cpu_b)
            works[-1].overlap_slowdown = ops.overlap_slowdown(shape, gpu, dense, moe, inv.last, first)
    # context parallelism runs kernel blocks, not the whole causal square (flops.attention_counted): the
    # score FLOPs forward and backward, and forward again where full recomputation re-runs attention
    # (counted above: all-gather's masked calls whole, the ring's windowed layers by the chunk pairs they run)
    uncounted = (1.0 - counted) * score_flops_per_token(m.heads * m.head_dim, seq)
    for n, (split, rep, rs, rr), _ in _layer_groups(m, tuple(range(m.layers)), seq, recomputed, lk, dims.tp, whole):
        hw_tok += n * (split + rs + (rep + rr) * dims.tp - uncounted * (3 + again_attention))
    for sid, share in again_share.items():
        for n, (_, _, rs, rr), _ in _layer_groups(m, stages[sid], seq, recomputed, lk, dims.tp, whole):
            hw_tok += share * n * (rs + rr * dims.tp - uncounted)
    world = dims.world_size
    bubble = bubble_fraction(p.pp_schedule, dims.pp, v, batch.microbatches)
    st = step_time(works, gpu, batch.microbatches, bubble, p.pp_schedule if dims.pp > 1 else None, tokens_step, world,
                   model_tok * tokens_step, hw_tok * tokens_step, v, dp_overlap, dims.pp, t.precision,
                   fp8_matmul_fraction(m, t.seq_len) if t.precision == "fp8" else 0.0, v2=v2, straggler=slow)
    flops = {
        "model_flops_per_token": model_tok, "model_flops_per_step": model_tok * tokens_step,
        "model_flops_per_gpu_per_step": model_tok * tokens_step / world,
        "hardware_flops_per_step": hw_tok * tokens_step, "hardware_flops_per_gpu_per_step": hw_tok * tokens_step / world,
        "recompute_overhead": hw_tok / model_tok - 1.0,
        "convention": "model FLOPs = 6 x active matmul params + 12 L h s per token (attention without causal halving; "
                      "a windowed layer's over its window, 12 h min(s, window)); "
                      "hardware FLOPs add recomputation and MoE routers replicated over TP; with ring or all-gather CP they count "
                      "the kernel blocks run, not the whole causal square"
                      + ("; LoRA: 4 x frozen + 6 x adapter params (executed: no weight gradients of the frozen base)"
                         if lk is not None else ""),
    }
    cm = CostModel(gpu, mode, worst, per_pp, flops, comm_by_rank[st.slowest_pp_rank], bubble, st, _global_rank(dims, worst),
                   time_model=recipe.cluster.time_model, assumptions=planner_assumptions(recipe))
    if hints and not cm.fits:
        from llmtrain.plan.hints import memory_hints  # noqa: PLC0415  (imports validate; avoids a cycle)

        cm.hints = memory_hints(recipe, placement, cm)
    return cm


def v2_priced(recipe: Recipe) -> bool:
    """Whether time model v2 prices this recipe's compute per operation (and its stragglers): v2,
    except LoRA under fp8, whose targets stay bf16 beside Float8 bases (v1's compute; plan/loratime.py)."""
    return recipe.cluster.time_model == "v2" and not (recipe.train.lora is not None and recipe.train.precision == "fp8")


def recompute_again(recipe: Recipe, dims: ParallelDims, stages, microbatches: int) -> dict[int, float]:
    """Stage -> share of its micro batches whose full recomputation runs a second time. Under a split
    backward the input-gradient pass recomputes each checkpointed block and the weight pass, a
    second backward, recomputes it again (engine/parallel/pipeline.py groups the weight pass's
    parameter groups into one recomputation): every micro batch under zero-bubble and ZBV, DualPipeV's
    few split ones (:func:`llmtrain.plan.inflight.split_backwards`); never on stage 0, whose input
    needs no gradient, so torch runs its backward whole at the weight step. Measured with
    benchmarks/planner_fidelity.py: zero-bubble and ZBV +14 %, DualPipeV +1.7 % FLOPs (pp 2) against
    one recomputation."""
    if (dims.pp == 1 or recipe.parallel.pp_schedule not in SPLIT_BACKWARD_SCHEDULES
            or recipe.train.activation_checkpointing != "full"):
        return {}
    out = {}
    for s in range(1, len(stages)):
        k = split_backwards(recipe.parallel.pp_schedule, dims.pp, s, microbatches)
        if k and stages[s]:
            out[s] = k / microbatches
    return out


def _layer_groups(m, layers: tuple[int, ...], seq: int, recompute: str, lk, tp: int = 1, whole: bool = False) -> list[tuple]:
    """``(count, (split, replicated, recompute split, recompute replicated), (forward split, forward
    replicated))`` FLOPs per token of the given blocks, grouped: by kind (dense, MoE) without LoRA
    (the forward is a third); with LoRA block 0 differs from the others (its input needs no
    gradient), so each block is its own group (cached per block in :mod:`llmtrain.plan.flops`)."""
    if lk is not None:
        return [(1, block_flops_per_token(m, i, seq, lk) + recompute_flops_per_token(m, i, seq, recompute, lk, tp),
                 forward_flops_per_token(m, i, seq, lk)) for i in layers]
    out = []
    n_moe = sum(1 for layer in layers if is_moe_layer(m, layer)) if m.is_moe else 0
    for kind, n in ((False, len(layers) - n_moe), (True, n_moe)):
        if n:
            layer = next(layer for layer in layers if is_moe_layer(m, layer) == kind)
            split, rep = block_flops_per_token(m, layer, seq)
            out.append((n, (split, rep) + recompute_flops_per_token(m, layer, seq, recompute, tp=tp, whole_block=whole),
                        (split / 3, rep / 3)))
    return out


def _global_rank(dims: ParallelDims, mem: RankMemory) -> int:
    """The global rank of (pp rank, dp_cp index j): j = (dp_replicate x dp_shard + dp_shard) x cp + cp."""
    rep, inner = divmod(mem.dp_index, dims.dp_shard * dims.cp)
    shard, cp = divmod(inner, dims.cp)
    return dims.rank_of((mem.pp_rank, rep, shard, cp, 0))
