"""Peak host memory per rank while loading HF weights: streaming slices vs reading the whole model.

    python benchmarks/hf_load_memory.py           # ~275M-param Llama, fp32 (~1.1 GB, 4 shards), 4 ranks FSDP 4
    python benchmarks/hf_load_memory.py --tiny    # toy model on 2 ranks (CI smoke test)

The checkpoint is written by transformers' own ``LlamaForCausalLM.save_pretrained`` (random
weights, ``max_shard_size`` 300MB, so ``model-0000i-of-00004.safetensors`` + index) into a
scratch directory. Then, per mode, one torchrun job of N ranks (benchmarks/hf_load_memory_worker.py)
builds the recipe's model as FSDP2 over all ranks (dp_shard N, zero 3, fp32) and loads the
weights:

* **stream** — ``load_hf_weights`` (what ``--init-from-hf`` does): each rank reads only the
  slices of its own shards (``safe_open(...).get_slice``), one file open at a time;
* **whole** — ``load_hf_weights_whole`` (the previous loader): each rank reads every tensor,
  then ``set_model_state_dict(full_state_dict=True)`` keeps its shard.

Per rank: RSS before the load (model shard built and initialized), the peak RSS during the load
(the kernel's high-water mark, reset just before it: see the worker), and the load's wall time.
The modes run as separate jobs so neither inherits the other's memory (``--tiny``: one job).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import common  # noqa: E402

WORKER = Path(__file__).with_name("hf_load_memory_worker.py")
FULL = dict(hidden_size=1024, num_hidden_layers=18, num_attention_heads=16, num_key_value_heads=8,
            intermediate_size=2816, vocab_size=32000)
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
            vocab_size=256)
MIB = 2**20


def write_checkpoint(shape: dict, out: Path, shard: str) -> int:
    """Random Llama of ``shape`` saved by transformers (fp32, sharded); returns its parameter count."""
    import torch
    import transformers as tf

    conf = tf.LlamaConfig(**shape, max_position_embeddings=2048, tie_word_embeddings=False,
                          rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(conf).to(torch.float32)
    model.save_pretrained(out, max_shard_size=shard)
    return sum(p.numel() for p in model.parameters())


def write_recipe(hf: Path, ranks: int, out: Path) -> Path:
    import yaml

    sys.path.insert(0, str(common.ROOT))
    from llmtrain.engine.hf import model_from_hf_config

    model = model_from_hf_config(json.loads((hf / "config.json").read_text()))
    doc = {"name": "hf-load-bench", "model": model, "parallel": {"tp": 1, "dp_shard": -1, "zero": 3},
           "train": {"seq_len": 64, "micro_batch_size": 1, "global_batch_size": ranks, "steps": 1, "precision": "fp32"},
           "data": {"source": "synthetic"}, "cluster": {"nodes": 1, "gpus_per_node": ranks, "gpu": "cpu"}}
    out.write_text(yaml.safe_dump(doc))
    return out


def run_mode(mode: str, recipe: Path, hf: Path, ranks: int, work: Path) -> dict[str, list[dict]]:
    out = work / f"{mode.replace(',', '-')}.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", LLMTRAIN_TENSORBOARD="0")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(common.ROOT), env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks), str(WORKER),
           "--recipe", str(recipe), "--hf", str(hf), "--mode", mode, "--out", str(out)]
    done = subprocess.run(cmd, cwd=common.ROOT, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0 or not out.is_file():
        raise SystemExit(f"{mode} worker failed ({done.returncode}):\n{(done.stdout + done.stderr)[-6000:]}")
    return json.loads(out.read_text())


def main() -> None:
    args = common.parser(__doc__.split("\n\n")[0]).parse_args()
    shape, ranks, shard = (TINY, 2, "100KB") if args.tiny else (FULL, 4, "300MB")
    rows, raw = [], {}
    with tempfile.TemporaryDirectory(prefix="llmtrain-hf-load-") as tmp:
        work = Path(tmp)
        hf = work / "hf"
        params = write_checkpoint(shape, hf, shard)
        files = sorted(hf.glob("*.safetensors"))
        ckpt_bytes = sum(f.stat().st_size for f in files)
        recipe = write_recipe(hf, ranks, work / "recipe.yaml")
        # --tiny: both modes in one job (a smoke test: its memory numbers mean nothing)
        jobs = [("stream,whole", ("stream", "whole"))] if args.tiny else [("stream", ("stream",)), ("whole", ("whole",))]
        measured = {}
        for spec, modes in jobs:
            load_before = os.getloadavg()[0]
            done = run_mode(spec, recipe, hf, ranks, work)
            load = round((load_before + os.getloadavg()[0]) / 2, 1)
            measured.update({m: (rows_, load) for m, rows_ in done.items()})
        for mode in ("stream", "whole"):
            per_rank, load = measured[mode]
            raw[mode] = per_rank
            rows.append({"mode": mode, "ranks": ranks, "ckpt": ckpt_bytes / MIB, "files": len(files),
                         "shard": max(r["shard_bytes"] for r in per_rank) / MIB,
                         "before": max(r["rss_before"] for r in per_rank) / MIB,
                         "peak": max(r["peak"] for r in per_rank) / MIB,
                         "growth": max(r["peak"] - r["rss_before"] for r in per_rank) / MIB,
                         "seconds": max(r["seconds"] for r in per_rank),
                         "load1": load})
            print(json.dumps(rows[-1]), flush=True)
    table = common.md_table(rows, [("mode", "mode"), ("ranks", "ranks (FSDP)"), ("ckpt", "checkpoint MiB"),
                                   ("files", "files"), ("shard", "shard per rank MiB"),
                                   ("before", "RSS before load MiB"), ("peak", "**peak RSS during load MiB**"),
                                   ("growth", "peak − before MiB"), ("seconds", "load s"),
                                   ("load1", "machine load avg")])
    s, w = rows[0], rows[1]
    notes = (f"{params / 1e6:.0f}M-parameter Llama (hidden {shape['hidden_size']}, {shape['num_hidden_layers']} layers, "
             f"vocab {shape['vocab_size']}), fp32, written by transformers' `save_pretrained` into {s['files']} files. "
             f"Max over the {ranks} ranks of each column. Streaming grows a rank's memory by "
             f"{s['growth']:.0f} MiB for a {s['shard']:.0f} MiB shard (the file pages of its own slices, mapped by "
             f"safetensors, are resident while their file is open); reading the whole model grows it by "
             f"{w['growth']:.0f} MiB ({w['growth'] / max(s['growth'], 1):.1f}x) — every rank holds the full "
             f"{s['ckpt']:.0f} MiB checkpoint once. Load time: {s['seconds']:.1f} s streaming vs {w['seconds']:.1f} s "
             f"whole, {ranks} ranks on this shared 2-core machine (the ranks compete for the cores; see the load average).")
    common.publish(args, "hf_load_memory", "HF weights into FSDP: peak memory per rank, streaming vs whole-model read",
                   {"params": params, "shape": shape, "ranks": ranks, "rows": rows, "per_rank": raw}, table, notes,
                   extra_versions=("transformers", "safetensors"))


if __name__ == "__main__":
    main()
