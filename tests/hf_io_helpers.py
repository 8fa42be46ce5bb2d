"""Helpers of the Hugging Face I/O tests (tests/test_hf_io.py, test_hf_io_tp_fsdp.py): recipes for a
tiny HF directory, a tiny tokenizer, the torchrun worker, and reading exports back."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
import yaml

ROOT = Path(__file__).resolve().parent.parent


def write_recipe(hf: Path, out: Path, **data) -> Path:
    from llmtrain.engine.hf import model_from_hf_config

    model = model_from_hf_config(json.loads((hf / "config.json").read_text()))
    doc = {"name": "hfio", "model": model, "parallel": {"tp": 1, "dp_shard": -1, "zero": 3},
           "train": {"seq_len": 16, "micro_batch_size": 2, "global_batch_size": 4, "steps": 2, "precision": "fp32",
                     "seed": 0, "optimizer": {"lr": 0.003, "weight_decay": 0.0}, "log_interval": 1},
           "data": {"source": "synthetic", **data}, "cluster": {"nodes": 1, "gpus_per_node": 2, "gpu": "cpu"}}
    out.write_text(yaml.safe_dump(doc))
    return out


def write_tokenizer(d: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers

    d.mkdir()
    vocab = {"<s>": 0, "</s>": 1, "<unk>": 2, **{chr(97 + i): 3 + i for i in range(26)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<s>", "</s>"])
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>",
                                                         "tokenizer_class": "PreTrainedTokenizerFast"}))
    return d


def run_worker(spec: dict, path: Path, nproc: int | None) -> dict:
    path.write_text(json.dumps(spec))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LLMTRAIN_TENSORBOARD": "0", "PYTHONPATH": str(ROOT)}
    worker = str(ROOT / "tests" / "hf_io_worker.py")
    cmd = ([sys.executable, str(ROOT / "tests" / "dist_launch.py"), str(nproc), worker, str(path)]
           if nproc else [sys.executable, worker, "--single", str(path)])
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return torch.load(spec["out"], weights_only=False)


def shard_tensors(d: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def logits_error(ckpt: Path, out: Path, model_type: str) -> float:
    """Max |logit| difference between our engine model loaded from ``ckpt`` and transformers'
    ``AutoModelForCausalLM`` of the export ``out`` (which must be of ``model_type``)."""
    from transformers import AutoModelForCausalLM

    from llmtrain.engine.hf import read_checkpoint_model
    from llmtrain.engine.models.llama import Transformer
    from llmtrain.recipe.schema import ModelConfig

    meta = json.loads((ckpt / "metadata.json").read_text())
    cfg = ModelConfig.model_validate(meta["recipe"]["model"])
    ours = Transformer(cfg)
    missing, unexpected = ours.load_state_dict(read_checkpoint_model(ckpt), strict=False)
    assert unexpected == [] and set(missing) == ({"output.weight"} if cfg.tie_embeddings else set())  # tied: one key
    theirs = AutoModelForCausalLM.from_pretrained(out).eval()
    assert theirs.config.model_type == model_type
    ids = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return float((ours.eval()(ids) - theirs(ids).logits).abs().max())
