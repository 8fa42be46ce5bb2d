"""PEFT interop of our LoRA adapters, one process (no torchrun): on transformers' own tiny bases of each
family, PEFT with our exported adapter equals our LoRA model's forward; an MoE model's MLP adapters are
refused by ``--peft`` and exported merged instead; PEFT's key names and the base fingerprint. Split out of
tests/test_lora.py (the end-to-end LoRA runs stay there)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from tests.hf_tiny import lora_model, save_tiny
from tests.test_lora import LOGIT_TOL


@pytest.mark.parametrize("family, targets", [("phi3", None), ("phi3", ["wq", "wv", "w3", "wo"]), ("gemma3", None),
                                             ("gemma2", None), ("gemma", None), ("granite", None), ("smollm3", None),
                                             ("olmo2", None), ("qwen3_moe", ["wq", "wk", "wv", "wo"]),
                                             ("granitemoe", ["wq", "wv"]), ("olmoe", ["wq", "wk", "wv", "wo"])])
def test_peft_adapters_of_phi3_and_gemma_load_in_peft(tmp_path, family, targets):
    """Phi-3 keeps q/k/v and gate/up fused, where PEFT puts its adapters: our per-projection adapters
    become one block-diagonal adapter per fused module (peft_export.py). On transformers' own tiny
    Phi-3 base, PEFT with the exported adapter equals our LoRA model's forward (LOGIT_TOL), with
    every projection adapted (rank 12 on qkv_proj, 8 on gate_up_proj) and with some (k and gate
    not: their rows of B stay zero). Gemma 3 (unfused; GeGLU, offset and post norms, sliding and
    full layers) the same, on its own tiny base; Gemma 2 (soft-capped scores and logits), Gemma 1,
    Granite (its multipliers), SmolLM3 (NoPE layers) and OLMo 2 (post norms only) too; MoE models
    (Qwen3-MoE, GraniteMoE, OLMoE) with attention adapters (MLP targets on an MoE model: refused by
    ``--peft``, test below)."""
    assert_peft_equals_ours(tmp_path, family, {"targets": targets} if targets else {})


@pytest.mark.parametrize("family, targets", [("mixtral", None), ("olmoe", ["wq", "w2"]), ("granitemoe", ["w1"]),
                                             ("mixtral", ["wv", "w3", "w2"])])
def test_peft_adapters_of_the_routed_experts_load_in_peft(tmp_path, family, targets):
    """``train.lora.experts`` on MoE models without dense layers: the experts' adapters export as PEFT's
    ``target_parameters`` on transformers' stacked ``gate_up_proj`` / ``down_proj`` (peft_experts.py: w1 and
    w3 one block-diagonal adapter of rank 2 r, nested wrappers when down_proj is adapted too); PEFT with
    the exported adapter equals our LoRA model's forward on transformers' own tiny bases (LOGIT_TOL), with
    all MLP targets, with w2 alone, with w1 alone (its up rows of B zero) and with w3 + w2."""
    assert_peft_equals_ours(tmp_path, family, {"experts": True, **({"targets": targets} if targets else {})})


def test_peft_export_of_moe_mlp_adapters_is_refused_and_merged_export_matches(tmp_path):
    """LoRA on all-linear targets of a Qwen3-MoE (dense layer 0, MoE layer 1): ``--peft`` refuses it in one
    line (PEFT 0.21 would put gate/up/down_proj on the experts and drop layer 0's MLP adapters: measured
    0.72 apart), and the merged weights (what ``--hf`` writes) give transformers our LoRA model's logits."""
    from transformers import AutoModelForCausalLM

    from llmtrain.engine.finetune.lora import merge_lora
    from llmtrain.engine.finetune.peft_export import export_peft
    from llmtrain.engine.hf import check_hf_dir, from_hf_state, model_from_hf_config, read_hf_state, to_hf_state
    from llmtrain.errors import LLMTrainError
    from llmtrain.recipe.schema import LoRAConfig, ModelConfig

    base = save_tiny("qwen3_moe", tmp_path / "base", shards=1)
    conf, files = check_hf_dir(base)
    cfg = ModelConfig(**model_from_hf_config(conf))
    lora_cfg = LoRAConfig(rank=4, alpha=8.0)
    with pytest.raises(LLMTrainError) as exc:
        export_peft(tmp_path / "no-ckpt", {}, cfg, lora_cfg, tmp_path / "peft", str(base))
    assert "w1/w2/w3 of an MoE model" in str(exc.value) and not (tmp_path / "peft").exists()
    with pytest.raises(LLMTrainError) as exc:  # with the experts adapted too: layer 0's dense MLP still cannot be said
        export_peft(tmp_path / "no-ckpt", {}, cfg, LoRAConfig(rank=4, alpha=8.0, experts=True), tmp_path / "peft", str(base))
    assert "w1/w2/w3 of an MoE model" in str(exc.value) and not (tmp_path / "peft").exists()
    ours = lora_model(cfg, from_hf_state(read_hf_state(files), cfg), lora_cfg)
    assert any("layers.0.feed_forward.w1.lora_a" in k for k in ours.state_dict())  # the dense layer's MLP adapted
    merged = merge_lora(dict(ours.state_dict()), lora_cfg)
    theirs = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    theirs.load_state_dict(to_hf_state(merged, cfg), strict=False)
    tokens = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (theirs.eval()(tokens).logits - ours.eval()(tokens)).abs().max().item()
    print(f"qwen3_moe merged LoRA vs ours: {diff:.2e}")
    assert diff <= LOGIT_TOL, diff


def test_peft_names_and_fingerprint(tmp_path):
    """PEFT key names; the base fingerprint sees a re-saved base with other weights (headers equal)."""
    from llmtrain.engine.finetune.base import fingerprint
    from llmtrain.engine.finetune.peft_export import peft_name

    assert peft_name("layers.1.attention.wq.lora_a.weight") == \
        "base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight"
    assert peft_name("layers.0.feed_forward.w2.lora_b.weight") == \
        "base_model.model.model.layers.0.mlp.down_proj.lora_B.weight"
    a, b = save_tiny("llama", tmp_path / "a", shards=2), save_tiny("llama", tmp_path / "b", shards=2, seed=1)
    shutil.copytree(a, tmp_path / "c")
    fa, fb, fc = fingerprint(a), fingerprint(b), fingerprint(tmp_path / "c")
    assert fa["sha256"] == fc["sha256"] and fa["sha256"] != fb["sha256"] and fa["files"] >= 3


def assert_peft_equals_ours(tmp_path, family: str, lora_kwargs: dict) -> None:
    """Our LoRA model (rank 4, alpha 8, ``lora_kwargs``) on transformers' own tiny ``family`` base, its adapters
    exported (peft_export.py): PEFT with them gives our forward's logits within LOGIT_TOL, and the adapters
    matter (> 1e-2 from the base's)."""
    from peft import PeftModel
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from llmtrain.engine.finetune.lora import is_adapter_key
    from llmtrain.engine.finetune.peft_export import CONFIG, WEIGHTS, adapter_config, peft_tensors
    from llmtrain.engine.hf import check_hf_dir, from_hf_state, model_from_hf_config, read_hf_state
    from llmtrain.recipe.hf_families import family_of
    from llmtrain.recipe.schema import LoRAConfig, ModelConfig

    base = save_tiny(family, tmp_path / "base", shards=1)
    conf, files = check_hf_dir(base)
    cfg = ModelConfig(**model_from_hf_config(conf))
    lora_cfg = LoRAConfig(rank=4, alpha=8.0, **lora_kwargs)
    ours = lora_model(cfg, from_hf_state(read_hf_state(files), cfg), lora_cfg)
    adapters = {k: v for k, v in ours.state_dict().items() if is_adapter_key(k)}
    assert not lora_cfg.experts or any(".experts.lora_b." in k for k in adapters)
    out = tmp_path / "peft"
    out.mkdir()
    save_file(peft_tensors(adapters, cfg), str(out / WEIGHTS), metadata={"format": "pt"})
    (out / CONFIG).write_text(json.dumps(adapter_config(lora_cfg, str(base), fused=family_of(cfg).fused)))
    tokens = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
        base_logits = plain(tokens).logits
        theirs = PeftModel.from_pretrained(plain, out).eval()(tokens).logits
        want = ours.eval()(tokens)
    diff = (theirs - want).abs().max().item()
    print(f"{family} PEFT vs our LoRA forward ({lora_kwargs or 'all-linear'}): {diff:.2e}; vs base "
          f"{(want - base_logits).abs().max().item():.2e}")
    assert diff <= LOGIT_TOL, diff
    assert (want - base_logits).abs().max().item() > 1e-2
