"""The published-run benchmark rows (benchmarks/published_runs.py) and the rank-quality helpers.

Pure and fast (no torchrun): every row must build a valid recipe and plan, the table in
docs/planner.md section 7 must be the script's current output (so a change to the model or the
rows that moves a number cannot leave the docs stale), and ``plan --search``'s pruning must not
lose the optimum of an fp8 recipe (the compute floor once used the bf16 peak: see the test).
"""

from __future__ import annotations

import contextlib
import io
import math
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import bloom_layouts  # noqa: E402
import planner_vs_published  # noqa: E402
import published_runs  # noqa: E402
import sc21_figures  # noqa: E402
import search_rank  # noqa: E402

from llmtrain.plan.api import plan_recipe, resolve_placement  # noqa: E402
from llmtrain.plan.search import search  # noqa: E402
from llmtrain.recipe.load import validate_recipe_dict  # noqa: E402

ROWS = published_runs.rows()


def test_every_row_is_a_valid_recipe_that_plans():
    """Each row names its source and its choices, validates as written, plans without errors, and
    gets a finite positive prediction in its own metric."""
    assert len(ROWS) >= 30
    names = [r["name"] for r in ROWS]
    assert len(set(names)) == len(names), "row names must be unique (the docs table is keyed by them)"
    for row in ROWS:
        assert row["source"] and row["url"] and row["note"], row["name"]
        assert row["metric"] in published_runs.METRICS, row["name"]
        assert row["published"] > 0, row["name"]
        plan = plan_recipe(validate_recipe_dict(row["recipe"]))
        assert plan.valid, (row["name"], [e.line() for e in plan.validation.errors])
        got = planner_vs_published.predict(row)["predicted"]
        assert math.isfinite(got) and got > 0, row["name"]


def test_docs_table_is_the_scripts_output():
    """docs/planner.md section 7 holds exactly the table ``planner_vs_published.py`` prints (default
    time model), line for line and in order: regenerate the docs when a prediction moves."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        planner_vs_published.main([])
    table = [line for line in out.getvalue().splitlines() if line.startswith("|")]
    docs = (REPO / "docs" / "planner.md").read_text()
    section = docs[docs.index("## 7. Predicted vs published"):docs.index("## 8.")]
    assert "\n".join(table) in section, "docs/planner.md section 7 is stale: paste `python benchmarks/planner_vs_published.py`"


def test_power_cap_slows_the_torchtitan_rows(tmp_path):
    """torchtitan's 500 W H100 rows are planned with cluster.gpu_power_w 500: the cap scales only the
    compute peak by 500/700, so the prediction drops, by at most that factor (communication and
    memory-bound time do not scale)."""
    row = next(r for r in ROWS if r["recipe"]["cluster"].get("gpu_power_w") == 500 and r["metric"] == "tokens/s/GPU")
    uncapped = dict(row, recipe=dict(row["recipe"], cluster={k: v for k, v in row["recipe"]["cluster"].items()
                                                             if k != "gpu_power_w"}))
    path = tmp_path / "uncapped.yaml"
    path.write_text(published_runs.recipe_yaml(uncapped))
    capped, full = planner_vs_published.predict(row)["predicted"], planner_vs_published.predict(uncapped, path=path)["predicted"]
    assert 500 / 700 - 1e-9 <= capped / full < 1.0


def test_recipe_files_are_the_generators_output():
    """benchmarks/published/ holds exactly one file per row, each what ``published_runs.py --write``
    writes (the benchmark plans the files: a row edited without rewriting them would be stale)."""
    want = {published_runs.recipe_file(i, r).name for i, r in enumerate(ROWS)}
    assert {p.name for p in published_runs.RECIPES.glob("*.yaml")} == want
    note = ""
    for i, row in enumerate(ROWS):
        note = note if row["note"] == "as above" else row["note"]
        assert published_runs.recipe_file(i, row).read_text() == published_runs.recipe_yaml(row, note), \
            f"{row['name']}: run `python benchmarks/published_runs.py --write`"


def test_the_real_cli_gives_the_benchmarks_number():
    """One row through a real ``llmtrain plan FILE --json`` process equals the benchmark's in-process
    number (the same code path), and the text plan marks the DP collectives it priced under
    ``planner.assume_dp_overlap``."""
    import json
    import subprocess

    i, row = next((i, r) for i, r in enumerate(ROWS) if r["source"].startswith("Megatron-Bridge") and
                  r["recipe"]["parallel"]["zero"] == 1 and r["recipe"]["cluster"]["nodes"] == 8)
    path = published_runs.recipe_file(i, row)
    cmd = [sys.executable, "-m", "llmtrain.cli.app", "plan", str(path)]
    out = subprocess.run([*cmd, "--json"], capture_output=True, text=True, check=True, timeout=120).stdout
    assert json.loads(out)["time"]["planner_assumptions"] == [  # time model v2, the default: its kernel settings too
        "planner.assume_dp_overlap true", "planner.attention_kernel cudnn", "planner.fp8_casts fused", "planner.tp_overlap true",
        "planner.dp_optimizer distributed", "planner.block_kernels fused", "planner.param_memory master",
        "planner.grad_memory persistent", "planner.loss megatron_fused"]
    assert json.loads(out)["time"]["tokens_per_s_per_gpu"] == pytest.approx(
        planner_vs_published.predict(row, "v2")["predicted"], rel=1e-12)
    text = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=120).stdout
    dp = [line for line in text.splitlines() if line.strip().startswith("dp ")]
    assert dp and all("planner.assume_dp_overlap" in line for line in dp)
    assert "assumes (planner only; the bundled engine does not do this): planner.assume_dp_overlap true" in text
    tp = [line for line in text.splitlines() if line.strip().startswith("tp ")]
    assert tp and any("planner.tp_overlap" in line for line in tp)


def test_tp_floor_is_below_the_exposed_tp_time_of_every_published_layout():
    """Branch and bound's TP floor (search_bounds.tp_floor) must stay under the TP seconds the cost
    model leaves exposed, or pruning may drop the fastest layout. Regression: it counted 4 all-reduce
    equivalents per layer in line under every setting, above what async TP, planner.tp_overlap and
    planner.tp_backward_overlap leave exposed (torchtitan's 70B async TP row: 3.34 s floor, 1.33 s
    exposed). Every published row with TP, as published and with planner.tp_overlap added."""
    from llmtrain.plan.costmodel import estimate  # noqa: PLC0415
    from llmtrain.plan.search_bounds import tp_floor  # noqa: PLC0415
    from llmtrain.recipe.gpus import GPUS  # noqa: PLC0415

    checked = 0
    for row in ROWS:
        if row["recipe"]["parallel"].get("tp", 1) == 1:
            continue
        for extra in ({}, {"tp_overlap": True}):
            d = {**row["recipe"], "planner": {**row["recipe"].get("planner", {}), **extra}}
            rc = validate_recipe_dict(d)
            p = plan_recipe(rc)
            exposed = estimate(rc, p.validation.dims, p.validation.batch, p.placement, hints=False).time.breakdown["tp_comm"]
            pa = rc.parallel
            dp = rc.cluster.nodes * rc.cluster.gpus_per_node // (pa.tp * pa.pp * pa.cp)
            floor = tp_floor(rc, GPUS[rc.cluster.gpu], pa.tp, pa.pp, pa.cp, dp, rc.train.global_batch_size)
            assert floor <= exposed * (1 + 1e-9), (row["name"], extra, floor, exposed)
            checked += 1
    assert checked >= 60


def test_pruned_search_keeps_the_fp8_optimum():
    """Branch and bound must not prune the fastest layout of an fp8 recipe. Regression: the compute
    floor used the bf16 peak, which overstates fp8 compute, so on this case (Llama 3 8B, fp8, one
    node of H100) the pruned search returned a layout 15 % slower than the exhaustive one. Equal
    step times to 1e-9 relative: both price layouts with the same function."""
    rc = validate_recipe_dict(dict(model=dict(preset="llama3-8b"), parallel=dict(),
                                   train=dict(seq_len=8192, global_batch_size=32, precision="fp8"),
                                   cluster=dict(nodes=1, gpus_per_node=8, gpu="h100-sxm")))
    placement = resolve_placement(rc)
    pruned = search(rc, placement, top=3, dp_overlap=True)
    full = search(rc, placement, top=3, dp_overlap=True, exhaustive=True)
    assert pruned.top[0].cost.time.step_s == pytest.approx(full.top[0].cost.time.step_s, rel=1e-9)


def test_kendall_tau_and_groups():
    """Tau-a: +1 for the same order, -1 reversed, 0 for a tie against an order; the several-layouts
    groups are Table 5's two schedules, the three vanilla / async TP pairs (Table 4; 2025-06 bf16
    and Float8), Tables 1 and 3's eager / torch.compile bf16 pairs, Korthikanti et al.'s four
    full / SP + selective recomputation pairs and the Zero Bubble paper's 21 schedule pairs."""
    assert search_rank.kendall_tau([1, 2, 3], [10, 20, 30]) == 1.0
    assert search_rank.kendall_tau([1, 2, 3], [30, 20, 10]) == -1.0
    assert search_rank.kendall_tau([1, 2], [5, 5]) == 0.0
    groups = list(search_rank.layout_groups(ROWS).values())
    assert [len(g) for g in groups] == [2] * 31, [[r["name"] for r in g] for g in groups]
    assert sorted(g[0]["source"] for g in groups) == ["Korthikanti et al. 2022"] * 4 + ["Zero Bubble Table 4"] * 12 + [
        "Zero Bubble Table 6"] * 9 + [
        "torchtitan H100 2024-12 Table 1", "torchtitan H100 2024-12 Table 3", "torchtitan H100 2024-12 Table 4",
        "torchtitan H100 2024-12 Table 5", "torchtitan async TP 2025-06", "torchtitan async TP 2025-06"]
    # the Zero Bubble pairs: one model, GPU count and batch, 1F1B against 1F1B-I (Table 4) or ZB-V (Table 6)
    zb = [sorted(r["recipe"]["parallel"]["pp_schedule"] for r in g) for g in groups if g[0]["source"].startswith("Zero")]
    assert zb == [["1f1b", "interleaved-1f1b"]] * 12 + [["1f1b", "zbv"]] * 9
    tp_pairs = [g for g in groups if "Table 5" not in g[0]["source"] and "Table 1" not in g[0]["source"]
                and "Table 3" not in g[0]["source"] and "Korthikanti" not in g[0]["source"]
                and not g[0]["source"].startswith("Zero")]
    assert all(g[0]["name"].endswith("full recomputation") and g[1]["name"].endswith("SP + selective recomputation")
               for g in groups if "Korthikanti" in g[0]["source"])
    assert all(("async TP" in g[1]["name"]) != ("async TP" in g[0]["name"]) for g in tp_pairs)
    assert all(g[0]["name"].endswith("eager") and g[1]["name"].endswith("compile") for g in groups
               if g[0]["source"].endswith(("Table 1", "Table 3")))


def test_sc21_figure_orderings_and_their_docs_table():
    """The layout orders the Megatron-LM SC'21 paper states for its Figures 11-16 (measured), planned
    with NVIDIA's scripted runs: the model agrees on 11-15 (pipeline weak scaling by batch,
    interleaving and its closing gap, TP 8 peak against PP 16 / 32, PP and TP against DP); Figure 16
    (best micro batch 2) holds at batch 512 but not 128, a documented miss. A model change that breaks
    one of 11-15 must say why in docs/planner.md. The docs carry the script's table verbatim."""
    results = sc21_figures.evaluate()
    assert [r["fig"] for r in results] == ["11", "12", "13", "14", "15", "16"]
    assert {r["fig"]: r["holds"] for r in results} == {"11": True, "12": True, "13": True, "14": True, "15": True,
                                                       "16": False}
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        sc21_figures.main([])
    table = "\n".join(line for line in out.getvalue().splitlines() if line.startswith("|"))
    assert table in (REPO / "docs" / "planner.md").read_text(), \
        "docs/planner.md Rank quality is stale: paste `python benchmarks/sc21_figures.py`"


def test_bloom_layout_sweep_order_and_its_docs_table():
    """BigScience's timed layouts of a 181B model on 384 A100 (benchmarks/bloom_layouts.py): the
    question behind the SC'21 rank misses, TP 8 against a smaller TP with a longer pipeline, measured
    on A100 by someone else. Held: every planned step within 10 % of the measured one (all are within
    9 %, median 4.8 %: the single-iteration readings themselves spread a few %, so this is about the
    model's error on the Megatron rows); at PP 6, PP 12 and in BLOOM's final shape the best TP 4 layout
    is planned faster than the best TP 8 one, as measured; Kendall tau over the eleven at least 0.4 (it
    is +0.49: the layouts span 110-131 s, so pairs within the model's error flip). A model change that
    breaks one must say why in docs/planner.md. The docs carry the script's table verbatim."""
    result = bloom_layouts.evaluate()
    assert len(result["rows"]) == 11
    assert all(abs(r["error"]) < 0.10 for r in result["rows"]), result["rows"]
    assert result["kendall_tau"] >= 0.4
    pairs = bloom_layouts.fastest_tp_pairs(result)  # the measured fastest TP 4 and TP 8 layouts per depth
    assert sorted(pairs) == [6, 12]
    for fastest in pairs.values():
        assert fastest[8]["measured_s"] > fastest[4]["measured_s"], fastest
        assert fastest[8]["planned_s"] > fastest[4]["planned_s"], fastest
    final = {r["tp"]: r for r in result["final"]}
    assert final[8]["measured_s"] > final[4]["measured_s"] and final[8]["planned_s"] > final[4]["planned_s"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        bloom_layouts.main([])
    table = "\n".join(line for line in out.getvalue().splitlines() if line.startswith("|"))
    assert table in (REPO / "docs" / "planner.md").read_text(), \
        "docs/planner.md Rank quality is stale: paste `python benchmarks/bloom_layouts.py`"
