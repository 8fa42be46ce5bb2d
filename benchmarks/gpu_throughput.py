"""Tokens/s and MFU of a ~1B dense Llama on one CUDA GPU: bf16, torch.compile, FSDP2.

    python benchmarks/gpu_throughput.py                # needs a CUDA device; a few minutes
    python benchmarks/gpu_throughput.py --tiny --out /tmp/x   # toy size (CI smoke test)

What is measured: one training step (forward, fp32 cross-entropy, backward, AdamW(foreach) step,
zero_grad) of a 1.2B-parameter dense model (16 layers, hidden 2048, 16 heads / 8 KV heads, SwiGLU
8192, vocab 32000, seq 2048, micro batch ``--batch``) in one process on GPU 0, built with
llmtrain's own engine pieces: :func:`~llmtrain.engine.parallel.checkpointing.apply_compile`
(``torch.compile`` per block) and :func:`~llmtrain.engine.parallel.data_parallel.apply_fsdp`
(FSDP2 ``fully_shard`` per block and on the root, on a 1-rank process group, with
``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``; fp32 master weights). Variants:

* ``llmtrain fsdp2 eager`` and ``llmtrain fsdp2 + compile``;
* ``torchtitan fsdp2 + compile``: torchtitan's Llama3Model with the same config, weights and
  wrapping (see benchmarks/engine_throughput.py for how it is built), when torchtitan imports.

MFU = tokens/s x :func:`llmtrain.plan.flops.flops_per_token` (6 x matmul parameters + 12 x layers x
hidden x seq, the planner's convention, no recomputation) / the GPU's dense bf16 peak from
:mod:`llmtrain.recipe.gpus` (chosen by the device name, or ``--peak-tflops``). Variants run one
after another (each needs ~20 GB of model state; a dedicated GPU is not shared, so interleaving
is not needed), ``--warmup`` steps (compilation) then ``--reps`` timed steps, medians.

Without a CUDA device it prints "no CUDA device: nothing measured", writes a JSON saying so and
exits 0. It then leaves a measured section of docs/benchmarks.md (and a measured
benchmarks/results JSON) alone; if the doc has no section yet, it adds one saying the
benchmark was not run and the command to run it.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import common  # noqa: E402

NAME = "gpu_throughput"
TITLE = "One-GPU training throughput and MFU (~1B dense, bf16, compile, FSDP2)"
SIZES = {  # model fields, micro batch, seq, warmup, reps
    "full": (dict(layers=16, hidden=2048, heads=16, kv_heads=8, ffn_hidden=8192, vocab_size=32000), 4, 2048, 3, 10),
    "tiny": (dict(layers=2, hidden=128, heads=4, kv_heads=2, ffn_hidden=256, vocab_size=512), 2, 64, 1, 2),
}
DEVICE, BACKEND = "cuda", "nccl"  # a dry run of the code path may set "cpu", "gloo"
NAME_TO_GPU = (("H200", "h200"), ("H100", "h100-sxm"), ("A100", "a100-80g"), ("B200", "b200"))


def model_config(fields: dict, seq: int):
    from llmtrain.recipe.schema import ModelConfig

    return ModelConfig(**fields, max_seq_len=seq, rope_theta=500000.0, norm_eps=1e-5, tie_embeddings=False)


def gpu_peak(device_name: str, override_tflops: float | None) -> tuple[float | None, str | None]:
    from llmtrain.recipe.gpus import GPUS

    if override_tflops:
        return override_tflops * 1e12, "--peak-tflops"
    for needle, key in NAME_TO_GPU:
        if needle in device_name.upper():
            return GPUS[key].peak_flops_bf16, key
    return None, None


def init_one_rank_group() -> None:
    import torch.distributed as dist

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
        dist.init_process_group(BACKEND, rank=0, world_size=1)


def wrap(model: torch.nn.Module, compile_blocks: bool) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh

    from llmtrain.engine.parallel.checkpointing import apply_compile
    from llmtrain.engine.parallel.data_parallel import apply_fsdp

    if compile_blocks:
        apply_compile(model)  # per block, as the engine does; torchtitan's blocks live in .layers too
    apply_fsdp(model, init_device_mesh(DEVICE, (1,)), zero=3, pp_enabled=False, precision="bf16")
    return model


def build(kind: str, cfg, compile_blocks: bool) -> torch.nn.Module:
    from engine_throughput import build_torchtitan

    from llmtrain.engine.models.init import init_weights
    from llmtrain.engine.models.llama import Transformer

    with torch.device("meta"):  # as the engine does: no CPU copy of 1B parameters
        ours = Transformer(cfg)
    ours.to_empty(device=DEVICE)
    init_weights(ours, 0)
    if kind == "torchtitan":
        model = build_torchtitan(cfg, ours).to(DEVICE)
        del ours
    else:
        model = ours
    return wrap(model, compile_blocks)


def measure(model, cfg, batch: int, seq: int, warmup: int, reps: int) -> list[float]:
    g = torch.Generator(device=DEVICE).manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq + 1), device=DEVICE, generator=g)
    tokens, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, foreach=True)

    def step() -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        logits = model(tokens)
        F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    return common.interleaved({"step": step}, reps=reps, warmup=warmup)["step"]


def no_gpu(args) -> int:
    msg = "no CUDA device: nothing measured"
    results = {"measured": False, "reason": msg}
    out = args.out
    existing = common.RESULTS / f"{NAME}.json"
    if out is None and not args.tiny and existing.is_file():
        try:
            if json.loads(existing.read_text()).get("results", {}).get("measured"):
                out = Path(os.environ.get("TMPDIR", "/tmp")) / "llmtrain-bench"  # keep the measured result
        except (OSError, ValueError):
            pass
    args.out = out
    no_doc = args.no_doc
    args.no_doc = True  # never overwrite a measured section with "not run"
    common.publish(args, NAME, TITLE, results, msg + "\n")
    doc = common.DOC.read_text() if common.DOC.is_file() else ""
    if not args.tiny and not no_doc and f"<!-- bench:{NAME}:start -->" not in doc:
        common.write_section(NAME, f"## {TITLE}\n\nNot run yet: it needs a CUDA GPU, and none was available where "
                             "these pages were written. On a GPU machine run `python benchmarks/gpu_throughput.py` "
                             "(a few minutes on an H100/H200; add `--torchtitan-path DIR` to compare torchtitan's Llama); it "
                             "replaces this section with tokens/s and MFU.\n")
        print(f"added a not-run section to {common.DOC.relative_to(common.ROOT)}")
    return 0


def main() -> int:
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=None, help="micro batch (default 4)")
    p.add_argument("--reps", type=int, default=None)
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--peak-tflops", type=float, default=None, help="dense bf16 peak when the GPU is not known")
    p.add_argument("--no-torchtitan", action="store_true")
    p.add_argument("--torchtitan-path", default=os.environ.get("TORCHTITAN_PATH"))
    args = p.parse_args()
    if not torch.cuda.is_available():
        return no_gpu(args)
    from llmtrain.plan.flops import flops_per_token
    from llmtrain.plan.params import count_params

    fields, batch, seq, warmup, reps = SIZES["tiny" if args.tiny else "full"]
    batch, warmup, reps = args.batch or batch, args.warmup or warmup, args.reps or reps
    cfg = model_config(fields, seq)
    device_name = torch.cuda.get_device_name(0)
    peak, peak_src = gpu_peak(device_name, args.peak_tflops)
    fpt = flops_per_token(cfg, seq)
    init_one_rank_group()
    torch.backends.cuda.matmul.allow_tf32 = True

    variants = [("llmtrain fsdp2 eager", "llmtrain", False)]
    if not args.tiny:  # compilation alone takes longer than the smoke test's budget
        variants.append(("llmtrain fsdp2 + compile", "llmtrain", True))
    skipped = {}
    if not args.no_torchtitan and not args.tiny:
        try:
            if args.torchtitan_path:
                sys.path[:0] = args.torchtitan_path.split(os.pathsep)
            importlib.import_module("torchtitan.models.llama3")
            variants.append(("torchtitan fsdp2 + compile", "torchtitan", True))
        except Exception as e:  # noqa: BLE001 - optional comparison, the reason is recorded
            skipped["torchtitan"] = f"{type(e).__name__}: {e}"
    rows, raw = [], {}
    for label, kind, comp in variants:
        try:
            model = build(kind, cfg, comp)
            times = measure(model, cfg, batch, seq, warmup, reps)
        except Exception as e:  # noqa: BLE001 - one failing variant must not hide the others
            skipped[label] = f"{type(e).__name__}: {str(e)[:500]}"
            print(f"{label} failed: {skipped[label]}")
            continue
        finally:
            model = None
            torch.cuda.empty_cache()
        raw[label] = times
        tps = batch * seq / common.median(times)
        rows.append(dict(variant=label, step_s=common.median(times), tokens_per_s=tps,
                         tflops=tps * fpt / 1e12, mfu=(tps * fpt / peak) if peak else None,
                         peak_mem_gib=torch.cuda.max_memory_allocated() / 2**30))
        torch.cuda.reset_peak_memory_stats()
        print(rows[-1])

    n_params = count_params(cfg).total
    results = dict(measured=bool(rows), gpu=device_name, peak_flops=peak, peak_source=peak_src,
                   config=cfg.model_dump(exclude={"moe", "preset"}), params=n_params, batch=batch, seq=seq,
                   flops_per_token=fpt, warmup=warmup, reps=reps, rows=rows, step_seconds=raw, not_measured=skipped)
    table = common.md_table(rows, [("variant", "variant"), ("step_s", "s/step (median)"), ("tokens_per_s", "tokens/s"),
                                   ("tflops", "model TFLOP/s"), ("mfu", "MFU"), ("peak_mem_gib", "peak mem GiB")])
    notes = (f"{n_params / 1e9:.2f}B params ({cfg.layers} layers, hidden {cfg.hidden}, {cfg.heads}/{cfg.kv_heads} heads, "
             f"ffn {cfg.ffn_hidden}, vocab {cfg.vocab_size}), micro batch {batch} x seq {seq}, one GPU, FSDP2 on a "
             f"1-rank group, bf16 params / fp32 reduce and master weights, no activation checkpointing. MFU uses "
             f"{fpt / 1e9:.2f} GFLOP/token (llmtrain.plan.flops) and a peak of "
             f"{(peak or 0) / 1e12:.0f} TFLOP/s ({peak_src}).")
    notes += "".join(f"\n\n{k} not measured: `{v}`." for k, v in skipped.items())
    if not rows:
        args.no_doc = True
    common.publish(args, NAME, TITLE, results, table, notes, extra_versions=("torchtitan",))
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
