"""LoRA on the routed experts end to end (``train.lora.experts``): a 2-rank ``llmtrain launch`` with expert
parallelism on a Mixtral written by transformers (``checkpoint.init_from_hf``), its adapters-only checkpoint,
and both exports of it through the CLI: ``--peft`` (PEFT's ``target_parameters`` on transformers' stacked
experts, engine/finetune/peft_experts.py) loaded by ``peft.PeftModel`` onto that base gives the logits of
the ``--hf`` merged export loaded by transformers (tests/test_lora.py's LOGIT_TOL), which differ from the
base's. The layouts' parity with one process is in tests/test_lora.py (``experts_*``)."""

from __future__ import annotations

import json

import pytest

from tests.hf_tiny import save_tiny
from tests.test_lora import STEPS, assert_peft_equals_merged, cli, index_keys
from tests.test_lora_hf import launch_run

SETS = ["train.seq_len=32", "train.micro_batch_size=2", "train.global_batch_size=4", f"train.steps={STEPS}",
        "train.optimizer.lr=0.02", "train.optimizer.eps=1e-6", "train.schedule.warmup_steps=0",
        "train.schedule.decay=constant", "train.lora={rank: 4, alpha: 8, targets: [wq, wv, w1, w3, w2], experts: true}",
        "checkpoint.interval=4", "parallel.tp=1", "parallel.dp_shard=2", "parallel.ep=2", "parallel.zero=1",
        "cluster.gpus_per_node=2"]


@pytest.fixture(scope="module")
def mixtral_run(tmp_path_factory):
    from llmtrain.engine.hf import check_hf_dir, model_from_hf_config

    tmp = tmp_path_factory.mktemp("lora_experts")
    base = save_tiny("mixtral", tmp / "base", shards=2)
    conf, _ = check_hf_dir(base)
    recipe = tmp / "lora.yaml"
    recipe.write_text(f"name: experts\nmodel: {json.dumps(model_from_hf_config(conf))}\n"
                      "train: {precision: fp32, seed: 0}\ndata: {source: synthetic}\n"
                      f"checkpoint: {{init_from_hf: {json.dumps(str(base))}}}\n"
                      "cluster: {nodes: 1, gpus_per_node: 2, gpu: cpu}\n")
    return base, launch_run(recipe, tmp / "runs", SETS)


def test_expert_adapters_checkpoint_and_exports(mixtral_run, tmp_path):
    base, run = mixtral_run
    keys = index_keys(run / "checkpoints" / f"step-{STEPS}")
    model = [k for k in keys if k.startswith("model.")]
    # 2 layers: wq, wv adapters and the experts' w1, w3, w2 (stacked), nothing of the frozen base
    assert len(model) == 2 * 2 * (2 + 3) and sum(".experts.lora_" in k for k in model) == 2 * 2 * 3
    peft_dir, merged = tmp_path / "peft", tmp_path / "merged"
    proc = cli(["ckpt", "export", str(run), "--peft", str(peft_dir), "--hf", str(merged)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    conf = json.loads((peft_dir / "adapter_config.json").read_text())
    assert sorted(conf["target_modules"]) == ["q_proj", "v_proj"]
    assert conf["target_parameters"] == ["experts.down_proj", "experts.gate_up_proj"]
    assert conf["rank_pattern"] == {"gate_up_proj": 8} and conf["alpha_pattern"] == {"gate_up_proj": 16}
    assert_peft_equals_merged(peft_dir, merged, base)
