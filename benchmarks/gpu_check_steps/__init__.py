"""The steps of the GPU check (benchmarks/gpu_check.py) and what they share.

A step is a function ``fn(ctx) -> dict`` registered with :func:`step`, in the order of value per
second of device time (MODULES below is the run order of the groups; within a group,
registration order): (a) env, (b) correctness at the smallest size that still tests the thing,
(c)-(f) speed (1B dense compiled, the HF peer, dense eager and AC, MoE), (g) options. It returns its measurements; raising
records the step as ``error`` with the exception's one line, and the next step runs. A step
whose check failed raises :class:`CheckFailed` (the numbers go into the message). A step that
cannot run here (no CUDA, no torchao, torch too old) raises :class:`Skip` with the reason.

Adding a step: write ``def my_step(ctx)`` in the module of its group (correctness, speed,
kernels, speed, options), decorate it ``@step("name", est_s=..., cuda_only=...)`` where ``est_s`` is its
expected seconds on the GPU (the budget skips a step when less is left), keep it runnable at
``ctx.tiny`` size on CPU (the CI smoke test runs every step that is not ``cuda_only``), and add
its name to tests/test_gpu_check.py's expectations.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path


class Skip(Exception):
    """The step cannot run here; the message is the reason (recorded as ``skipped``)."""


class CheckFailed(Exception):
    """The step ran and its check failed; the message holds the numbers."""


@dataclass
class Step:
    name: str
    group: str
    fn: Callable
    est_s: float  # expected seconds on the GPU: skipped when the budget has less left
    cuda_only: bool = False


STEPS: list[Step] = []


def step(name: str, est_s: float, cuda_only: bool = False, group: str | None = None):
    """Register ``fn`` as a step; ``group`` (default: its module) places it in the run order."""
    def wrap(fn):
        STEPS.append(Step(name, group or fn.__module__.rsplit(".", 1)[-1], fn, float(est_s), cuda_only))
        return fn
    return wrap


# ---- estimates: seconds on one H200, cold (the budget skips a step by these) ----------------------
# A speed row's seconds = SETUP_S + its compile cost + its training FLOPs at an assumed fraction of
# the H200's dense bf16 peak (llmtrain/recipe/gpus.py "h200": 989 TFLOP/s; the device's own notes
# see ~790 TFLOP/s on plain bf16 GEMMs, 80 %). The FLOPs are the planner's (6 x matmul params +
# attention per token, plan/flops.py) times the recomputed share. For the 1.2B dense rows the
# FLOPs are the small part (11 steps x 8192 tokens x 7.2 GFLOP = 0.65 PFLOP: 1.6 s at 40 %); what
# the estimate really is, is the compile cost. Assumed, not yet measured (the first device run
# replaces these with its "seconds"): the first compiled 1.2B run pays a cold dynamo + inductor
# compile of ONE block forward and backward (the 16 blocks share its code: parameters are graph
# inputs) on 16 CPU cores; a later variant (AC, FSDP hooks) recompiles only its changed graphs
# with inductor's in-process and on-disk caches warm; HF's whole-model torch.compile traces all 16
# layers into one graph (no reuse). Each row is capped at 4x its estimate (gpu_check.py).
H200_PEAK_BF16 = 989e12
SETUP_S = 10.0  # build + init the model on the GPU, fused AdamW states, the planner's call, empty_cache
COMPILE_COLD_S = 45.0  # the first compiled row of a model family (dense, MoE) in the worker
COMPILE_WARM_S = 25.0  # a later variant of an already compiled family
HF_COMPILE_S = 75.0  # transformers' LlamaForCausalLM under torch.compile(model), 16 layers inlined
ASSUMED_MFU = {"compiled": 0.40, "eager": 0.30, "moe": 0.10}  # MoE: tiny experts, routing syncs
WORKER_START_S = 15.0  # import torch + transformers' pieces, CUDA context, the 1-rank NCCL group


def train_est_s(model: dict, seq: int, micro: int, steps: int, mfu: float, compile_s: float = 0.0,
                recompute: float = 1.0) -> float:
    """Estimated seconds of one speed row (the assumptions above); ``recompute`` = FLOPs multiple
    of activation checkpointing (full AC re-runs the forward: 4/3; selective about 1.1)."""
    from llmtrain.plan.flops import flops_per_token
    from llmtrain.recipe.schema import ModelConfig

    flops = flops_per_token(ModelConfig(**model), seq) * seq * micro * steps * recompute
    return round(SETUP_S + compile_s + flops / (mfu * H200_PEAK_BF16), 1)


@dataclass
class Ctx:
    """What every step gets: the device, the size, a scratch directory, results of earlier steps."""

    device: object  # torch.device
    tiny: bool
    scratch: Path
    gpu_key: str  # llmtrain.recipe.gpus key of this device ("cpu" on CPU)
    peak_flops: float
    shared: dict = field(default_factory=dict)  # earlier steps' outputs another step reuses (HF export: a run dir)

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def tmp(self, name: str) -> Path:
        return Path(tempfile.mkdtemp(prefix=f"{name}-", dir=self.scratch))


# ---- recipes --------------------------------------------------------------------------------------
TINY_MODEL = dict(layers=2, hidden=64, heads=4, kv_heads=2, ffn_hidden=128, vocab_size=256, max_seq_len=64,
                  rope_theta=10000.0, norm_eps=1e-5, tie_embeddings=False)


def recipe(ctx: Ctx, model: dict, *, precision: str, seq: int, micro: int, steps: int, lr: float = 3e-3,
           compile_: bool = False, ac: str = "none", zero: int = 3, states: str = "fp32", device_type: str | None = None,
           checkpoint: dict | None = None, seed: int = 0):
    """A one-rank recipe. World 1: the trainer runs the plain model (nothing to shard, so no FSDP;
    gpu_check_steps/fsdp1.py builds the FSDP2 path), and the planner plans the same."""
    from llmtrain.recipe.schema import Recipe

    gpu = "cpu" if (device_type or ctx.device.type) == "cpu" else ctx.gpu_key
    return Recipe.model_validate(dict(
        name="gpu-check", model=model, parallel=dict(tp=1, dp_shard=1, zero=zero),
        train=dict(seq_len=seq, micro_batch_size=micro, global_batch_size=micro, steps=steps, precision=precision,
                   seed=seed, compile=compile_, activation_checkpointing=ac, grad_clip=1.0,
                   optimizer=dict(lr=lr, weight_decay=0.0, states=states),
                   schedule=dict(warmup_steps=0, decay="cosine", min_lr_ratio=0.1)),
        data=dict(source="synthetic"), checkpoint=checkpoint or {},
        cluster=dict(nodes=1, gpus_per_node=1, gpu=gpu)))


def planned(r) -> dict:
    """``llmtrain plan``'s prediction for recipe ``r`` on one GPU: step seconds and peak GiB."""
    from llmtrain.plan.api import plan_recipe
    from llmtrain.plan.report import cost_dict

    plan = plan_recipe(r, nodes=1, gpus_per_node=1)
    if not plan.valid:
        return {"planned_error": "; ".join(e.message for e in plan.validation.errors)[:300]}
    cost = cost_dict(plan)
    return {"planned_step_s": cost["time"]["step_s"], "planned_peak_gib": cost["memory"]["peak_gib"],
            "planned_mfu": cost["time"]["mfu"]}


def train_run(ctx: Ctx, r, device, run_dir: Path | None = None, resume: str | None = None):
    """The engine's own training loop on this process's 1-rank group; returns (TrainResult, the
    trainer's per-step ``step`` events: loss, tokens_per_s, ...).

    The events are taken from the trainer's ``emit`` (swapped for a collector during the call)
    rather than from RUN_DIR/metrics.jsonl: a run directory also makes the trainer save a
    checkpoint at the end, 14 GB per speed row for the 1.2B model (and the device's disk is 64 GiB)."""
    from llmtrain.engine import trainer

    events: list[dict] = []
    original = trainer.emit
    trainer.emit = lambda event, **fields: events.append({"event": event, **fields})
    try:
        res = trainer.train(r, device, run_dir=str(run_dir) if run_dir else None, resume=resume, verbose=True)
    finally:
        trainer.emit = original
    return res, [e for e in events if e["event"] == "step"]


# The groups in run order (value per second of device time); within a group, definition order.
# kernels.py's cheap CP check is correctness; its torchao step runs as an option (group="options").
MODULES = ("env", "correctness", "kernels", "speed", "options", "profiling", "attention_kernels")


def load_all() -> list[Step]:
    """Import the step modules and return the steps in run order."""
    import importlib

    for module in MODULES:
        importlib.import_module(f"{__name__}.{module}")
    def place(s: Step) -> tuple[int, int]:
        # group first, then the defining module: the order never depends on which module some other
        # code imported first (tests/test_fp8.py imports options before kernels); sorted() is stable
        return MODULES.index(s.group), MODULES.index(s.fn.__module__.rsplit(".", 1)[-1])

    return sorted(STEPS, key=place)
