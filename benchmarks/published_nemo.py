"""NVIDIA NeMo's performance summary (NeMo 24.07 container, DGX-H100, FP8): the pretraining table's
rows as recipes. Split out of published_runs.py by concept (that file imports :func:`nemo_rows` and
:func:`nemo_more_rows` inside ``rows()``; this one imports ``recipe()``, ``gpt()`` and the source name
from it). :func:`nemo_rows` are rows 35-37 (the table's GPT3-175B on 128 GPUs and the two Llama 3
rows, used since the ninth session); :func:`nemo_more_rows` the table's nine other pretraining rows
(twenty-second session, appended so that the earlier files keep their numbers)."""

from __future__ import annotations

from published_runs import MEGATRON_GRADS, MEGATRON_PARAMS, NEMO, gpt, recipe

# optim.name distributed_fused_adam in every 24.07 launcher config (Apex's DistributedFusedAdam under NeMo's
# MegatronDistributedFusedAdam): gradients reduce-scattered, the updated parameters all-gathered in bf16, both
# overlapped (overlap_grad_sync, overlap_param_sync): planner.dp_optimizer distributed with
# planner.assume_dp_overlap (zero 1)
DIST_OPT = "distributed"
# optim.bucket_cap_mb of each model's 24.07 launcher config (the gradient buckets the optimizer reduce-scatters;
# Nemotron-340B also grad_sync_dtype bf16)
# model.cross_entropy_loss_fusion in each model's 24.07 launcher config: true for these (Megatron-Core's
# fused_vocab_parallel_cross_entropy: planner.loss megatron_fused); the others do not set it and run
# Megatron-Core's default, the unfused vocab_parallel_cross_entropy (planner.loss megatron)
LOSS_FUSION = ("LLAMA3-8B", "LLAMA3-70B", "Nemotron-8B", "Nemotron-22B")


def nemo_loss(name: str) -> str:
    return "megatron_fused" if name in LOSS_FUSION else "megatron"


BUCKET_MB = {"GPT3-5B": 400, "GPT3-20B": 220, "GPT3-175B": 220, "LLAMA2-7B": 125, "LLAMA2-13B": 125, "LLAMA2-70B": 125,
             "LLAMA3-8B": 125, "LLAMA3-70B": 125, "Nemotron-8B": 100, "Nemotron-22B": 100, "Nemotron-340B": 50}


CP_NOTE = ("; Transformer Engine's CP, for the table's CP 2 and any CP layout the search tries: its kernels take GQA "
           "K/V unrepeated and fold each step's output in with one fused kernel (flash_attn_fwd_out_correction: "
           "planner.cp_merge fused)")


def nemo_rows() -> list[dict]:
    """Without userbuffers, Transformer Engine's column-parallel layers still run the backward's input
    re-gather and input-gradient reduce-scatter beside the GEMMs (NVIDIA/TransformerEngine v1.8,
    ``module/linear.py`` and ``module/layernorm_linear.py``: "Overlap input AG with dgrad", "Overlap
    dgrad-RS/AR with wgrad"): ``planner.tp_backward_overlap`` where TP runs without the TP comm overlap.
    TP comm overlap as NeMo 24.07's launcher configs for these models set it
    (NVIDIA/NeMo-Framework-Launcher tag 24.07, ``launcher_scripts/conf/training``: ``llama/llama3_70b.yaml``
    ``ub_tp_comm_overlap: true`` with ``ub_cfg_h100_h8192_tp4_mbs1_seqlen8192``, ``gpt3/175b.yaml`` ``False``;
    8B has no TP). The table's virtual stages differ from those files' (5 and 6 against 10 and 12), so the
    runs were not the files verbatim."""
    rows = [  # (name, model, gpus, gbs, mbs, seq, tp, pp, cp, vp, tokens/s/GPU, TP comm overlap)
        ("GPT3-175B", gpt(12288, 96, 96, 4), 128, 256, 1, 2048, 4, 8, 1, 6, 726, False),
        ("LLAMA3-8B", dict(preset="llama3-8b"), 8, 128, 1, 8192, 1, 1, 2, 1, 12036, False),
        ("LLAMA3-70B", dict(preset="llama3-70b"), 64, 128, 1, 8192, 4, 4, 2, 5, 1533, True),
    ]
    out = []
    for name, model, gpus, gbs, mbs, seq, tp, pp, cp, vp, tps, overlap in rows:
        par = dict(tp=tp, pp=pp, cp=cp, zero=1, cp_method="ring", dp_bucket_mb=BUCKET_MB[name]) | (
            dict(pp_schedule="interleaved-1f1b", pp_virtual_stages=vp) if pp > 1 else {})
        out.append(dict(
            source="NeMo performance summary", url=NEMO, name=f"{name}, {gpus} H100, TP {tp} PP {pp} CP {cp} VP {vp}, FP8",
            metric="tokens/s/GPU", published=tps,
            recipe=recipe(model, par, dict(seq_len=seq, micro_batch_size=mbs, global_batch_size=gbs,
                                           activation_checkpointing="none", precision="fp8"), gpus, "h100-sxm",
                          attention="cudnn", fp8_casts="fused", tp_overlap=overlap, tp_backward_overlap=tp > 1 and not overlap,
                          dp_optimizer=DIST_OPT, loss=nemo_loss(name), block_kernels="fused",
                          grad_memory=MEGATRON_GRADS, param_memory=MEGATRON_PARAMS, cp_merge="fused"),
            note=("FP8; distributed optimizer (zero 1), ring CP, no recomputation (Megatron-Core's default: the table "
                  "does not say); Megatron-Core's fused block kernels (planner.block_kernels fused) and the launcher "
                  "config's cross-entropy (cross_entropy_loss_fusion: planner.loss megatron_fused, else megatron); "
                  "Transformer Engine's cuDNN attention (planner.attention_kernel cudnn) and fused "
                  "fp8 cast-transpose kernels (planner.fp8_casts fused); distributed_fused_adam: gradients "
                  "reduce-scattered in the config's bucket_cap_mb (parallel.dp_bucket_mb), bf16 parameters all-gathered "
                  "(planner.dp_optimizer distributed); TP comm overlap as "
                  "NeMo 24.07's launcher "
                  "config sets it (ub_tp_comm_overlap false), so Transformer Engine's own backward overlap: its "
                  "column-parallel layers re-gather the input beside the dgrad GEMM and reduce-scatter the input "
                  "gradient beside the wgrad GEMM (TE v1.8 module/linear.py, layernorm_linear.py: planner.tp_backward_overlap)"
                  + CP_NOTE if name == "GPT3-175B" else
                  "as above; the launcher's llama3_70b.yaml sets ub_tp_comm_overlap true: planner.tp_overlap"
                  if overlap else "as above")))
    return out


def _llama2(layers: int, h: int, heads: int, kv: int, ffn: int) -> dict:
    return dict(layers=layers, hidden=h, heads=heads, kv_heads=kv, ffn_hidden=ffn, vocab_size=32000, max_seq_len=4096,
                rope_theta=10000.0, norm_eps=1e-5, tie_embeddings=False)


def _nemotron(h: int, heads: int, layers: int, tp: int, kv: int | None = None) -> dict:
    """Nemotron's squared-ReLU 4h MLP (not gated) as a SwiGLU of equal FLOPs (``gpt``), its 256k vocabulary,
    RoPE, 4,096 tokens; LayerNorm1p priced as the engine's norm (the same bytes)."""
    return gpt(h, heads, layers, tp, vocab=256000, seq=4096) | ({"kv_heads": kv} if kv else {})


# The 24.07 table's other pretraining rows: (name, model, gpus, gbs, mbs, seq, tp, pp, vp, tokens/s/GPU, TP comm
# overlap, recomputation). What the table does not give is NeMo-Framework-Launcher 24.07's config for the model
# (launcher_scripts/conf/training/{gpt3/5b,gpt3/20b,gpt3/175b,llama/llama2_*,nemotron/nemotron_*}.yaml):
# sequence_parallel (on wherever TP > 1), ub_tp_comm_overlap (20B, Llama 2 70B, Nemotron 8B and 22B: True;
# GPT3-175B and Nemotron-340B: False), activations_checkpoint_granularity (null, Nemotron-340B selective),
# distributed_fused_adam with overlap_grad_sync / overlap_param_sync (zero 1, planner.assume_dp_overlap).
NEMO_MORE = [
    ("GPT3-5B", gpt(4096, 32, 24, 1), 64, 2048, 4, 2048, 1, 1, 1, 22521, False, "none"),
    ("GPT3-20B", gpt(6144, 48, 44, 2), 64, 256, 2, 2048, 2, 1, 1, 5851, True, "none"),
    ("GPT3-175B", gpt(12288, 96, 96, 4), 512, 2048, 2, 2048, 4, 8, 6, 782, False, "none"),
    ("LLAMA2-7B", _llama2(32, 4096, 32, 32, 11008), 8, 128, 1, 4096, 1, 1, 1, 16847, False, "none"),
    ("LLAMA2-13B", _llama2(40, 5120, 40, 40, 13824), 16, 128, 1, 4096, 1, 4, 10, 8646, False, "none"),
    ("LLAMA2-70B", _llama2(80, 8192, 64, 8, 28672), 64, 128, 1, 4096, 4, 4, 20, 1707, True, "none"),
    ("Nemotron-8B", _nemotron(4096, 32, 32, 2), 64, 256, 4, 4096, 2, 1, 1, 12701, True, "none"),
    ("Nemotron-22B", _nemotron(6144, 48, 40, 2), 64, 256, 2, 4096, 2, 4, 10, 4256, True, "none"),
    ("Nemotron-340B", _nemotron(18432, 96, 96, 8, kv=8), 128, 32, 1, 4096, 8, 8, 12, 322, False, "selective"),
]


def nemo_more_rows() -> list[dict]:
    """The table's rows not in :func:`nemo_rows`, with the stack those rows say (cuDNN attention, fused fp8
    casts, zero 1 with overlap) and each model's launcher config; without userbuffers TP overlap, Transformer
    Engine's own backward overlap (planner.tp_backward_overlap, :func:`nemo_rows`); Nemotron-340B's selective
    recomputation is Megatron-Core's (the core attention: planner.selective_recompute core_attention)."""
    out = []
    for name, model, gpus, gbs, mbs, seq, tp, pp, vp, tps, overlap, ac in NEMO_MORE:
        par = dict(tp=tp, pp=pp, zero=1, dp_bucket_mb=BUCKET_MB[name]) | (
            dict(pp_schedule="interleaved-1f1b", pp_virtual_stages=vp) if pp > 1 else {}) | (
            dict(reduce_dtype="bf16") if name == "Nemotron-340B" else {})
        first = name == NEMO_MORE[0][0]
        out.append(dict(
            source="NeMo performance summary", url=NEMO, name=f"{name}, {gpus} H100, TP {tp} PP {pp} CP 1 VP {vp}, FP8",
            metric="tokens/s/GPU", published=tps,
            recipe=recipe(model, par, dict(seq_len=seq, micro_batch_size=mbs, global_batch_size=gbs,
                                           activation_checkpointing=ac, precision="fp8"), gpus, "h100-sxm",
                          attention="cudnn", fp8_casts="fused", tp_overlap=overlap, tp_backward_overlap=tp > 1 and not overlap,
                          selective_recompute="core_attention" if ac == "selective" else None, dp_optimizer=DIST_OPT,
                          loss=nemo_loss(name), block_kernels="fused",
                          grad_memory=MEGATRON_GRADS, param_memory=MEGATRON_PARAMS, cp_merge="fused"),
            note=("FP8; the table's layout, the rest from NeMo-Framework-Launcher 24.07's config for the model "
                  "(launcher_scripts/conf/training/...): distributed_fused_adam with overlapped gradient and parameter "
                  "syncs (zero 1, planner.dp_optimizer distributed, planner.assume_dp_overlap) in its bucket_cap_mb "
                  "(parallel.dp_bucket_mb; Nemotron-340B's grad_sync_dtype bf16: parallel.reduce_dtype), sequence parallelism with TP, ub_tp_comm_overlap "
                  "(planner.tp_overlap; without it, Transformer Engine's backward overlap: planner.tp_backward_overlap), "
                  "recomputation as the config says (none; Nemotron-340B selective: planner.selective_recompute "
                  "core_attention); cuDNN attention and fused fp8 casts as rows 35-37; GPT3 as gpt() models it "
                  "(vocabulary 51,200 as row 35), Llama 2 as published (vocabulary 32,000), Nemotron's squared-ReLU "
                  "4h MLP as a SwiGLU of equal FLOPs (vocabulary 256,000)" + CP_NOTE if first else
                  "as above" + ("; ub_tp_comm_overlap true: planner.tp_overlap" if overlap else
                                "; ub_tp_comm_overlap false: planner.tp_backward_overlap" if tp > 1 else "")
                  + ("; selective recomputation (the config)" if ac == "selective" else ""))))
    return out
