"""The layout orderings the Megatron-LM SC'21 paper measured (its Figures 11-16), planned with the CLI.

    python benchmarks/sc21_figures.py                 # the markdown table of docs/planner.md 7, "Rank quality"
    python benchmarks/sc21_figures.py --tiny --out D  # CI smoke test: the same (under a second), D/sc21_figures.json

Table 1 of the paper (benchmarks/published_runs.py) gives one layout per model, so it can only say
where the search puts that layout. Figures 11-16 measure several layouts of one model on one GPU
count, and the paper's text states their order (section 5.3-5.5, quoted in ``FIGURES``): the
measurements issue 18's rank question asks about. The figures' bars are images and their values are
not used; only the order the text states is checked.

Each figure's runs are NVIDIA's reproduction scripts, ``examples/sc21/run_figure_N.sh`` in
NVIDIA/Megatron-LM (first version de7dc40, 2021-08-10), through ``examples/sc21/CONFIG.sh`` (s 2048,
V 51200, ``--fp16``): hidden size, heads, layers, tp, pp, micro and global batch as the script sets
them, ``--checkpoint-activations`` (full recomputation), ``--DDP-impl local`` (gradients all-reduced
after the backward, one fp16 bucket), the 1F1B schedule unless the script asks for virtual stages,
attention with the scores in HBM (``planner.attention_kernel: materialized``), whole layers recomputed
(``planner.full_recompute: whole_block``): the stack of the
Table 1 rows (``published_megatron.megatron_parallel``). Each run is a recipe planned by ``llmtrain plan
--json`` in this process (``planner_vs_published.plan_recipe_json``), and its throughput is the paper's
y axis, TFLOP/s per GPU counted by the paper's eq. 3 (``published_megatron.megatron_flops``) over the
predicted step time.

What this engine cannot run is left out and named: tensor parallelism across nodes (Figures 13 and
15's t = 16 and 32: ``plan`` refuses a TP group larger than a node), and fewer micro batches per
pipeline than stages (Figure 14's batch 32, Figure 11-16's smallest batches where that happens:
torch's 1F1B schedules refuse them; Megatron-LM ran them with a longer bubble).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from planner_vs_published import plan_recipe_json  # noqa: E402
from published_megatron import KERNELS, LOSS, WHOLE, megatron_flops, megatron_parallel  # noqa: E402
from published_runs import MEGATRON_GRADS, MEGATRON_PARAMS, gpt, recipe  # noqa: E402

SCRIPTS = "NVIDIA/Megatron-LM examples/sc21/run_figure_{n}.sh (de7dc40)"


def run(h: int, heads: int, layers: int, tp: int, pp: int, gpus: int, mbs: int, gbs: int,
        layers_per_virtual: int | None = None) -> dict:
    """One scripted run as a recipe (the Table 1 rows' Megatron-LM 2021 stack, local DDP)."""
    return recipe(gpt(h, heads, layers, tp), megatron_parallel(tp, pp, "local", layers_per_virtual, layers),
                  dict(seq_len=2048, micro_batch_size=mbs, global_batch_size=gbs, activation_checkpointing="full"),
                  gpus, "a100-80g", attention="materialized", dp_overlap=False, full_recompute=WHOLE, loss=LOSS,
                  block_kernels=KERNELS, grad_memory=MEGATRON_GRADS, param_memory=MEGATRON_PARAMS)


def tflops(r: dict) -> float:
    """Predicted TFLOP/s per GPU as the paper counts them (eq. 3 over the predicted step time)."""
    data = plan_recipe_json(r)
    m, t = r["model"], r["train"]
    return megatron_flops(t["global_batch_size"], m["layers"], m["hidden"]) / (data["world_size"] * data["time"]["step_s"]) / 1e12


def decreasing(values: list[float]) -> bool:
    return all(a > b for a, b in zip(values, values[1:]))


def fig11() -> dict:
    """Weak scaling of the pipeline: tp 8, pp 1-8 on 8 pp GPUs, 3 pp layers (h 20480), batch 8 and 128."""
    runs = {(gbs, pp): run(20480, 128, 3 * pp, 8, pp, 8 * pp, 1, gbs) for gbs in (8, 128) for pp in (1, 2, 4, 8)}
    got = {k: tflops(r) for k, r in runs.items()}
    scale = {gbs: got[(gbs, 8)] / got[(gbs, 1)] for gbs in (8, 128)}
    return dict(
        fig="11", runs="GPT h 20480, 3 pp layers, tp 8, pp 1 / 2 / 4 / 8 on 8 / 16 / 32 / 64 A100, micro 1, batch 8 and 128",
        says="\"the higher batch size scales better since the pipeline bubble is amortized over more microbatches\"",
        planned="; ".join(f"batch {g}: " + " / ".join(f"{got[(g, p)]:.0f}" for p in (1, 2, 4, 8)) for g in (8, 128))
        + f" (pp 8 / pp 1: {scale[8]:.2f} and {scale[128]:.2f})",
        holds=scale[128] > scale[8])


def fig12() -> dict:
    """Interleaved (2 layers per virtual stage: v 4) against 1F1B, 175B on 96 GPUs (tp 8, pp 12), batch 12-60."""
    batches = (12, 24, 36, 48, 60)
    inter = [tflops(run(12288, 96, 96, 8, 12, 96, 1, g, layers_per_virtual=2)) for g in batches]
    plain = [tflops(run(12288, 96, 96, 8, 12, 96, 1, g)) for g in batches]
    gain = [a / b for a, b in zip(inter, plain)]
    return dict(
        fig="12", runs="GPT-3 175B (96 layers, h 12288), tp 8, pp 12, 96 A100, micro 1, batch 12-60; 1F1B or 2 layers "
        "per virtual stage (v 4)",
        says="\"The interleaved schedule ... has higher computational performance than the non-interleaved (default) "
        "schedule. This gap closes as the batch size increases\"",
        planned="interleaved / 1F1B at batch " + ", ".join(f"{g}: {x:.2f}" for g, x in zip(batches, gain)),
        holds=all(x > 1 for x in gain) and decreasing(gain))


def fig13() -> dict:
    """(pp, tp) with pp x tp = 64, 162B (32 layers, h 20480), batch 32 and 128; tp 16 and 32 span nodes."""
    splits = ((8, 8), (16, 4), (32, 2))
    got = {(g, s): tflops(run(20480, 128, 32, s[1], s[0], 64, 1, g)) for g in (32, 128) for s in splits}
    return dict(
        fig="13", runs="GPT 162B (32 layers, h 20480), 64 A100, (pp, tp) = (8, 8), (16, 4), (32, 2), micro 1, batch 32 "
        "and 128 ((2, 32) and (4, 16): TP across nodes, refused)",
        says="\"we see peak performance when the tensor-parallel size is equal to the number of GPUs in a single node (8 "
        "with DGX A100 nodes)\"",
        planned="; ".join(f"batch {g}: " + " / ".join(f"{got[(g, s)]:.0f}" for s in splits) for g in (32, 128)),
        holds=all(got[(g, (8, 8))] == max(got[(g, s)] for s in splits) for g in (32, 128)))


def fig14() -> dict:
    """pp 2-32 with data parallelism, 5.9B (32 layers, h 3840), tp 1, batch 512 (32: fewer micro batches than stages)."""
    pps = (2, 4, 8, 16, 32)
    got = [tflops(run(3840, 32, 32, 1, pp, 64, 1, 512)) for pp in pps]
    return dict(
        fig="14", runs="GPT 5.9B (32 layers, h 3840), 64 A100, tp 1, (pp, dp) = (2, 32) ... (32, 2), micro 1, batch 512 "
        "(the script's batch 32 gives 1-16 micro batches per pipeline: refused)",
        says="\"for each batch size, the throughput decreases as the pipeline-parallel size increases\"",
        planned=" / ".join(f"{x:.0f}" for x in got), holds=decreasing(got))


def fig15() -> dict:
    """tp 2-8 with data parallelism, 5.9B, pp 1, batch 32, 128 and 512; tp 16 and 32 span nodes."""
    tps = (2, 4, 8)
    got = {g: [tflops(run(3840, 32, 32, tp, 1, 64, 1, g)) for tp in tps] for g in (32, 128, 512)}
    return dict(
        fig="15", runs="GPT 5.9B, 64 A100, pp 1, (tp, dp) = (2, 32), (4, 16), (8, 8), micro 1, batch 32, 128 and 512 "
        "(tp 16 and 32: across nodes, refused)",
        says="\"This all-to-all communication with tensor model parallelism dominates end-to-end training time ... as the "
        "tensor-model-parallel size increases, we perform smaller matrix multiplications on every GPU, decreasing "
        "utilization\" (throughput falls with tp)",
        planned="; ".join(f"batch {g}: " + " / ".join(f"{x:.0f}" for x in got[g]) for g in got),
        holds=all(decreasing(v) for v in got.values()))


def fig16() -> dict:
    """Micro batch 1-8 at (tp, pp) = (8, 8), 91B (32 layers, h 15360), batch 128 and 512."""
    mbs = (1, 2, 4, 8)
    got = {g: [tflops(run(15360, 128, 32, 8, 8, 64, b, g)) for b in mbs] for g in (128, 512)}
    best = {g: mbs[max(range(len(mbs)), key=lambda i: got[g][i])] for g in got}
    return dict(
        fig="16", runs="GPT 91B (32 layers, h 15360), 64 A100, (tp, pp) = (8, 8), micro 1 / 2 / 4 / 8, batch 128 and 512",
        says="\"the best microbatch size is 2 for this model\"",
        planned="; ".join(f"batch {g}: " + " / ".join(f"{x:.0f}" for x in got[g]) + f" (best micro {best[g]})" for g in got),
        holds=all(b == 2 for b in best.values()))


FIGURES = (fig11, fig12, fig13, fig14, fig15, fig16)


def evaluate() -> list[dict]:
    return [f() for f in FIGURES]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="the SC'21 paper's measured layout orders, planned")
    ap.add_argument("--tiny", action="store_true", help="CI smoke test (the whole benchmark: it plans in under a second)")
    ap.add_argument("--out", type=Path, default=None, help="also write OUT/sc21_figures.json")
    args = ap.parse_args(argv)
    results = evaluate()
    print("| figure | runs (NVIDIA's script) | the paper says | planned TFLOP/s/GPU (eq. 3), in the runs' order | order holds |")
    print("|---|---|---|---|---|")
    for r in results:
        print(f"| {r['fig']} | {r['runs']} | {r['says']} | {r['planned']} | {'yes' if r['holds'] else '**no**'} |")
    print(f"\n{sum(r['holds'] for r in results)} of {len(results)} stated orderings hold; scripts: "
          + SCRIPTS.format(n="11 ... 16"), file=sys.stderr)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "sc21_figures.json").write_text(json.dumps({"tiny": args.tiny, "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
