"""Rank quality of ``plan --search`` against published layouts (docs/planner.md section 7).

    python benchmarks/search_rank.py                  # prints the markdown tables (about 30 s)
    python benchmarks/search_rank.py --tiny --out D   # CI smoke test: one small run, D/search_rank.json

For every published run in benchmarks/published_runs.py that a layout search can compare (the
sources that chose their layout for speed: Megatron-LM SC'21 Table 1 and its README's H100 table, Llama 3 Table 4, NeMo's
and Megatron-Bridge's (H100) performance summaries, torchtitan's and llm-foundry's H100 tables), the run's recipe is searched
(``llmtrain.plan.search.search``, the ``plan --search`` code path, with ``dp_overlap=True`` as in
the published comparison) and the table gives where the published **split** (tp, cp, pp, ep)
first appears. Decisions:

- the split, not the whole layout, is matched: the search also picks schedule, virtual stages,
  zero, micro batch and recomputation for each split, and picks the least recomputation that
  fits *this* engine's memory, which is not what the source ran (a published layout that does
  not fit here in its own recomputation is still matched by its split);
- the rank counts distinct splits in the search's order (several layouts of one split count once);
  a split not among the first ``TOP`` layouts is reported as ``> n`` (n: distinct splits seen);
- the searched world, model, sequence length and global batch are the published ones; the
  power cap (torchtitan's 500 W) is kept.

Kendall tau is given where one source publishes several layouts of one model on one GPU count
(torchtitan's Table 5: 1F1B vs interleaved 1F1B): the published order against the order of the
planner's predictions for those same layouts (``planner_vs_published.predict``). A pooled tau over
every row of a source (each a different run) is also printed: it says whether the model orders
runs as the measurements do, a weaker statement than layout ranking.
"""

from __future__ import annotations

import argparse
import json
import sys
from itertools import combinations
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from planner_vs_published import predict  # noqa: E402
from published_runs import rows  # noqa: E402

from llmtrain.plan.api import resolve_placement  # noqa: E402
from llmtrain.plan.search import search  # noqa: E402
from llmtrain.plan.search_keep import keep_text  # noqa: E402
from llmtrain.recipe.load import validate_recipe_dict  # noqa: E402

NEAR = 0.05  # a published split this close to the search's #1 is inside the model's own error (docs/planner.md 7)
TOP = 200  # layouts the search returns per run (distinct splits are fewer); enough to reach the published zero
SEARCHED = ("Megatron-LM Table 1", "Llama 3 Table 4", "NeMo performance summary", "torchtitan H100 2024-12 Table 5",
            "llm-foundry H100 tables", "Megatron-Bridge 25.11 DGX-H100", "Megatron-LM README H100")


def split_of(parallel: dict) -> tuple[int, int, int, int]:
    return (parallel.get("tp", 1), parallel.get("cp", 1), parallel.get("pp", 1), parallel.get("ep", 1))


def label(s: tuple[int, int, int, int]) -> str:
    return " ".join(f"{k} {v}" for k, v in zip(("tp", "cp", "pp", "ep"), s) if v > 1 or k == "tp")


def search_rank(row: dict, top: int = TOP, time_model: str = "v2") -> dict:
    """Where the row's published split lands in ``plan --search`` for its model, GPUs and batch."""
    data = dict(row["recipe"])
    data["cluster"] = dict(data["cluster"], time_model=time_model)
    data["parallel"] = {k: v for k, v in data["parallel"].items() if k != "pp_layers_per_stage"}
    recipe = validate_recipe_dict(data)
    placement = resolve_placement(recipe)
    res = search(recipe, placement, top=top, dp_overlap=True)
    # what the published stack could run: its ZeRO stage, no SP where it had none, and what the row says
    # the stack lacked (Megatron-LM 2021: full recomputation only, equal stages); a kept search gives the
    # whole order among those layouts, not the few in the unconstrained top
    kept = {"parallel.zero": recipe.parallel.zero} | ({} if recipe.parallel.sequence_parallel else
                                                       {"parallel.sequence_parallel": False}) | row.get("stack", {})
    stack = search(recipe, placement, top=top, dp_overlap=True, keep=kept)
    want = split_of(row["recipe"]["parallel"])
    out = {"published": want, "seconds": res.seconds, "kept_seconds": stack.seconds}
    for tag, found in (("", res), ("kept_", stack)):
        splits: list[tuple] = []
        for c in found.top:
            o = c.overrides
            s = (o["parallel.tp"], o["parallel.cp"], o["parallel.pp"], o["parallel.ep"])
            if s not in splits:
                splits.append(s)
        out[tag + "rank"] = splits.index(want) + 1 if want in splits else None
        out[tag + "seen"] = len(splits)
        # how much slower the model thinks the published split is than the search's #1 (its best layout)
        mine = next((c for c in found.top if split_of({k.split(".", 1)[1]: v for k, v in c.overrides.items()}) == want), None)
        out[tag + "gap"] = mine.cost.time.step_s / found.top[0].cost.time.step_s - 1 if mine else None
    best = res.top[0] if res.top else None
    if best:
        o = best.overrides
        out["best"] = (o["parallel.tp"], o["parallel.cp"], o["parallel.pp"], o["parallel.ep"])
        out["best_zero"] = o["parallel.zero"]
    out["best_tokens"] = best.cost.time.tokens_per_s_per_gpu if best else 0.0
    return out


def kendall_tau(a: list[float], b: list[float]) -> float:
    """Tau-a over all pairs (ties count zero)."""
    pairs = list(combinations(range(len(a)), 2))
    s = sum(((a[i] > a[j]) - (a[i] < a[j])) * ((b[i] > b[j]) - (b[i] < b[j])) for i, j in pairs)
    return s / len(pairs) if pairs else float("nan")


def layout_groups(all_rows: list[dict]) -> dict[str, list[dict]]:
    """Rows of one source with the same model, GPU count, sequence and batch: several layouts of one run."""
    groups: dict[str, list[dict]] = {}
    for r in all_rows:
        rc = r["recipe"]
        key = (r["source"], str(rc["model"]), rc["cluster"]["nodes"], rc["train"]["seq_len"],
               rc["train"]["global_batch_size"], rc["train"].get("precision"))
        groups.setdefault(str(key), []).append(r)
    return {k: g for k, g in groups.items() if len(g) > 1}


def main() -> None:
    ap = argparse.ArgumentParser(description="plan --search against published layouts")
    ap.add_argument("--tiny", action="store_true", help="CI smoke test: the first Megatron run only, top 20")
    ap.add_argument("--out", type=Path, default=None, help="also write OUT/search_rank.json")
    ap.add_argument("--time-model", choices=("v1", "v2"), default="v2", help="cluster.time_model of every search (default v2, the planner's)")
    args = ap.parse_args()
    all_rows = rows()[:1] if args.tiny else rows()
    results = []
    print("| source | run | published split (zero) | search's #1 (tokens/s/GPU) | rank of published split | "
          "rank, stack kept | step time vs #1 (all / kept) | search s |")
    print("|---|---|---|---|---:|---:|---:|---:|")
    ranks: dict[str, list] = {}
    stacks: dict[str, dict] = {}  # what each source's rows say their stack lacked (published_runs.py "stack")
    seen_runs = set()
    for r in all_rows:
        if r["source"] not in SEARCHED:
            continue
        key = (r["source"], str(r["recipe"]["model"]), r["recipe"]["cluster"]["nodes"], r["recipe"]["train"]["seq_len"],
               split_of(r["recipe"]["parallel"]))
        if key in seen_runs:  # the same split under another schedule: one search answers both
            continue
        seen_runs.add(key)
        x = search_rank(r, top=20 if args.tiny else TOP, time_model=args.time_model)
        results.append({"source": r["source"], "run": r["name"], **{k: v for k, v in x.items()}})
        ranks.setdefault(r["source"], []).append((x["rank"], x["kept_rank"], x["kept_gap"]))
        stacks[r["source"]] = r.get("stack", {})
        rank, same = (str(x[k + "rank"]) if x[k + "rank"] else f"> {x[k + 'seen']}" for k in ("", "kept_"))
        best = f"{label(x['best'])} zero {x['best_zero']} ({x['best_tokens']:,.0f})" if "best" in x else "nothing fits"
        zero = r["recipe"]["parallel"].get("zero", 0)
        gaps = " / ".join(f"{x[k]:+.1%}" if x[k] is not None else "-" for k in ("gap", "kept_gap"))
        print(f"| {r['source']} | {r['name']} | {label(x['published'])} (zero {zero}) | {best} | {rank} | {same} | "
              f"{gaps} | {x['seconds']:.2f} |")
    print()
    for source, rs in ranks.items():
        top3, same3 = (sum(1 for k in rs if k[i] and k[i] <= 3) for i in (0, 1))
        near = sum(1 for k in rs if k[2] is not None and k[2] <= NEAR)
        print(f"- {source}: published split in the top 3 for {top3} of {len(rs)} runs; "
              f"{same3} of {len(rs)} with the published stack kept (its zero; no SP where it had none{'; ' + keep_text(stacks[source]) if stacks[source] else ''}); "
              f"within {NEAR:.0%} of #1's step time (kept) for {near} of {len(rs)}")
    print("\n| source | layouts (published -> predicted tokens/s/GPU) | Kendall tau |")
    print("|---|---|---:|")
    for group in layout_groups(all_rows).values():
        pub = [r["published"] for r in group]
        pred = [predict(r, args.time_model)["predicted"] for r in group]
        text = "; ".join(f"{r['name'].rsplit(', ', 1)[-1]} {p:,} -> {q:,.0f}" for r, p, q in zip(group, pub, pred))
        print(f"| {group[0]['source']} | {text} | {kendall_tau(pub, pred):+.2f} |")
    print("\n| source | rows | pooled Kendall tau (each row a different run) |")
    print("|---|---:|---:|")
    by_source: dict[str, list[dict]] = {}
    for r in all_rows:
        by_source.setdefault(r["source"].split(" Table")[0].split(" 20")[0], []).append(r)
    for source, group in by_source.items():
        if len(group) < 3:
            continue
        tau = kendall_tau([r["published"] for r in group], [predict(r, args.time_model)["predicted"] for r in group])
        print(f"| {source} | {len(group)} | {tau:+.2f} |")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "search_rank.json").write_text(json.dumps({"tiny": args.tiny, "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
