"""Memory per rank (the plan's "Memory" line): what one pipeline rank holds at its peak.

Evaluated for a pipeline rank at a data-parallel index (default: its largest shard, FSDP index 0,
the most loaded ZeRO-1 owner), at the start of the last backward (states + activations in flight +
working buffers; a step of one backward holds no gradient yet, or at its end every gradient and no
activation: docs/planner.md 1.4) and at the optimizer step (states + ZeRO-1's broadcast copy); the
peak is the larger. A fixed framework reserve (CUDA context, NCCL buffers) and
allocator fragmentation are added on GPUs (:data:`RESERVE_BYTES`, :data:`FRAGMENTATION`). The
terms come from :mod:`llmtrain.plan.shards` (what each rank holds), :mod:`llmtrain.plan.memory`
(model state and buffers) and :mod:`llmtrain.plan.activations` (activations and micro batches in
flight); :mod:`llmtrain.plan.costmodel` adds time. Split out of costmodel.py by concept (it
re-exports these names).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from llmtrain.plan import activations as act
from llmtrain.plan.batch import BatchMath
from llmtrain.plan.dims import ParallelDims
from llmtrain.plan.gqa import native_gqa, repeating_layers
from llmtrain.plan.attnshare import runs_local
from llmtrain.plan.inflight import inflight
from llmtrain.plan.memory import (
    compute_bytes, dp_mode, fp8_unsharded_numel, grad_buffer_bytes, master_params, master_weight_state,
    model_state_bytes, optimizer_step_bytes, param_buffer_bytes, torch_ddp_bucket_state, torch_ddp_grads,
    worst_dp_index,
)
from llmtrain.plan.shards import block_params, inventory, lora_key, rank_stages, stage_layers
from llmtrain.recipe.gpus import GPUSpec, cluster_gpu
from llmtrain.recipe.schema import Recipe

GIB = float(1 << 30)
RESERVE_BYTES = {"cpu": 0}  # others: DEFAULT_RESERVE
DEFAULT_RESERVE = int(1.5 * GIB)  # CUDA context (~0.5 GiB) + NCCL communicators and buffers (~1 GiB)
FRAGMENTATION = 0.05  # caching-allocator fragmentation on GPUs, as a share of the allocated bytes


@dataclass
class RankMemory:
    pp_rank: int
    dp_index: int
    params: int
    grads: int
    optimizer: int
    activations: int
    other: int
    phase: str  # "backward", "backward end" or "optimizer step": when the peak happens
    other_detail: dict[str, int] = field(default_factory=dict)
    activation_detail: dict[str, int] = field(default_factory=dict)
    trainable_params: int = 0  # parameters with gradients on this rank (TP/PP-local, before DP sharding)
    saved_detail: dict[str, int] = field(default_factory=dict)  # what backward holds, whichever phase peaks
    grads_held: int | None = None  # gradient bytes alive at the peak (None: all of ``grads``, the state)

    @property
    def held_grads(self) -> int:
        return self.grads if self.grads_held is None else self.grads_held

    @property
    def peak(self) -> int:
        return self.params + self.held_grads + self.optimizer + self.activations + self.other


def act_shape(recipe: Recipe, dims: ParallelDims, gpu: GPUSpec) -> act.ActShape:
    m, t = recipe.model, recipe.train
    e = compute_bytes(t.precision)
    windowed = m.windowed_layers
    mixed = bool(windowed) and len(windowed) < m.layers  # windowed and full-attention layers
    return act.ActShape(
        b=t.micro_batch_size, s=t.seq_len // dims.cp, h=m.hidden, heads=m.heads, kv_heads=m.kv_heads,
        ffn=m.ffn_hidden, vocab=m.vocab_size, tp=dims.tp, sp=recipe.parallel.sequence_parallel and dims.tp > 1,
        e=e, fused_norm=gpu.name != "cpu",
        experts=m.moe.num_experts, top_k=m.moe.top_k, expert_ffn=m.expert_ffn,
        shared_ffn=m.moe.shared_experts * m.expert_ffn if m.is_moe else 0, cp=dims.cp, cp_method=recipe.parallel.cp_method,
        hd=m.head_dim, lora=None if t.lora is None else (*lora_key(t.lora), t.lora.dropout > 0),
        chunked_loss=recipe.planner.loss == "engine", compiled_loss=recipe.planner.loss in ("compiled", "fused"),
        megatron_loss=recipe.planner.loss in ("megatron", "megatron_fused"),
        materialized=recipe.planner.attention_kernel == "materialized", window=m.sliding_window if windowed else 0,
        post_norms=m.post_norms, offset_norm=m.norm_offset, qk_norm=m.qk_norm,
        logit_softcap=m.logit_softcap is not None, packed=recipe.data.packing, pre_norms=m.pre_norms,
        qk_norm_all=m.qk_norm and m.qk_norm_width == "all",
        rope_dim=m.rope_dim, rope_eager=not t.compile,
        gqa_native=native_gqa(recipe, gpu.name, dims.cp, dims.tp),
        masked=recipe.data.packing or m.attention_softcap is not None, softcap=m.attention_softcap is not None,
        rope_sets=2 if m.local_rope_theta is not None and mixed else 1, full_layers=mixed)


def rank_memory(recipe: Recipe, dims: ParallelDims, batch: BatchMath, pp_rank: int, dp_index: int | None = None,
                gpu: GPUSpec | None = None, stages: list[list[int]] | None = None) -> RankMemory:
    """Memory of pipeline rank ``pp_rank`` at ``dp_cp`` index ``dp_index`` (None: the most loaded one)."""
    m, p, t = recipe.model, recipe.parallel, recipe.train
    gpu = gpu or cluster_gpu(recipe.cluster.gpu, recipe.cluster.gpu_power_w)
    mode = dp_mode(p.zero, dims)
    v = p.pp_virtual_stages if dims.pp > 1 else 1
    stages = stages or stage_layers(m.layers, dims.pp, v, p.pp_layers_per_stage)
    held = rank_stages(pp_rank, dims.pp, v, p.pp_schedule)
    inv = inventory(m, stages, held, dims.tp, dims.ep, lora_key(t.lora))
    index = worst_dp_index(inv.params, mode) if dp_index is None else dp_index
    state = model_state_bytes(inv.params, mode, index, t.optimizer.states)
    master = master_params(recipe)  # another stack's compute-dtype parameters and fp32 master copies
    if master:
        state = master_weight_state(state, compute_bytes(t.precision))
    if torch_ddp_grads(recipe):  # the .grad and DDP's bucket copy
        state = torch_ddp_bucket_state(state, compute_bytes(t.precision))
    x = act_shape(recipe, dims, gpu)
    recompute = t.activation_checkpointing
    counts = inflight(p.pp_schedule, dims.pp, v, batch.microbatches, pp_rank)
    detail: dict[str, int] = {}
    last = len(stages) - 1
    # the rank's CP coordinate (the dp_cp mesh is (dp_replicate, dp_shard, cp), cp fastest); None: the most loaded
    cp_index = None if dp_index is None else dp_index % dims.cp
    kinds = {moe: act.layer_terms(x, moe, recompute, cp_index=cp_index) for moe in (False, True)}
    # layers that differ from their kind's terms: SmolLM3's NoPE layers rotate nothing; a mixed model's
    # window-banded layers repeat GQA's K/V (plan/gqa.py), and under all-gather CP run one masked call
    per_layer = []
    if m.nope_layers:
        per_layer.append((frozenset(m.nope_layers), {"rope_rotation": -kinds[False].get("rope_rotation", 0)}))
    cp_unmasked = dims.cp > 1 and p.cp_method == "allgather" and not x.masked
    banded = repeating_layers(recipe) if x.gqa_native or cp_unmasked else frozenset()
    if banded:
        rep = act.layer_terms(replace(x, gqa_native=False, masked=True), False, recompute, cp_index=cp_index)
        per_layer.append((banded, {k: rep.get(k, 0) - kinds[False].get(k, 0) for k in rep.keys() | kinds[False].keys()}))
    # a windowed layer runs only its score boxes, under ring CP (its chunk pairs') and without CP or under Ulysses
    # (its row's): selective keeps each box call's output and lse, fewer or more than its kind's terms
    boxes = ({"ring_window": m.sliding_window} if dims.cp > 1 and p.cp_method == "ring" and repeating_layers(recipe)
             else {"local_window": m.sliding_window} if runs_local(recipe, dims.cp) else None)
    if boxes and recompute in ("selective", "selective_mm"):
        win = act.layer_terms(replace(x, **boxes), False, recompute, cp_index=cp_index)
        per_layer.append((repeating_layers(recipe),
                          {k: win.get(k, 0) - kinds[False].get(k, 0) for k in win.keys() | kinds[False].keys()}))
    per_layer = [(layers, delta) for layers, delta in per_layer if any(delta.values())]
    for chunk, count, n_layers, n_moe in zip(held, counts, inv.chunk_layers, inv.chunk_moe):
        parts = [(kinds[False], n_layers - n_moe), (kinds[True], n_moe), (act.stage_terms(x, recompute), 1)]
        for layers, delta in per_layer:
            n = sum(1 for i in stages[chunk] if i in layers)
            if n:
                parts.append((delta, n))
        if chunk == 0 and x.lora is not None and 0 in stages[chunk]:  # block 0: its input needs no gradient
            moe0 = m.is_moe_layer(0)  # (dense or MoE)
            parts[int(moe0)] = (kinds[moe0], parts[int(moe0)][1] - 1)
            parts.append((act.layer_terms(x, moe0, recompute, first=True, cp_index=cp_index), 1))
        if chunk == 0:
            parts.append((act.first_stage_terms(x), 1))
        if chunk == last:
            parts.append((act.last_stage_terms(x), 1))
        for terms, n in parts:
            for k, val in terms.items():
                if n:
                    detail[k] = detail.get(k, 0) + count * n * val
    working = max(act.recompute_working_bytes(x, inv.moe_layers > 0, recompute),
                  act.recompute_working_bytes(x, False, recompute) if len(inv.layers) > inv.moe_layers else 0)
    if working:
        detail["recompute_working_set"] = working
    activations, saved = sum(detail.values()), detail  # saved: kept whichever phase peaks (detail is rebound below)

    head = m.vocab_size // dims.tp * m.hidden if inv.last and not (m.tie_embeddings and inv.first) else 0  # output.weight
    # the chunked loss computes the head's gradients in forward: autocast's cast of it is not kept
    uncast = head if recipe.planner.loss == "engine" else 0
    if t.lora is not None and inv.first and 0 in inv.layers:
        uncast += lora_uncast_numel(m, dims.tp, dims.ep, lora_key(t.lora))  # block 0's inputs need no gradient
    weights = master_weight_buffers(inv.matmul_numel - head, t.precision) if master else param_buffer_bytes(
        inv.dense_numel + inv.expert_numel, inv.matmul_numel - uncast, mode, t.precision, inv.largest_block, inv.root,
        recompute, fp8=fp8_unsharded_numel(m, inv.layers, dims.tp) if p.fp8_all_gather else (0, 0))
    other = {
        "weight_buffers": weights,
        "grad_buffers": grad_buffer_bytes(inv.trainable, mode, t.precision, inv.trainable_block, batch.grad_accum,
                                          int(p.dp_bucket_mb * 2**20), pp=dims.pp,
                                          reduce_each=p.fsdp_reduce_each_microbatch),
    }
    if inv.last:
        other["logits"] = counts[held.index(last)] * act.logits_bytes(x) + act.loss_backward_bytes(x)
    if dims.cp > 1:  # under all-gather the larger of the zigzag blocks' and (window-banded layers) a masked call's
        other["cp_attention"] = max(act.cp_transient_bytes(x), act.cp_transient_bytes(replace(x, masked=True))
                                    if cp_unmasked and banded else 0)
    if inv.moe_layers:
        other["moe_buffers"] = 8 * m.moe.num_experts * inv.moe_layers
        if dims.ep > 1:
            other["ep_dispatch"] = 2 * x.b * x.s * x.top_k * x.h * x.e
    states = state.params + state.grads + state.optimizer
    step_extra = optimizer_step_bytes(mode, state.trainable)
    # The trainer frees the gradients after every step (zero_grad(set_to_none=True)), so a rank whose
    # step is one backward (one micro batch, no pipeline) makes them during it while it frees the
    # activations: at its start it holds the activations and no gradient (the loss's early output-layer
    # gradient is among the activations), at its end every gradient and no activation. Measured on CPU
    # (tests/test_peak_memory.py) and in the GPU record's one-GPU rows (docs/planner.md 1.4).
    # planner.grad_memory persistent: a stack whose gradient buffer lives across steps (Megatron).
    born = batch.grad_accum == 1 and dims.pp == 1 and recipe.planner.grad_memory == "engine"
    at_end = born and state.grads > activations  # such a step peaks at the end of its backward
    held = 0 if born and not at_end else state.grads
    acts = 0 if at_end else activations
    if at_end:  # the loss's backward ran first: its logits are gone
        other, detail = {k: v for k, v in other.items() if k != "logits"}, {}
    backward = state.params + held + state.optimizer + acts + sum(other.values())
    reserve = RESERVE_BYTES.get(gpu.name, DEFAULT_RESERVE)
    if backward >= states + step_extra:
        phase = "backward end" if at_end else "backward"
    else:
        phase, acts, held, other, detail = "optimizer step", 0, state.grads, {"optimizer_step_temporaries": step_extra}, {}
    if reserve:
        other["framework_reserve"] = reserve
        other["fragmentation"] = int(FRAGMENTATION * (state.params + held + state.optimizer + acts + sum(other.values())
                                                      - reserve))
    return RankMemory(pp_rank, index, state.params, state.grads, state.optimizer, acts, sum(other.values()), phase,
                      other, detail, state.trainable, saved, grads_held=held)


def lora_uncast_numel(m, tp: int, ep: int, lora) -> int:
    """Block 0's matmul weights whose autocast copy is not saved under LoRA: a linear keeps its (cast) weight
    only for its input's gradient, and block 0's input (the frozen embedding's output) needs none; what
    follows needs one once an adapter upstream trains (the attention's output after an adapter on wq / wk /
    wv, the MLP's input after one on wo too, w2's input after one on w1 / w3). The adapters' ``lora_a``
    take the same inputs; their ``lora_b`` always have one that needs a gradient (A x). Measured:
    tests/test_costmodel.py ``lora_ddp_amp`` (block 0's wq, wk and wv planned as kept before)."""
    targets = set(lora[1])
    free = {"wq", "wk", "wv"}
    if not targets & free:
        free.add("wo")
        if "wo" not in targets:
            free |= {"w1", "w3"}
            if not targets & {"w1", "w3"}:
                free.add("w2")
    n = 0
    for q in block_params(m, 0, tp, ep, lora):
        parts = q.name.split(".")  # layers.0.<module>.<proj>.weight | layers.0.<module>.<proj>.lora_a.weight
        if q.kind == "matmul" and parts[3] in free and "lora_b" not in parts:
            n += q.numel
    return n


def master_weight_buffers(block_matmul_numel: int, precision: str) -> int:
    """Weight copies beside ``planner.param_memory: master``'s compute-dtype parameters: none in bf16
    (the matmuls read the parameters themselves); in fp8 Transformer Engine's cached FP8 weight and
    its transpose (``_fp8_workspaces``, reused across micro batches), 2 bytes per weight element of
    the blocks' linears (``block_matmul_numel``: the output layer stays bf16)."""
    return 2 * block_matmul_numel if precision == "fp8" else 0


def probe_ranks(pp: int) -> list[int]:
    """Pipeline ranks the search prices (fast mode): the first two (most micro batches in flight,
    the embedding), the last two (logits) and one in the middle; the final top K are re-priced
    on every rank."""
    return sorted({0, min(1, pp - 1), pp // 2, max(0, pp - 2), pp - 1})


def peak_bytes(recipe: Recipe, dims: ParallelDims, batch: BatchMath, pp_ranks: list[int] | None = None) -> int:
    """The largest peak memory over ``pp_ranks`` (default: all): a memory-only check for the search."""
    m, p = recipe.model, recipe.parallel
    v = p.pp_virtual_stages if dims.pp > 1 else 1
    stages = stage_layers(m.layers, dims.pp, v, p.pp_layers_per_stage)
    ranks = range(dims.pp) if pp_ranks is None else pp_ranks
    return max(rank_memory(recipe, dims, batch, r, None, None, stages).peak for r in ranks)
