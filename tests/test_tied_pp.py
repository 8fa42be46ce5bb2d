"""Pipeline parallelism with tied embeddings (Llama 3.2 style), against one process.

The last stage's ``output.weight`` is a copy of the first stage's ``tok_embeddings.weight``
whose gradients are summed over the pair (llmtrain/engine/parallel/tied.py). Two torchrun jobs:
a 1-process reference and ONE 4-rank job holding every layout:

* ``pp2_1f1b_zero1``: pp 2 x dp 2, 1F1B, ZeRO-1 (plain tensors; the copy's AdamW state on
  another DP owner than the embedding's), checkpointing every 2 steps;
* ``pp2_zbv_zero1``: ZBV (V-shaped: stage 0 and the last stage on pp rank 0, local sum);
* ``pp2_tp2``: pp 2 x tp 2 (TP DTensors: the embedding's gradient in its weight's rows, the
  output's Shard(0));
* ``pp2_fsdp``: pp 2 x dp_shard 2, zero 3 (FSDP2 shards summed shard by shard);
* ``pp2_dualpipev_fsdp``: V-shaped and FSDP2 (zero 2) together;
* ``pp4_1f1b``: pp 4, the pair (pp ranks 0 and 3) a subgroup of the pp group;
* ``pp1_resume``: pp 1 on 4 ranks (FSDP2) resumed from ``pp2_1f1b_zero1``'s step-2 checkpoint;
* ``hf_pp2``: ``--init-from-hf`` of tests/hf_tiny.py's tied ``llama3`` model under pp 2.

Model: 4 layers, hidden 32, vocab 128, tied; fp32; 4 AdamW steps, weight decay 0.1 (so a copy
that decayed unlike the embedding would drift), gradient clipping active (grad_clip 0.5, step-1 norm ~0.8).

Tolerances (as tests/test_engine_parity.py, whose docstring gives the argument): the layouts
differ from one process only in summation order. Losses |diff| <= 2e-5; weights after the
AdamW steps |diff| <= 2e-4 absolute (AdamW turns rounding-level gradient differences into
~lr-sized moves of near-zero-gradient weights; eps 1e-6 damps that). Measured: losses <= 5e-7,
weights <= 2e-6. Without the gradient sum (checked by hand) the losses are off by 3.7e-2 and
the weights by 1.8e-2. The two copies must be bitwise equal (same sum on both sides of the
pair, same AdamW step). Gradient norms within 1e-5 relative (measured ~1e-7): the tied weight is
counted once (counted twice, the norm would grow by its gradient's share). The init-from-hf step-1 loss is
transformers' within 2e-5 (tests/test_families.py's argument).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.distrun import run_cases
from tests.helpers_ckpt import load_ckpt

STEPS = 4
LOSS_TOL, WEIGHT_TOL, NORM_RTOL = 2e-5, 2e-4, 1e-5
RECIPE = """name: tiedpp
model: {layers: 4, hidden: 32, heads: 4, kv_heads: 2, ffn_hidden: 64, vocab_size: 128, max_seq_len: 128,
        rope_theta: 10000.0, norm_eps: 1.0e-5, tie_embeddings: true}
parallel: {tp: 1, dp_shard: -1, zero: 0}
train: {seq_len: 32, micro_batch_size: 2, global_batch_size: 8, steps: 4, precision: fp32, seed: 0, grad_clip: 0.5,
        optimizer: {lr: 0.003, weight_decay: 0.1, eps: 1.0e-6}, schedule: {warmup_steps: 1, decay: cosine, min_lr_ratio: 0.1}}
data: {source: synthetic}
cluster: {nodes: 1, gpus_per_node: 4, gpu: cpu}
"""
PP2 = ["parallel.pp=2"]
V = ["parallel.pp_virtual_stages=2", "train.micro_batch_size=1"]  # 4 stages; 4 microbatches per DP rank
LAYOUTS = {
    "pp2_1f1b_zero1": PP2 + ["parallel.zero=1", "checkpoint.interval=2"],
    "pp2_zbv_zero1": PP2 + V + ["parallel.pp_schedule=zbv", "parallel.zero=1"],
    "pp2_tp2": PP2 + ["parallel.tp=2"],
    "pp2_fsdp": PP2 + ["parallel.zero=3"],
    "pp2_dualpipev_fsdp": PP2 + V + ["parallel.pp_schedule=dualpipev", "parallel.zero=2"],
    "pp4_1f1b": ["parallel.pp=4"],  # the pair is pp ranks 0 and 3 (a group of its own), 1 and 2 sit out
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from llmtrain.engine.hf import check_hf_dir, model_from_hf_config
    from tests.hf_tiny import save_tiny

    tmp = tmp_path_factory.mktemp("tiedpp")
    recipe = tmp / "tiedpp.yaml"
    recipe.write_text(RECIPE)
    hf_dir = save_tiny("llama3", tmp / "llama3")
    conf, _ = check_hf_dir(hf_dir)
    hf_sets = [f"model={json.dumps(model_from_hf_config(conf))}", f"checkpoint.init_from_hf={hf_dir}"]
    refs = run_cases(tmp, 1, str(recipe), [{"name": "ref", "set": ["parallel.dp_shard=1"]}], STEPS)
    cases = [{"name": k, "set": v, **({"run_dir": str(tmp / k)} if "checkpoint.interval=2" in v else {})}
             for k, v in LAYOUTS.items()]
    ckpt2 = tmp / "pp2_1f1b_zero1" / "checkpoints" / "step-2"
    cases.append({"name": "pp1_resume", "set": ["parallel.zero=3"], "run_dir": str(tmp / "pp1_resume"),
                  "resume": str(ckpt2)})
    cases.append({"name": "hf_pp2", "set": hf_sets + PP2, "steps": 1})
    layouts = run_cases(tmp, 4, str(recipe), cases, STEPS)
    return refs["ref"], layouts, tmp, hf_dir, hf_sets, recipe


def _worst(got: dict, ref: dict) -> float:
    assert set(got) == set(ref)
    return max((got[k] - ref[k]).abs().max().item() for k in ref)


@pytest.mark.parametrize("case", list(LAYOUTS))
def test_tied_pipeline_matches_one_process(runs, case):
    ref, layouts, *_ = runs
    got = layouts[case]
    assert got["layout_errors"] == []
    loss_diff = max(abs(a - b) for a, b in zip(got["losses"], ref["losses"], strict=True))
    assert loss_diff <= LOSS_TOL, f"{case}: losses {got['losses']} vs {ref['losses']}"
    assert got["losses"][-1] < got["losses"][0] - 0.05, "the loss must fall"
    assert got["grad_norms"] == pytest.approx(ref["grad_norms"], rel=NORM_RTOL)
    assert ref["grad_norms"][0] > 0.5, "clipping must be active for the norm to matter"
    state = got["state"]  # the embedding (first stage's rank) and the copy (last stage's), gathered
    assert torch.equal(state["output.weight"], state["tok_embeddings.weight"]), "the copies drifted apart"
    worst = _worst(state, ref["state"])
    print(f"{case}: worst loss diff {loss_diff:.1e}, weight diff {worst:.1e}")
    assert worst <= WEIGHT_TOL


def test_tied_pp_checkpoint_has_one_key_and_resumes_on_pp1(runs):
    """pp 2 (ZeRO-1) saved step 2; pp 1 (FSDP2 over 4 ranks) resumed it and must continue as the
    reference does (steps 3-4, then the final weights). Both checkpoints hold the tied weight and
    its AdamW state under ``tok_embeddings.weight`` only."""
    ref, layouts, tmp, *_ = runs
    got = layouts["pp1_resume"]
    assert len(got["losses"]) == STEPS - 2
    loss_diff = max(abs(a - b) for a, b in zip(got["losses"], ref["losses"][2:], strict=True))
    assert loss_diff <= LOSS_TOL, (got["losses"], ref["losses"])
    assert _worst(got["state"], ref["state"]) <= WEIGHT_TOL
    for ckpt in (tmp / "pp2_1f1b_zero1/checkpoints/step-2", tmp / "pp1_resume/checkpoints/step-4"):
        saved = load_ckpt(ckpt, tmp / "flat")
        assert "model.tok_embeddings.weight" in saved and "optimizer.state.tok_embeddings.weight.exp_avg" in saved
        assert not [k for k in saved if "output.weight" in k], ckpt


def test_init_from_hf_tied_llama3_under_pp2(runs):
    """Step-1 loss of pp 2 from the tied HF checkpoint (one embedding tensor on disk, read by both
    stages) equals transformers' loss on the same batch."""
    from llmtrain.recipe.load import load_recipe
    from tests.test_families import hf_step1_loss

    _, layouts, _, hf_dir, hf_sets, recipe = runs
    expected = hf_step1_loss(Path(hf_dir), load_recipe(recipe, hf_sets))
    got = layouts["hf_pp2"]
    assert got["layout_errors"] == []
    assert abs(got["losses"][0] - expected) <= LOSS_TOL, (got["losses"][0], expected)


def test_plan_accepts_tied_pp_and_counts_the_copy(tmp_path):
    """The planner no longer refuses pp > 1 with tied embeddings, and the rank of the last stage
    counts the copy (``output.weight``), also rank 0 of a V-shaped schedule, which holds the
    embedding as well. (Exact bytes per rank: tests/test_costmodel.py's tied cases.)"""
    from llmtrain.plan.shards import rank_params, rank_stages, stage_layers
    from llmtrain.plan.validate import validate
    from llmtrain.cluster.placement import Placement
    from llmtrain.recipe.load import load_recipe

    path = tmp_path / "r.yaml"
    path.write_text(RECIPE)
    for schedule, v in (("1f1b", 1), ("zbv", 2)):
        recipe = load_recipe(path, PP2 + [f"parallel.pp_schedule={schedule}", f"parallel.pp_virtual_stages={v}",
                                          "train.micro_batch_size=1"])
        assert validate(recipe, Placement.uniform(1, 4)).valid
        m = recipe.model
        stages = stage_layers(m.layers, 2, v)
        last_rank = 0 if schedule == "zbv" else 1
        names = [p.name for p in rank_params(m, stages, rank_stages(last_rank, 2, v, schedule), 1, 1)]
        assert "output.weight" in names and names.count("tok_embeddings.weight") == (last_rank == 0)
