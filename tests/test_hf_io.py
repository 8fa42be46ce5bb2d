"""HF I/O at scale: streaming ``--init-from-hf`` per rank, parallel sharded ``ckpt export --hf``, bad directories.

Real files throughout: tiny sharded checkpoints written by transformers' own ``save_pretrained``
(tests/hf_tiny.py ``save_tiny``, 4 shard files + ``model.safetensors.index.json`` each), a real
2-rank torchrun job (tests/hf_io_worker.py, one job for every multi-rank case), a real 1-process
resume, real ``llmtrain`` CLI commands.

* **Streaming = whole read, bitwise** (in the job): llama3 (tied) FSDP2 dp_shard 2; qwen3
  (head_dim 12 != hidden/heads, q/k norms) TP 2; qwen3_moe (stacked experts, dense layer 0) EP 2
  (expert shards are ``_StridedShard`` DTensors); llama PP 2; mixtral TP 2 (experts replicated).
  The streamed model's full weights must equal, with ``torch.equal``, those of the same layout
  loaded by reading every tensor and keeping the shard (``load_hf_weights_whole``); and phi3
  TP 2 (each rank's rows of the q, k, v blocks of the fused ``qkv_proj`` and of the gate and
  up halves of ``gate_up_proj``; a Phi-3 run trained at TP 2 is exported in 12 KB shards and
  loads in transformers with equal logits): both copy
  the same file values (one dtype, no arithmetic), so any difference is a wrong box.
* **Each rank reads only its bytes**: per rank, the elements read from the files equal the
  elements of its local shards, plus only the whole-head cover of a head-permuted tensor split
  inside a head (qwen3_moe's 12-element q/k norm split 6/6: 2 norms x 2 layers x 6 = 24
  elements); under FSDP2 each rank reads exactly half the model, under PP each rank only its
  stages' tensors (and so not every shard file).
* **Export from 2 ranks = export resharded to 1 rank, bitwise**: the job trains qwen3_moe
  (EP 2 + FSDP2, from the tiny HF weights) 2 steps and checkpoints step-2; a 1-process resume
  (EP 1, no torchrun: tests/hf_io_worker.py ``--single``) with learning rate 1e-30 (the schema
  wants lr > 0) saves step-3, holding step-2's weights exactly as a 1-rank checkpoint: AdamW's
  step moves a weight by about lr (|m / sqrt(v)| <= ~10), below half an fp32 ulp of every
  weight larger than ~1e-21 in magnitude, so the weights stay bit-identical. This is the MoE
  case (EP 2 + FSDP 2); the 4-rank dense case (TP 2 x FSDP 2) is in test_checkpoint_resume.py.
  Both exports (``--max-shard-size 40KB``: several shards; ``--workers 2``) must have the same
  files, index and tensors (``torch.equal``), and a ``--workers 1`` export is byte-identical
  (the plan is deterministic).
* **transformers loads the export**: ``AutoModelForCausalLM.from_pretrained(OUT)`` has
  model_type qwen3_moe and its logits equal our engine model's (loaded from the same
  checkpoint) within ``LOGIT_TOL = 1e-5`` absolute on logits of magnitude ~1: the same fp32
  function with other kernels and summation orders (rounding ~1e-7 relative per op through 2
  layers, routing identical); a wrong permutation or expert order is >= 1e-2. The tokenizer
  files are copied and generation_config.json carries their bos/eos ids. ``--dtype bf16``
  tensors are the fp32 export rounded to bf16 (``torch.equal`` after ``.to(bfloat16)``).
* **Bad directories**: each defect, through ``llmtrain launch --init-from-hf BAD`` (in process,
  torchrun replaced by a recorder; one defect also in a real subprocess): exit 2, exactly one
  error line naming the file (and tensor), no run directory, nothing launched.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from helpers_cli import errors_of, invoke_stubbed  # noqa: E402
from hf_io_helpers import logits_error, run_worker, shard_tensors, write_recipe, write_tokenizer  # noqa: E402
from hf_tiny import save_tiny, save_tiny_gemma3_multimodal  # noqa: E402

LOGIT_TOL = 1e-5
LOAD_CASES = {"llama3_fsdp": ("llama3", ["parallel.dp_shard=2"]), "qwen3_tp": ("qwen3", ["parallel.tp=2"]),
              "qwen3_moe_ep": ("qwen3_moe", ["parallel.ep=2"]), "llama_pp": ("llama", ["parallel.pp=2", "parallel.zero=1"]),
              "mixtral_tp": ("mixtral", ["parallel.tp=2"]), "phi3_tp": ("phi3", ["parallel.tp=2"]),
              "gemma3_tp": ("gemma3", ["parallel.tp=2"]),
              # GraniteMoE's experts fused per expert (input_linear [E, 2F, H]): expert-TP reads each half's rows
              "granitemoe_tp": ("granitemoe", ["parallel.tp=2"]),
              "gemma3_mm_tp": ("gemma3_mm", ["parallel.tp=2"])}  # Gemma3ForConditionalGeneration: its language model
TRAIN = ["parallel.ep=2", "train.steps=2", "checkpoint.interval=2", "checkpoint.async=false"]


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("hfio")
    hf = {f: save_tiny(f, tmp / f, shards=3) for f in ("llama", "llama3", "qwen3", "qwen3_moe", "mixtral", "phi3",
                                                       "gemma3", "granitemoe")}
    hf["gemma3_mm"] = save_tiny_gemma3_multimodal(tmp / "gemma3_mm", shards=3)
    tok = write_tokenizer(tmp / "tok")
    cases = [{"kind": "load", "name": name, "recipe": str(write_recipe(hf[fam], tmp / f"{fam}.yaml")), "set": sets,
              "hf": str(hf[fam])} for name, (fam, sets) in LOAD_CASES.items()]
    moe = write_recipe(hf["qwen3_moe"], tmp / "train.yaml", tokenizer=str(tok))
    ckpts = tmp / "ckpts"
    common = [f"checkpoint.dir={ckpts}", f"checkpoint.init_from_hf={hf['qwen3_moe']}"]
    cases.append({"kind": "train", "name": "train", "recipe": str(moe), "set": common + TRAIN, "steps": 2})
    phi3 = write_recipe(hf["phi3"], tmp / "phi3_train.yaml")
    cases.append({"kind": "train", "name": "phi3_train", "recipe": str(phi3), "steps": 2,
                  "set": [f"checkpoint.dir={tmp / 'ckpts_phi3'}", f"checkpoint.init_from_hf={hf['phi3']}", "parallel.tp=2",
                          "train.steps=2", "checkpoint.interval=2", "checkpoint.async=false"]})
    gemma3 = write_recipe(hf["gemma3"], tmp / "gemma3_train.yaml")  # seq 16 > window 8: sliding + full layers
    cases.append({"kind": "train", "name": "gemma3_train", "recipe": str(gemma3), "steps": 2,
                  "set": [f"checkpoint.dir={tmp / 'ckpts_gemma3'}", f"checkpoint.init_from_hf={hf['gemma3']}",
                          "parallel.tp=2", "train.steps=2", "checkpoint.interval=2", "checkpoint.async=false"]})
    granite = write_recipe(hf["granitemoe"], tmp / "granitemoe_train.yaml")
    cases.append({"kind": "train", "name": "granitemoe_train", "recipe": str(granite), "steps": 2,
                  "set": [f"checkpoint.dir={tmp / 'ckpts_granitemoe'}", f"checkpoint.init_from_hf={hf['granitemoe']}",
                          "parallel.tp=2", "train.steps=2", "checkpoint.interval=2", "checkpoint.async=false"]})
    results = run_worker({"cases": cases, "out": str(tmp / "res.pt")}, tmp / "spec.json", nproc=2)
    one = [*common, "parallel.ep=1", "cluster.gpus_per_node=1", "train.steps=3", "train.optimizer.lr=1e-30",
           "checkpoint.interval=1", "checkpoint.async=false"]
    resumed = run_worker({"cases": [{"kind": "train", "name": "one", "recipe": str(moe), "set": one, "steps": 3,
                                     "resume": "step-2"}], "out": str(tmp / "res1.pt"), "port": 29000 + os.getpid() % 2000},
                         tmp / "spec1.json", nproc=None)
    return {"tmp": tmp, "hf": hf, "tok": tok, "results": results, "resumed": resumed, "ckpts": ckpts, "moe": moe}


@pytest.mark.parametrize("case", list(LOAD_CASES))
def test_streaming_load_equals_whole_read_bitwise(world, case):
    r = world["results"][case]
    assert r["streamed"].keys() == r["whole"].keys() and r["streamed"]
    differ = [k for k in r["whole"] if not torch.equal(r["streamed"][k], r["whole"][k])]
    assert not differ, differ[:5]


def test_each_rank_reads_only_its_slices(world):
    res = world["results"]
    total = {c: sum(v.numel() for v in res[c]["whole"].values()) for c in LOAD_CASES}
    tied = total["llama3_fsdp"] - res["llama3_fsdp"]["whole"]["output.weight"].numel()  # the embedding, read once
    for case in LOAD_CASES:
        for s in res[case]["stats"]:
            print(f"{case} rank {s['rank']}: read {s['elements']} elements ({s['slices']} slices, "
                  f"{len(s['files'])} files), local shards {s['local_elements']}")
            overhead = 24 if case == "qwen3_moe_ep" else 0
            assert s["elements"] == s["local_elements"] + overhead, (case, s)
    for s in res["llama3_fsdp"]["stats"]:  # FSDP2: exactly half of every tensor
        assert 2 * s["elements"] == tied
    pp = res["llama_pp"]["stats"]
    assert sum(s["elements"] for s in pp) == total["llama_pp"] and all(len(s["files"]) < 4 for s in pp)


def invoke(args: list[str]):
    """``llmtrain ARGS`` in this process; a launch only records that it was called."""
    code, output, calls = invoke_stubbed(args, "llmtrain.launch.backends.local.launch_local")
    return code, output, [a for a, _ in calls]


def export(ckpts: Path, step: str, out: Path, *extra: str) -> Path:
    code, output, _ = invoke(["ckpt", "export", str(ckpts), "--ckpt", step, "--hf", str(out), *extra])
    assert code == 0, output[-3000:]
    return out


@pytest.fixture(scope="module")
def exports(world) -> dict:
    tmp, ckpts = world["tmp"], world["ckpts"]
    return {"two": export(ckpts, "step-2", tmp / "ex2", "--max-shard-size", "40KB", "--workers", "2"),
            "one": export(ckpts, "step-3", tmp / "ex1", "--max-shard-size", "40KB", "--workers", "2"),
            "serial": export(ckpts, "step-2", tmp / "ex2s", "--max-shard-size", "40KB", "--workers", "1")}


def test_export_after_2_ranks_equals_export_resharded_to_1_rank(world, exports):
    meta2 = json.loads((world["ckpts"] / "step-2" / "metadata.json").read_text())
    meta3 = json.loads((world["ckpts"] / "step-3" / "metadata.json").read_text())
    assert meta2["world_size"] == 2 and meta2["dims"]["ep"] == 2 and meta3["world_size"] == 1
    two, one, serial = exports["two"], exports["one"], exports["serial"]
    names = sorted(p.name for p in two.iterdir())
    shards = [n for n in names if n.endswith(".safetensors")]
    assert len(shards) >= 3 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors", names
    assert names == sorted(p.name for p in one.iterdir()) == sorted(p.name for p in serial.iterdir())
    index = json.loads((two / "model.safetensors.index.json").read_text())
    assert index == json.loads((one / "model.safetensors.index.json").read_text())
    a, b = shard_tensors(two), shard_tensors(one)
    assert a.keys() == b.keys() == index["weight_map"].keys()
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in a.values())
    assert not [k for k in a if not torch.equal(a[k], b[k])]
    for n in shards:  # deterministic plan: 1 worker or 2 write the same bytes
        assert (two / n).read_bytes() == (serial / n).read_bytes(), n
    trained = shard_tensors(world["hf"]["qwen3_moe"])
    assert any(not torch.equal(a[k], trained[k]) for k in a)  # training moved the weights


def test_export_loads_in_transformers_with_equal_logits(world, exports):
    out = exports["two"]
    err = logits_error(world["ckpts"] / "step-2", out, "qwen3_moe")
    print(f"export -> transformers: logits max abs error {err:.3g}")
    assert err <= LOGIT_TOL, err
    assert (out / "tokenizer.json").read_bytes() == (world["tok"] / "tokenizer.json").read_bytes()
    gen = json.loads((out / "generation_config.json").read_text())
    assert (gen["bos_token_id"], gen["eos_token_id"]) == (0, 1)


def test_fused_phi3_export_from_tp2_loads_in_transformers(world):
    """Phi-3's fused qkv_proj / gate_up_proj, trained from the tiny HF weights at TP 2 (each rank
    holds half the rows of every block) and exported in 12 KB shards by 2 workers: the blocks of a
    fused tensor land in one shard, joined in order; transformers' logits equal ours (LOGIT_TOL)."""
    ckpts = world["tmp"] / "ckpts_phi3"
    out = export(ckpts, "step-2", world["tmp"] / "phi3_export", "--max-shard-size", "12KB", "--workers", "2")
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) >= 3 and "model.layers.1.self_attn.qkv_proj.weight" in index
    assert not [k for k in index if k.endswith((".q_proj.weight", ".gate_proj.weight", ".up_proj.weight"))]
    assert json.loads((ckpts / "step-2" / "metadata.json").read_text())["dims"]["tp"] == 2
    err = logits_error(ckpts / "step-2", out, "phi3")
    print(f"phi3 export -> transformers: logits max abs error {err:.3g}")
    assert err <= LOGIT_TOL, err
    trained, start = shard_tensors(out), shard_tensors(world["hf"]["phi3"])
    assert not torch.equal(trained["model.layers.0.self_attn.qkv_proj.weight"],
                           start["model.layers.0.self_attn.qkv_proj.weight"])  # training moved the fused weights


def test_gemma3_export_from_tp2_loads_in_transformers(world):
    """Gemma 3 (offset and post norms, GeGLU, sliding and full layers) trained from the tiny HF
    weights at TP 2 with sequence parallelism, exported: Gemma3ForCausalLM's logits equal ours
    (LOGIT_TOL), and training moved the Gemma-only tensors (post-feedforward norm, embedding).
    Its embeddings are tied: `ckpt export` of a tied model was refused ("no model.output.weight")
    until the thirty-sixth session; this is the CLI test of that."""
    ckpts = world["tmp"] / "ckpts_gemma3"
    out = export(ckpts, "step-2", world["tmp"] / "gemma3_export", "--max-shard-size", "12KB", "--workers", "2")
    assert json.loads((out / "config.json").read_text())["layer_types"] == [
        "sliding_attention", "full_attention", "sliding_attention"]
    err = logits_error(ckpts / "step-2", out, "gemma3_text")
    print(f"gemma3 export -> transformers: logits max abs error {err:.3g}")
    assert err <= LOGIT_TOL, err
    trained, start = shard_tensors(out), shard_tensors(world["hf"]["gemma3"])
    for name in ("model.layers.0.post_feedforward_layernorm.weight", "model.embed_tokens.weight"):
        assert not torch.equal(trained[name], start[name]), name


def test_fused_granitemoe_export_from_tp2_loads_in_transformers(world):
    """GraniteMoE's experts (gate and up rows of every expert in one input_linear [E, 2F, H]) trained from
    the tiny HF weights at TP 2 (each rank holds half of each expert's gate and up rows) and exported:
    the two halves joined along dim 1, GraniteMoeForCausalLM's logits equal ours (LOGIT_TOL)."""
    ckpts = world["tmp"] / "ckpts_granitemoe"
    out = export(ckpts, "step-2", world["tmp"] / "granitemoe_export", "--max-shard-size", "12KB", "--workers", "2")
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.layers.1.block_sparse_moe.input_linear.weight" in index
    err = logits_error(ckpts / "step-2", out, "granitemoe")
    print(f"granitemoe export -> transformers: logits max abs error {err:.3g}")
    assert err <= LOGIT_TOL, err
    trained, start = shard_tensors(out), shard_tensors(world["hf"]["granitemoe"])
    name = "model.layers.0.block_sparse_moe.input_linear.weight"
    assert trained[name].shape == start[name].shape and not torch.equal(trained[name], start[name])


def test_export_bf16_is_the_fp32_export_rounded(world, exports):
    out = export(world["ckpts"], "step-2", world["tmp"] / "bf16", "--dtype", "bf16", "--workers", "1")
    assert sorted(p.name for p in out.glob("*.safetensors")) == ["model.safetensors"]  # 5GB default: one file
    a, b = shard_tensors(exports["two"]), shard_tensors(out)
    assert a.keys() == b.keys() and all(b[k].dtype == torch.bfloat16 and torch.equal(b[k], a[k].to(torch.bfloat16))
                                        for k in a)
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    code, output, _ = invoke(["ckpt", "export", str(world["ckpts"]), "--hf", str(world["tmp"] / "x"),
                              "--max-shard-size", "lots"])
    assert code == 2 and len(errors_of(output)) == 1 and "--max-shard-size" in output
    assert not (world["tmp"] / "x").exists()


# -- bad directories ---------------------------------------------------------------------------

def rewrite_shard(d: Path, name: str, change) -> Path:
    """Rewrite the shard holding tensor ``name`` with ``change(tensors)`` (a real safetensors file)."""
    from safetensors.torch import load_file, save_file

    index = json.loads((d / "model.safetensors.index.json").read_text())
    f = d / index["weight_map"][name]
    tensors = load_file(str(f))
    change(tensors)
    save_file(tensors, str(f), metadata={"format": "pt"})
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if k in tensors or v != f.name}
    index["weight_map"].update({k: f.name for k in tensors})
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    return f


def _drop_index_and_shard(d: Path) -> str:
    (d / "model.safetensors.index.json").unlink()
    (d / "model-00002-of-00004.safetensors").unlink()
    return "missing shard file model-00002-of-00004.safetensors"


def _index_names_missing_file(d: Path) -> str:
    (d / "model-00003-of-00004.safetensors").unlink()
    return "model-00003-of-00004.safetensors (for "


def _index_wrong_file(d: Path) -> str:
    index = json.loads((d / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.norm.weight"] = ("model-00001-of-00004.safetensors"
                                                if index["weight_map"]["model.norm.weight"] != "model-00001-of-00004.safetensors"
                                                else "model-00002-of-00004.safetensors")
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    return "weight_map puts tensor model.norm.weight in model-0000"


def _missing_tensor(d: Path) -> str:
    rewrite_shard(d, "model.layers.1.self_attn.k_proj.weight", lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    return "no tensor model.layers.1.self_attn.k_proj.weight (the model's layers.1.attention.wk.weight)"


def _wrong_shape(d: Path) -> str:
    rewrite_shard(d, "model.norm.weight", lambda t: t.update({"model.norm.weight": torch.ones(31)}))
    return "tensor model.norm.weight has shape [31], the model needs [32]"


def _unexpected(d: Path) -> str:
    rewrite_shard(d, "model.norm.weight", lambda t: t.update({"model.layers.0.mlp.extra.weight": torch.ones(3)}))
    return "unexpected tensor model.layers.0.mlp.extra.weight"


def _int_dtype(d: Path) -> str:
    rewrite_shard(d, "model.norm.weight", lambda t: t.update({"model.norm.weight": torch.ones(32, dtype=torch.int32)}))
    return "tensor model.norm.weight has dtype I32, not floating point"


def _config_string(d: Path) -> str:
    conf = json.loads((d / "config.json").read_text())
    conf["hidden_size"] = "32"
    (d / "config.json").write_text(json.dumps(conf))
    return "hidden_size='32'"


def _garbage_header(d: Path) -> str:
    (d / "model-00002-of-00004.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    return "model-00002-of-00004.safetensors: not a safetensors file (its header is not JSON)"


def _truncated(d: Path) -> str:
    f = d / "model-00004-of-00004.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    return "model-00004-of-00004.safetensors: truncated: its header needs"


def _symlink_out(d: Path) -> str:
    f = d / "model-00001-of-00004.safetensors"
    outside = d.parent / f"outside-{d.name}.safetensors"
    shutil.move(f, outside)
    os.symlink(outside, f)
    return "model-00001-of-00004.safetensors: resolves outside"


def _index_not_json(d: Path) -> str:
    (d / "model.safetensors.index.json").write_text("{weight_map")
    return "model.safetensors.index.json: not valid JSON"


def _index_too_big(d: Path) -> str:
    with open(d / "model.safetensors.index.json", "r+b") as f:  # sparse: costs no disk
        f.truncate(65 * 2**20)
    return "model.safetensors.index.json is 65 MiB, over the 64 MiB limit"


BAD = {f.__name__.lstrip("_"): f for f in (
    _drop_index_and_shard, _index_names_missing_file, _index_wrong_file, _missing_tensor, _wrong_shape, _unexpected,
    _int_dtype, _config_string, _garbage_header, _truncated, _symlink_out, _index_not_json, _index_too_big)}


@pytest.fixture(scope="module")
def good_llama(tmp_path_factory) -> tuple[Path, Path]:
    tmp = tmp_path_factory.mktemp("bad")
    hf = save_tiny("llama", tmp / "good", shards=3)
    return hf, write_recipe(hf, tmp / "llama.yaml")


@pytest.mark.parametrize("defect", list(BAD))
def test_bad_hf_directory_is_one_line_exit_2_nothing_started(good_llama, tmp_path, defect):
    good, recipe = good_llama
    bad = tmp_path / "bad"
    shutil.copytree(good, bad)
    expected = BAD[defect](bad)
    runs = tmp_path / "runs"
    code, output, launched = invoke(["launch", str(recipe), "--runs", str(runs), "--init-from-hf", str(bad)])
    errors = errors_of(output)
    assert code == 2 and len(errors) == 1, output[-3000:]
    assert expected in errors[0] and errors[0].startswith("error: --init-from-hf: "), errors[0]
    assert not launched and not runs.exists()


def test_good_directory_passes_and_a_real_cli_refuses_a_truncated_one(good_llama, tmp_path):
    good, recipe = good_llama
    code, output, launched = invoke(["launch", str(recipe), "--runs", str(tmp_path / "runs"), "--init-from-hf", str(good)])
    assert code == 0 and len(launched) == 1, output[-3000:]  # the check passed; the (recorded) launch was called
    bad = tmp_path / "bad"
    shutil.copytree(good, bad)
    expected = _truncated(bad)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("LLMTRAIN_DEBUG", None)
    proc = subprocess.run([sys.executable, "-m", "llmtrain.cli.app", "launch", str(recipe), "--runs",
                           str(tmp_path / "runs2"), "--init-from-hf", str(bad)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    errors = errors_of(proc.stderr)
    assert proc.returncode == 2 and len(errors) == 1 and expected in errors[0], proc.stderr[-3000:]
    assert not (tmp_path / "runs2").exists() and "torchrun" not in proc.stdout + proc.stderr
