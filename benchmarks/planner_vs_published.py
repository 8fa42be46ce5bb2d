"""The planner's predictions against published training throughput (the table in docs/planner.md).

    python benchmarks/planner_vs_published.py            # prints the markdown table

Each row (benchmarks/published_runs.py) is a published run rebuilt as a recipe for the planner;
where the source leaves a setting out, the choice made here is in the row's note. Published systems overlap the
data-parallel gradient reduction with backward (Megatron-LM's and Meta's DDP buckets), so the
rows use ``dp_overlap=True``; the engine itself does not (docs/planner.md).
"""

from __future__ import annotations

import sys
from pathlib import Path

from llmtrain.plan.api import plan_recipe
from llmtrain.plan.costmodel import estimate
from llmtrain.recipe.load import validate_recipe_dict

sys.path.insert(0, str(Path(__file__).resolve().parent))
from published_runs import rows  # noqa: E402  (the row data: benchmarks/published_runs.py)


def predict(row: dict, time_model: str = "v1") -> dict:
    data = dict(row["recipe"])
    data["cluster"] = dict(data["cluster"], time_model=time_model)
    data["parallel"] = dict(data["parallel"], dp_shard=-1)
    split = None
    model = data["model"]
    layers = model.get("layers") or {"llama3-405b": 126, "deepseek-v3": 61}.get(model.get("preset"), 0)
    pp, v = data["parallel"].get("pp", 1), data["parallel"].get("pp_virtual_stages", 1)
    if pp > 1 and layers % (pp * v):
        from llmtrain.plan.search import balanced_split

        split = balanced_split(layers, pp * v)
        data["parallel"]["pp_layers_per_stage"] = split
    recipe = validate_recipe_dict(data)
    plan = plan_recipe(recipe)
    if not plan.valid:
        raise SystemExit(f"{row['name']}: {[e.line() for e in plan.validation.errors]}")
    v = plan.validation
    cost = estimate(recipe, v.dims, v.batch, plan.placement, dp_overlap=True, hints=False)
    t = cost.time
    value = {"hw TFLOP/s/GPU": t.hw_tflops_per_gpu, "TFLOP/s/GPU (MFU)": t.tflops_per_gpu,
             "tokens/s/GPU": t.tokens_per_s_per_gpu}[row["metric"]]
    return {"predicted": value, "mfu": t.mfu, "fits": cost.fits, "peak_gib": cost.worst.peak / 2**30}


def main(argv: list[str] | None = None) -> None:
    """``--time-model v1|v2|both`` (default v1): ``both`` prints v1 and v2 side by side."""
    args = sys.argv[1:] if argv is None else argv
    models = ["v1"]
    if "--time-model" in args:
        i = args.index("--time-model")
        choice = args[i + 1] if i + 1 < len(args) else ""
        if choice not in ("v1", "v2", "both"):
            raise SystemExit(f"--time-model {choice!r}: use v1, v2 or both")
        models = ["v1", "v2"] if choice == "both" else [choice]
    pred_cols = " | ".join(f"predicted {m} | error {m}" for m in models)
    print(f"| source | run | metric | published | {pred_cols} | fits (peak GiB) | note |")
    print("|---|---|---|---:|" + "---:|---:|" * len(models) + "---|---|")
    errors: dict[str, list[float]] = {m: [] for m in models}
    for row in rows():
        cells = []
        for m in models:
            p = predict(row, m)
            err = p["predicted"] / row["published"] - 1
            errors[m].append(abs(err))
            cells.append(f"{p['predicted']:,.0f}" + (f" ({p['mfu']:.0%})" if "published_mfu" in row else "")
                         + f" | {err:+.0%}")
        pub = f"{row['published']:,}" + (f" ({row['published_mfu']:.0%})" if "published_mfu" in row else "")
        print(f"| {row['source']} | {row['name']} | {row['metric']} | {pub} | {' | '.join(cells)} | "
              f"{'yes' if p['fits'] else 'no'} ({p['peak_gib']:.0f}) | {row['note']} |")
    for m, errs in errors.items():
        print(f"\n{m}: median |error| {sorted(errs)[len(errs) // 2]:.0%}, within 15%: {sum(e <= 0.15 for e in errs)} "
              f"of {len(errs)}", file=sys.stderr)


if __name__ == "__main__":
    main()
