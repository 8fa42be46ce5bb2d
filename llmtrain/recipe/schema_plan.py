"""The recipe's ``planner`` section: settings that change what ``llmtrain plan`` prices, never what runs.

Why a section of its own: every other key describes a run the bundled engine executes. These
keys describe a *different* stack's behaviour so that a published run (Megatron-Core, Meta's
Llama 3 stack) can be written as a recipe and planned with the CLI (benchmarks/published/,
docs/planner.md section 7). The engine ignores them; ``plan`` says, next to each collective it
prices under such an assumption, that it did (plan/steptime.py).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from llmtrain.recipe.schema_base import Strict


class PlannerConfig(Strict):
    """Planner-only assumptions (the engine ignores them): price another stack's overlap and kernels."""

    assume_dp_overlap: bool = Field(
        False, description="Planner only; the bundled engine does not do this. Price the zero 0/1 data-parallel "
                           "communication as Megatron-Core's overlap_grad_reduce + overlap_param_gather do: all but the "
                           "last gradient bucket hidden behind the backward also under PP (not chunk by chunk as the "
                           "engine's buckets), and ZeRO-1's parameter broadcast hidden behind the next forward (the "
                           "engine runs it after the optimizer step). For planning a published run; plan marks each "
                           "collective priced this way.")
    attention_kernel: Literal["engine", "fa2", "fa3", "cudnn", "fa1", "materialized"] = Field(
        "engine", description="Planner only (time model v2); the bundled engine always runs SDPA. The attention kernel "
                              "to price, each at its measured rate by sequence length: engine (what the engine's SDPA "
                              "runs with torch >= 2.13: cuDNN's attention on Hopper and Blackwell, at the rate this "
                              "project's GPU check measured; FlashAttention-2 elsewhere and in the ring / all-gather CP "
                              "blocks), fa2 (SDPA's FlashAttention-2 backend, torch's choice on every GPU before cuDNN "
                              "went first, e.g. torchtitan 2024-2025), fa3 (FlashAttention-3), cudnn (cuDNN's fused flash "
                              "attention, what Transformer Engine runs on Hopper, e.g. Megatron-Core / NeMo), fa1 "
                              "(FlashAttention-1 or flash-attn's Triton FlashAttention, e.g. llm-foundry 0.3's "
                              "attn_impl triton), materialized (scores in HBM "
                              "with a fused softmax and dropout, as Megatron-LM before FlashAttention). "
                              "docs/planner.md section 9.")
    loss: Literal["engine", "unchunked", "compiled", "megatron", "megatron_fused", "fused"] = Field(
        "engine", description="Planner only (memory, and time model v2's time); the bundled engine always runs its "
                              "chunked cross-entropy. The loss to count: engine (chunked, one chunk's fp32 logits at a "
                              "time), unchunked (F.cross_entropy over the whole [b, s, vocab/tp] logits upcast to fp32, "
                              "as torchtitan 2024 and other stacks that do not chunk), compiled (that loss under "
                              "torch.compile, as torchtitan from April 2025 with training.compile: fused, no fp32 "
                              "[b, s, vocab/tp] tensors), megatron (Megatron's vocab_parallel_cross_entropy: an fp32 "
                              "copy turned into the softmax in place), megatron_fused (the same with "
                              "cross_entropy_loss_fusion, as NeMo and Megatron-Bridge run it), fused (one fused kernel "
                              "over the low-precision logits, e.g. flash-attn's CrossEntropyLoss as llm-foundry runs "
                              "it). plan/losstime.py; docs/planner.md sections 7 and 9.")
    fp8_casts: Literal["engine", "fused"] = Field(
        "engine", description="Planner only (time model v2, train.precision fp8); the bundled engine runs torchao's "
                              "casts. How to price the fp8 scaling casts beside the FP8 GEMMs: engine (torchao "
                              "Float8Linear: eager amax + cast kernels and layout copies, fused when train.compile), "
                              "fused (a stack whose casts are fused cast-transpose kernels, e.g. Transformer Engine: "
                              "priced as the compiled kernels). plan/fp8time.py.")
    tp_overlap: bool = Field(
        False, description="Planner only; the bundled engine overlaps TP only with parallel.async_tp (which needs "
                           "train.compile). Price the sequence-parallel collectives as overlapped with the matmuls, as "
                           "Megatron-Core's userbuffers TP overlap (tp_comm_overlap) does: the pipelined collectives "
                           "by the engine's async TP rule, and the backward's two input-gradient reduce-scatters per "
                           "layer, which async TP leaves in line, beside the weight-gradient GEMMs as Megatron-Core's "
                           "default tp_comm_bulk_dgrad runs them (plan/asynctp.py). For planning a published run.")
    norm: Literal["engine", "unfused"] = Field(
        "engine", description="Planner only (time model v2); the bundled engine runs nn.RMSNorm's fused kernel. How to "
                              "price the blocks' RMSNorms: engine (one fused kernel each way), unfused (the eager "
                              "composite RMSNorm of torchtitan 2024's norm_type rmsnorm: x.float(), pow, mean, rsqrt, "
                              "mul, type_as, mul by the weight, each its own kernel, and their autograd backward; "
                              "fused again under train.compile). plan/ops.py.")
    block_kernels: Literal["engine", "fused"] = Field(
        "engine", description="Planner only (time model v2); the bundled engine runs eager kernels. How to price a "
                              "block's element-wise work besides its norms: engine (the engine's eager ops: RoPE as an fp32 "
                              "complex multiply, SwiGLU with its SiLU recomputed in backward, GQA's K/V repeated to the "
                              "query heads where planner.gqa says so, autograd's sums of the separate q/k/v and w1/w3 input gradients), fused (the "
                              "fused kernels of Megatron-LM / Megatron-Core with Transformer Engine and of llm-foundry's "
                              "MPT: one QKV and one fc1 GEMM, so no such sums, a fused RoPE and a fused activation, "
                              "attention that takes the K/V heads as they are). plan/ops.py.")
    gqa: Literal["engine", "repeat"] = Field(
        "engine", description="Planner only; the bundled engine hands grouped-query K/V to the flash kernel with their own "
                              "heads where the kernel takes them. How the stack's attention takes GQA's K/V: engine (causal "
                              "attention without a mask on CPU, or on a GPU in 16-bit with head_dim <= 256, FlashAttention's "
                              "rule: K/V kept at kv_heads for backward, nothing repeated; masks, soft-capping, Ulysses and "
                              "other GPU cases repeat), repeat (K/V repeated to the query heads before the kernel, which "
                              "keeps the repeated copies: torchtitan, transformers before enable_gqa). plan/gqa.py.")
    rope: Literal["engine", "complex"] = Field(
        "engine", description="Planner only (time model v2, with train.compile); the bundled engine compiles RoPE's real "
                              "formula. How Inductor prices the blocks' RoPE: engine (fused with the casts around it and "
                              "GQA's K/V repeat: one kernel), complex (torch.view_as_complex, as torchtitan and Meta's "
                              "reference code write it: Inductor generates no complex code, so the fp32 cast, the "
                              "complex multiply and the cast back stay three kernels each way). Eager runs are priced "
                              "alike either way. plan/ops.py.")
    grad_memory: Literal["engine", "persistent"] = Field(
        "engine", description="Planner only; the bundled engine frees the gradients after every step. How the "
                              "stack keeps its gradients between steps: engine (freed, zero_grad(set_to_none=True): a "
                              "step of one backward makes them while freeing its activations, so they are not at its "
                              "peak), persistent (one gradient buffer allocated once and zeroed, as Megatron-Core's DDP "
                              "main_grad buffer, or Megatron-LM 2021's fp32 main gradients, which its optimizer "
                              "overwrites but never frees): every gradient counts at every peak. docs/planner.md 1.4.")
    param_memory: Literal["engine", "master"] = Field(
        "engine", description="Planner only (parallel.zero 0 / 1, bf16 or fp8 compute); the bundled engine keeps fp32 "
                              "parameters and autocast casts the matmul weights. How the stack holds its parameters: "
                              "engine (fp32 parameters updated in place, one compute-dtype copy of the weights made by "
                              "autocast), master (parameters in the compute dtype, fp32 master copies kept by the "
                              "optimizer and sharded as its moments, no autocast copy: Megatron-LM's "
                              "Float16OptimizerWithFloat16Params and Megatron-Core's distributed optimizer, the ZeRO "
                              "paper's 2-byte parameters and 12 optimizer bytes; gradients as counted; with fp8, Transformer Engine's cached FP8 weight "
                              "and its transpose, 2 bytes per block weight). Memory only. docs/planner.md 1.1.")
    torch_ddp_buckets: bool = Field(
        False, description="Planner only (parallel.zero 0, bf16 or fp8 compute); the bundled engine buckets its own "
                           "gradients. The stack wraps the model in torch's DistributedDataParallel without "
                           "gradient_as_bucket_view (torch's default), as Megatron-LM 2021 with --DDP-impl torch did: "
                           "every gradient exists in the compute dtype twice, the parameter's .grad and DDP's flat "
                           "bucket (torch's docs: the view option saves 'the total gradients size'), beside the fp32 "
                           "gradients the recipe's other settings count. Memory only. docs/planner.md 1.1.")
    full_recompute: Literal["engine", "whole_block"] = Field(
        "engine", description="Planner only; the bundled engine stops early. What train.activation_checkpointing full "
                              "re-runs in the backward: engine (torch's non-reentrant checkpoint, which stops once "
                              "every tensor the backward needs exists again, so each block's last GEMM, w2, is not "
                              "re-run), whole_block (the whole forward of each block, its last GEMM included, as "
                              "Megatron-LM's and Megatron-Core's CheckpointFunction and torch's use_reentrant=True "
                              "do). Time and hardware FLOPs; memory is the same. plan/flops.py.")
    pp_p2p: Literal["engine", "blocking"] = Field(
        "engine", description="Planner only; how the pipeline's sends and receives meet the compute. engine "
                              "(torch.distributed.pipelining: steady-state sends overlapped, those along the fill and "
                              "drain path exposed), blocking (every send and receive waits before the next compute, "
                              "as Megatron-LM's p2p_communication (batch_isend_irecv, wait, torch.cuda.synchronize) and "
                              "Megatron-Core without overlap_p2p_comm do; each TP rank sends 1/tp of the activation, "
                              "without sequence parallelism gathered again over TP after the receive: Megatron-LM's "
                              "scatter_gather_tensors_in_pipeline, on by default). plan/comm.py, plan/steptime.py.")
    dp_optimizer: Literal["engine", "distributed"] = Field(
        "engine", description="Planner only (parallel.zero 1); what ZeRO-1's data-parallel collectives move. engine "
                              "(the bundled engine's ZeRO-1: gradients all-reduced, each owner then broadcasts its "
                              "updated fp32 parameters), distributed (Megatron-Core's DistributedOptimizer and Apex's "
                              "DistributedFusedAdam, as NeMo and Megatron-LM run ZeRO-1: gradients reduce-scattered in "
                              "parallel.reduce_dtype, the updated parameters all-gathered in the compute dtype). Time "
                              "only; memory is the engine's. plan/comm.py.")
    tp_backward_overlap: bool = Field(
        False, description="Planner only; the bundled engine runs its TP collectives in line. Price the backward's "
                           "collectives at the column-parallel inputs as running beside that layer's gradient GEMMs, "
                           "as Megatron-LM's column-parallel linear does since 2021-09 "
                           "(LinearWithGradAccumulationAndAsyncCommunication: the input gradient's all-reduce, with "
                           "sequence parallelism the input's re-gather and the input gradient's reduce-scatter, each "
                           "async_op=True beside the input- or weight-gradient GEMM): 2 collectives per layer and "
                           "micro batch without SP, 4 with SP; hidden up to the rank's backward compute. Ignored where "
                           "parallel.async_tp or planner.tp_overlap already overlaps TP. plan/comm.py, plan/steptime.py.")
    selective_recompute: Literal["engine", "core_attention"] = Field(
        "engine", description="Planner only; what train.activation_checkpointing selective re-runs in the backward: "
                              "engine (the bundled engine's policy: the element-wise ops; every matmul and attention "
                              "output saved), core_attention (the attention scores, softmax, dropout and the product "
                              "with V, everything else saved: Megatron-LM's --recompute-granularity selective, "
                              "Korthikanti et al. 2022). Time and hardware FLOPs; memory is the engine's. plan/ops.py, "
                              "plan/flops.py.")
    cp_kv: Literal["engine", "repeated"] = Field(
        "engine", description="Planner only; what context parallelism moves. engine (the bundled engine: K/V with "
                              "their kv_heads only, repeated for GQA after the exchange, as Megatron-Core and Llama 3 "
                              "do), repeated (K/V already repeated to the query heads, as torch's context_parallel "
                              "under torchtitan's repeat_kv before SDPA). plan/comm.py.")
    cp_merge: Literal["engine", "fused", "torch"] = Field(
        "engine", description="Planner only (time model v2, ring / all-gather CP); what runs between the CP attention "
                              "kernels. engine (the bundled engine's: each block's output folded into an fp32 running "
                              "output by eager ops, GQA K/V repeated per kernel call, fp32 dQ / dK / dV accumulators; "
                              "priced from their bytes, plan/cpmerge.py), torch (torch's context_parallel, as torchtitan "
                              "runs it: one kernel call per cp step for either rotation, each step's output merged in "
                              "fp32 over all of a rank's rows, K/V and dK/dV concatenated for every send), fused "
                              "(Transformer Engine's CP, as Megatron-Core, NeMo and Megatron-Bridge run it: its kernels "
                              "take GQA K/V unrepeated and one fused kernel folds each step's output in; not counted, "
                              "the kernels alone).")
