"""Model-state memory (parameters, gradients, AdamW states) and working buffers, per rank.

Two accountings live here:

1. :func:`zero_paper_model_state_bytes`, the ZeRO paper's (Rajbhandari et al. 2019,
   arXiv:1910.02054, sec. 3 and Figure 1): mixed-precision Adam keeps ``2 + 2 + K`` bytes per
   parameter (fp16 parameters, fp16 gradients, ``K = 12`` bytes of fp32 master weights, momentum
   and variance); stage 1 (P_os) divides the K part by the data-parallel degree N, stage 2
   (P_os+g) also the gradients, stage 3 (P_os+g+p) everything. Figure 1: 7.5B parameters on
   64 GPUs -> 120, 31.4, 16.6 and 1.9 GB.

2. What **this engine** allocates, which :func:`model_state_bytes` reproduces exactly (the
   test compares it with ``_local_tensor`` bytes of a real run):

   - parameters are always fp32 (4 bytes). With ``precision: bf16`` the engine does not keep
     a persistent bf16 copy: zero 0/1 run the forward under ``torch.autocast`` (which casts
     each weight to bf16 once per forward), zero 2/3 use FSDP2's
     ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``, which keeps fp32 *sharded*
     parameters and all-gathers bf16 copies for compute. Those bf16 copies are working
     buffers (:func:`param_buffer_bytes`), not model state.
   - gradients are fp32 (4 bytes) in every mode: autocast leaves them in the parameters'
     dtype, FSDP2 reduce-scatters in ``reduce_dtype`` fp32 into fp32 sharded gradients.
   - AdamW (``fused``) keeps ``exp_avg`` and ``exp_avg_sq`` in fp32 (8 bytes per element)
     plus a 4-byte fp32 ``step`` tensor per parameter.
   So the engine's bf16 model state is 4 + 4 + 8 = 16 bytes per parameter (the paper's 2 + 2 +
   12 = 16 too, split differently: no fp16 parameter copy, fp32 gradients instead of fp16).
   ZeRO-2 (FSDP2 with ``reshard_after_forward=False``) and ZeRO-3 shard all three; ZeRO-1
   (:mod:`llmtrain.engine.parallel.zero1`) shards only the AdamW states, by whole parameters.
   - LoRA: frozen parameters (``ParamShape.trainable`` False) are stored and sharded like the
     others (fp32, FSDP2 shards them too) but have no gradient and are not in the optimizer, so
     they cost 4 bytes per element; the adapters cost the full 16. ZeRO-1's greedy partition
     runs over the trainable parameters only (the engine's optimizer never sees the others).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, replace
from functools import lru_cache

from llmtrain.plan.comm import fp8_gather_numel
from llmtrain.plan.dims import ParallelDims
from llmtrain.plan.dp_shards import fsdp_local_numel, fsdp_numel, zero1_loads
from llmtrain.plan.shards import ParamShape
from llmtrain.recipe.schema import Recipe, bf16_compute

FP32 = 4
ADAM_BYTES = 8  # exp_avg + exp_avg_sq, fp32
STEP_BYTES = 4  # AdamW's fp32 step tensor, one per parameter
Q8_BLOCK, Q8_MIN_NUMEL, Q8_QMAP = 256, 4096, 256  # torchao AdamW8bit: block, smallest quantized tensor, code map


def q8_quantized(local_numel: int) -> bool:
    """Whether torchao's AdamW8bit quantizes the moments of a shard of ``local_numel`` elements."""
    return local_numel >= Q8_MIN_NUMEL and local_numel % Q8_BLOCK == 0


def moment_bytes(local_numel: int, states: str) -> int:
    """exp_avg + exp_avg_sq bytes of one parameter shard (``train.optimizer.states``,
    engine/quant_optim.py): fp32 8 per element, bf16 4, 8bit (when quantized) uint8 codes + one
    fp32 scale per 256-element block + a 256-entry fp32 code map, per moment."""
    if states == "bf16":
        return 4 * local_numel
    if states == "8bit" and q8_quantized(local_numel):
        return 2 * (local_numel + FP32 * (local_numel // Q8_BLOCK) + FP32 * Q8_QMAP)
    return ADAM_BYTES * local_numel
ALLREDUCE_BUCKET = 25 << 20  # the default of parallel.dp_bucket_mb (a caller passes the recipe's)


def zero_paper_model_state_bytes(params: float, gpus: int, stage: int, k: int = 12) -> float:
    """Model-state bytes per GPU as in the ZeRO paper: (2 + 2 + K) Psi split by stage."""
    n = max(1, gpus)
    if stage == 0:
        return (2 + 2 + k) * params
    if stage == 1:
        return (2 + 2) * params + k * params / n
    if stage == 2:
        return 2 * params + (2 + k) * params / n
    if stage == 3:
        return (2 + 2 + k) * params / n
    raise ValueError(f"ZeRO stage {stage} is not 0-3")


@dataclass(frozen=True)
class DPMode:
    """How the engine treats data parallelism for a layout (``engine/parallelize.uses_fsdp``,
    ``engine/dp_optimizer.build_optimizer``).

    A data-parallel rank is identified by its index ``j`` in the flattened ``dp_cp`` mesh
    ``(dp_replicate, dp_shard, cp)``; within one replica its ``dp_shard x cp`` index is
    ``j % slice`` and, with EP, its expert-data-parallel index is ``(j % slice) // ep``
    (:meth:`ParallelDims.ep_rank` / ``edp_group``).
    """

    kind: str  # "plain" (one rank, or DDP: zero 0), "zero1", "fsdp"
    group: int  # dp x cp: ranks that average the dense gradients
    slice: int  # dp_shard x cp: FSDP shards the dense weights over it
    replicate: int  # dp_replicate
    ep: int
    reshard_after_forward: bool = False

    @property
    def edp(self) -> int:
        return max(1, self.slice // self.ep)

    @property
    def shards(self) -> int:
        """Ranks that split the dense state (FSDP: dp_shard x cp, ZeRO-1: dp x cp, else 1)."""
        return {"fsdp": self.slice, "zero1": self.group}.get(self.kind, 1)

    @property
    def label(self) -> str:
        return {"plain": "replicated", "zero1": f"ZeRO-1 over {self.group}", "fsdp": f"FSDP over {self.slice}"}[self.kind]

    def dense_index(self, j: int) -> int:
        return j % self.slice if self.kind == "fsdp" else j

    def expert_index(self, j: int) -> int:
        """Index among the ranks sharing the EP-local experts (FSDP: edp; ZeRO-1: dp_replicate x edp)."""
        inner = (j % self.slice) // self.ep
        return inner if self.kind == "fsdp" else (j // self.slice) * self.edp + inner

    @property
    def expert_shards(self) -> int:
        return self.edp if self.kind == "fsdp" else self.replicate * self.edp


def dp_mode(zero: int, dims: ParallelDims) -> DPMode:
    dpcp = dims.dp * dims.cp
    kind = "fsdp" if zero >= 2 and dpcp > 1 else "zero1" if zero == 1 and dpcp > 1 else "plain"
    return DPMode(kind, dpcp, dims.dp_shard * dims.cp, dims.dp_replicate, dims.ep,
                  kind == "fsdp" and zero == 3 and dims.pp == 1)


@dataclass(frozen=True)
class StateBytes:
    params: int
    grads: int
    optimizer: int
    local_numel: int  # parameter elements this rank stores
    full_numel: int  # parameter elements of its stages (TP/EP-local, before DP sharding)
    stepped: int  # parameter elements whose AdamW update this rank computes
    trainable_numel: int = -1  # trainable elements of its stages (before DP sharding); -1 = full_numel

    @property
    def trainable(self) -> int:
        return self.full_numel if self.trainable_numel < 0 else self.trainable_numel


def _zero1(numels: tuple[int, ...], ranks: int, index: int) -> tuple[int, int]:
    return zero1_loads(numels, ranks)[index] if numels else (0, 0)


@lru_cache(maxsize=4096)
def _extremes(sizes: tuple[int, ...], ranks: int) -> tuple[int, int]:
    """(most, least) loaded ZeRO-1 owner: optimizer bytes, ties to the lowest rank."""
    loads = zero1_loads(sizes, ranks) if sizes else [(0, 0)]
    key = [ADAM_BYTES * a + STEP_BYTES * b for a, b in loads]
    worst = max(range(len(key)), key=lambda r: (key[r], -r))
    best = min(range(len(key)), key=lambda r: (key[r], r))
    return worst, best


@dataclass(frozen=True)
class _Split:
    full: int  # elements
    grads: int  # gradient elements (trainable parameters only; the TP embedding's replicated gradient)
    dense: tuple[ParamShape, ...]  # all non-expert parameters (stored)
    experts: tuple[ParamShape, ...]  # EP-sharded experts (stored)
    t_full: int  # trainable elements
    t_count: int  # trainable parameters (one AdamW step tensor each)
    t_dense: tuple[ParamShape, ...]  # trainable non-expert parameters (gradients, AdamW states)
    t_experts: tuple[ParamShape, ...]


@lru_cache(maxsize=4096)
def _split(params: tuple[ParamShape, ...]) -> _Split:
    """The stage's parameters by kind and by trainability, cached (without LoRA every parameter is
    trainable and the trainable tuples are the same objects, so the shard caches stay shared)."""
    dense = tuple(p for p in params if p.kind != "expert")
    experts = tuple(p for p in params if p.kind == "expert")
    trainable = [p for p in params if p.trainable]
    t_dense, t_experts = dense, experts
    if len(trainable) != len(params):
        t_dense = tuple(p for p in dense if p.trainable)
        t_experts = tuple(p for p in experts if p.trainable)
    return _Split(sum(p.numel for p in params), sum(p.numel for p in trainable), dense, experts,
                  sum(p.numel for p in trainable), len(trainable), t_dense, t_experts)


@lru_cache(maxsize=4096)
def _sizes(params: tuple[ParamShape, ...]) -> tuple[int, ...]:
    return tuple(sorted((p.numel for p in params), reverse=True))


def _zero1_owned(sizes: tuple[int, ...], ranks: int, index: int) -> list[int]:
    """The parameter sizes owner ``index`` gets under the greedy partition of ``zero1_loads``."""
    load = [(0, r) for r in range(ranks)]
    heapq.heapify(load)
    mine = []
    for n in sizes:
        current, r = heapq.heappop(load)
        if r == index:
            mine.append(n)
        heapq.heappush(load, (current + n, r))
    return mine


def quantized_optimizer_bytes(params: tuple[ParamShape, ...], mode: DPMode, j: int, states: str) -> int:
    """Optimizer bytes of dp_cp index ``j`` for bf16 / 8bit moments: per parameter shard (8bit
    quantizes by the LOCAL shard's size), plus the 4-byte step tensor of each parameter."""
    sp = _split(params)
    if mode.kind == "fsdp":
        d, e = mode.dense_index(j), mode.expert_index(j)
        shards = [fsdp_numel(p, mode.slice, d) for p in sp.t_dense] + [fsdp_numel(p, mode.edp, e) for p in sp.t_experts]
    elif mode.kind == "zero1":
        shards = _zero1_owned(_sizes(sp.t_dense), mode.group, mode.dense_index(j)) + \
            _zero1_owned(_sizes(sp.t_experts), mode.expert_shards, mode.expert_index(j))
    else:
        shards = [p.numel for p in sp.t_dense + sp.t_experts]
    return sum(moment_bytes(n, states) + STEP_BYTES for n in shards)


def model_state_bytes(params: list[ParamShape] | tuple[ParamShape, ...], mode: DPMode, j: int = 0,
                      states: str = "fp32") -> StateBytes:
    """Exact parameter / gradient / AdamW bytes of the rank with ``dp_cp`` index ``j``.

    EP-sharded experts (``kind == "expert"``) are data-parallel over their own group: FSDP over
    edp (a separate FSDP unit), ZeRO-1 a separate optimizer over dp_replicate x edp.
    """
    if states != "fp32":  # bf16 / 8bit moments (train.optimizer.states): per-shard byte rule
        sb = model_state_bytes(params, mode, j)
        return replace(sb, optimizer=quantized_optimizer_bytes(tuple(params), mode, j, states))
    params = tuple(params)
    sp = _split(params)
    full, grads, t_full = sp.full, sp.grads, sp.t_full
    if mode.kind == "fsdp":
        d, e = mode.dense_index(j), mode.expert_index(j)
        local = fsdp_local_numel(sp.dense, mode.slice, d) + fsdp_local_numel(sp.experts, mode.edp, e)
        t_local = local if sp.t_dense is sp.dense and sp.t_experts is sp.experts else \
            fsdp_local_numel(sp.t_dense, mode.slice, d) + fsdp_local_numel(sp.t_experts, mode.edp, e)
        return StateBytes(FP32 * local, FP32 * t_local, ADAM_BYTES * t_local + STEP_BYTES * sp.t_count, local, full,
                          t_local, t_full)
    if mode.kind == "zero1":
        owned, count = _zero1(_sizes(sp.t_dense), mode.group, mode.dense_index(j))
        e_owned, e_count = _zero1(_sizes(sp.t_experts), mode.expert_shards, mode.expert_index(j))
        owned, count = owned + e_owned, count + e_count
        return StateBytes(FP32 * full, FP32 * grads, ADAM_BYTES * owned + STEP_BYTES * count, full, full, owned, t_full)
    return StateBytes(FP32 * full, FP32 * grads, ADAM_BYTES * t_full + STEP_BYTES * sp.t_count, full, full, t_full,
                      t_full)


def master_params(recipe: Recipe) -> bool:
    """Whether ``planner.param_memory: master`` applies: a zero 0 / 1 stack computing in bf16 / fp8
    (another stack's mixed precision; FSDP keeps fp32 shards, fp32 compute has no copy to master)."""
    return recipe.planner.param_memory == "master" and recipe.parallel.zero <= 1 and bf16_compute(recipe.train.precision)


def torch_ddp_grads(recipe: Recipe) -> bool:
    """Whether ``planner.torch_ddp_buckets`` applies: torch's DDP is zero 0, its copies are in the compute dtype."""
    return recipe.planner.torch_ddp_buckets and recipe.parallel.zero == 0 and bf16_compute(recipe.train.precision)


def master_weight_state(sb: StateBytes, e: int) -> StateBytes:
    """``planner.param_memory: master`` (another stack's mixed precision, zero 0 / 1): the parameters
    in the compute dtype (``e`` bytes) instead of fp32, and an fp32 master copy of every element
    this rank steps beside its moments (Megatron-LM's ``fp32_from_float16_groups``, Megatron-Core's
    distributed optimizer: sharded as the moments). Gradients as counted (fp32: Megatron's
    ``main_grad``)."""
    return replace(sb, params=e * sb.local_numel, optimizer=sb.optimizer + FP32 * sb.stepped)


def torch_ddp_bucket_state(sb: StateBytes, e: int) -> StateBytes:
    """``planner.torch_ddp_buckets`` (zero 0): torch's DDP without ``gradient_as_bucket_view`` holds
    every gradient twice in the compute dtype (``e`` bytes), the parameter's ``.grad`` and its flat
    bucket, beside the fp32 gradients counted already (Megatron-LM 2021's main gradients). At zero 0
    nothing is DP-sharded, so the gradient elements are the stages' trainable elements."""
    return replace(sb, grads=sb.grads + 2 * e * sb.trainable)


def worst_dp_index(params: list[ParamShape], mode: DPMode) -> int:
    """The ``dp_cp`` index with the most model state (FSDP: 0, the largest shards; ZeRO-1: the most
    loaded owner, found among the dense owners of replica 0)."""
    if mode.kind != "zero1":
        return 0
    return _extremes(_sizes(_split(tuple(params)).t_dense), mode.group)[0]


def best_dp_index(params: list[ParamShape], mode: DPMode) -> int:
    """The ``dp_cp`` index with the least model state (FSDP: the last shard)."""
    if mode.kind == "fsdp":
        return mode.slice - 1
    if mode.kind != "zero1":
        return 0
    return _extremes(_sizes(_split(tuple(params)).t_dense), mode.group)[1]


def compute_bytes(precision: str) -> int:
    return 2 if bf16_compute(precision) else 4


# ---- working buffers ("other") --------------------------------------------------------------------
def fp8_unsharded_numel(m, layers, tp: int) -> tuple[int, int]:
    """(every held block, the smallest block share) of weight elements that FSDP2 holds unsharded as
    float8 under ``parallel.fp8_all_gather``: the converted Linears (plan/comm.py ``fp8_gather_numel``:
    attention q/k/v/o, the dense MLP; MoE blocks only their attention), split over tp. The second is
    the least of any held block, so subtracting it from the largest block's bytes never undercounts
    (exact when all held blocks are alike)."""
    if not layers:
        return 0, 0
    return fp8_gather_numel(m, layers, tp), min(fp8_gather_numel(m, [i], tp) for i in layers)


def param_buffer_bytes(total: int, matmul: int, mode: DPMode, precision: str, largest_block: int, root_numel: int,
                       recompute: str, fp8: tuple[int, int] = (0, 0)) -> int:
    """Compute copies of the weights that live during forward/backward.

    - zero 0/1, bf16: autocast's bf16 copy of every matmul weight, saved for backward. We count
      ONE copy of the rank's weights (as Megatron's bf16 parameters); autocast re-casts per
      microbatch, so a pipeline engine that keeps several microbatches in flight must cast once
      per step to stay at this number. With recomputation the casts are redone in backward and
      only one block's copy is alive at a time. fp32: none.
    - FSDP, parameters not resharded after forward (zero 2, or zero 3 with pp > 1): the unsharded
      ``param_dtype`` copy of every parameter of the rank, from the first forward to the end of
      backward.
    - FSDP zero 3 (pp = 1): the current and the prefetched block, plus the root module
      (embedding, final norm, output), which the engine never reshards after forward.
    - ``parallel.fp8_all_gather`` (``fp8`` = :func:`fp8_unsharded_numel`): a Float8 Linear's unsharded
      weight is the all-gathered float8 data itself, 1 byte per element (torchao's
      ``fsdp_post_all_gather`` wraps it in a ``Float8TrainingTensor`` with its scale). No bf16 copy
      exists: the forward matmul takes it as already cast, and ``Float8Linear`` saves that same
      tensor for backward. Without the option the unsharded weight is bf16 (2 bytes) and the FP8
      cast per matmul is transient (torchao saves the bf16 weight and casts again in backward), so
      the 2-byte count stands. Transients not counted either way: FSDP2's flat all-gather output
      (freed after the copy-out) and, on CUDA, the column-major FP8 copy of one weight that
      ``_scaled_mm`` needs for the input gradient.
    """
    e = compute_bytes(precision)
    if mode.kind == "fsdp":
        fp8_all, fp8_block = fp8
        if not mode.reshard_after_forward:
            return e * total - (e - 1) * fp8_all
        return e * (2 * largest_block + root_numel) - (e - 1) * 2 * fp8_block
    if not bf16_compute(precision):
        return 0
    return e * (matmul if recompute == "none" else largest_block)


def grad_buffer_bytes(total: int, mode: DPMode, precision: str, largest_block: int, grad_accum: int,
                      bucket_bytes: int = ALLREDUCE_BUCKET, pp: int = 1, reduce_each: bool = False) -> int:
    """Gradient working memory beyond the persistent (sharded) gradients.

    - FSDP: a block's unsharded gradient in ``param_dtype`` plus its fp32 reduce-scatter input.
      With gradient accumulation the engine skips the reduce-scatter on the first
      ``grad_accum - 1`` micro batches (``set_requires_gradient_sync(False)``), and FSDP2 then
      keeps an **unsharded fp32 gradient of every parameter** of the rank until the last one
      (``FSDPParam.unsharded_accumulated_grad``) — unless ``reduce_each``
      (``parallel.fsdp_reduce_each_microbatch``, engine/step.py): then nothing. With PP torch's
      schedule always delays the reduction (``set_requires_gradient_sync(False)`` on every
      backward, then ``perform_reduce_grad``), whatever the setting.
    - zero 0/1: the bucketed all-reduce (engine/parallel/grad_buckets.py) holds a flat copy of
      each bucket in flight (``parallel.dp_bucket_mb``, fp32; capped by the gradient itself);
      counted as one: the earlier buckets' copies are freed as their reductions complete.
    """
    if mode.kind == "fsdp":
        working = (compute_bytes(precision) + FP32) * largest_block
        if pp > 1 or (grad_accum > 1 and not reduce_each):
            working += FP32 * total
        return working
    return min(bucket_bytes, FP32 * total) if mode.group > 1 else 0


def optimizer_step_bytes(mode: DPMode, params_numel: int) -> int:
    """Transient memory of the optimizer step beyond the states: ZeRO-1's flat broadcast copy of one
    owner's parameters. The engine's AdamW is torch's fused one (engine/optim.py ``fused=True``),
    which updates in place with no per-element temporary (foreach AdamW's ``sqrt(v)`` list, one fp32
    temporary per stepped element, was counted here until the twenty-sixth session: measured on CPU,
    tests/test_peak_memory.py, and in the GPU record's full-AC row, the step adds nothing); torchao's
    low-bit states step one parameter at a time."""
    return FP32 * -(-params_numel // mode.group) if mode.kind == "zero1" else 0
