"""Hugging Face families (issue 13): llama (+ Llama 3.1 rope scaling, tied), mistral, qwen2, qwen3,
mixtral, qwen3_moe, phi3 (fused qkv / gate_up), gemma, gemma2 (soft-capping), gemma3_text, granite, smollm3, olmo2 -- import, export, config.json, parameter counts, and
every parallel layout.

Checkpoints are tiny random models written by transformers' own ``save_pretrained`` in several
shards (tests/hf_tiny.py); references are transformers' own forward passes.

Tolerances (all fp32):

* Logits: ``max |ours - theirs| / max |theirs| <= LOGIT_RTOL = 1e-5``. Both compute the same
  function in fp32 with different kernels (complex-multiply RoPE vs rotate_half, our SDPA vs
  transformers' eager/SDPA attention, stacked vs per-expert matmuls), so they differ by fp32
  rounding accumulated over a few layers: measured 3e-7 .. 7e-7. A wrong permutation, a dropped
  bias, wrong rope scaling or routing is off by 1e-2 or more (the "teeth" test shows it).
* Step-1 loss of a 2-rank run vs transformers' loss on the same batch: ``LOSS_TOL = 2e-5``
  absolute on a loss of ~4.9 (ln 128): the same rounding argument plus the layouts' reduction
  orders (TP partial sums, vocabulary-parallel cross-entropy, ring-attention online softmax,
  per-microbatch loss means); measured <= 2e-6.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from llmtrain.engine.hf import (
    check_hf_dir, config_problems, family_problems, from_hf_state, hf_config, model_from_hf_config, read_hf_state,
    to_hf_state,
)
from llmtrain.engine.models.init import init_weights
from llmtrain.engine.models.llama import Transformer
from llmtrain.errors import LLMTrainError
from llmtrain.plan.params import count_params
from llmtrain.recipe.schema import ModelConfig
from tests.distrun import run_cases
from tests.hf_tiny import FAMILIES, save_tiny

LOGIT_RTOL, LOSS_TOL = 1e-5, 2e-5
MOE = ("mixtral", "qwen3_moe", "granitemoe", "olmoe")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf_tiny")
    return {fam: save_tiny(fam, root / fam) for fam in FAMILIES}


def ours_from(directory: Path) -> tuple[Transformer, ModelConfig]:
    conf, files = check_hf_dir(directory)
    cfg = ModelConfig(**model_from_hf_config(conf))
    assert config_problems(conf, cfg) == []
    model = Transformer(cfg)
    model.load_state_dict(from_hf_state(read_hf_state(files), cfg), strict=True)
    return model.eval(), cfg


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def ids(vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 48), generator=torch.Generator().manual_seed(seed))


# -- import and export ------------------------------------------------------------------------------

@pytest.mark.parametrize("family", FAMILIES)
def test_import_and_export_match_transformers(tiny, tmp_path, family):
    """Our model loaded from the sharded checkpoint gives transformers' logits; exported (to_hf_state
    + hf_config) it loads back into transformers with the same model_type and logits."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from safetensors.torch import save_file

    theirs = AutoModelForCausalLM.from_pretrained(tiny[family], dtype=torch.float32).eval()
    ours, cfg = ours_from(tiny[family])
    assert len(list(tiny[family].glob("model-*.safetensors"))) >= 2  # the sharded case
    x = ids(cfg.vocab_size)
    with torch.no_grad():
        want = theirs(x).logits
        err = rel_err(ours(x), want)
    print(f"{family}: import logits rel err {err:.2e}")
    assert err <= LOGIT_RTOL, err

    out = tmp_path / "export"
    out.mkdir()
    save_file(to_hf_state(ours.state_dict(), cfg), out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf_config(cfg)))
    assert AutoConfig.from_pretrained(out).model_type == theirs.config.model_type
    back = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(back) is type(theirs)
    with torch.no_grad():
        err = rel_err(back(x).logits, want)
    print(f"{family}: export logits rel err {err:.2e}")
    assert err <= LOGIT_RTOL, err
    if family == "llama3":  # the scaling survives the round trip (transformers computes it itself)
        assert back.config.rope_parameters["rope_type"] == "llama3"


def test_mapping_has_teeth(tiny):
    """The parity above is not vacuous: each switch, dropped, moves the logits far past the tolerance."""
    from transformers import AutoModelForCausalLM

    for family, change in (("llama3", {"rope_scaling": None}), ("qwen3_moe", {"moe": {"norm_topk_prob": True}}),
                           ("qwen2", {"qkv_bias": False}), ("mistral_swa", {"sliding_window": None}),
                           ("mistral_swa", {"sliding_window": 9}), ("phi3_longrope", {"rope_scaling": None}),
                           # Gemma 3: each switch and each per-layer-kind setting matters
                           ("gemma3", {"attention_scale": None}), ("gemma3", {"local_rope_theta": None}),
                           ("gemma3", {"full_attention_layers": []}), ("gemma3", {"rope_scaling": None}),
                           ("gemma3", {"embed_scale": False}), ("gemma3", {"mlp_activation": "silu"}),
                           ("gemma3", {"post_norms": False}), ("gemma3", {"norm_offset": False}),
                           # Gemma 2: each soft-cap, and its alternating layers
                           ("gemma2", {"attention_softcap": None}), ("gemma2", {"logit_softcap": None}),
                           ("gemma2", {"full_attention_layers": []}),
                           # Gemma 1: its three switches
                           ("gemma", {"norm_offset": False}), ("gemma", {"embed_scale": False}),
                           ("gemma", {"mlp_activation": "silu"}),
                           # Granite: each of its scalars
                           ("granite", {"embed_multiplier": None}), ("granite", {"residual_multiplier": None}),
                           ("granite", {"attention_scale": None}), ("granite", {"logit_divisor": None}),
                           # GraniteMoE: its scalars on the experts' branch, and Mixtral's renormalized top-k
                           ("granitemoe", {"residual_multiplier": None}),
                           ("granitemoe", {"moe": {"norm_topk_prob": False}}),
                           # OLMoE: its q/k norms, its top-k weights not renormalized
                           ("olmoe", {"qk_norm": False, "qk_norm_width": "head"}), ("olmoe", {"moe": {"norm_topk_prob": True}}),
                           ("smollm3", {"nope_layers": None}), ("smollm3", {"nope_layers": [3]}),
                           ("olmo2", {"pre_norms": True}), ("olmo2", {"post_norms": False}),
                           ("phi3_longrope", {"rope_scaling": {"attention_factor": 1.0}}),
                           ("phi3_longrope", {"rope_scaling": {"short_factor": [1.0, 1.0, 1.0]}}),
                           # the third pair unrotated (the first two keep their factors): rotary_dim matters
                           ("phi3_longrope", {"rotary_dim": 4, "rope_scaling": {"short_factor": [1.0, 1.5],
                                                                                "long_factor": [2.0, 3.0]}})):
        theirs = AutoModelForCausalLM.from_pretrained(tiny[family], dtype=torch.float32).eval()
        ours, cfg = ours_from(tiny[family])
        fields = cfg.model_dump()
        for k, v in change.items():
            fields[k] = {**fields[k], **v} if isinstance(v, dict) else v
        wrong_cfg = ModelConfig(**fields)
        wrong = Transformer(wrong_cfg).eval()
        wrong.load_state_dict(ours.state_dict(), strict=False)
        x = ids(cfg.vocab_size)
        with torch.no_grad():
            assert rel_err(wrong(x), theirs(x).logits) > 1e-3, (family, change)
    ours, cfg = ours_from(tiny["qwen3"])  # q_norm weights must be permuted into our head order
    theirs = AutoModelForCausalLM.from_pretrained(tiny["qwen3"], dtype=torch.float32).eval()
    conf, files = check_hf_dir(tiny["qwen3"])
    raw = read_hf_state(files)
    with torch.no_grad():
        for i in range(cfg.layers):
            ours.layers[str(i)].attention.q_norm.weight.copy_(raw[f"model.layers.{i}.self_attn.q_norm.weight"])
        assert rel_err(ours(ids(cfg.vocab_size)), theirs(ids(cfg.vocab_size)).logits) > 1e-3


def test_from_hf_state_names_missing_and_unknown_tensors(tiny):
    conf, files = check_hf_dir(tiny["qwen3_moe"])
    cfg = ModelConfig(**model_from_hf_config(conf))
    state = read_hf_state(files)
    missing = {k: v for k, v in state.items() if k != "model.layers.1.mlp.experts.3.up_proj.weight"}
    with pytest.raises(LLMTrainError, match=r"no Hugging Face tensor 'model.layers.1.mlp.experts.3.up_proj.weight'"):
        from_hf_state(missing, cfg)
    extra = dict(state, **{"model.layers.0.mlp.experts.0.gate_proj.weight": state["model.layers.1.mlp.gate.weight"]})
    with pytest.raises(LLMTrainError, match=r"'model.layers.0.mlp.experts.0.gate_proj.weight' has no counterpart"):
        from_hf_state(extra, cfg)  # layer 0 is dense (mlp_only_layers)


# -- config.json ------------------------------------------------------------------------------------

def test_config_disagreements_are_all_listed(tiny):
    conf, _ = check_hf_dir(tiny["qwen3_moe"])
    fields = model_from_hf_config(conf)
    assert fields["family"] == "qwen3_moe" and fields["head_dim"] == 12 and fields["qk_norm"]
    assert fields["moe"]["dense_layers"] == [0] and fields["moe"]["expert_ffn_hidden"] == 24
    wrong = ModelConfig(**{**fields, "hidden": 64, "head_dim": 8, "qk_norm": False, "family": "mixtral",
                           "moe": {**fields["moe"], "top_k": 1, "expert_ffn_hidden": 48, "norm_topk_prob": True,
                                   "dense_layers": []}})
    problems = config_problems(conf, wrong, "checkpoint.init_from_hf")
    paths = [p.path for p in problems]
    assert sorted(paths) == sorted(["model.family", "model.hidden", "model.head_dim", "model.qk_norm",
                                    "model.moe.top_k", "model.moe.expert_ffn_hidden", "model.moe.norm_topk_prob",
                                    "model.moe.dense_layers"]), paths
    top_k = next(p for p in problems if p.path == "model.moe.top_k")
    assert top_k.line() == ("model.moe.top_k: recipe has 1, checkpoint.init_from_hf config.json has "
                            "num_experts_per_tok=2; set model.moe.top_k=2 with --set, or use matching weights")


@pytest.mark.parametrize("change, words", [
    ({"model_type": "deepseek_v3"}, ["model_type='deepseek_v3' is not supported", "MLA"]),
    ({"model_type": "gemma", "hidden_act": "relu"}, ["model_type='gemma' has hidden_act='relu'", "tanh-approximated"]),
    ({"model_type": "qwen2_moe"}, ["model_type='qwen2_moe'", "shared expert"]),
    ({"attention_bias": True}, ["model_type='llama'", "attention_bias=True", "o_proj"]),
    ({"hidden_act": "gelu"}, ["model_type='llama'", "hidden_act='gelu'"]),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}, ["rope_type='yarn'"]),
    ({"num_hidden_layers": "2"}, ["num_hidden_layers='2' is not a positive integer"]),
    # not a string: `mt not in FAMILIES` raised TypeError (unhashable) with a traceback (unseeded fuzz)
    ({"model_type": {"rope_type": "llama3"}}, ["model_type={'rope_type': 'llama3'} is not supported"]),
    ({"model_type": ["llama"]}, ["model_type=['llama'] is not supported"]),
    # partial rotary, where Phi-3-style configs keep it (top level) and where transformers 5 does; a string
    # there was a ValueError traceback from float()
    ({"partial_rotary_factor": 0.75}, ["partial_rotary_factor=0.75", "llama rotates whole heads"]),
    ({"model_type": "phi3", "partial_rotary_factor": 0.2}, ["partial_rotary_factor=0.2", "an even number >= 2"]),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
     ["partial_rotary_factor=0.5"]),
    ({"partial_rotary_factor": "half"}, ["partial_rotary_factor='half' is not a positive number"]),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": [1]}},
     ["partial_rotary_factor=[1] is not a positive number"]),
    # each family takes default RoPE and the scaling its transformers config takes
    ({"rope_scaling": {"type": "longrope", "short_factor": [1.0], "long_factor": [2.0]}, "rope_parameters": None},
     ["model_type='llama'", "rope_type='longrope'", "default and llama3"]),
    ({"model_type": "phi3", "rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0}},
     ["model_type='phi3'", "rope_type='llama3'", "default and longrope"]),
    ({"model_type": "phi3", "rope_scaling": {"type": "longrope", "short_factor": [1.0, "x"], "long_factor": [2.0]},
      "rope_parameters": None}, ["short_factor=[1.0, 'x'] is not a list of positive numbers"]),
])
def test_unsupported_config_is_one_line(tiny, change, words):
    conf, _ = check_hf_dir(tiny["llama"])
    bad = {**conf, **change}
    with pytest.raises(LLMTrainError) as info:
        model_from_hf_config(bad)
    lines = info.value.lines()
    assert len(lines) == 1 and all(w in lines[0] for w in words), lines
    cfg = ModelConfig(**model_from_hf_config(conf))
    assert [p.line() for p in config_problems(bad, cfg, "config.json")] == lines  # the same single finding


def test_phi3_refuses_llama3_rope_scaling():
    """transformers' Phi3Config accepts only default and longrope RoPE: a phi3 model with llama3 scaling
    would write a config.json transformers refuses."""
    cfg = ModelConfig(preset="llama3.1-8b", family="phi3")
    assert [p.path for p in family_problems(cfg)] == ["model.rope_scaling"]
    with pytest.raises(LLMTrainError, match=r"model\.rope_scaling"):
        hf_config(cfg)


@pytest.mark.parametrize("moe, path", [
    ({"shared_experts": 1}, "model.moe.shared_experts"), ({"router": "sigmoid"}, "model.moe.router"),
    ({"balance": "bias"}, "model.moe.balance"), ({"norm_topk_prob": False}, "model.moe.norm_topk_prob"),
    ({"first_dense_layers": 1}, "model.moe.dense_layers"),
])
def test_features_no_family_has_are_refused(moe, path):
    cfg = ModelConfig(preset="mixtral-8x7b", moe=moe)
    problems = family_problems(cfg)
    assert [p.path for p in problems] == [path], problems
    with pytest.raises(LLMTrainError, match=path.replace(".", r"\.")):
        hf_config(cfg)


# -- parameter counts -----------------------------------------------------------------------------

PUBLISHED = {  # (total, active) of the HF architectures: the exact integers of their config.json formulas
    "llama3.1-8b": (8_030_261_248, None), "llama3.1-70b": (70_553_706_496, None),
    "llama3.1-405b": (405_853_388_800, None), "llama3.2-1b": (1_235_814_400, None),
    "llama3.2-3b": (3_212_749_824, None), "qwen2.5-7b": (7_615_616_512, None), "qwen3-8b": (8_190_735_360, None),
    "qwen3-32b": (32_762_123_264, None), "qwen3-30b-a3b": (30_532_122_624, 3_353_032_704),
    "mistral-7b": (7_248_023_552, None), "mixtral-8x7b": (46_702_792_704, 12_879_925_248),
    "phi3-mini-4k": (3_821_079_552, None), "phi4-14b": (14_659_507_200, None),
    "mistral-7b-v0.1": (7_241_732_096, None), "gemma3-1b": (999_885_952, None),
    "gemma3-4b": (3_880_263_168, None), "gemma3-12b": (11_766_034_176, None), "gemma3-27b": (27_009_346_304, None),
    "gemma2-2b": (2_614_341_888, None), "gemma2-9b": (9_241_705_984, None), "gemma2-27b": (27_227_128_320, None),
    "gemma-2b": (2_506_172_416, None), "gemma-7b": (8_537_680_896, None), "mistral-nemo-12b": (12_247_782_400, None),
    "qwen2.5-0.5b": (494_032_768, None), "qwen2.5-1.5b": (1_543_714_304, None), "qwen2.5-3b": (3_085_938_688, None),
    "qwen2.5-14b": (14_770_033_664, None), "qwen2.5-32b": (32_763_876_352, None), "qwen2.5-72b": (72_706_203_648, None),
    "olmo2-1b": (1_484_916_736, None), "olmo2-7b": (7_298_617_344, None), "olmo2-13b": (13_716_198_400, None),
    "smollm3-3b": (3_075_098_624, None), "granitemoe-1b-a400m": (1_334_628_352, 428_658_688),
}


@pytest.mark.parametrize("preset", list(PUBLISHED))
def test_preset_counts_are_the_published_architectures(preset):
    """Each integer equals what transformers builds from our hf_config (checked when the table was
    made, AutoModelForCausalLM on the meta device) and is the published size (8.03B, 70.6B, 405.9B,
    1.24B, 3.21B, 7.62B, 8.19B, 32.8B, 30.5B/3.3B active, 7.25B, 46.7B/12.9B active, 3.82B, 14.7B, 7.24B, 1.0B,
    the Gemma 3 4B / 12B / 27B language models 3.88B, 11.8B, 27.0B, Gemma 2 2.61B, 9.24B, 27.2B and
    Gemma 1 2.51B, 8.54B, Mistral NeMo 12.2B, Qwen2.5 0.49B-72.7B, OLMo 2 1.48B, 7.3B, 13.7B, SmolLM3 3.08B and
    GraniteMoE 1.33B / 0.43B active)."""
    total, active = PUBLISHED[preset]
    cfg = ModelConfig(preset=preset)
    counts = count_params(cfg)
    assert counts.total == total and counts.active == (active or total)
    assert cfg.family is not None and family_problems(cfg) == []
    with torch.device("meta"):
        assert sum(p.numel() for p in Transformer(cfg).parameters()) == total


def test_preset_count_equals_transformers_meta_model():
    from transformers import AutoConfig, AutoModelForCausalLM

    for preset in ("qwen3-8b", "llama3.2-1b", "qwen2.5-7b", "phi4-14b", "mistral-7b-v0.1", "gemma3-1b", "gemma3-27b",
                   "gemma2-9b", "gemma2-27b", "gemma-2b", "gemma-7b", "mistral-nemo-12b", "qwen2.5-0.5b", "qwen2.5-72b",
                   "olmo2-1b", "olmo2-13b", "smollm3-3b", "granitemoe-1b-a400m"):
        conf = hf_config(ModelConfig(preset=preset))
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**{k: v for k, v in conf.items()
                                                                               if k != "architectures"}))
        assert sum(p.numel() for p in model.parameters()) == PUBLISHED[preset][0]


@pytest.mark.parametrize("family", FAMILIES)
def test_engine_count_and_init_of_switches(tiny, family):
    """plan's count equals the engine's parameters for every switch combination; init sets biases
    to zero and norm weights to the identity scale: one, or zero for Gemma's (1 + w) norms."""
    conf, _ = check_hf_dir(tiny[family])
    fields = model_from_hf_config(conf)
    for tie in (False, True):
        cfg = ModelConfig(**{**fields, "tie_embeddings": tie})
        model = Transformer(cfg)
        assert sum(p.numel() for p in model.parameters()) == count_params(cfg).total
        init_weights(model, seed=0)
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                assert torch.equal(p, torch.zeros_like(p)), name
            if "norm" in name:
                identity = torch.zeros_like(p) if cfg.norm_offset else torch.ones_like(p)
                assert torch.equal(p, identity), name


# -- every layout, from each family's checkpoint ------------------------------------------------------

LAYOUTS = {"tp2": ["parallel.tp=2"], "pp2": ["parallel.pp=2"], "cp2": ["parallel.cp=2"],
           "fsdp2": ["parallel.dp_shard=2"], "ep2": ["parallel.dp_shard=2", "parallel.ep=2"],
           "ulysses2": ["parallel.cp=2", "parallel.cp_method=ulysses"],
           "allgather2": ["parallel.cp=2", "parallel.cp_method=allgather"],
           "pp2_21": ["parallel.pp=2", "parallel.pp_layers_per_stage=[2,1]"]}  # 3 layers: a sliding + full stage
RECIPE = """name: families
model: {preset: debug-dense}
parallel: {tp: 1, pp: 1, cp: 1, dp_shard: 1, zero: 3}
train: {seq_len: 32, micro_batch_size: 1, global_batch_size: 4, steps: 1, precision: fp32, seed: 0,
        optimizer: {lr: 0.001, weight_decay: 0.0}, schedule: {warmup_steps: 0, decay: constant}}
data: {source: synthetic}
cluster: {nodes: 1, gpus_per_node: 2, gpu: cpu}
"""


def layouts_of(family: str) -> list[str]:
    if family == "phi3_longrope":  # its RoPE at CP's non-contiguous positions and under TP; the rest is phi3's
        return ["tp2", "cp2"]
    if family in ("mistral_swa", "gemma3", "gemma2"):  # the window (8 of 32 tokens) as a band mask, in Ulysses'
        # attention, in all-gather's rows of it and in the ring's blocks (Gemma 2: its soft-capped kernel there too)
        return ["tp2", "pp2" if family == "mistral_swa" else "pp2_21", "fsdp2", "cp2", "ulysses2", "allgather2"]
    if family == "olmo2":  # its q/k norms span the heads TP splits (engine/models/norm.py SplitRMSNorm)
        return ["tp2", "pp2", "cp2", "fsdp2", "ulysses2"]
    extra = (["ep2"] if family in MOE else []) + (["ulysses2"] if family in ("qwen3", "qwen3_moe") else [])
    fsdp = [] if family in MOE else ["fsdp2"]  # ep2 borrows dp_shard 2: it runs FSDP 2 on the dense weights
    return ["tp2", "pp2", "cp2", *fsdp, *extra]  # llama3 (tied embeddings) too: PP syncs the two copies


def hf_step1_loss(directory: Path, recipe) -> float:
    from transformers import AutoModelForCausalLM

    from llmtrain.engine.data import BatchSampler, build_data

    t = recipe.train
    data = build_data(recipe.data, t.seq_len, recipe.model.vocab_size, t.seed)
    gbs = t.global_batch_size
    sampler = BatchSampler(getattr(data, "length", None), gbs, gbs, 0, 1, t.seed)  # the whole step-1 batch
    tokens = torch.from_numpy(np.stack([data.sample(i) for mb in sampler.step_indices() for i in mb]))
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(tokens[:, :-1]).logits
    return float(F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()))


def test_every_layout_starts_from_the_checkpoint(tiny, tmp_path):
    """One 2-rank torchrun job: per (family, layout) a run with ``checkpoint.init_from_hf`` whose
    step-1 loss equals transformers' loss on the same batch (LOSS_TOL, module docstring)."""
    from llmtrain.recipe.load import load_recipe

    recipe_path = tmp_path / "families.yaml"
    recipe_path.write_text(RECIPE)
    cases, expected = [], {}
    for family in FAMILIES:
        conf, _ = check_hf_dir(tiny[family])
        sets = [f"model={json.dumps(model_from_hf_config(conf))}", f"checkpoint.init_from_hf={tiny[family]}"]
        expected[family] = hf_step1_loss(tiny[family], load_recipe(recipe_path, sets))
        cases += [{"name": f"{family}/{layout}", "set": sets + LAYOUTS[layout]} for layout in layouts_of(family)]
        if family == "phi3_longrope":  # rows of 160 > original 128: the long factors, by the whole row's length
            long = sets + ["train.seq_len=160"]  # (a CP rank holds 80 tokens, a shard of the row)
            expected["phi3_longrope@160"] = hf_step1_loss(tiny[family], load_recipe(recipe_path, long))
            cases += [{"name": f"phi3_longrope@160/{layout}", "set": long + LAYOUTS[layout]}
                      for layout in ("tp2", "cp2", "ulysses2")]
    results = run_cases(tmp_path, 2, str(recipe_path), cases, steps=1)
    worst = 0.0
    for case in cases:
        family = case["name"].split("/")[0]
        got = results[case["name"]]
        assert got["layout_errors"] == [], got["layout_errors"]
        diff = abs(got["losses"][0] - expected[family])
        worst = max(worst, diff)
        assert diff <= LOSS_TOL, (case["name"], got["losses"][0], expected[family])
    print(f"{len(cases)} layouts: worst step-1 loss diff {worst:.2e} (losses ~{min(expected.values()):.3f})")
