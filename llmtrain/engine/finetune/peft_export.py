"""``llmtrain ckpt export RUN --peft OUT``: a LoRA checkpoint's adapters as a PEFT adapter directory.

``OUT/adapter_config.json`` + ``OUT/adapter_model.safetensors``, what
``peft.PeftModel.from_pretrained(base, OUT)`` loads onto the transformers base model:

* **Config**: ``peft_type LORA``, ``task_type CAUSAL_LM``, ``r``, ``lora_alpha``, ``lora_dropout``,
  ``bias none``, ``use_rslora false`` (PEFT's scale is then ``lora_alpha / r``, ours too),
  ``target_modules`` in HF module names (ours -> theirs: wq q_proj, wk k_proj, wv v_proj,
  wo o_proj, w1 gate_proj, w3 up_proj, w2 down_proj; :mod:`llmtrain.engine.hf.families`), and
  ``base_model_name_or_path``.
* **Tensors**: ``base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight`` / ``lora_B``
  (PEFT's saved names: no adapter name), in fp32 (``--dtype bf16``: bf16). Our q/k rows are
  permuted per head relative to HF's (interleaved vs half-split RoPE pairs), so ``lora_B`` of
  ``wq``/``wk`` gets the same row permutation as the base weight; ``lora_A`` acts on the input
  (the hidden state, not permuted) and is unchanged.
* **The base** (``base_model_name_or_path``): the resolved ``checkpoint.init_from_hf``
  directory, whose fingerprint the caller checked. A run without ``init_from_hf`` has no
  Hugging Face base anywhere: its frozen base lives only in the checkpoint, so ``--peft``
  writes it next to the adapters, unmerged, as ``OUT/base/`` (the ``--hf`` layout) and names
  that directory (absolute path; move both together). The alternative, refusing, would leave
  such a run with only the merged export.
* MoE models are refused: their experts' ``gate/up/down_proj`` would match the target names in
  PEFT, which would add adapters the run never trained (the planner refuses LoRA + MoE anyway).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

from llmtrain.errors import LLMTrainError

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
HF_TARGETS = {"wq": "q_proj", "wk": "k_proj", "wv": "v_proj", "wo": "o_proj", "w1": "gate_proj", "w3": "up_proj",
              "w2": "down_proj"}
PREFIX = "base_model.model."


def peft_name(ours: str) -> str:
    """``layers.3.attention.wq.lora_a.weight`` -> ``base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight``."""
    from llmtrain.engine.hf.families import LAYER_NAMES

    parts = ours.split(".")  # layers N attention|feed_forward wX lora_a|lora_b weight
    base = ".".join(parts[2:4]) + ".weight"
    hf_module = LAYER_NAMES[base].removesuffix(".weight")
    ab = {"lora_a": "lora_A", "lora_b": "lora_B"}[parts[4]]
    return f"{PREFIX}model.layers.{parts[1]}.{hf_module}.{ab}.weight"


def adapter_config(lora_cfg, base: str) -> dict:
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora_cfg.rank, "lora_alpha": lora_cfg.alpha,
            "lora_dropout": lora_cfg.dropout, "bias": "none", "fan_in_fan_out": False, "use_rslora": False,
            "use_dora": False, "init_lora_weights": True, "inference_mode": True, "modules_to_save": None,
            "target_modules": sorted(HF_TARGETS[t] for t in lora_cfg.target_names),
            "layers_to_transform": None, "rank_pattern": {}, "alpha_pattern": {}, "base_model_name_or_path": base}


def peft_tensors(adapters: dict, cfg) -> dict:
    """Our adapter tensors (keys without ``model.``) -> PEFT's names and row order."""
    from llmtrain.engine.hf.families import interleaved_to_half

    out = {}
    for key, t in adapters.items():
        t = t.detach()
        if key.endswith(("attention.wq.lora_b.weight", "attention.wk.lora_b.weight")):
            t = interleaved_to_half(t, t.shape[0] // cfg.head_dim, cfg.rope_dim)
        out[peft_name(key)] = t.contiguous()
    return out


def export_peft(ckpt: Path, files: dict, cfg, lora_cfg, out: Path, base: str, dtype: str = "fp32") -> list[Path]:
    """Write ``out`` (see the module docstring) from a verified checkpoint; returns the files written.
    ``base``: ``base_model_name_or_path``."""
    import torch
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    from llmtrain.engine.finetune.lora import adapter_shapes
    from llmtrain.engine.safe_reader import SafeReader, dcp_guard

    if cfg.is_moe:
        raise LLMTrainError("--peft: the model has experts, whose gate/up/down_proj PEFT would also adapt",
                            "export the merged model with --hf", path="--peft")
    shapes = {f"model.{k}": v for k, v in adapter_shapes(cfg, lora_cfg).items()}
    with dcp_guard(ckpt), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to load in a single process": it is
        reader = SafeReader(ckpt, files)
        have = {k: tuple(v.size) for k, v in reader.index.state_dict_metadata.items()}
        wrong = [k for k, v in shapes.items() if have.get(k) != v]
        if wrong:
            raise LLMTrainError(f"{ckpt / '.metadata'}: {wrong[0]} is {list(have[wrong[0]]) if wrong[0] in have else 'missing'}"
                                f", train.lora and recipe.model say {list(shapes[wrong[0]])}",
                                "the checkpoint is damaged or crafted; use another one (--ckpt step-N)", path="--ckpt")
        state = _load_state_dict_from_keys(set(shapes), storage_reader=reader)["model"]
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    tensors = {k: v.to(torch_dtype) for k, v in peft_tensors(state, cfg).items()}
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / (WEIGHTS + ".tmp")
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    tmp.replace(out / WEIGHTS)
    (out / CONFIG).write_text(json.dumps(adapter_config(lora_cfg, base), indent=2, sort_keys=True) + "\n")
    return [out / CONFIG, out / WEIGHTS]
