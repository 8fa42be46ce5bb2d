"""torchtitan's published rows, split out of benchmarks/published_runs.py by concept (that file imports
these functions inside ``rows()``; this one imports ``recipe()`` and the source names from it):
its docs/performance.md and 2024-12 Tables 1, 3, 4 and 5 (:func:`torchtitan_rows`), Trainy's H200
runs (:func:`trainy_rows`) and, appended after the others so their recipe files keep their numbers
(rows 46-59), the 2024-12 context-parallel tables, the async TP measurements and the compiled bf16
runs of Tables 1 and 3. Every row goes through this module's :func:`recipe`: torchtitan repeats
GQA's K/V before SDPA (``planner.gqa: repeat``)."""

from __future__ import annotations

from published_runs import TITAN_2412, TITAN_ASYNC, TITAN_AC, TITAN_COMPILE, TITAN_NOTE, TITAN_ROPE, TRAINY
from published_runs import recipe as _recipe


def recipe(*args, **kw) -> dict:
    """published_runs.recipe() for torchtitan's stack: its Attention repeats GQA's K/V to the query heads
    (``repeat_kv``) before SDPA, which keeps the repeated copies (``planner.gqa: repeat``)."""
    return _recipe(*args, gqa="repeat", **kw)

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


def torchtitan_rows() -> list[dict]:
    a100 = "pytorch/torchtitan docs/performance.md (2024), Llama 3 on 64 A100"
    out = [
        dict(source="torchtitan docs/performance.md", url=a100, name="Llama 3 8B, 64 A100, FSDP, local batch 1",
             metric="tokens/s/GPU", published=2973,
             recipe=recipe(dict(preset="llama3-8b"), dict(zero=3), dict(seq_len=8192, micro_batch_size=1, global_batch_size=64,
                                                                       activation_checkpointing=TITAN_AC), 64, "a100-80g",
                           loss="unchunked", norm="unfused"),
             note="torchtitan's selective op AC (selective_mm), unchunked loss (planner.loss), eager composite RMSNorm "
                  "(norm_type rmsnorm, compile false: planner.norm unfused); published MFU 58.2%"),
        dict(source="torchtitan docs/performance.md", url=a100, name="Llama 3 70B, 64 A100, FSDP, local batch 1",
             metric="tokens/s/GPU", published=331,
             recipe=recipe(dict(preset="llama3-70b"), dict(zero=3), dict(seq_len=8192, micro_batch_size=1, global_batch_size=64,
                                                                        activation_checkpointing="full"), 64, "a100-80g",
                           loss="unchunked", norm="unfused"),
             note="full AC, unchunked loss (planner.loss), eager RMSNorm (planner.norm unfused); published MFU 51.7%"),
    ]
    fsdp8b = dict(seq_len=8192, micro_batch_size=2, activation_checkpointing=TITAN_AC)
    for table, gpus, tps, fp8, gib in (("Table 1", 8, 5762, False, 82.4), ("Table 1", 8, 8532, True, 76.8),
                                       ("Table 3", 128, 5605, False, 67.0)):
        out.append(dict(
            source=f"torchtitan H100 2024-12 {table}", url=TITAN_2412,
            name=f"Llama 3.1 8B, {gpus} H100 500 W, FSDP, local batch 2" + (", compile + Float8" if fp8 else ", eager"),
            metric="tokens/s/GPU", published=tps, published_memory_gib=gib,
            recipe=recipe(dict(preset="llama3.1-8b"), dict(zero=3),
                          fsdp8b | dict(global_batch_size=2 * gpus) | (dict(precision="fp8", compile=True) if fp8 else {}),
                          gpus, "h100-96g", power=500, loss="unchunked", norm=None if fp8 else "unfused",
                          rope=TITAN_ROPE if fp8 else None),
            note=TITAN_NOTE + "; torchtitan's selective op AC (selective_mm), unchunked loss (planner.loss)"
            + ("" if fp8 else "; eager composite RMSNorm (norm_type rmsnorm: planner.norm unfused)")
            + ("; " + TITAN_COMPILE if fp8
               else "; they quote 33-39 % MFU" if gpus == 8 else "")))
    out.append(dict(
        source="torchtitan H100 2024-12 Table 4", url=TITAN_2412, name="Llama 3.1 70B, 256 H100 500 W, FSDP 32 TP 8, Float8",
        metric="tokens/s/GPU", published=829, published_memory_gib=71.9,
        recipe=recipe(dict(preset="llama3.1-70b"), dict(tp=8, zero=3),
                      dict(seq_len=8192, micro_batch_size=16, global_batch_size=512, activation_checkpointing="full",
                           precision="fp8", compile=True), 256, "h100-96g", power=500, loss="unchunked",
                      rope=TITAN_ROPE),
        note="compile + Float8, full AC; vanilla TP (with async TP: row 57); " + TITAN_COMPILE))
    # Local batch 32 per DP rank in as many micro batches as the PP degree: 8 of 4 for both schedules (torchtitan
    # 9dec370, parallelisms/pipelining_utils.py build_pipeline_schedule, when --experimental.pipeline_parallel_
    # microbatches is unset; its help text's "number of pipeline stages" is not what the code does: docs/planner.md 9.1).
    for sched, v, tps, gib in (("1f1b", 1, 100, 82.5), ("interleaved-1f1b", 2, 128, 72.7)):
        out.append(dict(
            source="torchtitan H100 2024-12 Table 5", url=TITAN_2412,
            name=f"Llama 3.1 405B, 512 H100 500 W, FSDP 8 TP 8 PP 8, {sched}", metric="tokens/s/GPU", published=tps,
            published_memory_gib=gib,
            recipe=recipe(dict(preset="llama3.1-405b"), dict(tp=8, pp=8, zero=2, pp_schedule=sched, pp_virtual_stages=v,
                                                             async_tp=True),
                          dict(seq_len=8192, micro_batch_size=4, global_batch_size=256,
                               activation_checkpointing="full", precision="fp8", compile=True), 512, "h100-96g",
                          power=500, loss="unchunked", rope=TITAN_ROPE, cp_kv="repeated", cp_merge="torch"),
            note=("compile + Float8 + async TP (parallel.async_tp); FSDP under PP run as zero 2 (the engine's rule); "
                  "local batch 32 in 8 micro batches of 4 (torchtitan 9dec370's default: as many as the PP degree)"
                  + ("; v = 2 (torchtitan's default without split points: 2 stages per rank)" if v > 1 else "")
                  + "; for any CP layout the search tries, torch's context_parallel as Table 2 (planner.cp_kv repeated, "
                    "planner.cp_merge torch)")))
    for name, preset, gpus, mb, ac, tps in (("70B", "llama3.1-70b", 256, 16, "full", 597.3),
                                            ("8B", "llama3.1-8b", 64, 12, TITAN_AC, 4378)):
        out.append(dict(
            source="torchtitan async TP 2025-06", url=TITAN_ASYNC,
            name=f"Llama 3.1 {name}, {gpus} H100 500 W, FSDP {gpus // 8} TP 8, bf16, vanilla TP", metric="tokens/s/GPU",
            published=tps,
            recipe=recipe(dict(preset=preset), dict(tp=8, zero=3),
                          dict(seq_len=8192, micro_batch_size=mb, global_batch_size=mb * gpus // 8, activation_checkpointing=ac,
                               compile=True), gpus, "h100-96g", power=500, loss="unchunked", rope=TITAN_ROPE),
            note=f"{TITAN_COMPILE}, {'per op SAC (selective_mm)' if ac == TITAN_AC else ac + ' AC'}, local batch "
                 f"{mb}; seq 8,192 (the file does not say: torchtitan's default); h100-96g at 500 W, unchunked loss"))
    return out


def trainy_rows() -> list[dict]:
    """Trainy's torchtitan runs on H200 (last, so that adding them kept the earlier rows' file numbers)."""
    out = []
    for nodes, tps, gib in ((4, 10938, 47.96), (8, 10753, 46.97)):
        out.append(dict(
            source="Trainy H200 2025-06", url=TRAINY,
            name=f"Llama 3.1 8B, {8 * nodes} H200, FSDP, local batch 2, compile + Float8", metric="tokens/s/GPU",
            published=tps, published_memory_gib=gib,
            recipe=recipe(dict(preset="llama3.1-8b"), dict(zero=3, fp8_all_gather=True),
                          dict(seq_len=8192, micro_batch_size=2, global_batch_size=16 * nodes, activation_checkpointing=TITAN_AC,
                               precision="fp8", compile=True), 8 * nodes, "h200", loss="compiled", rope=TITAN_ROPE),
            note=("torchtitan e7c0cae on WhiteFiber H200s: compile + Float8 with fp8 all-gather, the 8B config's selective "
                  "op AC (selective_mm), seq 8,192; " + TITAN_COMPILE + "; its loss compiled too "
                  "(torchtitan since 2025-04, components/loss.py: planner.loss compiled)"
                  if nodes == 4 else "as above")))
    return out
