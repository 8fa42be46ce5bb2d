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
* **Fused families** (Phi-3): PEFT adapts the fused ``qkv_proj`` / ``gate_up_proj``. Our adapters
  of q, k and v (rank r each) are one adapter of rank 3 r there: ``lora_A`` the three stacked,
  ``lora_B`` block-diagonal (each projection's ``B`` at its rows of the fused weight and its own
  r columns), so ``B A`` is each projection's update in its rows, zero elsewhere (a projection
  not targeted adds no columns). ``rank_pattern`` / ``alpha_pattern`` give such a module rank
  n r and alpha n alpha: PEFT's scale alpha / r stays ours.
* **A multimodal base** (Gemma 3 4B / 12B / 27B, ``Gemma3ForConditionalGeneration``): the
  adapters are named where that model keeps its language model in transformers 5,
  ``base_model.model.model.language_model.layers.N...``, and ``target_modules`` is a regular
  expression over the language model's modules only: the SigLIP vision tower has ``q_proj`` /
  ``k_proj`` / ``v_proj`` too, which a list of names would also adapt (PEFT full-matches a string
  against each module's name). Without this the adapter would name ``model.layers.N`` modules the
  multimodal model does not have, and PEFT would load nothing onto it.
* MoE models: attention adapters export as for a dense model (PEFT adapts exactly the attention
  projections); the routed experts' adapters (``train.lora.experts``) as PEFT's ``target_parameters``
  on the experts' stacked parameters (:mod:`.peft_experts`), on MoE models without dense layers. MLP
  targets on the dense layers of an MoE model are refused: PEFT (0.21, on transformers 5) turns
  ``gate_proj`` / ``up_proj`` / ``down_proj`` of an MoE model into its experts' fused parameters and
  drops the dense layers' MLPs our adapters are on (measured on a tiny Qwen3-MoE with a dense layer
  0: logits 0.72 apart), so such an adapter would not be what the run trained; the merged ``--hf``
  export is.
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


TEXT, MULTIMODAL = "model.", "model.language_model."  # where the decoder layers sit in the HF base's module tree


def peft_name(ours: str, where: str = TEXT) -> str:
    """``layers.3.attention.wq.lora_a.weight`` -> ``base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight``
    (``where``: :data:`MULTIMODAL` for a multimodal Gemma 3 base)."""
    from llmtrain.engine.hf.families import LAYER_NAMES

    parts = ours.split(".")  # layers N attention|feed_forward wX lora_a|lora_b weight
    base = ".".join(parts[2:4]) + ".weight"
    hf_module = LAYER_NAMES[base].removesuffix(".weight")
    ab = {"lora_a": "lora_A", "lora_b": "lora_B"}[parts[4]]
    return f"{PREFIX}{where}layers.{parts[1]}.{hf_module}.{ab}.weight"


# fused families (Phi-3): our projections -> the fused HF module their adapters join, in row order
FUSED = {"attention": (("wq", "wk", "wv"), "self_attn.qkv_proj"), "feed_forward": (("w1", "w3"), "mlp.gate_up_proj")}
FUSED_TARGETS = {"wq": "qkv_proj", "wk": "qkv_proj", "wv": "qkv_proj", "w1": "gate_up_proj", "w3": "gate_up_proj"}


def adapter_config(lora_cfg, base: str, fused: bool = False, multimodal: bool = False) -> dict:
    """PEFT's ``adapter_config.json``. ``fused`` (Phi-3): a fused module holding n adapted projections
    gets rank n r and alpha n alpha (``rank_pattern``/``alpha_pattern``), so its scale stays alpha / r.
    ``multimodal``: ``target_modules`` a regular expression over the language model's modules. With
    ``lora_cfg.experts`` (an MoE model without dense layers) the MLP targets are the experts' parameters
    (``target_parameters``, :mod:`.peft_experts`) and ``target_modules`` the attention's (or none)."""
    from llmtrain.engine.finetune.peft_experts import GATE_UP, expert_parameters, gate_up_count

    experts = bool(getattr(lora_cfg, "experts", False))
    targets_ours = [t for t in lora_cfg.target_names if not (experts and t in ("w1", "w2", "w3"))]
    names = {t: (FUSED_TARGETS.get(t, HF_TARGETS[t]) if fused else HF_TARGETS[t]) for t in targets_ours}
    count = {m: list(names.values()).count(m) for m in set(names.values())}
    ranks = {m: n * lora_cfg.rank for m, n in sorted(count.items()) if n > 1}
    alphas = {m: n * lora_cfg.alpha for m, n in sorted(count.items()) if n > 1}
    targets: list[str] | str = sorted(count)
    if multimodal:  # the decoder's projections only (module paths from the tensor map: self_attn.* / mlp.*)
        from llmtrain.engine.hf.families import LAYER_NAMES

        paths = sorted({LAYER_NAMES[f"{section}.{t}.weight"].removesuffix(".weight")
                        for t in lora_cfg.target_names for section in ("attention", "feed_forward")
                        if f"{section}.{t}.weight" in LAYER_NAMES})
        targets = MULTIMODAL.replace(".", r"\.") + r"layers\.\d+\.(" + "|".join(p.replace(".", r"\.") for p in paths) + ")"
    out = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora_cfg.rank, "lora_alpha": lora_cfg.alpha,
           "lora_dropout": lora_cfg.dropout, "bias": "none", "fan_in_fan_out": False, "use_rslora": False,
           "use_dora": False, "init_lora_weights": True, "inference_mode": True, "modules_to_save": None,
           "target_modules": targets, "layers_to_transform": None, "rank_pattern": ranks,
           "alpha_pattern": alphas, "base_model_name_or_path": base}
    if experts:
        out["target_parameters"] = expert_parameters(lora_cfg)
        out["target_modules"] = targets or None
        n = gate_up_count(lora_cfg)
        if n > 1:
            ranks[GATE_UP], alphas[GATE_UP] = n * lora_cfg.rank, n * lora_cfg.alpha
    return out


def peft_tensors(adapters: dict, cfg, where: str = TEXT) -> dict:
    """Our adapter tensors (keys without ``model.``) -> PEFT's names and row order. A fused family's
    adapters of one module are joined: ``lora_A`` stacked ``[n r, hidden]``, ``lora_B`` block-diagonal
    ``[fused rows, n r]`` with each projection's rows at its block of the fused weight, so
    ``B_fused @ A_fused`` is each projection's ``B @ A`` in its rows (zero rows: a projection not adapted)."""
    import torch

    from llmtrain.engine.hf.families import fused_rows, interleaved_to_half
    from llmtrain.recipe.hf_families import family_of

    from llmtrain.engine.finetune.peft_experts import expert_tensors

    fam = family_of(cfg)
    fused = fam.fused
    experts = {k: v for k, v in adapters.items() if ".experts.lora_" in k}
    out = expert_tensors(experts, cfg, fam.name, where, PREFIX) if experts else {}
    groups = {}
    for key, t in adapters.items():
        if key in experts:
            continue
        t = t.detach()
        if key.endswith(("attention.wq.lora_b.weight", "attention.wk.lora_b.weight")):
            t = interleaved_to_half(t, t.shape[0] // cfg.head_dim, cfg.rope_dim)
        parts = key.split(".")  # layers N attention|feed_forward wX lora_a|lora_b weight
        if fused and parts[3] in FUSED_TARGETS:
            groups.setdefault((parts[1], parts[2]), {}).setdefault(parts[3], {})[parts[4]] = t
        else:
            out[peft_name(key, where)] = t.contiguous()
    rows = fused_rows(cfg) if fused else {}
    for (layer, section), members in sorted(groups.items()):
        order, module = FUSED[section]
        present = [n for n in order if n in members]
        first = members[present[0]]
        r, total = first["lora_a"].shape[0], rows[f"{section}.{present[0]}.weight"][2]
        b = torch.zeros(total, len(present) * r, dtype=first["lora_b"].dtype)
        for j, n in enumerate(present):
            start, stop, _ = rows[f"{section}.{n}.weight"]
            b[start:stop, j * r:(j + 1) * r] = members[n]["lora_b"]
        name = f"{PREFIX}{where}layers.{layer}.{module}"
        out[f"{name}.lora_A.weight"] = torch.cat([members[n]["lora_a"] for n in present]).contiguous()
        out[f"{name}.lora_B.weight"] = b
    return out


def export_peft(ckpt: Path, files: dict, cfg, lora_cfg, out: Path, base: str, dtype: str = "fp32",
                multimodal: bool = False) -> list[Path]:
    """Write ``out`` (see the module docstring) from a verified checkpoint; returns the files written.
    ``base``: ``base_model_name_or_path``; ``multimodal``: that base is a multimodal Gemma 3."""
    import torch
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    from llmtrain.engine.finetune.lora import adapter_shapes
    from llmtrain.engine.safe_reader import SafeReader, dcp_guard

    mlp = [t for t in lora_cfg.target_names if t in ("w1", "w2", "w3")]
    all_moe = all(cfg.is_moe_layer(i) for i in range(cfg.layers))
    if cfg.is_moe and mlp and not (lora_cfg.experts and all_moe):
        raise LLMTrainError(f"--peft: LoRA on {'/'.join(mlp)} of an MoE model: PEFT maps gate/up/down_proj of an MoE model to "
                            "its experts, not to the dense MLPs these adapters are on",
                            "export the merged model with --hf, or train attention adapters only "
                            "(train.lora.targets: [wq, wk, wv, wo])", path="--peft")
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
    tensors = {k: v.to(torch_dtype) for k, v in peft_tensors(state, cfg, MULTIMODAL if multimodal else TEXT).items()}
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / (WEIGHTS + ".tmp")
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    tmp.replace(out / WEIGHTS)
    from llmtrain.recipe.hf_families import family_of

    config = adapter_config(lora_cfg, base, family_of(cfg).fused, multimodal)
    (out / CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return [out / CONFIG, out / WEIGHTS]
