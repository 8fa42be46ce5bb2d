"""The planner's predictions against published training throughput (the table in docs/planner.md).

    python benchmarks/planner_vs_published.py                    # prints the markdown table (time model v1)
    python benchmarks/planner_vs_published.py --time-model both  # v1 and v2 side by side (section 9.1)
    python benchmarks/planner_vs_published.py --time-model v2 --without interference,fa2   # what terms move
    python benchmarks/planner_vs_published.py --memory           # peak memory against torchtitan's readings
    python benchmarks/planner_vs_published.py --time-model v2 --set cluster.gpu_variability=0   # a setting's effect

Each row is a published run written as a recipe file, ``benchmarks/published/NN-<run>.yaml``
(generated from benchmarks/published_runs.py with ``--write``; the row's source and choices are
in the file's first lines), and planned with the CLI:

    llmtrain plan benchmarks/published/NN-<run>.yaml --json --nodes N --gpus-per-node G \\
        --set cluster.time_model=v1|v2

in this process through the typer app (``typer.testing.CliRunner``: the command's own code,
argument parsing included; 86 plans in about a second instead of a minute of interpreter
starts). ``--nodes`` / ``--gpus-per-node`` repeat the file's ``cluster`` so that an enclosing
Slurm allocation (which ``plan`` would otherwise plan for) cannot change a row. What the
published stacks do and the engine does not (the zero 0/1 rows' overlapped gradient reduction
under PP and ZeRO-1's parameter gather) is the recipe's ``planner.assume_dp_overlap``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from published_runs import recipe_file, rows  # noqa: E402  (the row data: benchmarks/published_runs.py)

METRIC_KEY = {"hw TFLOP/s/GPU": "hw_tflops_per_gpu", "TFLOP/s/GPU (MFU)": "tflops_per_gpu",
              "tokens/s/GPU": "tokens_per_s_per_gpu"}


def plan_json(path: Path, overrides: list[str] = ()) -> dict:
    """``llmtrain plan PATH --json`` (in this process) as a dict; a failed plan ends the benchmark."""
    import yaml  # noqa: PLC0415
    from typer.testing import CliRunner  # noqa: PLC0415

    from llmtrain.cli import plan as _plan  # noqa: F401, PLC0415  (registers the command)
    from llmtrain.cli.app import app  # noqa: PLC0415

    cluster = yaml.safe_load(path.read_text())["cluster"]
    args = ["plan", str(path), "--json", "--nodes", str(cluster["nodes"]), "--gpus-per-node", str(cluster["gpus_per_node"])]
    for o in overrides:
        args += ["--set", o]
    result = CliRunner().invoke(app, args)
    if result.exit_code != 0:
        raise SystemExit(f"{path.name}: llmtrain plan exited {result.exit_code}: {result.output.strip()[-500:]}")
    return json.loads(result.stdout)


def plan_recipe_json(recipe: dict) -> dict:
    """:func:`plan_json` of a recipe given as a dict (written to a temporary file: the CLI reads files)."""
    import tempfile  # noqa: PLC0415

    import yaml  # noqa: PLC0415

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "run.yaml"
        path.write_text(yaml.safe_dump(recipe, sort_keys=False))
        return plan_json(path)


def predict(row: dict, time_model: str = "v1", path: Path | None = None, overrides: list[str] = ()) -> dict:
    """The row's metric as ``plan --json`` predicts it (``path``: default the row's recipe file;
    ``overrides``: more ``--set KEY=VALUE`` for every row)."""
    if path is None:
        path = recipe_file(rows_index()[row["name"]], row)
    data = plan_json(path, [f"cluster.time_model={time_model}", *overrides])
    t, mem = data["time"], data["memory"]
    value = t[METRIC_KEY[row["metric"]]]
    if "flops_per_step" in row:  # the source's own FLOP count over the predicted time (published_megatron.megatron_flops)
        value = row["flops_per_step"] / (data["world_size"] * t["step_s"]) / 1e12
    return {"predicted": value, "mfu": t["mfu"], "fits": mem["fits"], "peak_gib": mem["peak_gib"],
            "breakdown_s": t["breakdown_s"]}


_INDEX: dict[str, int] = {}


def rows_index() -> dict[str, int]:
    if not _INDEX:
        _INDEX.update({r["name"]: i for i, r in enumerate(rows())})
    return _INDEX


TERMS = {"interference": "(a) compute slowed beside NCCL's CTAs", "blocks": "(b) FSDP per-block waits",
         "launch": "(c) eager launches", "fa2": "(d) the engine's SDPA as FlashAttention-2 (off: FA3 rates)",
         "kernels": "the rows' planner.attention_kernel (off: every row the engine's kernel)"}


def switch_off(terms: list[str]) -> None:
    """``--without T,...``: turn v2 terms off in this process (docs/planner.md 9.1, what each term
    moves) by their constants: no NCCL CTAs, v1's pooled FSDP window, free launches, FA3's rates
    as the engine's, or the engine's kernel for every row. For that table only; never a default."""
    import dataclasses  # noqa: PLC0415

    from llmtrain.plan import launchtime, ops, steptime  # noqa: PLC0415

    bad = [t for t in terms if t not in TERMS]
    if bad:
        raise SystemExit(f"--without {','.join(bad)}: use some of {', '.join(TERMS)}")
    if "interference" in terms:
        ops.NCCL_CTAS = 1 << 30
    if "blocks" in terms:
        steptime.fsdp_block_exposed = steptime._fsdp_exposed
    if "launch" in terms:
        launchtime.LAUNCH_S = 0.0
    if "fa2" in terms:
        from llmtrain.plan import attentiontime  # noqa: PLC0415

        fractions = attentiontime.attention_fractions
        attentiontime.attention_fractions = lambda kernel, key, n: fractions("fa3" if kernel == "engine" else kernel,
                                                                              key, n)
    if "kernels" in terms:
        shape_of = ops.shape_of
        ops.shape_of = lambda *a, **k: dataclasses.replace(shape_of(*a, **k), attention="engine")


def median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def memory_table() -> None:
    """``--memory``: the rows that publish a memory reading (torchtitan's ``Memory(GiB)``: the
    largest ``torch.cuda.max_memory_reserved`` over the ranks, read every 10 steps; the Zero Bubble
    paper's ``Memory (GB)``, read as GiB: benchmarks/published_zerobubble.py) against the planner's
    peak (allocator reserve and fragmentation included, section 1.3); the time model does not change
    memory. Median and rows within 15 % on stderr, over all rows and per family (torchtitan's, the
    issue's acceptance, with Trainy's torchtitan runs; Zero Bubble's)."""
    print("| source | run | published GiB | predicted GiB | error | note |")
    print("|---|---|---:|---:|---:|---|")
    family: dict[str, list[float]] = {}
    for i, row in enumerate(rows()):
        if "published_memory_gib" not in row:
            continue
        p = predict(row, "v1", recipe_file(i, row))
        err = p["peak_gib"] / row["published_memory_gib"] - 1
        family.setdefault("Zero Bubble" if row["source"].startswith("Zero Bubble") else "torchtitan", []).append(abs(err))
        print(f"| {row['source']} | {row['name']} | {row['published_memory_gib']:.1f} | {p['peak_gib']:.1f} | {err:+.0%} | "
              f"{row['note']} |")
    errs = [e for es in family.values() for e in es]
    print(f"\nmemory: median |error| {median(errs):.1%}, within 15%: {sum(e <= 0.15 for e in errs)} of {len(errs)}",
          file=sys.stderr)
    for name, es in family.items():
        print(f"memory, {name}: median |error| {median(es):.1%}, within 15%: {sum(e <= 0.15 for e in es)} of {len(es)}",
              file=sys.stderr)


def main(argv: list[str] | None = None) -> None:
    """``--time-model v1|v2|both`` (default v1): ``both`` prints v1 and v2 side by side, and per
    source group the median |error| and rows within 15 % (stderr). ``--without T,...``: v2 with
    those terms off (:data:`TERMS`, :func:`switch_off`). ``--set KEY=VALUE`` (repeatable): the
    same override on every row (a setting's effect, e.g. ``cluster.gpu_variability=0``)."""
    args = sys.argv[1:] if argv is None else argv
    if "--memory" in args:
        memory_table()
        return
    models = ["v1"]
    if "--time-model" in args:
        i = args.index("--time-model")
        choice = args[i + 1] if i + 1 < len(args) else ""
        if choice not in ("v1", "v2", "both"):
            raise SystemExit(f"--time-model {choice!r}: use v1, v2 or both")
        models = ["v1", "v2"] if choice == "both" else [choice]
    if "--without" in args:
        i = args.index("--without")
        switch_off([t for t in (args[i + 1] if i + 1 < len(args) else "").split(",") if t])
    overrides = [args[i + 1] for i, a in enumerate(args[:-1]) if a == "--set"]
    pred_cols = " | ".join(f"predicted {m} | error {m}" for m in models)
    print(f"| source | run | metric | published | {pred_cols} | fits (peak GiB) | note |")
    print("|---|---|---|---:|" + "---:|---:|" * len(models) + "---|---|")
    errors: dict[str, list[float]] = {m: [] for m in models}
    groups: dict[str, dict[str, list[float]]] = {}
    for i, row in enumerate(rows()):
        cells = []
        for m in models:
            p = predict(row, m, recipe_file(i, row), overrides)
            err = p["predicted"] / row["published"] - 1
            errors[m].append(abs(err))
            groups.setdefault(row["source"].split(",")[0], {k: [] for k in models})[m].append(abs(err))
            cells.append(f"{p['predicted']:,.0f}" + (f" ({p['mfu']:.0%})" if "published_mfu" in row else "")
                         + f" | {err:+.0%}")
        pub = f"{row['published']:,}" + (f" ({row['published_mfu']:.0%})" if "published_mfu" in row else "")
        print(f"| {row['source']} | {row['name']} | {row['metric']} | {pub} | {' | '.join(cells)} | "
              f"{'yes' if p['fits'] else 'no'} ({p['peak_gib']:.0f}) | {row['note']} |")
    for m, errs in errors.items():
        print(f"\n{m}: median |error| {median(errs):.2%}, within 15%: {sum(e <= 0.15 for e in errs)} "
              f"of {len(errs)}", file=sys.stderr)
    if len(models) > 1:
        print("\n| source | rows | " + " | ".join(f"median {m} | within 15 % {m}" for m in models) + " |", file=sys.stderr)
        print("|---|---:|" + "---:|---:|" * len(models), file=sys.stderr)
        for source, by in groups.items():
            cells = " | ".join(f"{median(by[m]):.0%} | {sum(e <= 0.15 for e in by[m])}" for m in models)
            print(f"| {source} | {len(by[models[0]])} | {cells} |", file=sys.stderr)


if __name__ == "__main__":
    main()
