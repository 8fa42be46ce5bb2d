"""Published training runs, each rebuilt as a recipe for the planner (benchmarks/planner_vs_published.py,
benchmarks/search_rank.py, the tables in docs/planner.md section 7).

    python benchmarks/published_runs.py [--tiny] [--out D]   # the rows as JSON (stdout, or D/published_runs.json)
    python benchmarks/published_runs.py --write              # (re)write benchmarks/published/NN-<run>.yaml

Each row's recipe is also a YAML file in ``benchmarks/published/`` (``--write``), and that file is
what benchmarks/planner_vs_published.py plans, with ``llmtrain plan FILE --json``. The files are
generated, not kept by hand: the rows are tables of a few numbers each (a paper's Table 1 is ten
tuples here), so the generator is the one place a published number or a default is written, and
tests/test_published.py fails when a file differs from what ``--write`` makes (run it again).
Each file starts with a comment naming its source, URL, metric, published number and note.

A row is a dict: ``source`` (paper/file and table), ``url``, ``name``, ``metric`` (one of ``METRICS``),
``published`` (the number as printed), ``recipe`` (a recipe dict for ``validate_recipe_dict``) and
``note`` (every choice the source leaves out, and the features it used that the planner does not
model). Rules kept here:

- the layout is written as the source gives it (tp, pp, cp, virtual stages, schedule, micro and global
  batch, recomputation, precision, power cap); a setting the source does not give takes the
  framework's documented default, named in the note; nothing is changed to make a row fit or to move
  its error;
- features the engine lacks stay out of the recipe (torch.compile speed, async TP, MLA, DualPipe's
  EP overlap) and are named in the note: the row then shows what this engine would do;
- the pipeline layer split is the planner's balanced one (``search.balanced_split``) where the
  layers do not divide evenly, written into the recipe (``parallel.pp_layers_per_stage``); the
  sources do not give theirs;
- zero 0/1 rows (Llama 3, NeMo, Megatron-Bridge DDP, DeepSeek-V3) carry
  ``planner.assume_dp_overlap: true``: those stacks overlap the gradient reduction under PP and
  ZeRO-1's parameter gather with compute, which the bundled engine does not
  (llmtrain/recipe/schema_plan.py); FSDP rows do not need it (FSDP's prefetch is the engine's own);
  Megatron-LM 2021 did not overlap it (its local DDP all-reduced after the backward: ``megatron_rows``);
- ``planner.attention_kernel`` (time model v2) on every row: ``materialized`` for Megatron-LM 2021 (before
  FlashAttention), ``cudnn`` for NeMo and Megatron-Bridge (Transformer Engine's cuDNN fused attention, which it
  prefers on Hopper), ``fa1`` for llm-foundry's 2023 tables (its Triton FlashAttention, ``attn_impl: triton``),
  ``fa2`` for the rest (:func:`recipe`'s default): torchtitan's SDPA chose FlashAttention-2 on every GPU until
  torch put cuDNN first on Hopper (torch 2.5.1 made cuDNN opt-in, pytorch PR 138522; torchtitan's PR 1000 of
  2025-03 lists it only under CP, after FLASH), llm-foundry's 2024 large-scale table ran flash-attn 2.4.2, and
  Llama 3 and DeepSeek-V3 do not say (FA2, as before). Not ``engine``: since the twenty-fifth session that is
  the engine's own SDPA, cuDNN's on Hopper at the rate this project's GPU check measured;
- ``planner.fp8_casts: fused`` for the Transformer Engine rows (NeMo, Megatron-Bridge): TE fuses its fp8
  casts into cast-transpose kernels and the norms before the GEMMs, where the engine runs torchao's;
- ``planner.gqa: repeat`` for torchtitan's rows (2024-12 and Trainy's 2025 ones): its ``Attention`` repeats
  GQA's K/V to the query heads (``repeat_kv``) before SDPA, which keeps the repeated copies; the other stacks
  hand K/V to their kernels as they are (Transformer Engine, FlashAttention), as the engine does;
- ``planner.loss: unchunked`` for torchtitan 2024 (``F.cross_entropy`` over the whole fp32 logits; ``compiled`` for
  the 2025 Trainy rows, whose torchtitan compiles that loss under ``training.compile``; the
  engine chunks): memory only, what ``--memory`` compares with torchtitan's readings.
"""

from __future__ import annotations

import re
from pathlib import Path

from llmtrain.plan.search import balanced_split
from llmtrain.recipe.presets import PRESETS

METRICS = ("hw TFLOP/s/GPU", "TFLOP/s/GPU (MFU)", "tokens/s/GPU")

MEGATRON_URL = "https://arxiv.org/abs/2104.04473"
LLAMA3_URL = "https://arxiv.org/abs/2407.21783"
TITAN_2412 = "pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md"
TITAN_ASYNC = "pytorch/torchtitan benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md"
FOUNDRY = "mosaicml/llm-foundry scripts/train/benchmarking/README.md"
BRIDGE = ("NVIDIA-NeMo/Megatron-Bridge docs/performance-summary.md, 25.11 container (read from the fork "
          "pufanyi/Megatron-Bridge at 21a2ced)")
NEMO = "NVIDIA/NeMo docs/source/performance/performance_summary.md (NeMo 24.07, commit 070a0bb)"
TITAN_NOTE = ("Grand Teton H100s (cluster.gpu h100-96g: 96 GB HBM2e at 2.4 TB/s) at their default 500 W limit "
              "(cluster.gpu_power_w 500)")
# Megatron's gradients live across steps (planner.grad_memory persistent, docs/planner.md 1.4): Megatron-Core's
# DDP allocates one main_grad buffer and zeroes it each step (distributed/param_and_grad_buffer.py), and
# Megatron-LM 2021 (aed2f75) copies the fp16 gradients into fp32 main gradients its optimizer never frees
# (optimizer.py _copy_model_grads_to_main_grads; zero_grad skips fp32_from_float16_groups).
MEGATRON_GRADS = "persistent"
# Megatron's parameters are in the compute dtype with fp32 master copies in the optimizer (planner.param_memory
# master, docs/planner.md 1.1): Megatron-LM's Float16OptimizerWithFloat16Params (fp32_from_float16_groups, aed2f75
# and d898a89 alike) and Megatron-Core's distributed optimizer (its fp32 main parameters sharded as the moments).
MEGATRON_PARAMS = "master"
# torch.compile as the planner prices it (plan/ops.py _compiled_elementwise): Inductor's fused element-wise
# kernels of the block; torchtitan's RoPE is a complex multiply (torch.view_as_complex, 2024-12 and 2025),
# which Inductor does not generate code for: planner.rope complex.
TITAN_ROPE = "complex"
TITAN_COMPILE = "torch.compile: Inductor's fused element-wise kernels, RoPE a complex multiply it does not fuse (planner.rope complex)"
TRAINY = "pytorch/torchtitan benchmarks/llama3-8b_h200_202506_trainy-whitefiber.md"
# torchtitan's "selective op" AC (torchtitan/parallelisms/parallelize_llama.py at 9dec370, the same at
# e7c0cae) saves every mm and SDPA output except every second mm of a block: the engine's selective_mm.
# Its loss is F.cross_entropy over the whole fp32 logits: planner.loss unchunked (memory only).
TITAN_AC = "selective_mm"


def gpt(h: int, heads: int, layers: int, tp: int, vocab: int = 51200, seq: int = 2048) -> dict:
    """A GPT-3-style model as the planner's Llama block: MHA, and a SwiGLU of width 8h/3 (rounded
    to a multiple of 8 x tp) has the FLOPs and parameters of GPT's 4h GeLU MLP."""
    ffn = round(8 * h / 3 / (8 * tp)) * 8 * tp
    return dict(layers=layers, hidden=h, heads=heads, kv_heads=heads, ffn_hidden=ffn, vocab_size=vocab,
                max_seq_len=seq, rope_theta=10000.0, norm_eps=1e-5, tie_embeddings=False)


def mcore_bucket_mb(dp: int) -> float:
    """Megatron-Core's default gradient bucket without ``--ddp-bucket-size``
    (``distributed_data_parallel.py``: ``max(40000000, 1000000 * dp_size)`` parameters) in MiB of fp32
    gradients (``parallel.dp_bucket_mb``)."""
    return round(4 * max(40_000_000, 1_000_000 * dp) / 2**20, 1)


def layers_of(model: dict) -> int:
    return model.get("layers") or PRESETS[model["preset"]]["layers"]


def with_split(recipe: dict) -> dict:
    """The planner's balanced pipeline split where the layers do not divide pp x v evenly."""
    par = recipe["parallel"]
    pp, v = par.get("pp", 1), par.get("pp_virtual_stages", 1)
    if pp > 1 and "pp_layers_per_stage" not in par:
        split = balanced_split(layers_of(recipe["model"]), pp * v)
        if split:
            par["pp_layers_per_stage"] = split
    return recipe


def recipe(model: dict, parallel: dict, train: dict, gpus: int, gpu: str, power: float | None = None,
           attention: str | None = "fa2", loss: str | None = None, fp8_casts: str | None = None,
           norm: str | None = None, tp_overlap: bool = False, cp_kv: str | None = None,
           dp_overlap: bool = True, full_recompute: str | None = None, pp_p2p: str | None = None,
           selective_recompute: str | None = None, tp_backward_overlap: bool = False,
           dp_optimizer: str | None = None, block_kernels: str | None = None, rope: str | None = None,
           grad_memory: str | None = None, param_memory: str | None = None, torch_ddp_buckets: bool = False,
           cp_merge: str | None = None, gqa: str | None = None) -> dict:
    cluster = dict(nodes=gpus // 8, gpus_per_node=8, gpu=gpu) | ({"gpu_power_w": power} if power else {})
    out = dict(model=model, parallel=dict(parallel), train=dict(train), cluster=cluster)
    overlapped = dp_overlap and parallel.get("zero", 3) in (0, 1)
    planner = {"assume_dp_overlap": True} if overlapped else {}  # (module docstring)
    said = dict(attention_kernel=attention, loss=loss, fp8_casts=fp8_casts, norm=norm, tp_overlap=tp_overlap, cp_kv=cp_kv,
                full_recompute=full_recompute, pp_p2p=pp_p2p, selective_recompute=selective_recompute,
                tp_backward_overlap=tp_backward_overlap, dp_optimizer=dp_optimizer, block_kernels=block_kernels, rope=rope,
                grad_memory=grad_memory, param_memory=param_memory, torch_ddp_buckets=torch_ddp_buckets,
                cp_merge=cp_merge, gqa=gqa)
    planner |= {key: value for key, value in said.items() if value}  # what the stack did (the row's note says why)
    if planner:
        out["planner"] = planner
    return with_split(out)


# Llama 3 405B's stack as the paper (section 3.3.2) describes it: FSDP that "shards optimizer states and
# gradients, but for model shards we do not reshard after forward computation" (the engine's zero 2:
# FSDP2 without resharding after the forward), gradients "reduce-scatter[ed] ... in FP32" (reduce_dtype
# fp32); "we reduce one Transformer layer each from the first and the last stages ... the first model
# chunk on the first stage has only the embedding, and the last model chunk on the last stage has only
# output projection and loss": removing one layer empties a chunk, so a chunk is one layer and the 126
# layers fill pp x v - 2 chunks: v = 8 at pp 16 (interleaved); "we could pre-train Llama 3 on sequences
# of 8K tokens without activation checkpointing".
LLAMA3_LAYERS = [0] + [1] * 126 + [0]


def llama3_rows() -> list[dict]:
    out = []
    for gpus, cp, seq, gbs, tflops, mfu in ((8192, 1, 8192, 2048, 430, 0.43), (16384, 1, 8192, 2048, 400, 0.41),
                                            (16384, 16, 131072, 128, 380, 0.38)):
        ac = "none" if cp == 1 else "selective"  # the paper says so for 8K; 128K: not said, the engine's lightest fit
        out.append(dict(
            source="Llama 3 Table 4", url=LLAMA3_URL, name=f"Llama 3 405B, {gpus:,} H100, TP 8 CP {cp} PP 16, seq {seq:,}",
            metric="TFLOP/s/GPU (MFU)", published=tflops, published_mfu=mfu,
            recipe=recipe(dict(preset="llama3-405b"), dict(tp=8, cp=cp, pp=16, zero=2, reduce_dtype="fp32",
                                                           pp_schedule="interleaved-1f1b", pp_virtual_stages=8,
                                                           pp_layers_per_stage=list(LLAMA3_LAYERS), cp_method="allgather"),
                          dict(seq_len=seq, micro_batch_size=1, global_batch_size=gbs, activation_checkpointing=ac),
                          gpus, "h100-sxm"),
            note=("FSDP without resharding after the forward (zero 2), fp32 reduce-scatter, interleaved v = 8 with the "
                  "first and last chunks holding only the embedding and the output (the paper's pipeline balancing: "
                  "one layer per chunk), no activation checkpointing at 8K (section 3.3.2)" if cp == 1 and gpus == 8192
                  else "all-gather CP; selective recomputation (the paper says none only for 8K)" if cp > 1
                  else "as above")))
    return out


def bridge_rows() -> list[dict]:
    """The table's "FSDP 0" is Megatron-Core's DDP, and the Bridge recipes run it with the distributed
    optimizer (NVIDIA-NeMo/Megatron-Bridge ``recipes/llama/llama3.py``: ``cfg.ddp.use_distributed_optimizer =
    True``, ``grad_reduce_in_fp32 = True``, ``overlap_grad_reduce`` and ``overlap_param_gather``;
    ``recipes/utils/optimizer_utils.py`` ``distributed_fused_adam_with_cosine_annealing``:
    ``use_distributed_optimizer=True``): zero 1 with ``planner.dp_optimizer: distributed`` (before the
    twenty-second session these rows said zero 0, plain DDP), in Megatron-Core's default buckets
    (``distributed_data_parallel.py``: ``bucket_size = max(40000000, 1000000 * dp_size)`` parameters, fp32
    gradients: ``parallel.dp_bucket_mb``)."""
    rows = [  # (system, gpu, name, model, gpus, gbs, mbs, fsdp, tp, pp, cp, vp, tokens/s/GPU), FP8 current scaling
        ("DGX-H100", "h100-sxm", "LLAMA3_8B", "llama3-8b", 8, 128, 1, True, 1, 1, 1, 1, 14451),
        ("DGX-H100", "h100-sxm", "LLAMA3_70B", "llama3-70b", 64, 128, 1, False, 4, 8, 1, 5, 1602),
        ("DGX-H100", "h100-sxm", "LLAMA3.1_405B", "llama3.1-405b", 1024, 512, 1, False, 8, 8, 2, 8, 292),
        ("DGX-B200", "b200", "LLAMA3_8B", "llama3-8b", 8, 128, 2, False, 1, 1, 1, 1, 30624),
        ("DGX-B200", "b200", "LLAMA3.1_405B", "llama3.1-405b", 128, 64, 1, False, 4, 8, 2, 8, 661),
    ]
    out = []
    for system, gpu, name, preset, gpus, gbs, mbs, fsdp, tp, pp, cp, vp, tps in rows:
        # tp > 1: the Bridge Llama 3 recipes turn on Megatron-Core's userbuffers TP overlap
        # (CommOverlapConfig(tp_comm_overlap=True, tp_comm_overlap_cfg=userbuffers_*_h100_h16384_tp8_cp2_... for
        # 405B, ..._h8192_tp4_... for 70B, ..._b200_h16384_tp4_cp2_... on B200): planner.tp_overlap
        par = dict(tp=tp, pp=pp, cp=cp, zero=3 if fsdp else 1, cp_method="ring") | (
            {} if fsdp else dict(dp_bucket_mb=mcore_bucket_mb(gpus // (tp * pp * cp)))) | (
            dict(pp_schedule="interleaved-1f1b", pp_virtual_stages=vp) if pp > 1 else {})
        out.append(dict(
            source=f"Megatron-Bridge 25.11 {system}", url=BRIDGE,
            name=f"{name}, {gpus} {gpu.split('-')[0].upper()}, {'FSDP' if fsdp else 'DDP'} TP {tp} PP {pp} CP {cp} VP {vp}, FP8",
            metric="tokens/s/GPU", published=tps,
            recipe=recipe(dict(preset=preset), par, dict(seq_len=8192, micro_batch_size=mbs, global_batch_size=gbs,
                                                        activation_checkpointing="none", precision="fp8"), gpus, gpu,
                          attention="cudnn", fp8_casts="fused", tp_overlap=tp > 1,
                          dp_optimizer=None if fsdp else "distributed", loss="megatron_fused", block_kernels="fused",
                          grad_memory=None if fsdp else MEGATRON_GRADS,
                          param_memory=None if fsdp else MEGATRON_PARAMS, cp_merge="fused"),
            note=("FP8 current scaling; the table's FSDP 1 as zero 3 and FSDP 0 as Megatron-Core's DDP with the "
                  "distributed optimizer the Bridge recipes set (use_distributed_optimizer, grad_reduce_in_fp32, "
                  "overlap_grad_reduce, overlap_param_gather: zero 1, planner.dp_optimizer distributed) in Megatron-Core's "
                  "default buckets (max(40M, 1M x dp) parameters: parallel.dp_bucket_mb), ring CP, no "
                  "recomputation (Megatron-Core's default: the table does not say); the fused vocabulary-parallel "
                  "cross-entropy (GPTModelProvider's cross_entropy_loss_fusion True: planner.loss megatron_fused), "
                  "Megatron-Core's fused block kernels (fused QKV and fc1, RoPE and SwiGLU fusions: planner.block_kernels fused); "
                  "Transformer Engine's cuDNN attention "
                  "(planner.attention_kernel cudnn) and fused fp8 casts (planner.fp8_casts fused); with TP, Megatron-Core's "
                  "userbuffers TP overlap (the recipes' tp_comm_overlap: planner.tp_overlap, the pipelined collectives "
                  "priced as the engine's async TP, the 2 input-gradient reduce-scatters per layer beside the "
                  "weight-gradient GEMMs as its default tp_comm_bulk_dgrad runs them); Transformer Engine's CP, for "
                  "the table's CP 2 and any CP layout the search tries: its kernels take GQA K/V unrepeated and fold "
                  "each step's output in with one fused kernel (planner.cp_merge fused)"
                  if (system, name) == ("DGX-H100", "LLAMA3_8B")
                  else "as above")))
    return out


def deepseek_rows() -> list[dict]:
    return [dict(
        source="DeepSeek-V3 report, Table 1", url="https://arxiv.org/abs/2412.19437",
        name="DeepSeek-V3, 2,048 H800, PP 16 DualPipe, EP 64", metric="tokens/s/GPU", published=1543,
        recipe=recipe(dict(preset="deepseek-v3"), dict(pp=16, ep=64, zero=1, pp_schedule="dualpipev", pp_virtual_stages=2),
                      dict(seq_len=4096, micro_batch_size=1, global_batch_size=15360, activation_checkpointing="full"),
                      2048, "h100-sxm"),
        note="180K H800 GPU hours per trillion tokens; trained in FP8 with DualPipe overlapping EP, which the model does not capture")]


def rows() -> list[dict]:
    from published_titan import (  # noqa: PLC0415 (it imports recipe() from here)
        titan_async_tp_rows, titan_compile_rows, titan_cp_rows, torchtitan_rows, trainy_rows)
    from published_foundry import foundry_rows  # noqa: PLC0415 (it imports recipe() from here)
    from published_megatron import megatron_2022_rows, megatron_h100_rows, megatron_rows  # noqa: PLC0415 (it imports recipe() from here)
    from published_nemo import nemo_more_rows, nemo_rows  # noqa: PLC0415 (it imports recipe() from here)
    from published_zerobubble import zero_bubble_rows  # noqa: PLC0415 (it imports recipe() from here)

    return (megatron_rows() + llama3_rows() + torchtitan_rows() + foundry_rows() + nemo_rows() + bridge_rows()
            + deepseek_rows() + trainy_rows() + titan_cp_rows() + titan_async_tp_rows() + titan_compile_rows()
            + megatron_2022_rows() + nemo_more_rows() + megatron_h100_rows() + zero_bubble_rows())


RECIPES = Path(__file__).resolve().parent / "published"


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9.]+", "-", text.lower().replace(",", "")).strip("-.")


def recipe_file(i: int, row: dict) -> Path:
    """``benchmarks/published/NN-<run>.yaml``: NN is the row's place in the table (1-based)."""
    return RECIPES / f"{i + 1:02d}-{slug(row['name'])}.yaml"


def recipe_yaml(row: dict, note: str | None = None) -> str:
    """The row's recipe as YAML, after a comment that names its source and every choice made
    (``note``: the row's note, spelled out where the table says "as above")."""
    import yaml  # noqa: PLC0415

    head = [f"source: {row['source']} ({row['url']})", f"run: {row['name']}",
            f"published: {row['published']:,}" + (f" ({row['published_mfu']:.0%})" if "published_mfu" in row else "")
            + f" {row['metric']}",
            f"note: {note or row['note']}", "generated by: python benchmarks/published_runs.py --write (do not edit)"]
    return "".join(f"# {line}\n" for line in head) + yaml.safe_dump(row["recipe"], sort_keys=False, width=120, default_flow_style=None)


def write_recipes() -> list[Path]:
    """(Re)write every row's recipe file; remove files of rows that no longer exist."""
    RECIPES.mkdir(exist_ok=True)
    wanted, note = {}, ""
    for i, row in enumerate(rows()):
        note = note if row["note"] == "as above" else row["note"]
        wanted[recipe_file(i, row)] = recipe_yaml(row, note)
    for old in RECIPES.glob("*.yaml"):
        if old not in wanted:
            old.unlink()
    for path, text in wanted.items():
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
    return list(wanted)


def main() -> None:
    import argparse  # noqa: PLC0415
    import json  # noqa: PLC0415

    ap = argparse.ArgumentParser(description="the published runs as JSON")
    ap.add_argument("--tiny", action="store_true", help="accepted for the CI smoke test (the rows are data: same output)")
    ap.add_argument("--out", type=Path, default=None, help="write OUT/published_runs.json instead of stdout")
    ap.add_argument("--write", action="store_true", help="(re)write the recipe files in benchmarks/published/")
    args = ap.parse_args()
    if args.write:
        print(f"wrote {len(write_recipes())} recipes to {RECIPES}")
        return
    text = json.dumps({"tiny": args.tiny, "results": rows()}, indent=1) + "\n"
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "published_runs.json").write_text(text)
    else:
        print(text, end="")


if __name__ == "__main__":
    main()
