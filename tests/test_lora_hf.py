"""LoRA on a Hugging Face base, end to end (split out of tests/test_lora.py, whose tolerances and helpers it uses).

**HF base** (2-rank ``llmtrain launch``, TP 2 + SP, ``checkpoint.init_from_hf`` = a tiny Llama
written by transformers): the checkpoint holds only adapters (+ their AdamW state) and the
base's fingerprint; resume from step 2 in the same layout is **bitwise** equal to the
uninterrupted run (losses and step-4 checkpoint: same operations in the same order, the base
re-read bit-exactly from the same files); resume in another layout (dp 2, ZeRO-1) is within the
parity tolerances; a different base directory is refused in one line by resume and by export.
``train.lora``'s rank, targets and experts other than the checkpoint's are refused by resume in one line;
``--peft`` and ``--hf`` of the run give the same logits (tests/test_lora.py ``assert_peft_equals_merged``).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.helpers_ckpt import load_ckpt
from tests.hf_tiny import save_tiny
from tests.test_lora import LOSS_TOL, STEPS, WEIGHT_TOL, assert_peft_equals_merged, cli, index_keys

ALL_LINEAR = ("wq", "wk", "wv", "wo", "w1", "w2", "w3")

HF_SETS = ["train.seq_len=32", "train.micro_batch_size=2", "train.global_batch_size=4", f"train.steps={STEPS}",
           "train.optimizer.lr=0.02", "train.optimizer.eps=1e-6", "train.schedule.warmup_steps=0",
           "train.schedule.decay=constant", "train.lora={rank: 4, alpha: 8}", "checkpoint.interval=2",
           "train.log_interval=1", "parallel.tp=2", "parallel.sequence_parallel=true", "parallel.dp_shard=1",
           "parallel.zero=3", "cluster.gpus_per_node=2"]


def losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r}


@pytest.fixture(scope="module")
def hf_run(tmp_path_factory):
    from llmtrain.engine.hf import check_hf_dir, model_from_hf_config

    tmp = tmp_path_factory.mktemp("lora_hf")
    base = save_tiny("llama", tmp / "base", shards=2)
    conf, _ = check_hf_dir(base)
    model = json.dumps(model_from_hf_config(conf))
    recipe = tmp / "lora.yaml"
    recipe.write_text(f"name: lora\nmodel: {model}\nparallel: {{tp: 2}}\ntrain: {{precision: fp32, seed: 0}}\n"
                      f"data: {{source: synthetic}}\ncheckpoint: {{init_from_hf: {json.dumps(str(base))}}}\n"
                      "cluster: {nodes: 1, gpus_per_node: 2, gpu: cpu}\n")
    return tmp, base, launch_run(recipe, tmp / "runs", HF_SETS)


def launch_run(recipe: Path, runs: Path, sets: list[str]) -> Path:
    """``llmtrain launch recipe --set ...`` into ``runs``; the run directory."""
    args = ["launch", str(recipe), "--runs", str(runs)]
    for s in sets:
        args += ["--set", s]
    proc = cli(args)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return next(next(runs.iterdir()).iterdir())


def test_hf_checkpoint_holds_adapters_and_fingerprint(hf_run):
    _, base, run = hf_run
    step = run / "checkpoints" / f"step-{STEPS}"
    meta = json.loads((step / "metadata.json").read_text())
    assert meta["lora_base"]["path"] == str(base.resolve()) and len(meta["lora_base"]["sha256"]) == 64
    keys = index_keys(step)
    model = [k for k in keys if k.startswith("model.")]
    assert model and all(".lora_a." in k or ".lora_b." in k for k in model) and len(model) == 2 * 7 * 2
    assert all(".lora_" in k for k in keys if k.startswith("optimizer."))


def test_hf_resume_exact_and_resharded(hf_run, tmp_path):
    """Resume from step 2: same layout bitwise (losses, adapters, AdamW state); dp 2 + ZeRO-1
    within the parity tolerances (module docstring)."""
    tmp, _, ref = hf_run
    ref_final = load_ckpt(ref / "checkpoints" / f"step-{STEPS}", tmp_path)
    for name, sets in (("same", []), ("dp2_zero1", ["parallel.tp=1", "parallel.dp_shard=2", "parallel.zero=1"])):
        run = tmp_path / name / "lora" / ref.name
        shutil.copytree(ref, run)
        shutil.rmtree(run / "checkpoints" / f"step-{STEPS}")
        args = ["resume", "--run", str(run), "--ckpt", "step-2"]
        for s in sets:
            args += ["--set", s]
        proc = cli(args)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        got = load_ckpt(run / "checkpoints" / f"step-{STEPS}", tmp_path / name)
        assert got.keys() == ref_final.keys()
        if name == "same":
            assert losses(run) == losses(ref)
            assert all(torch.equal(got[k], ref_final[k]) for k in got)
        else:
            loss_diff = max(abs(losses(run)[s] - losses(ref)[s]) for s in (3, 4))
            weight_diff = max((got[k] - ref_final[k]).abs().max().item() for k in got if k.startswith("model."))
            print(f"resume dp2_zero1: loss diff {loss_diff:.2e}, adapter weight diff {weight_diff:.2e}")
            assert loss_diff <= LOSS_TOL and weight_diff <= WEIGHT_TOL


def test_resume_with_other_adapters_is_refused(hf_run):
    """train.lora's rank, targets and experts are the checkpoint's: loading takes the new model's keys, so
    fewer targets would silently drop trained adapters; refused in one line before anything starts."""
    _, _, ref = hf_run
    for change in ("train.lora={rank: 4, alpha: 8, targets: [wq, wk, wv, wo]}", "train.lora.rank=8", "train.lora=null"):
        proc = cli(["resume", "--run", str(ref), "--ckpt", "step-2", "--set", change])
        assert proc.returncode == 2 and f"step-2 holds rank 4 on {' '.join(ALL_LINEAR)}" in proc.stderr, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_hf_base_changed_is_refused(hf_run, tmp_path):
    tmp, _, ref = hf_run
    other = save_tiny("llama", tmp_path / "other", shards=2, seed=1)  # same architecture, other weights
    run = tmp_path / "lora" / ref.name
    shutil.copytree(ref, run)
    proc = cli(["resume", "--run", str(run), "--ckpt", "step-2", "--set", f"checkpoint.init_from_hf={other}"])
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "is not the base model the adapters in" in out, out[-3000:]
    proc = cli(["ckpt", "export", str(run), "--hf", str(tmp_path / "m"), "--base", str(other)])
    assert proc.returncode == 2 and "is not the base model the adapters in" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_hf_peft_export_equals_merged(hf_run, tmp_path):
    tmp, base, run = hf_run
    peft_dir, merged = tmp_path / "peft", tmp_path / "merged"
    proc = cli(["ckpt", "export", str(run), "--peft", str(peft_dir), "--hf", str(merged)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    conf = json.loads((peft_dir / "adapter_config.json").read_text())
    assert conf["peft_type"] == "LORA" and conf["r"] == 4 and conf["lora_alpha"] == 8
    assert conf["base_model_name_or_path"] == str(base.resolve()) and not (peft_dir / "base").exists()
    assert sorted(conf["target_modules"]) == sorted(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                     "down_proj"])
    from safetensors.torch import load_file

    tensors = load_file(peft_dir / "adapter_model.safetensors")
    assert len(tensors) == 2 * 7 * 2
    assert tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"].abs().max() > 1e-2
    assert_peft_equals_merged(peft_dir, merged, base)
