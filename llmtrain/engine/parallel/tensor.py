"""Tensor parallelism (Megatron-style) with optional sequence parallelism, via DTensor.

Per block: ``wq/wk/wv`` and the MLP's ``w1/w3`` are column-parallel (heads / ffn split over
tp), ``wo`` and ``w2`` row-parallel (their partial sums reduced). With sequence parallelism the
residual stream between those regions stays split along the sequence (dim 1): the norms run
on sequence shards (``SequenceParallel``), the all-reduce of the row-parallel output becomes
a reduce-scatter, and the column-parallel input an all-gather — same communication volume,
1/tp of the norm activations. The embedding is row-parallel over the vocabulary; the output
layer is column-parallel over the vocabulary and its logits stay sharded for the
vocabulary-parallel cross-entropy (``loss_parallel``): the full [tokens, vocab] logits are
never materialized on one rank.

Family switches: q/k/v biases (Qwen2) are split with their column-parallel weights (the
styles shard ``bias`` like the output rows). Qwen3's per-head ``q_norm``/``k_norm`` see the local
heads ``[b, s, heads / tp, head_dim]``; they are ``SequenceParallel(sequence_dim=2)``: the weight
becomes a replicated DTensor and the input is declared sharded on the head dim, so the weight's
gradient (a sum over all heads) is reduced over the TP ranks, as torchtitan does for Qwen3. OLMo 2's
q/k norms over all heads are split with the heads (``Shard(0)`` weights, the squares summed over the
TP group: :func:`_split_norms`).

FP8 (``train.precision: fp8``): the Linears are already torchao ``Float8Linear`` s here (converted
before TP, engine/parallel/float8.py), and each converted one gets torchao's
``Float8ColwiseParallel`` / ``Float8RowwiseParallel``: same weight sharding, but the input is cast
to float8 (tensorwise, the amax all-reduced over the DTensor) before any redistribution and the
output's gradient is cast in backward. A region's input preparation (``PrepareFloat8ModuleInput``)
casts once for wq/wk/wv (w1/w3) when all of them are converted, so SP all-gathers the FP8
activation; if any of them is not (LoRA targets, odd sizes), the plain preparation is kept and
each converted projection casts its own input. Embedding, output head and norms keep plain styles.

MoE blocks are expert-tensor-parallel (:func:`~llmtrain.engine.parallel.expert.apply_expert_tensor_parallel`):
each routed and shared expert is split over tp like the dense MLP and the block is one TP region
(input gathered / copied, partial outputs summed after the combine), so expert memory and FLOPs
are divided by tp. The decision and its measurement are in :mod:`llmtrain.engine.parallel.expert`.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from llmtrain.engine.parallel.data_parallel import in_param_layout
from llmtrain.engine.parallel.expert import apply_expert_tensor_parallel
from llmtrain.engine.parallel.float8 import float8_tp_styles, is_float8_linear


def _styles(*linears: nn.Module) -> tuple[type, type, type]:
    """(colwise, rowwise, prepare-input) styles for a TP region whose inputs feed ``linears``:
    torchao's Float8 styles when every one of them is a ``Float8Linear`` (the input is then cast
    to FP8 once, before the sequence-parallel all-gather), the plain ones otherwise (a plain
    Linear must never receive an FP8 input)."""
    if linears and all(is_float8_linear(m) for m in linears):
        return float8_tp_styles()
    return ColwiseParallel, RowwiseParallel, PrepareModuleInput


def _split_norms(attn: nn.Module, tp_mesh: DeviceMesh) -> None:
    """OLMo 2's q/k norms over all heads under TP (engine/models/norm.py ``SplitRMSNorm``): each weight
    becomes a ``Shard(0)`` DTensor (rank r holds the features of its heads, like wq's / wk's rows) and
    the norm sums its squares over the TP group."""
    for norm in (attn.q_norm, attn.k_norm):
        full = norm.weight.shape[0]
        norm.weight = nn.Parameter(distribute_tensor(norm.weight.detach(), tp_mesh, [Shard(0)], src_data_rank=None))
        norm.group, norm.full = tp_mesh.get_group(), full


def _col(linear: nn.Module, **kw) -> ColwiseParallel:
    return _styles(linear)[0](**kw)


def _row(linear: nn.Module, **kw) -> RowwiseParallel:
    return _styles(linear)[1](**kw)


def keep_embedding_grad_sharded(model: nn.Module) -> None:
    """Keep the vocabulary-parallel embedding's gradient in the weight's own layout (Shard(0)).

    DTensor's embedding backward (torch 2.13) returns the gradient of the row-sharded weight
    Replicate: the full ``[vocab, hidden]`` on every TP rank, accumulated over the micro batches,
    all-reduced over DP at that size and held through the optimizer step (405B at TP 8: 8.4 GB of
    fp32 per rank where 1/8 of it is the rank's). A hook on the weight brings each gradient to the
    weight's placements (Replicate -> Shard(0): a local copy of the rank's rows, no
    communication), so only the full tensor of one backward exists, briefly. Without FSDP only:
    FSDP2 replaces the parameter and reduce-scatters its gradient itself. Tied without PP, the hook
    sees the sum of both uses (one Parameter); with PP the last stage's copy is synchronised
    after backward (:mod:`llmtrain.engine.parallel.tied`), by then already in this layout."""
    emb = getattr(model, "tok_embeddings", None)
    weight = getattr(emb, "weight", None)
    if not isinstance(weight, DTensor) or not weight.requires_grad:
        return

    weight.register_hook(lambda grad: in_param_layout(grad, weight))


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool, loss_parallel: bool) -> None:
    sp = sequence_parallel
    stream = Shard(1) if sp else Replicate()  # layout of the residual stream between regions
    root_plan = {}
    if model.tok_embeddings is not None:
        root_plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=stream)
    if model.norm is not None and sp:
        root_plan["norm"] = SequenceParallel()
    if model.output is not None:
        root_plan["output"] = ColwiseParallel(
            input_layouts=stream,
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        )
    parallelize_module(model, tp_mesh, root_plan)

    for block in model.layers.values():
        attn, mlp = block.attention, getattr(block, "feed_forward", None)
        plan = {
            "attention.wq": _col(attn.wq),
            "attention.wk": _col(attn.wk),
            "attention.wv": _col(attn.wv),
            "attention.wo": _row(attn.wo, output_layouts=stream),
        }
        # The attention's (and the MLP's) input enters as one Replicate DTensor, so the input
        # gradients of wq/wk/wv (w1/w3) add up as Partial DTensors and are reduced once at that
        # boundary: one all-reduce (SP: reduce-scatter) per region backward instead of one per
        # column-parallel layer (measured by benchmarks/planner_fidelity.py: 7 -> 4 per layer).
        plan["attention"] = _styles(attn.wq, attn.wk, attn.wv)[2](input_layouts=(stream, None, None),
                                                                  desired_input_layouts=(Replicate(), None, None))
        if getattr(attn, "qk_norm_all", False):  # OLMo 2: over all heads; each rank holds heads / tp of them
            _split_norms(attn, tp_mesh)
        elif getattr(block.attention, "q_norm", None) is not None:
            plan["attention.q_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
            plan["attention.k_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
        if sp and getattr(block, "attention_norm", None) is not None:  # OLMo 2 has no input norms
            plan.update({
                "attention_norm": SequenceParallel(),
                "ffn_norm": SequenceParallel(),
            })
        if sp and getattr(block, "attention_post_norm", None) is not None:
            # the norms on the branch outputs (Gemma 2/3 with input norms, OLMo 2 without), which wo / w2
            # reduce-scatter (SP): each rank normalizes its sequence shard, so the weight's gradient is a sum
            # over the TP group that SequenceParallel's replicated DTensor weight reduces (a plain weight here
            # would update each TP rank from its own shard's part); local outputs: the residual add takes
            # plain tensors
            plan["attention_post_norm"] = SequenceParallel(use_local_output=True)
            plan["ffn_post_norm"] = SequenceParallel(use_local_output=True)
        if getattr(block, "moe", None) is not None:
            apply_expert_tensor_parallel(block.moe, tp_mesh, sequence_parallel=sp)
        else:
            plan.update({
                "feed_forward.w1": _col(mlp.w1),
                "feed_forward.w3": _col(mlp.w3),
                "feed_forward.w2": _row(mlp.w2, output_layouts=stream),
            })
            plan["feed_forward"] = _styles(mlp.w1, mlp.w3)[2](input_layouts=(stream,),
                                                              desired_input_layouts=(Replicate(),))
        parallelize_module(block, tp_mesh, plan)

