"""Hugging Face family variants beyond one config per family (the families themselves:
tests/test_families.py, whose helpers and tolerances these use): longrope's long-factor regime,
Qwen2's sliding window on the later layers only, and Gemma 3's multimodal checkpoints (4B and
larger), whose language model is what llmtrain trains."""

from __future__ import annotations

import json

import torch

from llmtrain.engine.hf import (
    check_hf_dir, config_problems, family_problems, from_hf_state, hf_config, model_from_hf_config, read_hf_state,
)
from llmtrain.engine.models.llama import Transformer
from llmtrain.recipe.schema import ModelConfig
from tests.hf_tiny import save_tiny
from tests.test_families import LOGIT_RTOL, ids, ours_from, rel_err


def test_longrope_long_factors_past_the_original_length(tmp_path):
    """A forward whose longest row passes original_max_position_embeddings (128 in the tiny Phi-4-mini)
    uses the long factors for every position, as transformers does: equal logits at 100, 128 (short),
    129 and 200 tokens (long); with the long factors replaced by the short ones the 200-token logits
    move by far more than the tolerance. Packed rows decide by their longest sample, as transformers
    does by the largest position id: samples of <= 128 tokens in a 200-token row keep the short factors."""
    from transformers import AutoModelForCausalLM

    base = save_tiny("phi3_longrope", tmp_path / "phi3_longrope")
    theirs = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    ours, cfg = ours_from(base)
    fields = cfg.model_dump()
    fields["rope_scaling"]["long_factor"] = fields["rope_scaling"]["short_factor"]
    short_only = Transformer(ModelConfig(**fields)).eval()
    short_only.load_state_dict(ours.state_dict(), strict=False)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n in (100, 128, 129, 200):
            x = torch.randint(0, cfg.vocab_size, (2, n), generator=gen)
            want = theirs(x).logits
            assert rel_err(ours(x), want) <= LOGIT_RTOL, n
            assert (rel_err(short_only(x), want) > 1e-2) == (n > 128), n
        a, b = torch.randint(0, cfg.vocab_size, (1, 120), generator=gen), torch.randint(0, cfg.vocab_size, (1, 80), generator=gen)
        positions = torch.cat([torch.arange(120), torch.arange(80)]).unsqueeze(0)
        segments = torch.cat([torch.zeros(120), torch.ones(80)]).long().unsqueeze(0)
        packed = ours(torch.cat([a, b], 1), positions=positions, segments=segments)
        assert rel_err(packed[:, :120], theirs(a).logits) <= LOGIT_RTOL
        assert rel_err(packed[:, 120:], theirs(b).logits) <= LOGIT_RTOL


def test_qwen2_window_on_the_later_layers_only(tmp_path):
    """Qwen2 with use_sliding_window and max_window_layers 1 of 3: transformers windows layers 1 and 2
    only (its layer_types); read as full_attention_layers [0], our logits equal its (LOGIT_RTOL), and
    windowing every layer instead moves them past 1e-3; the exported config.json says the same."""
    import transformers as tf

    from tests.hf_tiny import COMMON

    conf = tf.Qwen2Config(**{**COMMON, "num_hidden_layers": 3}, use_sliding_window=True, sliding_window=8,
                          max_window_layers=1, rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    torch.manual_seed(0)
    theirs = tf.AutoModelForCausalLM.from_config(conf, dtype=torch.float32).eval()
    theirs.save_pretrained(tmp_path)
    ours, cfg = ours_from(tmp_path)
    assert (cfg.sliding_window, cfg.full_attention_layers) == (8, [0])
    every = Transformer(cfg.model_copy(update={"full_attention_layers": None})).eval()
    every.load_state_dict(ours.state_dict())
    x = ids(cfg.vocab_size)
    with torch.no_grad():
        want = theirs(x).logits
        assert rel_err(ours(x), want) <= LOGIT_RTOL
        assert rel_err(every(x), want) > 1e-3
    out = hf_config(cfg)
    assert (out["max_window_layers"], out["layer_types"]) == (1, ["full_attention", "sliding_attention",
                                                                  "sliding_attention"])
    assert config_problems(out, cfg) == []
    assert [p.path for p in family_problems(cfg.model_copy(update={"full_attention_layers": [1]}))] == [
        "model.full_attention_layers"]  # Qwen's full layers come first


GEMMA3_4B_IT = {  # google/gemma-3-4b-it config.json as released (transformers 4.50): a sparse text_config
    "architectures": ["Gemma3ForConditionalGeneration"], "boi_token_index": 255999, "eoi_token_index": 256000,
    "eos_token_id": [1, 106], "image_token_index": 262144, "initializer_range": 0.02, "mm_tokens_per_image": 256,
    "model_type": "gemma3", "torch_dtype": "bfloat16", "transformers_version": "4.50.0.dev0",
    "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text", "num_hidden_layers": 34,
                    "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024},
    "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304, "model_type": "siglip_vision_model",
                      "num_attention_heads": 16, "num_hidden_layers": 27, "patch_size": 14, "vision_use_head": False}}


def test_multimodal_gemma3_language_model_loads(tmp_path):
    """Gemma 3 4B and larger ship as Gemma3ForConditionalGeneration (a vision tower beside the language
    model, tensors named language_model.model.*): the checked directory knows the language model's
    tensors by the text model's names (vision tensors left out), and our model streamed from them
    gives the multimodal model's text logits (LOGIT_RTOL). The released sparse 4B config.json reads as
    the gemma3-4b preset with transformers' own defaults, which GEMMA3_TEXT_DEFAULTS equals."""
    import transformers as tf

    from llmtrain.engine.hf.files import check_hf_model
    from llmtrain.recipe.hf_gemma import GEMMA3_TEXT_DEFAULTS
    from tests.hf_tiny import save_tiny_gemma3_multimodal

    d = save_tiny_gemma3_multimodal(tmp_path / "mm")
    conf, files = check_hf_dir(d)
    cfg = ModelConfig(**model_from_hf_config(conf))
    assert (cfg.family, cfg.full_attention_layers, cfg.sliding_window) == ("gemma3_text", [1], 8)
    hf = check_hf_model(d, cfg)
    assert not [n for n in hf.tensors if "vision" in n] and all(n.startswith(("model.", "lm_head")) for n in hf.tensors)
    raw = read_hf_state(files)
    assert any(k.startswith("vision_tower.") for k in raw)
    ours = Transformer(cfg)
    ours.load_state_dict(from_hf_state({n: raw[h.key or n] for n, h in hf.tensors.items()}, cfg), strict=True)
    theirs = tf.AutoModelForImageTextToText.from_pretrained(d, dtype=torch.float32).eval()
    x = ids(cfg.vocab_size)
    with torch.no_grad():
        assert rel_err(ours.eval()(x), theirs(input_ids=x).logits) <= LOGIT_RTOL
    assert config_problems(GEMMA3_4B_IT, ModelConfig(preset="gemma3-4b")) == []
    defaults = tf.Gemma3TextConfig()
    assert {k: getattr(defaults, k) for k in GEMMA3_TEXT_DEFAULTS} == GEMMA3_TEXT_DEFAULTS


def test_multimodal_gemma3_with_two_spellings_of_a_tensor_is_refused(tmp_path):
    """A multimodal Gemma 3 directory whose files hold one language-model tensor under both of its
    spellings (language_model.model.* and model.language_model.*) is refused in one line naming both,
    rather than one of them silently winning."""
    from safetensors.torch import load_file, save_file

    from llmtrain.engine.hf.files import check_hf_model
    from llmtrain.errors import LLMTrainError
    from tests.hf_tiny import save_tiny_gemma3_multimodal

    d = save_tiny_gemma3_multimodal(tmp_path / "mm", shards=1)
    conf, files = check_hf_dir(d)
    cfg = ModelConfig(**model_from_hf_config(conf))
    check_hf_model(d, cfg)  # as written by transformers: loads
    state = load_file(str(files[0]))
    state["model.language_model.norm.weight"] = state["language_model.model.norm.weight"].clone()
    save_file(state, str(files[0]), metadata={"format": "pt"})
    try:
        check_hf_model(d, cfg)
    except LLMTrainError as exc:
        line = " ".join(exc.lines())
        assert "language_model.model.norm.weight" in line and "model.language_model.norm.weight" in line, line
    else:
        raise AssertionError("two spellings of one tensor were accepted")


def test_peft_adapter_of_a_multimodal_gemma3_loads_onto_the_multimodal_model(tmp_path):
    """A LoRA run on a multimodal Gemma 3 base (4B and larger) exports adapters named where
    Gemma3ForConditionalGeneration keeps its language model (``model.language_model.layers.N``), with
    ``target_modules`` a regular expression over the language model only: peft on the multimodal model
    gives our LoRA model's text logits (within 1e-5 of their scale), no vision-tower module gets an
    adapter, and the text model's naming (the control) would load nothing (base logits)."""
    from peft import PeftModel
    from safetensors.torch import save_file
    from transformers import Gemma3ForConditionalGeneration

    from llmtrain.engine.finetune.lora import is_adapter_key
    from llmtrain.engine.finetune.peft_export import CONFIG, MULTIMODAL, TEXT, WEIGHTS, adapter_config, peft_tensors
    from llmtrain.engine.hf.files import check_hf_model
    from llmtrain.recipe.schema import LoRAConfig
    from tests.hf_tiny import lora_model, save_tiny_gemma3_multimodal

    base = save_tiny_gemma3_multimodal(tmp_path / "mm", shards=1)
    conf, files = check_hf_dir(base)
    cfg = ModelConfig(**model_from_hf_config(conf))
    raw = read_hf_state(files)
    lora_cfg = LoRAConfig(rank=4, alpha=8.0)
    ours = lora_model(cfg, from_hf_state({n: raw[h.key or n] for n, h in check_hf_model(base, cfg).tensors.items()}, cfg),
                      lora_cfg)
    adapters = {k: v for k, v in ours.state_dict().items() if is_adapter_key(k)}
    tokens = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = ours.eval()(tokens)
    logits = {}
    for where, multimodal in ((MULTIMODAL, True), (TEXT, False)):
        out = tmp_path / f"peft_{multimodal}"
        out.mkdir()
        save_file(peft_tensors(adapters, cfg, where), str(out / WEIGHTS), metadata={"format": "pt"})
        (out / CONFIG).write_text(json.dumps(adapter_config(lora_cfg, str(base), multimodal=multimodal)))
        plain = Gemma3ForConditionalGeneration.from_pretrained(base, dtype=torch.float32).eval()
        with torch.no_grad():
            base_logits = plain(input_ids=tokens).logits
            peft = PeftModel.from_pretrained(plain, out).eval()
            logits[multimodal] = peft(input_ids=tokens).logits
        if multimodal:
            adapted = [n for n, _ in peft.named_modules() if n.endswith("lora_A")]
            assert adapted and not [n for n in adapted if "vision" in n or "projector" in n], adapted[:4]
            assert len(adapted) == 7 * cfg.layers  # every projection of every decoder layer
    scale = want.abs().max().item()
    assert (logits[True] - want).abs().max().item() <= 1e-5 * scale
    assert (logits[False] - base_logits).abs().max().item() <= 1e-6 * scale  # the text naming: nothing loaded
    assert (want - base_logits).abs().max().item() > 1e-2
