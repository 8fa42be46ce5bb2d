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
   - AdamW (``foreach``) keeps ``exp_avg`` and ``exp_avg_sq`` in fp32 (8 bytes per element)
     plus a 4-byte fp32 ``step`` tensor per parameter.
   So the engine's bf16 model state is 4 + 4 + 8 = 16 bytes per parameter (the paper's 2 + 2 +
   12 = 16 too, split differently: no fp16 parameter copy, fp32 gradients instead of fp16).
   ZeRO-2 (FSDP2 with ``reshard_after_forward=False``) and ZeRO-3 shard all three; ZeRO-1
   (:mod:`llmtrain.engine.parallel.zero1`) shards only the AdamW states, by whole parameters.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmtrain.plan.dims import ParallelDims
from llmtrain.plan.shards import ParamShape, fsdp_numel, zero1_loads

FP32 = 4
ADAM_BYTES = 8  # exp_avg + exp_avg_sq, fp32
STEP_BYTES = 4  # AdamW's fp32 step tensor, one per parameter
ALLREDUCE_BUCKET = 32 << 20  # GradientAllReduce(bucket_bytes=32 MiB): one flat copy in flight


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
    """How the engine treats data parallelism for a layout (see ``engine/parallelize.uses_fsdp``)."""

    kind: str  # "plain" (one rank or DDP, zero 0), "zero1", "fsdp"
    shards: int  # ranks that split the state: FSDP dp_shard x cp, ZeRO-1 dp x cp, plain 1
    expert_shards: int  # the same for EP-sharded expert weights
    reshard_after_forward: bool
    group: int = 1  # data x context-parallel ranks (dp x cp) that average gradients

    @property
    def label(self) -> str:
        return {"plain": "replicated", "zero1": f"ZeRO-1 over {self.shards}", "fsdp": f"FSDP over {self.shards}"}[self.kind]


def dp_mode(zero: int, dims: ParallelDims) -> DPMode:
    dpcp = dims.dp * dims.cp
    if zero >= 2 and dpcp > 1:
        shards = dims.dp_shard * dims.cp
        return DPMode("fsdp", shards, max(1, shards // dims.ep), zero == 3 and dims.pp == 1, dpcp)
    if zero == 1 and dpcp > 1:
        return DPMode("zero1", dpcp, max(1, dpcp // dims.ep), False, dpcp)
    return DPMode("plain", 1, 1, False, dpcp)


@dataclass(frozen=True)
class StateBytes:
    params: int
    grads: int
    optimizer: int
    local_numel: int  # parameter elements this rank stores
    full_numel: int  # parameter elements of its stages (TP/EP-local, before DP sharding)
    stepped: int  # parameter elements whose AdamW update this rank computes


def model_state_bytes(params: list[ParamShape], mode: DPMode, index: int = 0) -> StateBytes:
    """Exact parameter / gradient / AdamW bytes of data-parallel rank ``index`` (0 = the largest shard)."""
    full = sum(p.numel for p in params)
    count = len(params)
    if mode.kind == "fsdp":
        local = 0
        for p in params:
            if p.kind == "expert":  # EP is not in the engine yet: assume an even split (torchtitan shards
                local += -(-p.numel // mode.expert_shards)  # experts on dim 1 when dim 0 is too short)
            else:
                local += fsdp_numel(p, mode.shards, index % mode.shards)
        return StateBytes(FP32 * local, FP32 * local, ADAM_BYTES * local + STEP_BYTES * count, local, full, local)
    if mode.kind == "zero1":
        dense = [p.numel for p in params if p.kind != "expert"]
        owned, owned_count = zero1_loads(dense, mode.shards)[index % mode.shards]
        experts = [p.numel for p in params if p.kind == "expert"]
        if experts:  # EP is not in the engine yet: expert states split evenly over expert-DP ranks
            owned += sum(experts) // mode.expert_shards
            owned_count += len(experts)
        return StateBytes(FP32 * full, FP32 * full, ADAM_BYTES * owned + STEP_BYTES * owned_count, full, full, owned)
    return StateBytes(FP32 * full, FP32 * full, ADAM_BYTES * full + STEP_BYTES * count, full, full, full)


def worst_dp_index(params: list[ParamShape], mode: DPMode) -> int:
    """The data-parallel index with the most model state (FSDP: 0; ZeRO-1: the most loaded owner)."""
    if mode.kind != "zero1":
        return 0
    loads = zero1_loads([p.numel for p in params if p.kind != "expert"], mode.shards)
    return max(range(len(loads)), key=lambda r: (ADAM_BYTES * loads[r][0] + STEP_BYTES * loads[r][1], -r))


def best_dp_index(params: list[ParamShape], mode: DPMode) -> int:
    """The data-parallel index with the least model state (FSDP: the last shard)."""
    if mode.kind == "fsdp":
        return mode.shards - 1
    if mode.kind != "zero1":
        return 0
    loads = zero1_loads([p.numel for p in params if p.kind != "expert"], mode.shards)
    return min(range(len(loads)), key=lambda r: (ADAM_BYTES * loads[r][0] + STEP_BYTES * loads[r][1], r))


def compute_bytes(precision: str) -> int:
    return 2 if precision == "bf16" else 4


# ---- working buffers ("other") --------------------------------------------------------------------
def param_buffer_bytes(params: list[ParamShape], mode: DPMode, precision: str, largest_block: int,
                       root_numel: int, recompute: str) -> int:
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
    """
    e = compute_bytes(precision)
    matmul = sum(p.numel for p in params if p.kind in ("matmul", "expert"))
    if mode.kind == "fsdp":
        if not mode.reshard_after_forward:
            return e * sum(p.numel for p in params)
        return e * (2 * largest_block + root_numel)
    if precision != "bf16":
        return 0
    return e * (matmul if recompute == "none" else largest_block)


def grad_buffer_bytes(params: list[ParamShape], mode: DPMode, precision: str, largest_block: int,
                      grad_accum: int) -> int:
    """Gradient working memory beyond the persistent (sharded) gradients.

    - FSDP: a block's unsharded gradient in ``param_dtype`` plus its fp32 reduce-scatter input.
      With gradient accumulation the engine skips the reduce-scatter on the first
      ``grad_accum - 1`` microbatches (``set_requires_gradient_sync``), and FSDP2 then keeps an
      **unsharded fp32 gradient of every parameter** of the rank until the last microbatch
      (``FSDPParam.unsharded_accumulated_grad``).
    - zero 0/1: the gradient all-reduce copies at most one 32 MiB bucket into a flat buffer.
    """
    if mode.kind == "fsdp":
        working = (compute_bytes(precision) + FP32) * largest_block
        if grad_accum > 1:
            working += FP32 * sum(p.numel for p in params)
        return working
    return ALLREDUCE_BUCKET if mode.group > 1 else 0


def optimizer_step_bytes(stepped_numel: int, mode: DPMode, params_numel: int) -> int:
    """Transient memory of the optimizer step: foreach AdamW's ``sqrt(v)`` intermediate (one fp32
    temporary per stepped element, ``torch.optim.adamw._multi_tensor_adamw``) and, for ZeRO-1, the
    flat broadcast copy of one owner's parameters."""
    extra = FP32 * stepped_numel
    if mode.kind == "zero1":
        extra += FP32 * -(-params_numel // mode.shards)
    return extra
