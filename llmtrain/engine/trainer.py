"""The training loop: data -> forward/backward (accumulation or pipeline schedule) -> gradient
sync -> clip with the global norm -> AdamW step -> MoE bias update -> metrics.

:func:`train` is callable repeatedly inside one process group (the parity tests run many
layouts in one job); :mod:`llmtrain.engine.main` wraps it for torchrun.
"""

from __future__ import annotations

import os
from functools import partial
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from llmtrain.engine.checkpoint import Checkpointer, checkpoint_root
from llmtrain.engine.checkpoint_hooks import TestHooks
from llmtrain.engine.data import BatchSampler, build_data, microbatches, step_target_count
from llmtrain.engine.mesh import Meshes, build_meshes
from llmtrain.engine.evaluate import PeriodicEval
from llmtrain.engine.metrics import MetricsWriter, emit, memory_gib, peak_flops
from llmtrain.engine.models.moe import set_aux_loss_scale, update_expert_bias
from llmtrain.engine.dp_optimizer import build_optimizer
from llmtrain.engine.guard import CODE_REASON, REASON_CODE, LossGuard
from llmtrain.engine.optim import lr_multiplier, set_lr
from llmtrain.engine.parallel.clip import clip_grads
from llmtrain.engine.parallel.context import cp_positions, shard_sequence
from llmtrain.engine.parallel.pipeline import build_schedule, stage_io_shapes
from llmtrain.engine.parallel.tied import TiedEmbedding
from llmtrain.engine.parallelize import ModelParts, build_parts, uses_fsdp
from llmtrain.engine.step import StepLoss, accumulation_step, compute_context, pipelined_step
from llmtrain.errors import LLMTrainError
from llmtrain.plan.dims import ParallelDims
from llmtrain.plan.flops import model_flops_per_token
from llmtrain.cluster.placement import Placement
from llmtrain.plan.validate import validate
from llmtrain.recipe.schema import Recipe, bf16_compute


@dataclass
class TrainResult:
    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    tokens_per_s: float = 0.0
    parts: ModelParts | None = None
    meshes: Meshes | None = None
    schedule: object | None = None
    skipped: list[int] = field(default_factory=list)  # steps whose update the guard skipped


def resolve_dims(recipe: Recipe, world_size: int, local_world_size: int | None = None) -> ParallelDims:
    """The recipe's layout for this world, validated by the same rules as ``llmtrain plan``."""
    local = local_world_size or int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    local = local if world_size % local == 0 else world_size
    validation = validate(recipe, Placement.uniform(world_size // local, local))
    if not validation.valid:
        raise LLMTrainError(validation.errors)
    return validation.dims


def dp_rank_of(dims: ParallelDims, rank: int) -> int:
    c = dims.coord_dict(rank)
    return c["dp_replicate"] * dims.dp_shard + c["dp_shard"]


def train(recipe: Recipe, device: torch.device, run_dir: str | None = None, steps: int | None = None,
          verbose: bool = True, resume: str | None = None, auto_resume: bool = False) -> TrainResult:
    """Train; with ``run_dir`` (or ``checkpoint.dir``) save checkpoints, and with ``resume``
    (latest | step-N | PATH) continue from one, in this layout (docs/checkpoint.md).
    ``auto_resume`` (torchrun restarted the workers): continue from the latest committed
    checkpoint if there is one, else from ``resume`` / the start."""
    rank, world = dist.get_rank(), dist.get_world_size()
    dims = resolve_dims(recipe, world)
    meshes = build_meshes(dims, device.type)
    t = recipe.train
    torch.manual_seed(t.seed)
    parts = build_parts(recipe, meshes, device)
    for part in parts.parts:
        part.train()
    # LoRA checkpoints hold the adapters, not the frozen base: it is re-read on resume too.
    if recipe.checkpoint.init_from_hf and (not resume or recipe.train.lora is not None):
        from llmtrain.engine.hf import load_hf_weights
        loaded = load_hf_weights(parts, recipe.checkpoint.init_from_hf, recipe.model)  # this rank's slices only
        if rank == 0 and verbose:
            print(f"init_from_hf: rank 0 read {loaded.bytes / 2**20:.1f} MiB in {loaded.slices} slices "
                  f"of {len(loaded.files)} files in {loaded.seconds:.2f} s", flush=True)

    dp_group, dp_size = meshes.dp_cp.get_group(), meshes.dp_cp.size()
    pp_group = meshes.pp.get_group() if dims.pp > 1 else None
    params = parts.parameters()
    fsdp = uses_fsdp(recipe, meshes)
    optimizer, grad_sync = build_optimizer(parts, recipe, meshes, fsdp)
    tied = TiedEmbedding.build(parts, meshes, recipe.parallel)  # PP + tie_embeddings: two copies, one gradient

    dataset = build_data(recipe.data, t.seq_len, recipe.model.vocab_size, t.seed)
    gbs = t.global_batch_size or t.micro_batch_size * dims.dp
    sampler = BatchSampler(getattr(dataset, "length", None), gbs, t.micro_batch_size, dp_rank_of(dims, rank), dims.dp, t.seed)
    grad_accum = gbs // (t.micro_batch_size * dims.dp)
    if rank == 0 and verbose and getattr(dataset, "summary", None) is not None:
        print(f"data: {dataset.summary.line()}", flush=True)
    # token-weighted over the global batch for data with ignored labels; chunked over the output head
    loss_fn = StepLoss.for_parts(parts)
    schedule = None
    if dims.pp > 1:
        p, m = recipe.parallel, recipe.model
        sp_shards = dims.tp if dims.tp > 1 and p.sequence_parallel else 1
        act_dtype = torch.bfloat16 if bf16_compute(t.precision) else torch.float32  # the residual stream (models/llama.py)
        shapes = partial(stage_io_shapes, n_stages=parts.n_stages, micro=t.micro_batch_size, seq=t.seq_len // dims.cp,
                         hidden=m.hidden, vocab=m.vocab_size, sp_shards=sp_shards, head_in_loss=True)
        schedule, _ = build_schedule(parts.parts, parts.stage_ids, parts.n_stages, p.pp_schedule, grad_accum,
                                     loss_fn, device, pp_group, shapes=shapes, dtype=act_dtype)
    for part in parts.parts:  # the aux loss is scaled like the main loss (PP: the schedule scales grads)
        set_aux_loss_scale(part, 1.0 if schedule else 1.0 / grad_accum)
    # Global RoPE positions of this rank's tokens: CP shards the sequence (zigzag for ring);
    # PP stages after the first get hidden states, possibly sequence-sharded, so they are told.
    positions = None
    if dims.cp > 1 or dims.pp > 1:
        positions = cp_positions(t.seq_len, dims.cp, meshes.cp.get_local_rank(), recipe.parallel.cp_method).to(device)
        for part in parts.parts:
            part.positions = positions

    total_steps = steps or t.steps
    flops_token = model_flops_per_token(recipe.model, t.seq_len, t.lora)  # LoRA: executed; a window: its keys
    peak = peak_flops(device, t.precision)
    writer = MetricsWriter(run_dir, enabled=rank == 0)
    evaluator = PeriodicEval(recipe, dims, gbs) if t.eval_interval else None  # held-out loss (docs/eval.md)
    autocast = compute_context(t.precision, fsdp, device)
    tp = dims.tp > 1
    result = TrainResult(parts=parts, meshes=meshes, schedule=schedule)
    bias_reduce = (lambda x: dist.all_reduce(x, group=dp_group)) if dp_size > 1 else None
    if rank == 0 and verbose:
        emit("start", steps=total_steps, world_size=world)
    ckpt_root = checkpoint_root(recipe, run_dir)
    ckpt = Checkpointer(recipe, ckpt_root, dims, grad_accum, verbose) if ckpt_root is not None else None
    start_step = 0
    restored = None
    if auto_resume and ckpt is not None:  # a torchrun restart: continue from the newest committed checkpoint
        restored = ckpt.restore("latest", parts, optimizer, sampler, missing_ok=True)
        if rank == 0 and verbose and restored is None:
            print("checkpoint: restarted before the first checkpoint was committed", flush=True)
    if restored is None and resume:
        if ckpt is None:
            raise LLMTrainError("resume needs a run directory or checkpoint.dir", "pass --run-dir", path="resume")
        restored = ckpt.restore(resume, parts, optimizer, sampler)
    start_step = restored or 0
    test_hooks = TestHooks.from_env(rank, dp_rank_of(dims, rank), dims)
    guard = LossGuard(t.guard)
    world_group = dist.group.WORLD
    fp8_scales = None
    if recipe.parallel.fp8_all_gather and fsdp:
        from llmtrain.engine.parallel.float8 import precompute_fp8_scales as fp8_scales
    t_start = time.perf_counter()
    step = start_step
    while step < total_steps:
        t0 = time.perf_counter()
        if fp8_scales is not None:  # fp8_all_gather: every FP8 weight's scale in one all-reduce (float8.py)
            fp8_scales(parts.parts)
        lr = t.optimizer.lr * lr_multiplier(step, total_steps, t.schedule)
        set_lr(optimizer, lr)
        test_hooks.log_samples(step, sampler)
        batches = microbatches(dataset, sampler)
        loss_fn.set_targets(step_target_count(dataset, sampler), dp_size, grad_accum if schedule else 1)
        if dims.cp > 1:  # packed rows (Ulysses, all-gather: validate.py) keep their whole row's sample ids for the mask
            batches = [(*(shard_sequence(t, positions) for t in b[:3]), *b[3:]) for b in batches]
        if grad_sync is not None:  # zero 0/1: reduce buckets during the last backward
            grad_sync.expect_backwards(len(batches), schedule)  # PP: the schedule's per-stage 1/n
        if schedule is None:
            delay_sync = fsdp and not recipe.parallel.fsdp_reduce_each_microbatch  # engine/step.py docstring
            loss = accumulation_step(parts, batches, device, delay_sync, tp, autocast, loss_fn)
        else:
            loss = pipelined_step(parts, schedule, batches, device, tp, autocast)
            loss = loss if loss is not None else torch.zeros((), device=device)
            dist.all_reduce(loss, group=pp_group)  # only the last stage holds a non-zero loss
        test_hooks.maybe_poison(sampler, loss, params)
        if grad_sync is not None:
            grad_sync(params)
        tied.sync_grads()
        norm = clip_grads(params, t.grad_clip, pp_group, skip=tied.copies)
        dist.all_reduce(loss, group=dp_group)
        loss_value = loss.item() / dp_size
        verdict = guard_verdict(guard, loss_value, float(norm), world_group)
        consumed_before = sampler.state_dict()["consumed_samples"]
        if verdict is None:
            optimizer.step()
            for part in parts.parts:
                update_expert_bias(part, all_reduce=bias_reduce)
            guard.accept(loss_value)
        optimizer.zero_grad(set_to_none=True)
        sampler.advance()
        dt = time.perf_counter() - t0
        tokens_per_s = gbs * t.seq_len / dt
        result.losses.append(loss_value)
        result.grad_norms.append(float(norm))
        if verdict is not None:
            result.skipped.append(step + 1)
            if rank == 0:
                print(f"guard: step {step + 1}: {verdict} (loss {loss_value:.6g}, grad norm {float(norm):.6g}): "
                      f"update skipped ({guard.bad_in_row + 1} bad in a row)", flush=True)
                writer.log(dict(step=step + 1, skipped=verdict, loss=loss_value, grad_norm=float(norm)))
            if guard.reject(consumed_before):
                step = rollback(guard, ckpt, parts, optimizer, sampler, step, rank, writer)
                continue
        if rank == 0 and verdict is None and (step % t.log_interval == 0 or step == total_steps - 1):
            tflops = flops_token * tokens_per_s / world
            record = dict(step=step + 1, loss=loss_value, lr=lr, grad_norm=float(norm), tokens_per_s=tokens_per_s,
                          tflops_per_gpu=tflops / 1e12, mfu=tflops / peak, memory_gib=memory_gib(device),
                          elapsed_s=time.perf_counter() - t_start)
            writer.log(record)
        if rank == 0 and verbose and (step % t.log_interval == 0 or step == total_steps - 1):
            emit("step", step=step + 1, steps=total_steps, loss=loss_value, lr=lr, grad_norm=float(norm),
                 tokens_per_s=tokens_per_s, mfu=flops_token * tokens_per_s / world / peak)
        if evaluator is not None and evaluator.due(step + 1, total_steps):
            evaluator.run(parts, meshes, device, step + 1, writer, verbose)
        if ckpt is not None:
            if ckpt.due(step + 1, total_steps):
                ckpt.save(step + 1, parts, optimizer, sampler, t.seq_len)
                test_hooks.maybe_kill_in_save(step + 1)
            else:
                ckpt.poll()
        test_hooks.maybe_kill(step + 1)
        step += 1
    if ckpt is not None:
        ckpt.wait()
    elapsed = time.perf_counter() - t_start
    result.tokens_per_s = gbs * t.seq_len * max(1, total_steps - start_step) / elapsed
    if rank == 0 and verbose:
        emit("end", step=total_steps, final_loss=result.losses[-1] if result.losses else None,
             tokens_per_s=result.tokens_per_s)
    writer.close()
    return result


def guard_verdict(guard: LossGuard, loss: float, grad_norm: float, group) -> str | None:
    """The world's verdict on this step: the worst of every rank's (one 1-element MAX all-reduce)."""
    if not guard.enabled:
        return None
    code = torch.tensor([REASON_CODE[guard.judge(loss, grad_norm)]], dtype=torch.int32)
    dist.all_reduce(code, op=dist.ReduceOp.MAX, group=group)
    return CODE_REASON[int(code.item())]


def rollback(guard: LossGuard, ckpt, parts, optimizer, sampler, step: int, rank: int, writer) -> int:
    """After ``max_bad_steps`` bad steps: reload the latest checkpoint, jump the data position past
    the bad window (its samples are never trained on), and return the step to continue at."""
    bad_from, bad_to = guard.first_bad_sample, sampler.state_dict()["consumed_samples"]
    if ckpt is None:
        raise LLMTrainError(f"{guard.bad_in_row} bad steps in a row (up to step {step + 1}) and no checkpoint "
                            "directory to roll back to", "set checkpoint.interval and run with a run directory, "
                            "or raise train.guard.max_bad_steps", path="train.guard.max_bad_steps")
    if guard.rollbacks >= guard.cfg.max_rollbacks:
        raise LLMTrainError(f"{guard.bad_in_row} bad steps in a row (up to step {step + 1}) after "
                            f"{guard.rollbacks} rollback(s)", "inspect the data and the learning rate; "
                            "raise train.guard.max_rollbacks to keep trying", path="train.guard.max_rollbacks")
    ckpt.wait()
    restored = ckpt.restore("latest", parts, optimizer, sampler, missing_ok=True)
    if restored is None:
        raise LLMTrainError(f"{guard.bad_in_row} bad steps in a row (up to step {step + 1}) before the first "
                            "checkpoint was committed", "lower checkpoint.interval or raise train.guard.max_bad_steps",
                            path="train.guard.max_bad_steps")
    sampler.load_state_dict({"consumed_samples": bad_to})
    guard.rolled_back()
    if rank == 0:
        print(f"guard: rollback {guard.rollbacks}: bad steps up to {step + 1}; reloaded step {restored}, "
              f"skipping samples [{bad_from}, {bad_to}) — continuing at step {restored + 1}", flush=True)
        writer.log(dict(step=step + 1, rollback=guard.rollbacks, restored_step=restored,
                        skipped_samples=[bad_from, bad_to]))
    return restored
