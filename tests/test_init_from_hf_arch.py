"""``--init-from-hf DIR`` takes the architecture from DIR's config.json.

A recipe whose ``model`` names no preset gets config.json's model with its own fields on top;
every field the recipe states must agree with config.json, and all disagreements come in one
error (exit 2, nothing started). Checkpoints are tiny ones written by transformers itself
(tests/hf_tiny.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from llmtrain.cli.launch import check_init_from_hf
from llmtrain.errors import LLMTrainError
from llmtrain.recipe.load import load_recipe
from tests.hf_tiny import save_tiny

ROOT = Path(__file__).resolve().parents[1]
BODY = """name: hf
parallel: {zero: 0}
train: {seq_len: 32, micro_batch_size: 2, global_batch_size: 2, steps: 1, precision: fp32, seed: 0}
data: {source: synthetic}
cluster: {nodes: 1, gpus_per_node: 1, gpu: cpu}
"""


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory) -> Path:
    return save_tiny("qwen3_moe", tmp_path_factory.mktemp("hf") / "qwen3_moe")


def recipe(tmp_path: Path, model: str = "") -> Path:
    path = tmp_path / "hf.yaml"
    path.write_text(BODY + model)
    return path


def test_no_model_in_the_recipe_means_config_json_s_model(qwen3_moe, tmp_path):
    items = check_init_from_hf(recipe(tmp_path), [], qwen3_moe)
    m = load_recipe(recipe(tmp_path), items).model
    assert (m.family, m.layers, m.hidden, m.heads, m.kv_heads, m.head_dim, m.vocab_size) == ("qwen3_moe", 2, 32, 4, 2, 12, 128)
    assert (m.qk_norm, m.moe.num_experts, m.moe.top_k, m.moe.expert_ffn_hidden) == (True, 4, 2, 24)
    assert (m.moe.dense_layers, m.moe.norm_topk_prob, m.is_moe_layer(0), m.is_moe_layer(1)) == ([0], False, False, True)
    # a field the recipe gives is kept (and checked): max_seq_len may be lower than the model's
    items = check_init_from_hf(recipe(tmp_path, "model: {max_seq_len: 64}\n"), [], qwen3_moe)
    assert load_recipe(recipe(tmp_path), items).model.max_seq_len == 64


def test_every_disagreement_in_one_error(qwen3_moe, tmp_path):
    with pytest.raises(LLMTrainError) as err:
        check_init_from_hf(recipe(tmp_path, "model: {layers: 3, hidden: 48, moe: {top_k: 1}}\n"), [], qwen3_moe)
    paths = {p.path for p in err.value.problems}
    assert {"model.layers", "model.hidden", "model.moe.top_k"} <= paths, err.value.lines()


def test_launch_with_no_model_trains_the_hf_architecture(qwen3_moe, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "llmtrain.cli.app", "launch", str(recipe(tmp_path)),
                           "--init-from-hf", str(qwen3_moe), "--runs", str(tmp_path / "runs")],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "LLMTRAIN_TENSORBOARD": "0"})
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    run = next((tmp_path / "runs" / "hf").iterdir())
    lock = load_recipe(run / "recipe.lock.yaml")
    assert (lock.model.family, lock.model.head_dim, lock.model.moe.dense_layers) == ("qwen3_moe", 12, [0])
    assert lock.checkpoint.init_from_hf == str(qwen3_moe.resolve())
