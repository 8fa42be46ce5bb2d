"""Zero Bubble Pipeline Parallelism (Qi, Wan, Huang, Lin; Sea AI Lab; arXiv:2401.10241v1, ICLR 2024): the
measured throughput of Tables 4 and 6 as rows of benchmarks/published_runs.py, for the schedules this
engine runs. Split out of published_runs.py by concept (that file imports ``zero_bubble_rows`` inside
``rows()``; this one imports ``recipe()`` and ``gpt()`` from it).

What the paper ran (section 5.1, Table 3): GPT-3-like models on A100 SXM 80 GB, up to 32 GPUs in 4 nodes
on RoCE, its fork of Megatron-LM (sail-sg/zero-bubble-pipeline-parallelism), sequence 1,024, pipeline
parallelism only (one pipeline: pp = GPUs, no TP, no DP), "both the initial and final pipeline stages
possess one fewer transformer layer compared to the intermediate stages" (22 = 2 + 6 x 3 + 2 layers on 8
stages, 30 on 8, 46 on 16, 62 on 32: every model has ``pp x k - 2`` layers), samples per GPU per second
measured after warm-up. Table 4 (section 5.2) compares 1F1B, interleaved 1F1B ("1F1B-I": "we always use
the maximum number of chunks ... each transformer layer serves as a chunk"), ZB-1p and ZB-2p at three
micro-batch counts; Table 6 (section 6.1) 1F1B, ZB-1p, ZB-2p* and ZB-V on 16, 24 and 32 GPUs.

Rows kept: every throughput of both tables for the schedules this engine runs -- 1F1B
(``pp_schedule: 1f1b``), 1F1B-I (``interleaved-1f1b``, one layer per chunk; the emptied first and last
chunk hold only the embedding and the output layer, ``k`` chunks per rank, as the Llama 3 rows) and ZB-V
(``zbv``: 2 pp chunks of one layer, the first and last only the embedding and the output, both on rank
0). Left out, decided before planning them: ZB-1p and ZB-2p / ZB-2p*, the paper's searched schedules with
one stage per rank (this engine's zero-bubble is torch's ScheduleInterleavedZeroBubble, which needs two or
more stages per rank, and it has no memory-limited schedule search), and the appendix tables (Tables 7,
11, 12: variants of the same runs). That leaves 24 rows from Table 4 and 18 from Table 6, and 21 pairs of
two schedules on one model, GPU count and batch for Kendall tau (benchmarks/search_rank.py).

Choices the paper does not state, and why:

- **Attention with the scores in HBM** (``planner.attention_kernel: materialized``, Megatron-LM's default
  without ``--use-flash-attn``): the memory the paper measured needs them. 1.5B's 1F1B holds 8 micro
  batches of 2 layers on stage 0 at b 6, s 1,024, h 2,304, 24 heads: Korthikanti et al.'s
  ``s b (34 h + 5 a s)`` bytes per layer is 1.24 GB with the scores and 0.48 GB without (34 s b h), so
  19.8 or 7.7 GB of activations beside about 4.4 GB of model state; Table 4 reads 30 GB. For 28.3B's stage
  1 (2 layers, 31 micro batches, b 1, h 6,144, 48 heads): 28.8 or 13.3 GB beside 16.3 GB; Table 4 reads
  43 GB. (The planner's memory does not count materialized scores, so its peaks here are low; only the
  throughput is compared.)
- **Vocabulary: 32,000** (Llama's SentencePiece size). The paper names none. Its balancing takes one layer off
  the first and last stages "to compensate for the extra embedding lookup and loss computations ... so
  that they won't become the bottleneck": at 1.5B's h 2,304 an output layer of 32,000 is 1.07 layers of
  forward GEMM FLOPs (2 h V against 24 h^2 + 4 s h per token), GPT-3's 50,257 (padded 50,304) 1.7 layers,
  which would make the last stage the bottleneck by a fifth; the authors' released scripts
  (``examples/pretrain_zero_bubble.sh``) train with ``--tokenizer-type GPTSentencePieceTokenizer``. Planned
  with 50,304 instead, 1.5B's six rows lose 18 % (1F1B at 24 micro batches: 9.94 against 12.15 samples/s);
  the larger models, whose h makes the output layer about one layer at either size, move less.
- **Pipeline sends that wait** (``planner.pp_p2p: blocking``): the fork's script passes
  ``--no-overlap-p2p-communication`` and Megatron's ``_communicate`` waits on each batched send.
- Megatron's fp16 mixed precision as bf16 (the same tensor-core rate on A100), its fused bias-GeLU and
  cross-entropy, its parameter and gradient memory (the Megatron rows' ``planner.*`` values), no
  recomputation (Table 4's memory leaves no room for it to have been used and the paper does not name it).

``published`` is tokens/s/GPU = samples per GPU per second x 1,024.
"""

from __future__ import annotations

from published_runs import MEGATRON_GRADS, MEGATRON_PARAMS, gpt, recipe

ZB_URL = ("https://arxiv.org/abs/2401.10241 (v1, 2023-11-30; Tables 3, 4, 6 and 9, read from two public text "
          "conversions of the PDF that agree on every number used)")
SEQ = 1024
VOCAB = 32000  # the released scripts' SentencePiece vocabulary (module docstring: "Vocabulary")
MODELS = {"1.5B": (22, 24, 2304), "6.2B": (30, 32, 4096), "14.6B": (46, 40, 5120), "28.3B": (62, 48, 6144)}  # layers, heads, h
# Table 4 (Table 3's setup): model -> (GPUs = pp, micro batch, micro-batch counts, {schedule: samples/GPU/s})
TABLE4 = {
    "1.5B": (8, 6, (24, 32, 64), {"1F1B": (11.8, 12.5, 13.6), "1F1B-I": (13.1, 13.4, 13.9)}),
    "6.2B": (8, 3, (24, 32, 64), {"1F1B": (3.50, 3.70, 4.03), "1F1B-I": (4.01, 4.08, 4.19)}),
    "14.6B": (16, 1, (48, 64, 128), {"1F1B": (1.40, 1.49, 1.64), "1F1B-I": (1.54, 1.59, 1.66)}),
    "28.3B": (32, 1, (96, 128, 256), {"1F1B": (0.76, 0.80, 0.88), "1F1B-I": (0.82, 0.85, 0.90)}),
}
# the tables' "Memory (GB)", one reading per model and schedule (the same at every micro-batch count), read as
# GiB: Megatron's report_memory divides by 1024^2 and calls it MB (planner_vs_published.py --memory)
MEMORY4 = {"1.5B": {"1F1B": 30, "1F1B-I": 40}, "6.2B": {"1F1B": 39, "1F1B-I": 48}, "14.6B": {"1F1B": 32, "1F1B-I": 39},
           "28.3B": {"1F1B": 43, "1F1B-I": 58}}
MEMORY6 = {"6.2B": {"ZB-V": 64, "1F1B": 61}, "14.6B": {"ZB-V": 45, "1F1B": 44}, "28.3B": {"ZB-V": 71, "1F1B": 69}}
# Table 6: the same models at the micro batch b of its "Setup" rows
TABLE6 = {
    "6.2B": (16, 6, (48, 64, 128), {"ZB-V": (4.15, 4.21, 4.35), "1F1B": (3.38, 3.57, 3.91)}),
    "14.6B": (24, 2, (72, 96, 192), {"ZB-V": (1.85, 1.88, 1.93), "1F1B": (1.52, 1.61, 1.76)}),
    "28.3B": (32, 2, (96, 128, 256), {"ZB-V": (1.01, 1.02, 1.06), "1F1B": (0.82, 0.87, 0.95)}),
}


def zero_bubble_parallel(schedule: str, layers: int, pp: int) -> dict:
    """The pipeline of one run: every stage ``k = (layers + 2) / pp`` layers but the first and last
    (``k - 1``, the paper's balancing); interleaved and V-shaped, one layer per chunk, the first and the
    last chunk only the embedding and the output layer (module docstring)."""
    k = (layers + 2) // pp
    if k * pp != layers + 2:
        raise ValueError(f"{layers} layers do not fill {pp} stages of {k} with the ends one short")
    par = dict(tp=1, pp=pp, zero=0, sequence_parallel=False)
    chunks = [0] + [1] * layers + [0]
    if schedule == "1F1B":
        return par | dict(pp_schedule="1f1b", pp_layers_per_stage=[k - 1] + [k] * (pp - 2) + [k - 1])
    if schedule == "1F1B-I":
        return par | dict(pp_schedule="interleaved-1f1b", pp_virtual_stages=k, pp_layers_per_stage=chunks)
    if schedule == "ZB-V":
        if k != 2:
            raise ValueError(f"ZB-V needs 2 chunks per rank, the model gives {k}")
        return par | dict(pp_schedule="zbv", pp_virtual_stages=2, pp_layers_per_stage=chunks)
    raise ValueError(f"schedule {schedule} is not one this engine runs")


def zero_bubble_rows() -> list[dict]:
    out = []
    first = True
    for table, runs, memory in (("Table 4", TABLE4, MEMORY4), ("Table 6", TABLE6, MEMORY6)):
        for name, (gpus, b, counts, by_schedule) in runs.items():
            layers, heads, h = MODELS[name]
            for schedule, samples in by_schedule.items():
                for m, value in zip(counts, samples, strict=True):
                    out.append(dict(
                        source=f"Zero Bubble {table}", url=ZB_URL,
                        name=f"GPT {name}, {gpus} A100, PP {gpus}, {m} micro batches of {b}, {schedule}",
                        metric="tokens/s/GPU", published=round(value * SEQ, 1),
                        published_memory_gib=float(memory[name][schedule]),
                        recipe=recipe(gpt(h, heads, layers, 1, vocab=VOCAB, seq=SEQ),
                                      zero_bubble_parallel(schedule, layers, gpus),
                                      dict(seq_len=SEQ, micro_batch_size=b, global_batch_size=m * b,
                                           activation_checkpointing="none"),
                                      gpus, "a100-80g", attention="materialized", dp_overlap=False, pp_p2p="blocking",
                                      loss="megatron", block_kernels="fused", grad_memory=MEGATRON_GRADS,
                                      param_memory=MEGATRON_PARAMS),
                        note=(f"{value} samples/GPU/s x {SEQ} tokens; one pipeline over every GPU (no TP, no DP), the "
                              "first and last stages one layer short (the paper's balancing); 1F1B-I and ZB-V one layer "
                              "per chunk, the end chunks only the embedding and the output; attention with the scores in "
                              "HBM (planner.attention_kernel materialized: Table 4's memory needs them, "
                              "benchmarks/published_zerobubble.py); a 32,000-token vocabulary; blocking "
                              "pipeline sends (--no-overlap-p2p-communication: planner.pp_p2p blocking); Megatron's "
                              "fused kernels, cross-entropy, parameter and gradient memory; fp16 as bf16; no recomputation"
                              if first else "as above")))
                    first = False
    return out
