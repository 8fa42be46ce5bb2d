"""MosaicML llm-foundry's published rows (rows 24-34 of benchmarks/published_runs.py): MPT with FSDP on
H100 and A100, from the benchmarking README's tables. Split out of published_runs.py by concept (that
file imports :func:`foundry_rows` inside ``rows()``; this one imports ``recipe()``, ``gpt()`` and the
source name from it)."""

from __future__ import annotations

from published_runs import FOUNDRY, gpt, recipe

# MosaicML llm-foundry, "H100 80GB BF16" / "... Large Scale" / "A100 80GB ... (RoCE)" tables: MPT
# (GeLU 4h MLP, ALiBi, vocab 50,368) with FSDP. (size, h, heads, layers, gpu, gpus, micro, global batch,
# sharding, activation checkpointing, tokens/s/GPU)
MPT = {"1b": (2048, 16, 24), "3b": (2560, 20, 32), "7b": (4096, 32, 32), "13b": (5120, 40, 40),
       "30b": (7168, 56, 48), "70b": (8192, 64, 80)}
FOUNDRY_ROWS = [
    ("7b", "h100-sxm", 8, 6, 48, "FULL_SHARD", False, 10643), ("13b", "h100-sxm", 8, 2, 16, "FULL_SHARD", False, 4792),
    ("30b", "h100-sxm", 8, 3, 504, "FULL_SHARD", True, 2002), ("70b", "h100-sxm", 64, 8, 2048, "FULL_SHARD", True, 1039),
    ("3b", "h100-sxm", 128, 8, 1024, "SHARD_GRAD_OP", False, 23422),
    ("7b", "h100-sxm", 128, 6, 768, "FULL_SHARD", False, 10475), ("70b", "h100-sxm", 512, 8, 4096, "FULL_SHARD", True, 1007),
    ("7b", "a100-80g", 8, 6, 96, "FULL_SHARD", False, 4641), ("13b", "a100-80g", 8, 2, 48, "FULL_SHARD", False, 2262),
    ("30b", "a100-80g", 8, 3, 504, "FULL_SHARD", True, 916), ("70b", "a100-80g", 64, 8, 2048, "FULL_SHARD", True, 410),
]


def foundry_rows() -> list[dict]:
    """The rows on 8-64 GPUs are the 2023 tables (sweep.sh at llm-foundry b2a43a147, v0.3.0, no
    ``--attn_impl``: submit_benchmarks.py's default ``triton``, the Triton FlashAttention copied from
    flash-attn 1.x, ``planner.attention_kernel: fa1``); the >= 128-GPU rows are the 2024-01 "Large
    Scale" table (5e85bd62d: sweep.py passes ``--attn_impl flash`` for 3b, 7b and 70b with flash-attn
    2.4.2: planner.attention_kernel fa2)."""
    out = []
    for size, gpu, gpus, mb, gbs, shard, ac, tps in FOUNDRY_ROWS:
        h, heads, layers = MPT[size]
        kind = "H100" if gpu == "h100-sxm" else "A100"
        large = gpus >= 128
        first = (size, gpus, gpu) in (("7b", 8, "h100-sxm"), ("3b", 128, "h100-sxm"), ("7b", 8, "a100-80g"))
        note = ("seq 2,048; ALiBi and GeLU MLP modelled as RoPE + SwiGLU of equal FLOPs; gradients reduce-scattered "
                "after every micro batch (composer runs FSDP without no_sync: parallel.fsdp_reduce_each_microbatch); "
                "flash-attn's fused CrossEntropyLoss (MPT's default loss_fn fused_crossentropy: planner.loss fused); "
                "MPT's one Wqkv GEMM, ALiBi (no RoPE: priced as a fused one) and GeLU MLP (planner.block_kernels fused); " +
                ("flash-attn 2.4.2 (attn_impl flash: planner.attention_kernel fa2)" if large else
                 "the Triton FlashAttention of llm-foundry 0.3 (attn_impl triton: planner.attention_kernel fa1)"))
        out.append(dict(
            source=f"llm-foundry {kind} tables", url=FOUNDRY,
            name=f"MPT {size}, {gpus} {kind}, FSDP {shard}, micro {mb}" + (", AC" if ac else ""),
            metric="tokens/s/GPU", published=tps,
            recipe=recipe(gpt(h, heads, layers, 1, vocab=50368),
                          dict(zero=3 if shard == "FULL_SHARD" else 2, fsdp_reduce_each_microbatch=True),
                          dict(seq_len=2048, micro_batch_size=mb, global_batch_size=gbs,
                               activation_checkpointing="full" if ac else "none"), gpus, gpu,
                          attention="fa2" if large else "fa1", loss="fused", block_kernels="fused"),
            note=note if first else "as above"))
    return out
