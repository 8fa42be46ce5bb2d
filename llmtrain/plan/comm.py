"""Communication per step and per parallel dimension, and the link that carries it.

Collective cost (Thakur et al. 2005; the NCCL "bus bandwidth" convention, nccl-tests
PERFORMANCE.md): for a message of ``M`` bytes over ``n`` ranks,
all-reduce moves ``2 (n-1)/n M`` per rank, all-gather / reduce-scatter / all-to-all
``(n-1)/n M`` (``M`` = the full, unsharded size), a broadcast ``(n-1)/n M`` (pipelined), a P2P
send ``M``; time = that volume / bus bandwidth + a latency per step of the algorithm.

Link: a group whose ranks sit on one node talks over NVLink, otherwise over the inter-node
network (one NIC per GPU). Decided from the real layout: rank 0's group of the dimension
(:meth:`ParallelDims.group`) and :meth:`Placement.spans_nodes`; :func:`spans_nodes_fast`
computes the same from the group's largest rank (the search uses it; a test checks they agree).
Bandwidths come from ``recipe/gpus.py`` (datasheets): NVLink's figure is both directions, so
one direction is half of it; the NIC figure (400 Gb/s) is per direction. NCCL reaches about
:data:`LINK_EFFICIENCY` of either.

Volumes per step, as the engine communicates (``b`` micro batch, ``s`` tokens per CP rank,
``h`` hidden, ``e`` compute bytes, ``P`` the rank's parameters, ``m`` micro batches):

- DP, zero 0: all-reduce of the gradients (``rP`` with ``r`` = 4 bytes, 2 with
  ``parallel.reduce_dtype: bf16``) over
  dp x cp, once per step, in buckets of ``parallel.dp_bucket_mb`` that start during the last
  micro batch's backward (``engine/parallel/grad_buckets.py``; phase ``step-overlap``: the
  step-time model exposes only the last bucket and what exceeds that backward), under every
  PP schedule: per chunk (virtual stage), during its last backward, or with the zero-bubble
  family's weight passes (no hooks) right after it; when each chunk's gradients are final
  comes from :func:`llmtrain.plan.schedule.gradient_ready`. zero 1: the same, plus each
  owner broadcasting its updated fp32 parameters (``4P`` in all; after the optimizer step, not
  overlapped). ``parallel.grad_compression`` (zero 0/1) replaces the gradient all-reduce:
  PowerSGD all-reduces (fp32) the uncompressed tensors, then ``P`` (``n x r`` per matrix), then
  ``Q`` (``m x r``); top-k all-gathers ``8k`` bytes per rank; both after backward (phase
  ``step``), :func:`compressed_grad_bytes`: the steady state. PowerSGD's warm-up
  (``parallel.powersgd_start_step``) all-reduces the whole fp32 gradient in its first steps; the
  planner prices the steady state and says so in the collective's note. FSDP's reduce-scatter (and HSDP's all-reduce) also use ``r`` bytes. FSDP (zero 2/3): all-gather of the ``param_dtype`` weights
  (``eP``) per forward (zero 2 and zero 3) and again per backward (zero 3, resharded after
  forward; not the root unit — embedding, final norm, output — which FSDP2 keeps gathered), reduce-scatter of fp32 gradients (``4P``) once, the last micro batch
  (the others accumulate unsharded; ``parallel.fsdp_reduce_each_microbatch`` without PP: every
  micro batch), and for HSDP an all-reduce of the sharded gradients over dp_replicate as often. With pp > 1 parameters are gathered once per step. LoRA: gradients (and the
  ZeRO-1 broadcast) cover the adapters only; FSDP still gathers the frozen weights. The adapters'
  own TP collectives (an all-reduce of ``b s rank`` per adapter) are not counted: ``rank`` is
  small next to ``h``. Block 0's input needs no gradient under LoRA: one TP all-reduce
  equivalent less per micro batch on the first stage.
- TP, per layer and micro batch: 2 all-reduces forward and 2 backward of ``bshe``; with
  sequence parallelism 2 all-gathers + 2 reduce-scatters each way (same volume). Activation
  recomputation re-runs some of the forward ones (:func:`recomputed_tp_sites`, measured with
  benchmarks/planner_fidelity.py): ``selective`` and ``selective_mm`` the two gathers (SP: the
  attention and MLP inputs' all-gathers; without SP nothing), since the policy caches wo's
  reduced output and nothing after w2 is re-run; ``full`` also wo's reduction (the
  checkpoint stops after the last saved tensor, w2's input, so w2's reduction is not re-run);
  ``planner.full_recompute: whole_block`` (Megatron-LM's checkpoint) all four. ``selective_mm``'s
  extra recomputed GEMMs (wk, w3; wo only without TP, so never wo's reduction) read the gathered
  norm outputs that ``selective`` re-gathers anyway. Plus one all-reduce for the embedding (forward) and
  one for the output layer's input (backward). MoE layers count like dense ones: with expert-TP
  (``engine/parallel/expert.py``) the block is one TP region whose input is copied (SP: gathered)
  and whose partial output is all-reduced (SP: reduce-scattered) after the combine, the dense
  MLP's traffic; the router's weight-gradient all-reduce over TP (``E x h`` per MoE layer and micro
  batch, backward) is not counted: ``E`` is small next to the tokens.
- PP: per micro batch and stage boundary, the activation ``bshe`` forward and its gradient
  backward (``/t`` with sequence parallelism: each TP rank sends its shard; under
  ``planner.pp_p2p blocking`` always ``/t``, Megatron's scatter/gather, plus without SP an
  all-gather of ``bshe`` over TP per receive, phase ``pipeline-blocking``: every send exposed). Counted as the sends
  of the busiest rank: a middle rank sends each of its ``v`` chunks' activations on and their
  gradients back (``2 v`` per micro batch); with pp 2 no rank is in the middle, and each sends
  ``2 v - 1`` (the chunk at the pipeline's end sends no activation, the one at its start no
  gradient: 1F1B, ``m`` activations from rank 0 and ``m`` gradients from rank 1). V-shaped
  schedules (zbv, dualpipev: rank ``r`` holds stages ``r`` and ``2 pp - 1 - r``) pass stage
  ``pp - 1``'s activation to stage ``pp`` on the same rank: with pp 2 each rank sends 2 (rank 0
  stage 0's activation and stage 3's gradient; rank 1 stage 2's activation and stage 1's
  gradient; measured, benchmarks/planner_fidelity.py zbv), the middle ranks of a longer V ``2 v``.
- CP ring: per layer, ``cp - 1`` passes of the local K and V blocks forward, K, V and their
  gradients backward, and one last pass of dK/dV back to their owner (the gradients in the
  accumulation dtype, fp32 at least: twice K/V's bytes in bf16); a windowed layer whose window needs
  few keys of other ranks (``ringwindow.use_exchange``) instead sends, per forward pass, the keys its
  neighbours' boxes read (the last ``window - 1`` of a chunk under a window shorter than it), in the
  backward the same again, and the received keys' dK/dV back to their owners: the busiest rank's sends
  (``exchange_tokens``), phase ``cp-exchange``, priced exposed (engine/parallel/context_exchange.py
  overlaps only the forward's); Ulysses: 4 all-to-alls (q, k, v, output) each way; all-gather: K and V
  gathered forward, their gradients reduce-scattered backward. Ring and all-gather move K/V (and
  dK/dV) with the rank's ``kv_heads / tp`` heads: the engine repeats them to the query heads only
  after the exchange (``engine/parallel/context.py``), as Megatron-Core and Llama 3 do;
  ``planner.cp_kv repeated`` prices them repeated to the query heads (``heads / tp``), as torch's
  context_parallel under torchtitan, which repeats K/V before SDPA. Ulysses re-shards K/V with
  their ``kv_heads / tp`` heads when those split over cp (thirty-eighth session; measured equal by
  benchmarks/planner_fidelity.py, -25 % of its bytes at 8 / 4 heads), else repeated to the query heads.
- EP, per MoE layer and micro batch: dispatch and combine all-to-alls of ``top_k x tokens x h``
  forward, and the same backward.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import ceil

from llmtrain.plan.dims import ParallelDims
from llmtrain.cluster.placement import Placement
from llmtrain.recipe.gpus import GPUSpec
from llmtrain.plan.collective import Comm, make  # noqa: F401 (re-exported: callers import Comm from comm)
from llmtrain.plan.comm_tp import tp_comms
from llmtrain.plan.ringtime import forward_passes, ring_grad_units, ring_units
from llmtrain.plan.comm_compression import (  # noqa: F401 (powersgd_* re-exported)
    POWERSGD_MIN_RATE, _numel, compressed_grad_bytes, powersgd_rank_of, powersgd_start)
from llmtrain.plan.links import (  # noqa: F401 (re-exported: callers import them from comm)
    FACTOR, LATENCY_S, LINK_EFFICIENCY, Link, collective_time, link, spans_nodes, spans_nodes_ep_fast,
    spans_nodes_fast)


# ---- volumes ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CommSpec:
    """The numbers the volumes need, for one pipeline rank."""

    dims: ParallelDims
    dp_kind: str  # DPMode.kind
    zero: int
    e: int  # compute bytes
    params: int  # the rank's parameters (TP/EP-local, before DP sharding), non-expert
    expert_params: int  # EP-sharded expert parameters of the rank
    largest_block: int  # parameters of its largest transformer block (one FSDP unit)
    microbatches: int
    tokens: int  # b x s per micro batch on this rank (s = seq_len / cp)
    hidden: int
    heads: int
    head_dim: int
    top_k: int
    layers: int  # transformer blocks on this rank
    moe_layers: int
    embedding: bool
    output: bool
    sp: bool
    recompute: str
    cp_method: str
    chunks: int  # pipeline chunks on this rank (virtual stages)
    root: int = 0  # parameters of the FSDP root unit (embedding, final norm, output) on this rank
    trainable: int = -1  # parameters with gradients (LoRA: the adapters only); -1 = all
    lora_first: bool = False  # LoRA and this rank holds block 0, whose input needs no gradient
    lora_replicated: int = 0  # LoRA under TP: adapter elements replicated over TP (shards.lora_replicated_numel)
    # LoRA on the routed experts under TP: per MoE block, the replicated factors (A of w1 / w3, B of w2)
    # whose gradients are all-reduced over TP in every backward (count, elements each, bytes per element)
    lora_expert_tp: tuple[int, int, int] = (0, 0, 4)
    reduce_bytes: int = 4  # bytes per gradient element in every reduction (parallel.reduce_dtype)
    bucket_bytes: int = 25 << 20  # zero 0/1 gradient bucket (parallel.dp_bucket_mb)
    grad_overlap: bool = True  # zero 0/1 buckets start before the step's end (every PP schedule)
    grad_ready: tuple = ((0.0, True),)  # when each chunk's gradients are final (schedule.gradient_ready)
    fsdp_reduce_each: bool = False  # parallel.fsdp_reduce_each_microbatch (no PP): FSDP reduces every micro batch
    compression: str = "none"  # parallel.grad_compression (zero 0/1)
    powersgd_rank: int = 4
    topk_ratio: float = 0.01
    powersgd_start_step: int = 0  # PowerSGD warm-up: plain all-reduce steps (the note says it)
    grad_shapes: tuple = ((), ())  # with compression: (dense, expert) local gradient shapes (TP embedding: replicated)
    async_tp: bool = False  # parallel.async_tp (with SP): per-layer TP collectives fused with their matmuls
    overlap_by_planner: bool = False  # async_tp set by planner.tp_overlap (another stack's TP overlap)
    tp_bwd_overlap: bool = False  # planner.tp_backward_overlap: the column-parallel inputs' backward collectives async
    dist_opt: bool = False  # planner.dp_optimizer distributed: ZeRO-1 reduce-scatters gradients, all-gathers parameters
    fp8_gather_numel: int = 0  # parallel.fp8_all_gather: this rank's Float8-converted weight elements (1 byte each)
    kv_heads: int = 0  # model.kv_heads (GQA); 0 = heads
    # ring CP's windowed layers that exchange only their window's keys: (layers on this rank, the busiest rank's
    # K/V sent and received per forward pass as shares of its local K/V; plan/ringwindow.py exchange_tokens)
    cp_exchange: tuple[int, float, float] = (0, 0.0, 0.0)
    cp_kv: str = "engine"  # planner.cp_kv: "repeated" prices ring / all-gather K/V repeated to the query heads
    pp_blocking: bool = False  # planner.pp_p2p blocking: Megatron's waiting sends, 1/tp of the activation per TP rank
    recompute_whole: bool = False  # planner.full_recompute whole_block: full AC re-runs w2 and its reduction too
    v_shaped: bool = False  # zbv / dualpipev: rank r holds stages r and 2 pp - 1 - r
    trainable_expert: int = 0  # of ``trainable``, EP-sharded ones (LoRA on the experts under EP: their adapters)

    @property
    def grad_params(self) -> tuple[int, int]:
        """(dense, expert) parameters whose gradients are reduced (and, ZeRO-1, broadcast)."""
        if self.trainable < 0:
            return self.params, self.expert_params
        return self.trainable - self.trainable_expert, self.trainable_expert


def fp8_gather_numel(m, layers, tp: int) -> int:
    """Weight elements ``parallel.fp8_all_gather`` gathers as float8 on a rank holding ``layers``:
    the Linears engine/parallel/float8.py converts (every block's q/k/v/o, the dense MLP's
    w1/w2/w3; not the output head, the embedding, norms, biases or MoE experts), split over tp.
    Like plan/flops.py ``fp8_matmul_fraction`` it does not apply the engine's multiple-of-16
    filter (production shapes pass it). The engine's gathered float8 weights are counted in the
    CPU-emulated 4-rank fp8 + TP x FSDP2 case (tests/fp8_tp_check.py)."""
    h, hd = m.hidden, m.head_dim
    attn = 2 * h * m.heads * hd + 2 * h * m.kv_heads * hd
    return sum(attn + (0 if m.is_moe_layer(i) else 3 * h * m.ffn_hidden) for i in layers) // tp


GROUPS = {"tp": ("tp",), "cp": ("cp",), "pp": ("pp",), "ep": ("ep",), "dp_replicate": ("dp_replicate",),
          "fsdp": ("dp_shard", "cp"), "dp_cp": ("dp_replicate", "dp_shard", "cp")}


def group_spans(dims: ParallelDims, placement: Placement, fast: bool = False) -> dict[str, bool]:
    """Whether rank 0's group of each dimension (and of the FSDP / gradient all-reduce groups)
    crosses nodes; groups of size 1 do not."""
    out = {}
    for key, names in GROUPS.items():
        size = dims.ep if key == "ep" else 1
        if key != "ep":
            for name in names:
                size *= dims.degree(name)
        out[key] = size > 1 and spans_nodes(dims, placement, names, fast)
    return out


def compressed_grad_comms(c: CommSpec, shapes: tuple, group: int, lk: Link, what: str) -> list[Comm]:
    """``parallel.grad_compression``: the compressed averaging of ``what``, at the step's end (not
    overlapped with backward: phase ``step``). The steady state: with a PowerSGD warm-up the first
    collective's note says that the first steps send the whole gradient instead."""
    warm = ""
    if c.compression == "powersgd" and c.powersgd_start_step:
        full = 4 * sum(_numel(s) for s in shapes)
        warm = (f"; steady state: the first {c.powersgd_start_step} steps (powersgd_start_step) all-reduce "
                f"the whole fp32 gradient, {full} bytes")
    parts = compressed_grad_bytes(c.compression, shapes, c.powersgd_rank, c.topk_ratio, group)
    return [make("dp", op, group, nbytes, 1, lk, "step", f"{c.compression} {what}: {part}, after backward"
                 + (warm if i == 0 else "")) for i, (op, part, nbytes) in enumerate(parts)]


def step_comms(c: CommSpec, gpu: GPUSpec, spans: dict[str, bool]) -> list[Comm]:
    d = c.dims
    out: list[Comm] = []
    m = c.microbatches

    def lk(key: str) -> Link:
        return link(gpu, spans[key])

    # -- data parallel -------------------------------------------------------------------------------
    dpcp = d.dp * d.cp
    if c.dp_kind == "fsdp":
        shard = d.dp_shard * d.cp
        g = lk("fsdp")
        # EP: the experts are their own FSDP unit on the edp mesh (engine/parallel/data_parallel.py); with edp 1
        # (ep = dp_shard x cp) that unit has one shard: nothing of theirs is gathered or reduce-scattered
        alone = d.ep > 1 and d.edp == 1
        total = c.params + (0 if alone else c.expert_params)
        # zero 3 gathers again for backward, except FSDP2's root unit (embedding, norm, output),
        # which is not resharded after forward
        passes = 1 if d.pp > 1 else (2 * m - m * min(c.root, total) / max(1, total) if c.zero == 3 else m)
        fp8 = min(c.fp8_gather_numel, total)  # parallel.fp8_all_gather: those weights travel as 1-byte float8
        units = max(1, c.layers) + int(c.root > 0)  # FSDP2's units on this rank: one per block, and the root's
        out.append(make("dp", "all-gather", shard, c.e * total - (c.e - 1) * fp8, passes, g, "fsdp-gather",
                        f"{c.e}-byte weights{' (the Float8 Linears: 1-byte)' if fp8 else ''}, {'once per step (pp > 1)' if d.pp > 1 else 'per micro batch' + (' forward and backward' if c.zero == 3 else '')}"))
        out[-1].units = units
        dense_grads, expert_grads = c.grad_params
        grads = dense_grads + (0 if alone else expert_grads)
        r, rname = c.reduce_bytes, "bf16" if c.reduce_bytes == 2 else "fp32"
        # parallel.fsdp_reduce_each_microbatch (no PP): every micro batch; else the last one (engine/step.py)
        reduces = m if c.fsdp_reduce_each and d.pp == 1 else 1
        out.append(make("dp", "reduce-scatter", shard, r * grads, reduces, g, "fsdp-reduce",
                        f"{rname} gradients, {'per' if reduces > 1 else 'last'} micro batch"))
        out[-1].units = units
        if d.dp_replicate > 1:  # (edp 1: the experts' whole gradients)
            out.append(make("dp", "all-reduce", d.dp_replicate, r * (grads / shard + (expert_grads if alone else 0)),
                            reduces, lk("dp_replicate"), "fsdp-reduce", "HSDP: sharded gradients across replicas"))
    elif dpcp > 1:
        g = lk("dp_cp")
        dense, expert = c.grad_params
        r, rname = c.reduce_bytes, "bf16" if c.reduce_bytes == 2 else "fp32"
        overlap = c.grad_overlap

        def grads_comm(group: int, message: float, what: str) -> Comm:
            n = max(1, ceil(message / c.bucket_bytes))
            size = f"{n} bucket(s) of {c.bucket_bytes / 2**20:.3g} MiB"
            if len(c.grad_ready) == 1:
                how = f"{size} during the last backward, the last one exposed"
            elif all(hooked for _, hooked in c.grad_ready):
                how = f"{size} during each chunk's last backward, what outlasts the rank's last one exposed"
            else:  # zero-bubble family: weight passes report no gradients to the hooks (stage 0's do)
                tail = "last one" if c.grad_ready[-1][1] else "whole reduction"
                how = f"{size}, each chunk's after its last weight pass, the last chunk's {tail} exposed"
            if not overlap:
                how = "after the pipeline schedule (not overlapped)"
            op = "reduce-scatter" if c.dist_opt and c.dp_kind == "zero1" else "all-reduce"  # planner.dp_optimizer
            comm = make("dp", op, group, message, 1, g, "step-overlap" if overlap else "step",
                        f"{rname} {what}: {how}")
            comm.bucket_bytes = c.bucket_bytes
            comm.ready = c.grad_ready
            comm.units = n
            return comm

        if c.compression != "none":
            expert_group = d.dp_replicate * d.edp if d.ep > 1 else 0
            for shapes, group, what in ((c.grad_shapes[0], dpcp, "gradients"),
                                        (c.grad_shapes[1], expert_group, "expert gradients over expert-DP")):
                if shapes and group > 1:
                    out += compressed_grad_comms(c, shapes, group, g, what)
        else:
            out.append(grads_comm(dpcp, r * dense, "gradients"))
            if expert and d.dp_replicate * d.edp > 1:
                out.append(grads_comm(d.dp_replicate * d.edp, r * expert, "expert gradients over expert-DP"))
        if c.dp_kind == "zero1" and c.dist_opt:  # planner.dp_optimizer distributed: Megatron-Core's / Apex's
            out.append(make("dp", "all-gather", dpcp, c.e * dense, 1, g, "step",
                            f"ZeRO-1 as a distributed optimizer: updated {c.e}-byte parameters all-gathered "
                            "(planner.dp_optimizer distributed)"))
            out[-1].after_step = True
            if expert and d.dp_replicate * d.edp > 1:
                out.append(make("dp", "all-gather", d.dp_replicate * d.edp, c.e * expert, 1, g, "step",
                                "ZeRO-1 as a distributed optimizer: expert parameters over expert-DP"))
                out[-1].after_step = True
        elif c.dp_kind == "zero1":  # the experts' owners among their expert-DP group (engine/dp_optimizer.py)
            out.append(make("dp", "broadcast", dpcp, 4 * dense, 1, g, "step",
                            "ZeRO-1: owners broadcast updated fp32 parameters"))
            out[-1].after_step = True
            if expert and d.dp_replicate * d.edp > 1:
                out.append(make("dp", "broadcast", d.dp_replicate * d.edp, 4 * expert, 1, g, "step",
                                "ZeRO-1: expert owners broadcast over expert-DP"))
                out[-1].after_step = True

    # -- tensor parallel -------------------------------------------------------------------------------
    if d.tp > 1:
        out += tp_comms(c, lk("tp"))

    # -- pipeline --------------------------------------------------------------------------------------
    if d.pp > 1:
        g = lk("pp")
        full = c.e * c.tokens * c.hidden
        # per micro batch, the busiest rank (module docstring); V-shaped with pp 2: each rank's two stages meet
        # on rank 1 (stages 1 and 2), so each rank sends 2
        sends = 2 if c.v_shaped and d.pp == 2 else 2 * c.chunks - (1 if d.pp == 2 else 0)
        if c.pp_blocking:  # Megatron: each TP rank sends its 1/tp share and waits for it (planner.pp_p2p)
            out.append(make("pp", "p2p", 2, full / d.tp, m * sends, g, "pipeline-blocking",
                            "activations forward, gradients backward; every send waits (planner.pp_p2p blocking)"
                            + (", 1/tp of each per TP rank" if d.tp > 1 else "")))
            if d.tp > 1 and not c.sp:  # scatter/gather: the received shares gathered again over TP
                out.append(make("tp", "all-gather", d.tp, full, m * sends, lk("tp"), "microbatch",
                                "pipeline scatter/gather: each received activation or gradient gathered over TP "
                                "(planner.pp_p2p blocking)"))
        else:
            out.append(make("pp", "p2p", 2, full / (d.tp if c.sp else 1), m * sends, g, "pipeline",
                            "activations forward, gradients backward"))

    # -- context parallel ------------------------------------------------------------------------------
    if d.cp > 1:
        g = lk("cp")
        # local K and V: the rank's kv_heads (the engine repeats them after the exchange), or repeated
        # to the query heads under planner.cp_kv repeated (torchtitan's context_parallel; memory is
        # still priced as the engine's, plan/activations.py)
        kv_heads = c.heads if c.cp_kv == "repeated" or not c.kv_heads else c.kv_heads
        kv = 2 * c.e * c.tokens * (kv_heads // d.tp) * c.head_dim
        fwd = forward_passes(c.recompute)
        if c.cp_method == "ring":
            # cp - 1 ring passes per forward (and recomputed forward), K, V and dK/dV per backward
            # pass, plus the final pass that brings the accumulated dK/dV home; dK/dV travel in the
            # accumulation dtype (fp32 at least: ``grad`` K/V-sized messages each)
            grad = ring_grad_units(c.e)
            ex_layers, sent, received = c.cp_exchange
            if c.layers > ex_layers:
                out.append(make("cp", "p2p", 2, kv, m * (c.layers - ex_layers) * ring_units(d.cp, fwd, grad), g,
                                "cp-ring", "K/V blocks around the ring (backward: K, V and their gradients, then "
                                "dK/dV home)"))
            if ex_layers and sent:  # windowed layers fetching only their window's keys (plan/ringwindow.py use_exchange)
                out.append(make("cp", "p2p", 2, kv * sent, m * ex_layers * (fwd + 1), g, "cp-exchange",
                                "windowed layers: only the K/V the window reads, from their owners (forward and "
                                "again backward); not overlapped"))
            if ex_layers and received:
                out.append(make("cp", "p2p", 2, kv * received * grad, m * ex_layers, g, "cp-exchange",
                                "windowed layers: the received keys' dK/dV back to their owners; not overlapped"))
        elif c.cp_method == "ulysses":
            one = c.e * c.tokens * (c.heads // d.tp) * c.head_dim  # the local q (or out) each rank re-shards
            if (kv_heads // d.tp) % d.cp == 0:  # K/V exchanged with their kv_heads (plan/gqa.py ulysses_kv_split)
                kv_one = c.e * c.tokens * (kv_heads // d.tp) * c.head_dim
                out.append(make("cp", "all-to-all", d.cp, one, m * c.layers * 2 * (fwd + 1), g, "microbatch",
                                "q, output re-sharded from sequence to heads"))
                out.append(make("cp", "all-to-all", d.cp, kv_one, m * c.layers * 2 * (fwd + 1), g, "microbatch",
                                "k, v re-sharded with their kv_heads"))
            else:
                out.append(make("cp", "all-to-all", d.cp, one, m * c.layers * 4 * (fwd + 1), g, "microbatch",
                                "q, k, v (repeated to the query heads), output re-sharded from sequence to heads"))
        else:
            out.append(make("cp", "all-gather", d.cp, kv * d.cp, m * c.layers * fwd, g, "microbatch", "K/V gathered"))
            out.append(make("cp", "reduce-scatter", d.cp, kv * d.cp, m * c.layers, g, "microbatch", "dK/dV"))

    # -- expert parallel -------------------------------------------------------------------------------
    if d.ep > 1 and c.moe_layers:
        g = lk("ep")
        msg = c.e * c.tokens * c.top_k * c.hidden
        fwd = 2 * forward_passes(c.recompute)
        out.append(make("ep", "all-to-all", d.ep, msg, m * c.moe_layers * (fwd + 2), g, "ep",
                        "token dispatch and combine"))
    return out
