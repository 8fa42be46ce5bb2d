"""torchtitan's later published rows (rows 46-59 of benchmarks/published_runs.py, appended after the
others so their recipe files keep their numbers): the 2024-12 context-parallel tables, the async
TP measurements and the 2024-12 Tables 1 and 3 compiled bf16 runs. Split out of published_runs.py by concept (that file imports these functions inside
``rows()``; this one imports ``recipe()`` and the source names from it)."""

from __future__ import annotations

from published_runs import TITAN_2412, TITAN_AC, TITAN_COMPILE, TITAN_NOTE, TITAN_ROPE, recipe

# torchtitan PR #1299 (2025-06-15, "[Async TP] Add new async TP benchmarks"): the table the benchmark file
# held before it became an image (benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md, review diff):
# Llama 3.1 70B on 256 H100s, FSDP 32, TP 8, torch.compile, full AC, local batch 16.
TITAN_ASYNC_PR = "pytorch/torchtitan pull request 1299 (the table of benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md)"


def titan_cp_rows() -> list[dict]:
    """torchtitan 2024-12 Tables 2 and 6: context parallelism with compile + Float8 (Table 6: + async
    TP), full AC, local batch 1 (Table 2) and 8 (Table 6) per FSDP rank (last, so the
    earlier rows keep their file numbers). torch's ``context_parallel`` (torch 1963fc8, 2024-12) rotates
    K/V by all-gather by default and load-balances the causal blocks (2 x cp chunks): the engine's
    load-balanced all-gather CP. The 8B config's 131,072 max_seq_len is raised for the 262,144 row."""
    out = []
    for seq, fsdp, cp, tps, gib in ((32768, 8, 1, 3890, 83.9), (65536, 4, 2, 2540, 84.2), (131072, 2, 4, 1071, 84.0),
                                    (262144, 1, 8, 548, 84.5)):
        out.append(dict(
            source="torchtitan H100 2024-12 Table 2", url=TITAN_2412,
            name=f"Llama 3.1 8B, 8 H100 500 W, FSDP {fsdp} CP {cp}, seq {seq:,}", metric="tokens/s/GPU", published=tps,
            published_memory_gib=gib,
            recipe=recipe(dict(preset="llama3.1-8b", max_seq_len=max(seq, 131072)),
                          dict(zero=3, cp=cp, cp_method="allgather") if cp > 1 else dict(zero=3),
                          dict(seq_len=seq, micro_batch_size=1, global_batch_size=fsdp, activation_checkpointing="full",
                               precision="fp8", compile=True), 8, "h100-96g", power=500, loss="unchunked",
                          cp_kv="repeated" if cp > 1 else None, cp_merge="torch", rope=TITAN_ROPE),
            note=("compile + Float8, full AC, local batch 1; torch's context_parallel (all-gather rotation, load "
                  "balanced) as the engine's all-gather CP, moving K/V repeated to the query heads (torchtitan repeats "
                  "them before SDPA: planner.cp_kv repeated), with torch's own loop between the kernels (one call per "
                  "cp step, each output merged in fp32 over the rank's rows: planner.cp_merge torch); " + TITAN_COMPILE
                  + "; h100-96g at "
                  "500 W, unchunked loss" if cp == 1 else "as above")))
    for seq, fsdp, cp, tps, gib in ((32768, 8, 1, 76, 75.3), (65536, 4, 2, 47, 75.9), (131072, 2, 4, 31, 77.1),
                                    (262144, 1, 8, 16, 84.9)):
        out.append(dict(
            source="torchtitan H100 2024-12 Table 6", url=TITAN_2412,
            name=f"Llama 3.1 405B, 512 H100 500 W, FSDP {fsdp} CP {cp} TP 8 PP 8, seq {seq:,}", metric="tokens/s/GPU",
            published=tps, published_memory_gib=gib,
            recipe=recipe(dict(preset="llama3.1-405b", max_seq_len=max(seq, 131072)),
                          dict(tp=8, pp=8, zero=2, pp_schedule="1f1b", async_tp=True,
                               **(dict(cp=cp, cp_method="allgather") if cp > 1 else {})),
                          dict(seq_len=seq, micro_batch_size=1, global_batch_size=8 * fsdp, activation_checkpointing="full",
                               precision="fp8", compile=True), 512, "h100-96g", power=500, loss="unchunked",
                          cp_kv="repeated" if cp > 1 else None, cp_merge="torch", rope=TITAN_ROPE),
            note=("compile + Float8 + async TP (parallel.async_tp), 1F1B, full AC, local batch 8 (micro batch 1); FSDP under PP "
                  "as zero 2 (the engine's rule); CP as Table 2" if cp == 1 else "as above")))
    return out


def titan_70b_tp8(fp8: bool, async_tp: bool) -> dict:
    """torchtitan's 70B on 256 H100 500 W, FSDP 32 x TP 8, compiled, full AC, local batch 16 (seq 8,192)."""
    return recipe(dict(preset="llama3.1-70b"), dict(tp=8, zero=3) | (dict(async_tp=True) if async_tp else {}),
                  dict(seq_len=8192, micro_batch_size=16, global_batch_size=512, activation_checkpointing="full")
                  | (dict(precision="fp8") if fp8 else {}) | dict(compile=True),
                  256, "h100-96g", power=500, loss="unchunked", rope=TITAN_ROPE)


def titan_async_tp_rows() -> list[dict]:
    """Async TP as torchtitan measured it (eleventh session, appended): the 2025-06 70B runs with async
    TP (bf16, and Float8 tensorwise with and without it: the engine's Float8 is tensorwise) and
    Table 4's 2D + AsyncTP of 2024-12 (876 tokens/s, 67.6 GiB). The rowwise-Float8 rows are left out:
    the engine's ``train.precision: fp8`` is tensorwise."""
    out = []
    for i, (label, fp8, async_tp, tps) in enumerate((("bf16, async TP", False, True, 652.4),
                                                     ("Float8 tensorwise, vanilla TP", True, False, 809.8),
                                                     ("Float8 tensorwise, async TP", True, True, 942.4))):
        out.append(dict(
            source="torchtitan async TP 2025-06", url=TITAN_ASYNC_PR,
            name=f"Llama 3.1 70B, 256 H100 500 W, FSDP 32 TP 8, {label}", metric="tokens/s/GPU", published=tps,
            recipe=titan_70b_tp8(fp8, async_tp),
            note=(TITAN_COMPILE + ", full AC, local batch 16; seq 8,192 (the file does not say: torchtitan's "
                  "default); h100-96g at 500 W, unchunked loss; async TP as parallel.async_tp" if i == 0 else "as above")))
    out.append(dict(
        source="torchtitan H100 2024-12 Table 4", url=TITAN_2412,
        name="Llama 3.1 70B, 256 H100 500 W, FSDP 32 TP 8, Float8, async TP", metric="tokens/s/GPU", published=876,
        published_memory_gib=67.6, recipe=titan_70b_tp8(fp8=True, async_tp=True),
        note="compile + Float8, full AC; 2D + AsyncTP (parallel.async_tp); vanilla TP: row 19"))
    return out


def titan_compile_rows() -> list[dict]:
    """torchtitan 2024-12 Tables 1 and 3, "FSDP + torch.compile" (bf16): the middle rows of the tables
    whose eager (rows 16, 18) and compile + Float8 (row 17) runs were already rows (twelfth session,
    appended). Same recipe as the eager rows with ``train.compile``: the run's eager composite RMSNorm
    (``planner.norm: unfused``) is fused by Inductor, and so are the block's other element-wise ops
    (plan/ops.py ``_compiled_elementwise``) but torchtitan's complex RoPE (``planner.rope: complex``)."""
    out = []
    for table, gpus, tps, gib in (("Table 1", 8, 6667, 77.0), ("Table 3", 128, 6514, 62.0)):
        out.append(dict(
            source=f"torchtitan H100 2024-12 {table}", url=TITAN_2412,
            name=f"Llama 3.1 8B, {gpus} H100 500 W, FSDP, local batch 2, compile", metric="tokens/s/GPU", published=tps,
            published_memory_gib=gib,
            recipe=recipe(dict(preset="llama3.1-8b"), dict(zero=3),
                          dict(seq_len=8192, micro_batch_size=2, global_batch_size=2 * gpus, activation_checkpointing=TITAN_AC,
                               compile=True), gpus, "h100-96g", power=500, loss="unchunked", norm="unfused",
                          rope=TITAN_ROPE),
            note=TITAN_NOTE + "; torchtitan's selective op AC (selective_mm), unchunked loss (planner.loss); torch.compile: "
                              "Inductor fuses the eager RMSNorm (planner.norm unfused) and the block's other element-wise "
                              "ops; RoPE a complex multiply it does not fuse (planner.rope complex)"))
    return out
