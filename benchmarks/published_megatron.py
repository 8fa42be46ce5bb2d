"""Megatron-LM SC'21 (Narayanan et al. 2021, arXiv:2104.04473): the Table 1 rows of
benchmarks/published_runs.py (rows 1-10), the stack they ran (micro batch, DDP, virtual stages from
NVIDIA's reproduction script; whole-layer recomputation), and the paper's FLOP count. Split out of
published_runs.py by concept (that file imports ``megatron_rows`` inside ``rows()``; this one imports
``recipe()`` and ``gpt()`` from it); benchmarks/sc21_figures.py plans the paper's Figures 11-16 with
the same stack."""

from __future__ import annotations

from published_runs import MEGATRON_GRADS, MEGATRON_PARAMS, MEGATRON_URL, gpt, mcore_bucket_mb, recipe

# Megatron-LM (Narayanan et al. 2021, arXiv:2104.04473), Table 1: GPT on DGX A100 80GB, s = 2048,
# V = 51200, activation recomputation, TFLOP/s per GPU counted with recomputation. What the table leaves
# out (micro batch, DDP implementation, layers per virtual stage) is NVIDIA's reproduction script for the
# table, NVIDIA/Megatron-LM examples/sc21/run_table_1.sh (first version de7dc40, 2021-08-10: "scripts for
# sc21"; the same values at 79a3bb6), which passes each through examples/sc21/CONFIG.sh with --fp16.
MEGATRON = [  # (params, heads, hidden, layers, tp, pp, gpus, batch, TFLOP/s per GPU, MBS, DDP, layers per virtual stage)
    ("1.7B", 24, 2304, 24, 1, 1, 32, 512, 137, 16, "torch", None),
    ("3.6B", 32, 3072, 30, 2, 1, 64, 512, 138, 16, "torch", None),
    ("7.5B", 32, 4096, 36, 4, 1, 128, 512, 142, 16, "torch", None),
    ("18B", 48, 6144, 40, 8, 1, 256, 1024, 135, 8, "torch", None),
    ("39B", 64, 8192, 48, 8, 2, 512, 1536, 138, 4, "local", None),
    ("76B", 80, 10240, 60, 8, 4, 1024, 1792, 140, 2, "local", 5),
    ("146B", 96, 12288, 80, 8, 8, 1536, 2304, 148, 2, "local", 5),
    ("310B", 128, 16384, 96, 8, 16, 1920, 2160, 155, 1, "local", 3),
    ("530B", 128, 20480, 105, 8, 35, 2520, 2520, 163, 1, "local", 1),
    ("1T", 160, 25600, 128, 8, 64, 3072, 3072, 163, 1, "local", None),
]
SC21_SCRIPT = "NVIDIA/Megatron-LM examples/sc21/run_table_1.sh (de7dc40)"
# --checkpoint-activations at aed2f75: megatron/mpu/random.py CheckpointFunction.backward re-runs the whole
# checkpointed layer (``outputs = ctx.run_function(*detached_inputs)``), its last GEMM included, where the
# engine's torch checkpoint stops before it (planner.full_recompute; the paper's eq. 3 counts the whole pass)
WHOLE = "whole_block"
# megatron/p2p_communication.py at de7dc40: _communicate posts batch_isend_irecv, waits on every request and
# calls torch.cuda.synchronize() before the next compute; each TP rank sends 1/tp of the tensor
# (--scatter-gather-tensors-in-pipeline, on unless --no-scatter-gather-tensors-in-pipeline) and the receiver
# all-gathers it over TP (planner.pp_p2p blocking)
P2P = "blocking"
# Megatron's cross-entropy: tensor_parallel/cross_entropy.py (mpu/cross_entropy.py in 2021-22) over the logits
# upcast to fp32, unfused (Megatron-Core's --cross-entropy-loss-fusion is opt-in): plan/losstime.py
LOSS = "megatron"
# Megatron's fused block kernels: one QKV and one fc1 GEMM, fused bias-GeLU / SwiGLU and RoPE (GPT's learned
# positions have none: priced as a fused RoPE, 2 bytes per q / k element each way), attention that takes the
# K/V heads as they are (planner.block_kernels fused, plan/ops.py)
KERNELS = "fused"
TORCH_DDP_BUCKET_MB = 25  # torch.nn.parallel.DistributedDataParallel's bucket_cap_mb default (Megatron passed none)

# what Megatron-LM could run at the paper's commit (aed2f75), beyond its zero and SP (benchmarks/search_rank.py
# keeps these in its "stack kept" search): only full recomputation (--checkpoint-activations; selective
# recomputation came in 2022), and equal stages: megatron/model/transformer.py asserts "num_layers must be
# divisible by pipeline_model_parallel_size", and arguments.py the same per virtual stage
MEGATRON_2021_STACK = {"train.activation_checkpointing": "full", "parallel.pp_layers_per_stage": None}


def megatron_parallel(tp: int, pp: int, ddp: str, layers_per_virtual: int | None, layers: int) -> dict:
    """The parallel section of a Megatron-LM 2021 run. ``--DDP-impl local`` (the default at aed2f75):
    ``allreduce_gradients()`` runs after ``forward_backward_func`` returns (``training.py`` ``train_step``: not
    overlapped with the backward), on the contiguous gradient buffer in the parameters' fp16
    (``--accumulate-allreduce-grads-in-fp32`` defaults to off): 2 bytes in one bucket. ``--DDP-impl torch``:
    torch's DistributedDataParallel around the fp16 module, its default 25 MB buckets all-reduced during the
    backward (the recipe's ``planner.assume_dp_overlap``, set by ``recipe``)."""
    par = dict(tp=tp, pp=pp, zero=0, pp_schedule="1f1b", sequence_parallel=False, reduce_dtype="bf16",
               dp_bucket_mb=TORCH_DDP_BUCKET_MB if ddp == "torch" else 65536)
    if layers_per_virtual:  # --num-layers-per-virtual-pipeline-stage: the interleaved schedule
        par |= dict(pp_schedule="interleaved-1f1b", pp_virtual_stages=layers // (pp * layers_per_virtual))
    return par


def megatron_rows() -> list[dict]:
    """Megatron-LM at the paper's time (NVIDIA/Megatron-LM aed2f75, 2021-04-14), each row as
    ``examples/sc21/run_table_1.sh`` ran it (``megatron_parallel`` says what its DDP choices mean)."""
    out = []
    for name, heads, h, layers, tp, pp, gpus, batch, tflops, mbs, ddp, per_virtual in MEGATRON:
        par = megatron_parallel(tp, pp, ddp, per_virtual, layers)
        v = par.get("pp_virtual_stages", 1)
        schedule = f"interleaved 1F1B, v = {v} ({per_virtual} layer{'s' if per_virtual > 1 else ''} per virtual stage)" if v > 1 else "1F1B" if pp > 1 else "no PP"
        ddp_note = ("torch DDP (--DDP-impl torch): fp16 gradients all-reduced in 25 MB buckets during the backward "
                    "(planner.assume_dp_overlap), each gradient held as the fp16 .grad and in DDP's bucket beside the fp32 main "
                    "gradient (planner.torch_ddp_buckets)" if ddp == "torch" else
                    "local DDP (--DDP-impl local): the fp16 gradient buffer all-reduced after the whole backward, "
                    "one bucket (dp_bucket_mb 65536), no planner.assume_dp_overlap")
        first = name == MEGATRON[0][0]
        out.append(dict(
            source="Megatron-LM Table 1", url=MEGATRON_URL, name=f"GPT {name}, {gpus} A100, TP {tp} PP {pp}",
            metric="hw TFLOP/s/GPU", published=tflops, flops_per_step=megatron_flops(batch, layers, h),
            recipe=recipe(gpt(h, heads, layers, tp), par,
                          dict(seq_len=2048, micro_batch_size=mbs, global_batch_size=batch, activation_checkpointing="full"),
                          gpus, "a100-80g", attention="materialized", dp_overlap=ddp == "torch", full_recompute=WHOLE,
                          pp_p2p=P2P, loss=LOSS, block_kernels=KERNELS,
                          grad_memory=MEGATRON_GRADS, param_memory=MEGATRON_PARAMS, torch_ddp_buckets=ddp == "torch"),
            stack=MEGATRON_2021_STACK,
            note=(f"micro batch {mbs}, {schedule}, full recomputation, zero 0, {ddp_note}; attention with the scores in "
                  "HBM (2021, before FlashAttention: planner.attention_kernel materialized); micro batch, DDP and virtual "
                  f"stages from {SC21_SCRIPT}; Megatron-LM's CheckpointFunction re-runs whole layers (planner.full_recompute "
                  "whole_block); pipeline sends that wait, 1/tp per TP rank gathered after the receive (Megatron-LM "
                  "p2p_communication: planner.pp_p2p blocking, also what the search prices for this stack); "
                  "mpu.vocab_parallel_cross_entropy over the fp32 logits (planner.loss megatron); fused QKV and "
                  "bias-GeLU kernels (planner.block_kernels fused); predicted = the paper's FLOPs per step "
                  "(its eq. 3) / predicted step time"
                  if first else f"micro batch {mbs}, {schedule}, {ddp} DDP; the rest as the 1.7B row")))
    return out


# Korthikanti et al. 2022 (arXiv:2205.05198, "Reducing Activation Recomputation in Large Transformer Models"):
# GPT on DGX A100 80GB (s = 2048, V = 51200, fp16, data parallel 1), end-to-end iteration time with full
# recomputation and with sequence parallelism + selective recomputation. The times and layouts are as
# Calculon's validation quotes and rebuilds them (calculon-ai/calculon calculon/megatron/validation.py
# kProfile, "reported here: https://arxiv.org/pdf/2205.05198.pdf"; validation/<model>_{full,seqsel}.json:
# TP, PP, batch, micro batch, interleaving); the Megatron-LM README's MFU table (22B 41.5 %, 175B 51.4 %,
# 530B 56.0 %, 1T 56.3 %) is the same runs' selective times in the paper's FLOP count (22B: 72 B s l h^2
# (1 + s/6h + V/12lh) / (1.10 s x 8 x 312 TFLOP/s) = 41.6 %).
KORTHIKANTI = [  # (params, heads, hidden, layers, pp, gpus, batch, micro batch, virtual stages, s full, s selective)
    ("22B", 64, 6144, 48, 1, 8, 4, 4, 1, 1.42, 1.10),
    ("175B", 96, 12288, 96, 8, 64, 64, 1, 3, 18.13, 13.75),
    ("530B", 128, 20480, 105, 35, 280, 280, 1, 3, 49.05, 37.83),
    ("1T", 160, 25600, 128, 64, 512, 512, 1, 1, 94.42, 71.49),
]
KORTHIKANTI_URL = ("https://arxiv.org/abs/2205.05198 (times and layouts as calculon-ai/calculon "
                   "calculon/megatron/validation.py and validation/*.json quote them)")


def megatron_2022_rows() -> list[dict]:
    """Megatron-LM as the paper ran it (NVIDIA/Megatron-LM d898a89, 2022-05-25, the merge of its sequence
    parallelism): full recomputation re-runs whole layers (``CheckpointFunction``: planner.full_recompute
    whole_block); ``--recompute-granularity selective`` checkpoints only ``CoreAttention`` (scores, softmax,
    dropout, the product with V: planner.selective_recompute core_attention); the column-parallel linear
    (``LinearWithGradAccumulationAndAsyncCommunication``) runs the input gradient's all-reduce (with SP: the
    input's re-gather and the gradient's reduce-scatter) beside the gradient GEMMs
    (planner.tp_backward_overlap); pipeline sends still wait (``p2p_communication._communicate`` calls
    ``torch.cuda.synchronize()``: planner.pp_p2p blocking) and, with SP, send the shard without the gather;
    attention with the scores in HBM (planner.attention_kernel materialized). Data parallelism 1: no
    gradient all-reduce. The metric is tokens/s/GPU from the published time: batch x 2,048 / (time x GPUs)."""
    out = []
    for name, heads, h, layers, pp, gpus, batch, mbs, v, t_full, t_sel in KORTHIKANTI:
        for ac, seconds in (("full", t_full), ("selective", t_sel)):
            par = megatron_parallel(8, pp, "local", layers // (pp * v) if v > 1 else None, layers)
            par["sequence_parallel"] = ac == "selective"
            schedule = f"interleaved 1F1B, v = {v}" if v > 1 else "1F1B" if pp > 1 else "no PP"
            what = "full recomputation" if ac == "full" else "SP + selective recomputation"
            first = name == KORTHIKANTI[0][0] and ac == "full"
            out.append(dict(
                source="Korthikanti et al. 2022", url=KORTHIKANTI_URL,
                name=f"GPT {name}, {gpus} A100, TP 8 PP {pp}, {what}", metric="tokens/s/GPU",
                published=round(batch * 2048 / (seconds * gpus), 1),
                recipe=recipe(gpt(h, heads, layers, 8), par,
                              dict(seq_len=2048, micro_batch_size=mbs, global_batch_size=batch, activation_checkpointing=ac),
                              gpus, "a100-80g", attention="materialized", dp_overlap=False,
                              full_recompute=WHOLE if ac == "full" else None, pp_p2p=P2P,
                              selective_recompute="core_attention" if ac == "selective" else None,
                              tp_backward_overlap=True, loss=LOSS, block_kernels=KERNELS,
                          grad_memory=MEGATRON_GRADS, param_memory=MEGATRON_PARAMS),
                note=(f"published as {seconds:.2f} s per iteration (batch {batch} x 2,048 tokens on {gpus} GPUs); micro batch "
                      f"{mbs}, {schedule}, {what}, data parallel 1; Megatron-LM d898a89 (2022-05): whole-layer "
                      "recomputation (planner.full_recompute whole_block), selective = the core attention "
                      "(planner.selective_recompute core_attention), the column-parallel inputs' backward collectives "
                      "beside the gradient GEMMs (planner.tp_backward_overlap), blocking pipeline sends (planner.pp_p2p "
                      "blocking), scores in HBM (planner.attention_kernel materialized), the unfused vocabulary-parallel "
                      "cross-entropy (planner.loss megatron) and fused block kernels (planner.block_kernels fused); "
                      "layouts as Calculon's validation "
                      "files rebuild them"
                      if first else f"published as {seconds:.2f} s per iteration; micro batch {mbs}, {schedule}; the rest "
                      "as the 22B row")))
    return out


def megatron_flops(batch: int, layers: int, h: int, s: int = 2048, vocab: int = 51200) -> float:
    """FLOPs per step as the SC'21 paper counts them for its TFLOP/s (section 5.1, eq. 3: the GEMMs of
    forward, backward and the recomputed forward, ``96 B s l h^2 (1 + s / 6h + V / 16 l h)``). The
    benchmark divides this count, not the planner's own, by the predicted step time: the published
    number is this count over the measured time, so only the times are compared (the planner's
    hardware FLOPs are about 5 % fewer: its recomputation stops before each block's last GEMM, as
    the engine's does)."""
    return 96.0 * batch * s * layers * h * h * (1 + s / (6 * h) + vocab / (16 * layers * h))


# The Megatron-LM README's H100 weak-scaling table (NVIDIA/Megatron-LM images/model_table.png, added in
# f2e5db402c, 2024-07-15, "New scaling figures on H100 GPUs"; the figures name Megatron-Core r0.8.0): GPT
# models of 1.7B-462B, vocabulary 131,072, 4,096 tokens, data parallel 48, bf16 (MFU = TFLOP/s / 989), "fine-
# grained overlapping of data-parallel (--overlap-grad-reduce --overlap-param-gather), tensor-parallel
# (--tp-comm-overlap) and pipeline-parallel communication (enabled by default)"; the table gives heads, hidden,
# layers, TP, PP, GPUs, batch and the per-GPU TFLOP/s in Megatron's own count (megatron_core_flops).
MEGATRON_H100 = [  # (params, heads, hidden, layers, tp, pp, gpus, batch, TFLOP/s per GPU, MFU)
    ("1.7B", 16, 2048, 24, 1, 1, 48, 192, 408.8, 0.41),
    ("7.1B", 32, 4096, 30, 2, 1, 96, 192, 465.9, 0.47),
    ("16B", 48, 6144, 32, 4, 1, 192, 192, 489.1, 0.49),
    ("32B", 56, 7168, 48, 8, 1, 384, 192, 459.6, 0.46),
    ("70B", 64, 8192, 84, 8, 2, 768, 384, 419.7, 0.42),
    ("119B", 80, 10240, 92, 8, 4, 1536, 768, 420.5, 0.43),
    ("177B", 96, 12288, 96, 8, 6, 2304, 1152, 432.8, 0.44),
    ("314B", 128, 16384, 96, 8, 8, 3072, 1536, 474.4, 0.48),
    ("462B", 144, 18432, 112, 8, 16, 6144, 3072, 459.9, 0.47),
]
MEGATRON_H100_URL = "NVIDIA/Megatron-LM README.md, images/model_table.png (f2e5db402c, Megatron-Core r0.8.0)"


def megatron_core_flops(batch: int, layers: int, h: int, s: int = 4096, vocab: int = 131072) -> float:
    """FLOPs per step as Megatron-LM counts them for its TFLOP/s (``megatron/training/training.py``
    ``num_floating_point_operations`` at f2e5db402c): ``12 B s l h^2 ((1 + groups / heads + s / h) + ffn / h +
    V / (2 l h))``, for MHA and GPT's 4h GeLU MLP ``12 B s l h^2 (6 + s / h + V / 2 l h)``: model FLOPs (no
    recomputation), attention unmasked."""
    return 12.0 * batch * s * layers * h * h * (6 + s / h + vocab / (2 * layers * h))


def megatron_h100_rows() -> list[dict]:
    """The README's table as Megatron-Core r0.8.0 runs it with the flags the README names
    (NVIDIA/Megatron-LM tag core_r0.8.0): ``--overlap-param-gather`` needs the distributed optimizer
    (``arguments.py``), so zero 1 with ``planner.dp_optimizer: distributed`` and overlapped syncs; bf16 turns on
    ``accumulate_allreduce_grads_in_fp32`` (fp32 reduce-scatter, the engine's default); no ``--ddp-bucket-size``:
    ``max(40M, 1M x dp)`` parameters (``distributed_data_parallel.py``); ``--tp-comm-overlap`` needs sequence
    parallelism (planner.tp_overlap); the non-interleaved schedule turns ``overlap_p2p_comm`` off and its
    batched sends end in ``torch.cuda.synchronize()`` (``batch_p2p_sync`` defaults on: planner.pp_p2p
    blocking); Transformer Engine's cuDNN attention on Hopper (planner.attention_kernel cudnn, as the NeMo
    rows). Not in the table, Megatron's defaults: no recomputation, no virtual stages, and micro batch 1 (the
    repository's GPT-3 example, ``examples/gpt3/train_gpt3_175b_distributed.sh``); GPT's learned positions and
    LayerNorm priced as RoPE and the engine's norm, the 4h GeLU MLP as a SwiGLU of equal FLOPs (``gpt``)."""
    out = []
    for name, heads, h, layers, tp, pp, gpus, batch, tflops, mfu in MEGATRON_H100:
        dp = gpus // (tp * pp)
        par = dict(tp=tp, pp=pp, zero=1, dp_bucket_mb=mcore_bucket_mb(dp))
        first = name == MEGATRON_H100[0][0]
        out.append(dict(
            source="Megatron-LM README H100", url=MEGATRON_H100_URL, name=f"GPT {name}, {gpus} H100, TP {tp} PP {pp}",
            metric="TFLOP/s/GPU (MFU)", published=tflops, published_mfu=mfu,
            flops_per_step=megatron_core_flops(batch, layers, h),
            recipe=recipe(gpt(h, heads, layers, tp, vocab=131072, seq=4096), par,
                          dict(seq_len=4096, micro_batch_size=1, global_batch_size=batch, activation_checkpointing="none"),
                          gpus, "h100-sxm", attention="cudnn", tp_overlap=tp > 1, dp_optimizer="distributed",
                          pp_p2p=P2P if pp > 1 else None, loss=LOSS, block_kernels=KERNELS,
                          grad_memory=MEGATRON_GRADS, param_memory=MEGATRON_PARAMS, cp_merge="fused"),
            note=("bf16, data parallel 48; Megatron-Core r0.8.0 with the README's flags: distributed optimizer with "
                  "overlapped gradient reduce-scatter and parameter all-gather (zero 1, planner.dp_optimizer distributed, "
                  "planner.assume_dp_overlap) in fp32 and Megatron-Core's default buckets (max(40M, 1M x dp) parameters), "
                  "TP comm overlap with SP (planner.tp_overlap), 1F1B sends that end in torch.cuda.synchronize() "
                  "(planner.pp_p2p blocking), cuDNN attention (planner.attention_kernel cudnn), the unfused "
                  "vocab_parallel_cross_entropy (--cross-entropy-loss-fusion is off by default: planner.loss megatron), "
                  "Megatron-Core's fused block kernels (planner.block_kernels fused); not in the table: micro "
                  "batch 1, no recomputation, no virtual stages (Megatron's defaults); predicted = Megatron's FLOP count "
                  "(training.py num_floating_point_operations) / predicted step time; Transformer Engine's CP for any CP "
                  "layout the search tries (planner.cp_merge fused)"
                  if first else "as the 1.7B row")))
    return out
