"""``llmtrain plan`` / ``llmtrain schema`` as a user runs them: real subprocesses, real files.

The console script is not installed in a fresh clone, so the tests run
``python -m llmtrain.cli.app`` (the same ``main`` the ``llmtrain`` script calls).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from tests.helpers_plan import CLI, REPO

ENV = {k: v for k, v in os.environ.items() if k != "LLMTRAIN_DEBUG"}


def run(*args: str, env: dict | None = None, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout, env=env or ENV)


@pytest.fixture(scope="module")
def llama70b_json():
    out = run("plan", "recipes/llama3-70b.yaml", "--nodes", "64", "--gpus-per-node", "8", "--json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_plan_prints_layout_and_batch_math():
    out = run("plan", "recipes/llama3-70b.yaml", "--nodes", "64", "--gpus-per-node", "8")
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "llmtrain plan llama3-70b: valid, world size 512" in text
    assert "Layout pp 4 x dp_replicate 1 x dp_shard 16 x cp 1 x tp 8" in text
    assert "schedule interleaved-1f1b (v=2)" in text
    assert "Batch global 512 sequences = micro 1 x grad_accum 32 x dp 16; 32 microbatches/step" in text
    assert "4,194,304 tokens/step" in text
    assert "Ranks on nodes" in text and "61 more nodes" in text
    assert "70.55B parameters" in text
    assert "Traceback" not in out.stderr


def test_plan_json_has_documented_keys(llama70b_json):
    d = llama70b_json
    assert {"schema_version", "valid", "errors", "warnings", "recipe", "world_size", "model", "parallel", "batch",
            "pipeline", "layout"} <= set(d)
    assert d["schema_version"] == 1 and d["valid"] is True and d["errors"] == [] and d["world_size"] == 512
    assert d["recipe"] == "llama3-70b"
    b = d["batch"]
    assert (b["dp"], b["micro_batch_size"], b["grad_accum"], b["microbatches"], b["global_batch_size"],
            b["seq_len"], b["tokens_per_step"]) == (16, 1, 32, 32, 512, 8192, 4194304)
    p = d["parallel"]
    assert (p["pp"], p["dp_replicate"], p["dp_shard"], p["cp"], p["tp"], p["ep"], p["dp"]) == (4, 1, 16, 1, 8, 1, 16)
    assert p["dp_mode"].startswith("ZeRO-1") and p["reshard_after_forward"] is False and p["sequence_parallel"] is True
    assert d["model"]["params_total"] == d["model"]["params_active"] and d["model"]["moe"] is None
    assert 0 < d["pipeline"]["bubble_fraction"] < 0.1
    lay = d["layout"]
    assert lay["mesh_dims"] == ["pp", "dp_replicate", "dp_shard", "cp", "tp"] and lay["mesh_shape"] == [4, 1, 16, 1, 8]
    assert len(lay["nodes"]) == 64 and len(lay["rank_coords"]) == 512
    assert lay["nodes"][1] == {"node": 1, "host": "node1", "slots": 8, "ranks": [8, 15],
                               "coords_range": {"pp": [0, 0], "dp_replicate": [0, 0], "dp_shard": [1, 1],
                                                "cp": [0, 0], "tp": [0, 7]}}
    assert lay["rank_coords"][9] == [0, 0, 1, 0, 1]
    assert lay["groups"]["tp"] == {"size": 8, "count": 64, "first": list(range(8)), "crosses_nodes": False}
    assert lay["groups"]["pp"]["first"] == [0, 128, 256, 384] and lay["groups"]["pp"]["crosses_nodes"] is True
    assert lay["ep"] is None


INVALID = textwrap.dedent("""\
    model: {preset: debug-dense, kv_heads: 3}
    parallel: {ep: 2, pp: 2, pp_schedule: gpipe, pp_virtual_stages: 2}
    train: {seq_len: 1024}
    data: {source: memmap}
""")


def test_invalid_layout_reports_every_problem(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(INVALID)
    out = run("plan", str(path), "--nodes", "1", "--gpus-per-node", "8")
    assert out.returncode == 2 and "Traceback" not in out.stdout + out.stderr
    assert "bad: invalid: 6 error(s)" in out.stdout
    for line in ("error   model.kv_heads: heads (8) not divisible by kv_heads (3); use kv_heads in {1, 2, 4, 8}",
                 "error   parallel.ep: ep is 2 but the model is dense",
                 "error   parallel.pp_virtual_stages: gpipe runs one stage per rank, got 2",
                 "error   train.seq_len: seq_len (1024) exceeds model.max_seq_len (512)",
                 "error   data.path: source memmap needs a path",
                 "error   train.global_batch_size: 1 microbatches per step but gpipe with pp 2 needs >= 2"):
        assert line in out.stdout, out.stdout
    js = run("plan", str(path), "--nodes", "1", "--gpus-per-node", "8", "--json")
    assert js.returncode == 2
    d = json.loads(js.stdout)
    assert d["valid"] is False and d["layout"] is None and len(d["errors"]) == 6
    assert all(set(e) == {"path", "message", "hint"} and all(e.values()) for e in d["errors"])


def test_recipe_errors_one_line_each(tmp_path):
    path = tmp_path / "typo.yaml"
    path.write_text("model: {preset: debug-dense}\nparallel: {tpp: 2, pp: 0}\ntrain: {seq_len: '8'}\n")
    out = run("plan", str(path))
    assert out.returncode == 2 and out.stdout == "" and "Traceback" not in out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 3 and all(line.startswith("error: ") for line in lines)
    assert "error: parallel.tpp: unknown key; did you mean parallel.tp or parallel.pp? valid keys here: tp, pp, cp, ep" in out.stderr
    assert "error: parallel.pp: " in out.stderr and "error: train.seq_len: " in out.stderr


def test_cli_flag_and_set_errors(tmp_path):
    out = run("plan", "recipes/debug.yaml", "--set", "parallel.tp")
    assert out.returncode == 2 and "error: --set: --set 'parallel.tp' is not KEY=VALUE" in out.stderr
    out = run("plan", "recipes/debug.yaml", "--nodes", "0")
    assert out.returncode == 2 and "error: --nodes: --nodes 0 is out of range" in out.stderr
    out = run("plan", "recipes/debug.yaml", "--nodes", "16777216", "--gpus-per-node", "8")
    assert out.returncode == 2 and "error: --nodes: " in out.stderr and "more than the 1048576" in out.stderr
    out = run("plan", "recipes/debug.yaml", "--set", "parallel.tp=1", "--set", "train.global_batch_size=32", "--json")
    assert out.returncode == 0 and json.loads(out.stdout)["batch"]["grad_accum"] == 2


def test_missing_file_is_one_line_and_debug_shows_traceback(tmp_path):
    missing = str(tmp_path / "nope.yaml")
    out = run("plan", missing)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip() == f"error: {missing}: recipe not found; pass a YAML recipe file " \
                                 "(shipped recipes are in recipes/)"
    debug = run("plan", missing, env={**ENV, "LLMTRAIN_DEBUG": "1"})
    assert debug.returncode not in (0, 2)
    assert "Traceback" in debug.stderr and "LLMTrainError" in debug.stderr and "recipe not found" in debug.stderr


def test_schema_out_writes_json(tmp_path):
    target = tmp_path / "recipe.schema.json"
    out = run("schema", "--out", str(target))
    assert out.returncode == 0, out.stderr
    schema = json.loads(target.read_text())
    assert schema["title"] == "Recipe" and "ParallelConfig" in schema["$defs"]
    assert schema["properties"]["parallel"]["description"]
    stdout = run("schema")
    assert json.loads(stdout.stdout) == schema


def test_mixtral_plan_explains_ep():
    out = run("plan", "recipes/mixtral-8x7b.yaml")
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())
    assert "ep 8" in text
    assert "EP 8 borrows ranks, it does not multiply them" in text
    assert "dp_shard x cp = 32 x 1 = 32 ranks" in text and "'EP 8 x expert-DP 4'" in text
    assert "46.70B parameters, 12.88B active per token (8 experts, top-2)" in text


PROBE = textwrap.dedent("""\
    import json, sys
    sys.argv = ["llmtrain", *json.loads(sys.argv[1])]
    from llmtrain.cli.app import main
    try:
        main()
    except SystemExit as exc:
        code = exc.code
    else:
        code = 0
    heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "fabric", "paramiko", "invoke"))
    sys.stderr.write("\\nPROBE " + json.dumps({"code": code, "heavy": heavy, "n": len(sys.modules)}) + "\\n")
""")


@pytest.mark.parametrize("args", [
    ["plan", "recipes/llama3-70b.yaml", "--nodes", "64", "--gpus-per-node", "8"],
    ["plan", "recipes/mixtral-8x7b.yaml", "--json"],
    ["plan", "recipes/does-not-exist.yaml"],
])
def test_plan_does_not_import_torch_or_fabric(args):
    out = subprocess.run([sys.executable, "-c", PROBE, json.dumps(args)], cwd=REPO, capture_output=True, text=True,
                         timeout=120, env=ENV)
    probe = json.loads(out.stderr.rsplit("PROBE ", 1)[1])
    assert probe["code"] in (0, 2, None), out.stderr
    assert probe["heavy"] == [], probe["heavy"]
    if "--json" in args:
        assert json.loads(out.stdout)["valid"] is True


def test_plan_json_doc_lists_every_key():
    """docs/plan-json.md documents every key the JSON object has (checked on an MoE plan)."""
    from llmtrain.plan.api import make_plan
    from llmtrain.plan.report import plan_to_dict

    doc = (REPO / "docs" / "plan-json.md").read_text()
    d = plan_to_dict(make_plan(REPO / "recipes" / "mixtral-8x7b.yaml"))
    keys = set(d) | set(d["parallel"]) | set(d["batch"]) | set(d["pipeline"]) | set(d["layout"])
    keys |= set(d["layout"]["nodes"][0]) | set(d["layout"]["groups"]["tp"]) | set(d["layout"]["ep"])
    keys |= set(d["model"]) - {"layers", "hidden", "heads", "kv_heads", "ffn_hidden", "vocab_size"}
    missing = sorted(k for k in keys if f"`{k}`" not in doc)
    assert not missing, f"undocumented keys in docs/plan-json.md: {missing}"


# -- LoRA (issue 14) --------------------------------------------------------------------------------
LORA_SET = ["--set", "train.lora.rank=16", "--set", "train.lora.targets=[wq,wv]", "--set", "train.lora.alpha=32"]


def test_plan_shows_lora_and_trainable_params():
    """llama3-8b (32 blocks, hidden 4096, 8 kv heads of 128): wq adapters 16 x (4096 + 4096), wv 16 x
    (4096 + 1024) per block = 32 x 16 x 13312 = 6,815,744 trainable parameters."""
    js = run("plan", "recipes/llama3-8b.yaml", *LORA_SET, "--json")
    assert js.returncode == 0, js.stderr
    d = json.loads(js.stdout)
    m = d["model"]
    assert m["trainable_params"] == 6_815_744 and m["params_total"] > 1000 * m["trainable_params"]
    assert m["lora"] == {"rank": 16, "alpha": 32.0, "scale": 2.0, "dropout": 0.0, "targets": ["wq", "wv"], "experts": False}
    mem = d["memory"]
    # tp 1, pp 1: one rank holds every adapter before FSDP shards them
    assert mem["trainable_params_per_rank"] == 6_815_744 == mem["per_rank"][0]["trainable_params"]
    b = mem["breakdown_gib"]
    assert b["grads"] < b["params"] / 100 and b["optimizer"] < b["params"] / 50  # only the adapters train
    assert "LoRA" in d["flops"]["convention"]
    full = json.loads(run("plan", "recipes/llama3-8b.yaml", "--json").stdout)
    assert full["model"]["trainable_params"] == full["model"]["params_total"] and full["model"]["lora"] is None
    # executed FLOPs: 4 per frozen weight and token instead of 6, attention unchanged
    assert 0.6 < d["flops"]["model_flops_per_token"] / full["flops"]["model_flops_per_token"] < 0.8
    text = run("plan", "recipes/llama3-8b.yaml", *LORA_SET)
    assert text.returncode == 0, text.stderr
    assert "LoRA rank 16, alpha 32 (scale 2) on wq wv: 6.82M trainable (0.08%), the base frozen" in text.stdout
    assert "6.82M trainable per rank" in text.stdout


def test_plan_counts_lora_on_the_routed_experts():
    """``train.lora.experts`` on Mixtral 8x7B (32 MoE blocks, hidden 4096, 8 experts of 14336), rank 16 on wq wv w1
    w2 w3: attention 16 x (8192 + 5120) and per expert 16 x 3 x (4096 + 14336) per block, 32 x (212,992 +
    7,077,888) = 233,308,160 trainable; a rank of the default layout (tp 2, ep 8) holds its one expert's
    adapters split over TP: 32 x (172,032 + 540,672) = 22,806,528."""
    js = run("plan", "recipes/mixtral-8x7b.yaml", "--set", "train.lora.rank=16", "--set",
             "train.lora.targets=[wq,wv,w1,w2,w3]", "--set", "train.lora.experts=true", "--json")
    assert js.returncode == 0, js.stderr
    d = json.loads(js.stdout)
    assert d["model"]["trainable_params"] == 233_308_160 and d["model"]["lora"]["experts"] is True
    assert d["memory"]["trainable_params_per_rank"] == 22_806_528
    text = run("plan", "recipes/mixtral-8x7b.yaml", "--set", "train.lora.targets=[wq,w1]", "--set",
               "train.lora.experts=true")
    assert text.returncode == 0 and "on wq w1 (and the routed experts)" in text.stdout


def test_search_with_lora_fits_where_full_training_cannot():
    """70B on one node of 8 H100s: full training needs 16 bytes x 70B / 8 = 141 GB of state per GPU,
    LoRA about 4 bytes x 70B / 8 = 35 GB. The search's memory bounds must know that (it would
    otherwise prune every layout) and its pruning must lose nothing against the exhaustive search."""
    from llmtrain.plan.api import make_plan
    from llmtrain.plan.costmodel import estimate
    from llmtrain.plan.search import search
    from llmtrain.plan.validate import validate

    sets = ["train.lora.rank=16", "train.global_batch_size=64", "train.seq_len=4096"]
    full = make_plan(REPO / "recipes/llama3-70b.yaml", None, 1, 8, ["train.global_batch_size=64", "train.seq_len=4096"])
    assert not search(full.recipe, full.placement, top=2).top
    plan = make_plan(REPO / "recipes/llama3-70b.yaml", None, 1, 8, sets)
    fast = search(plan.recipe, plan.placement, top=2)
    exhaustive = search(plan.recipe, plan.placement, top=2, exhaustive=True)
    assert fast.top and [round(c.cost.time.step_s, 9) for c in fast.top] == \
        [round(c.cost.time.step_s, 9) for c in exhaustive.top]
    for choice in fast.top:
        par = {k.split(".", 1)[1]: v for k, v in choice.overrides.items() if k.startswith("parallel.")}
        train = {k.split(".", 1)[1]: v for k, v in choice.overrides.items() if k.startswith("train.")}
        variant = plan.recipe.model_copy(update={"parallel": plan.recipe.parallel.model_copy(update=par),
                                                 "train": plan.recipe.train.model_copy(update=train)})
        v = validate(variant, plan.placement)
        assert v.valid and variant.train.lora is not None
        assert estimate(variant, v.dims, v.batch, plan.placement, hints=False).fits
    out = run("plan", "recipes/llama3-70b.yaml", "--nodes", "1", "--gpus-per-node", "8", "--search", "--top", "1",
              *[x for s in sets for x in ("--set", s)])
    assert out.returncode == 0 and "why: fastest" in out.stdout, out.stdout + out.stderr
