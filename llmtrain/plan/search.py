"""``plan --search``: every valid layout for a recipe and a cluster, ranked by modeled throughput.

Search space: tp, cp, pp with its schedule and virtual stages, dp_replicate / dp_shard (HSDP),
ep, zero, micro batch size and activation recomputation; the model, the sequence length and the
global batch (tokens per step) stay as the recipe says. Every layout that is evaluated is first
checked by :func:`llmtrain.plan.validate.validate` itself (no second set of rules to drift),
then priced by :func:`llmtrain.plan.costmodel.estimate`; layouts that do not fit are dropped.

Pruning (so that Llama 3 405B on 16,384 GPUs takes about a second; docs/planner.md):

- tp divides every node's GPUs and the model's head/kv-head/ffn/vocab sizes (validate's rule),
  cp keeps at least 2,048 tokens per rank, pp is a divisor of the world and at most the layer
  count; layer splits that do not divide evenly get a balanced ``pp_layers_per_stage``, and the
  stages (pp x virtual stages) may number up to the layers + 2 (:func:`max_stages`);
- a layout whose parameters and optimizer states alone do not fit even fully sharded is skipped
  with all its variants;
- branch and bound: each (tp, cp, pp, schedule, ep) split gets a lower bound on its step time
  (compute at the calibrated rate, TP/CP/EP communication, the bubble at its smallest), and
  splits are evaluated in bound order until the bound exceeds the K-th best step time found;
- within a split, the least recomputation that fits is taken (more recomputation never helps
  throughput in the model), and micro batches grow while they fit.

The HSDP shard groups tried (a node, 2 nodes, 8 nodes: the seed's "ZeRO-4") come from
:mod:`llmtrain.plan.hier`; the bounds live in :mod:`llmtrain.plan.search_bounds`, the text
output in :mod:`llmtrain.plan.search_render`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from math import gcd

from llmtrain.plan.batch import BatchMath
from llmtrain.plan.bubble import bubble_fraction
from llmtrain.plan.costmodel import CostModel, estimate, peak_bytes, probe_ranks
from llmtrain.plan.dims import ParallelDims
from llmtrain.plan.hier import shard_replicas
from llmtrain.cluster.placement import Placement
from llmtrain.plan.search_bounds import (
    StepFloor,
    make_variant,
    needs_full_recompute,
    state_lower_bound,
    zero_lower_bound,
)
from llmtrain.plan.search_keep import allowed
from llmtrain.plan.search_render import explain, format_result, layout_label, set_flags  # noqa: F401 (the CLI imports these from here)
from llmtrain.plan.validate import SELECTIVE, divisors, validate
from llmtrain.recipe.gpus import cluster_gpu
from llmtrain.recipe.schema import SPLIT_BACKWARD_SCHEDULES, Recipe

# least memory last: selective_mm (torchtitan's op policy) saves less than selective (drops the outputs
# of wk, w3 and, without TP, wo) and re-runs far less than full
RECOMPUTE = ("none", "selective", "selective_mm", "full")
MIN_CP_TOKENS = 2048
MAX_MICRO_BATCH = 64


@dataclass
class Choice:
    rank: int
    overrides: dict  # recipe keys (dotted) -> value
    dims: ParallelDims
    batch: BatchMath
    cost: CostModel
    reason: str = ""

    def summary(self) -> dict:
        c, t = self.cost, self.cost.time
        return {"rank": self.rank, "set": self.overrides, "step_s": t.step_s, "tokens_per_s_per_gpu": t.tokens_per_s_per_gpu,
                "tflops_per_gpu": t.tflops_per_gpu, "mfu": t.mfu, "peak_gib": c.worst.peak / 2**30,
                "bubble_fraction": c.bubble, "breakdown_s": t.breakdown, "reason": self.reason}


@dataclass
class SearchResult:
    recipe: str | None
    world_size: int
    seconds: float = 0.0  # wall clock
    cpu_seconds: float = 0.0  # this process's CPU time (what the tests bound: immune to busy neighbours)
    splits: int = 0  # (tp, cp, pp, schedule, ep) combinations enumerated
    splits_evaluated: int = 0
    layouts_evaluated: int = 0
    rejected_invalid: int = 0
    rejected_memory: int = 0
    top: list[Choice] = field(default_factory=list)
    # HSDP layouts the search considered: (tp, cp, pp, schedule, v, ep, zero, dp_replicate, dp_shard, model state
    # fits the bound); each one that fits is then priced like any other layout (plan/hier.py)
    hsdp: list[tuple] = field(default_factory=list)
    kept: dict = field(default_factory=dict)  # --keep: only layouts with these values were searched

    def to_dict(self) -> dict:
        return {"recipe": self.recipe, "world_size": self.world_size, "seconds": self.seconds,
                "cpu_seconds": self.cpu_seconds, "splits": self.splits,
                "splits_evaluated": self.splits_evaluated, "layouts_evaluated": self.layouts_evaluated,
                "rejected_invalid": self.rejected_invalid, "rejected_memory": self.rejected_memory,
                "hsdp_considered": len(self.hsdp), "kept": self.kept,
                "top": [c.summary() for c in self.top]}


def max_stages(layers: int) -> int:
    """The most pipeline stages (pp x virtual stages) the search splits ``layers`` into: the layers
    and the embedding and the output layer, each counted as one layer. With more stages than layers
    :func:`balanced_split` leaves the first stage only the embedding and the last only the output:
    the Llama 3 paper's pipeline balancing (arXiv:2407.21783 section 3.3.2: 126 layers in 128 chunks
    on pp 16, v 8), Megatron-Core's ``account_for_embedding_in_pipeline_split`` /
    ``account_for_loss_in_pipeline_split`` (a layer less in the first and the last chunk). Before
    the eighteenth session the search stopped at ``layers`` stages, so Llama 3 405B on pp 16 never
    saw v 8."""
    return layers + 2


def balanced_split(layers: int, stages: int) -> list[int] | None:
    """None when the layers divide evenly; else counts differing by at most one, the extra layers
    on the middle stages (the first and last also hold the embedding and the output layer; with
    more stages than layers, up to :func:`max_stages`, they hold only those)."""
    if layers % stages == 0:
        return None
    base, extra = divmod(layers, stages)
    counts = [base] * stages
    order = sorted(range(stages), key=lambda i: abs(i - (stages - 1) / 2))
    for i in order[:extra]:
        counts[i] += 1
    return counts


def _schedules(recipe: Recipe, pp: int, layers: int, keep: dict | None = None) -> list[tuple[str, int]]:
    """1F1B and interleaved 1F1B (v 2, 4, 8) always; the recipe's own schedule (or a kept one) too.
    Interleaved 1F1B up to :func:`max_stages` stages (tests/test_engine_5d.py runs its empty end
    chunks); the zero-bubble family and the V-shaped schedules up to ``layers`` (a V puts the first
    and the last stage on rank 0, which would then hold no layer)."""
    if pp == 1:
        return [("1f1b", 1)]
    most = max_stages(layers)
    out = [("1f1b", 1)] + [("interleaved-1f1b", v) for v in (2, 4, 8) if pp * v <= most]
    own = (keep or {}).get("parallel.pp_schedule", recipe.parallel.pp_schedule)
    if own in ("zbv", "dualpipev") and 2 * pp <= layers:
        out.append((own, 2))
    elif own == "zero-bubble":
        out += [(own, v) for v in (2, 4) if pp * v <= layers]
    elif own == "gpipe":
        out.append((own, 1))
    v = (keep or {}).get("parallel.pp_virtual_stages", 1)
    if v > 1 and ("interleaved-1f1b", v) not in out and pp * v <= most:  # a kept v beside 2, 4, 8
        out.append(("interleaved-1f1b", v))
    return out


def search(recipe: Recipe, placement: Placement, top: int = 5, dp_overlap: bool = False,
           exhaustive: bool = False, keep: dict | None = None) -> SearchResult:
    """The ``top`` fastest layouts that validate and fit. ``exhaustive`` turns the bounds off (every
    split and micro batch is priced): the tests use it to check that pruning loses nothing. ``keep``
    ({dotted key: value}, :mod:`llmtrain.plan.search_keep`): only layouts with those values."""
    t0, c0 = time.perf_counter(), time.process_time()
    m, t = recipe.model, recipe.train
    world = placement.world_size
    slots = [n.slots for n in placement.nodes]
    result = SearchResult(recipe.name, world, kept=dict(keep or {}))
    own = validate(recipe, placement)
    gbs = t.global_batch_size or (own.batch.global_batch_size if own.batch else t.micro_batch_size * world)
    tp_common = 0
    for value in (m.heads, m.kv_heads, m.ffn_hidden, m.vocab_size) + ((m.expert_ffn,) if m.is_moe else ()):
        tp_common = gcd(tp_common, value)
    tps = [x for x in divisors(tp_common, min(slots)) if all(s % x == 0 for s in slots) and world % x == 0
           and allowed(keep, "parallel.tp", x)]
    cps = [c for c in divisors(world) if (c == 1 or (t.seq_len % (2 * c) == 0 and t.seq_len // c >= MIN_CP_TOKENS))
           and allowed(keep, "parallel.cp", c)]
    floors = StepFloor.of(recipe, placement, gbs)
    capacity = floors.gpu.memory_bytes  # the planned GPU (power cap, network share), as the floors price it

    splits = []
    for tp in tps:
        for cp in cps:
            if world % (tp * cp):
                continue
            for pp in divisors(world // (tp * cp)):
                if pp > m.layers:
                    break
                if not allowed(keep, "parallel.pp", pp):
                    continue
                dp = world // (tp * cp * pp)
                if gbs % dp:
                    continue
                eps = [e for e in divisors(m.moe.num_experts) if (dp * cp) % e == 0] if m.is_moe else [1]
                eps = [e for e in eps if allowed(keep, "parallel.ep", e)]
                # compute (MoE blocks are replicated over TP ranks; causal SDPA skips half the
                # scores, as in the step-time model) and TP communication, per GPU
                floor = floors.compute_and_tp(tp, cp, pp, dp)
                for schedule, v in _schedules(recipe, pp, m.layers, keep):
                    split = balanced_split(m.layers, pp * v)  # None for pp 1: one stage holds every layer
                    if not (allowed(keep, "parallel.pp_schedule", schedule) and allowed(keep, "parallel.pp_virtual_stages", v)
                            and allowed(keep, "parallel.pp_layers_per_stage", split)):
                        continue
                    for ep in eps:
                        if state_lower_bound(recipe, tp, pp, ep, dp * cp) > capacity:
                            continue
                        ep_s = floors.ep(tp, cp, pp, dp, ep)
                        bound = (floor + ep_s) * (1 + bubble_fraction(schedule, pp, v, gbs // dp))
                        splits.append((bound, tp, cp, pp, schedule, v, ep, dp, split))
    result.splits = len(splits)
    splits.sort()
    found: list[Choice] = []

    def kth() -> float:
        if exhaustive:
            return float("inf")
        return found[top - 1].cost.time.step_s if len(found) >= top else float("inf")

    def explore_split(base: dict, bound: float, dp: int) -> None:
        """Every ZeRO stage, HSDP replica count and micro batch of one split (``base``: its parallel settings)."""
        tp, cp, pp, ep, schedule, v = (base[k] for k in ("tp", "cp", "pp", "ep", "pp_schedule", "pp_virtual_stages"))
        if kth() < float("inf") and needs_full_recompute(recipe, placement, base, gbs, dp, capacity):
            # the recomputed forward is part of every layout of this split
            if bound + floors.recompute(tp, cp) >= kth():
                return
        result.splits_evaluated += 1
        for zero in (0, 1, 2, 3):
            if (zero and dp * cp == 1) or (zero == 3 and pp > 1) or not allowed(keep, "parallel.zero", zero):
                continue  # pp > 1: the engine runs zero 3 as zero 2
            reps = [1] + (shard_replicas(dp, cp, tp, ep, min(slots)) if zero >= 2 else [])
            for rep in filter(lambda r: allowed(keep, "parallel.dp_replicate", r), reps):
                fits_bound = zero_lower_bound(recipe, tp, pp, ep, dp, cp, zero, rep) <= capacity
                if rep > 1:
                    result.hsdp.append((tp, cp, pp, schedule, v, ep, zero, rep, dp // rep, fits_bound))
                if not fits_bound:
                    continue
                par = dict(base, zero=zero, dp_replicate=rep, dp_shard=dp // rep)
                floor = bound / (1 + bubble_fraction(schedule, pp, v, gbs // dp))
                _explore_micro_batches(recipe, placement, par, gbs, dp, pp, found, result, 0 if exhaustive else top, dp_overlap,
                                       lambda mb: floor * (1 + bubble_fraction(schedule, pp, v, gbs // dp // mb)) >= kth(),
                                       keep)

    for bound, tp, cp, pp, schedule, v, ep, dp, split in splits:
        if bound >= kth():
            break
        sp = tp > 1 and (t.seq_len // cp) % tp == 0
        kept_sp = (keep or {}).get("parallel.sequence_parallel")
        if kept_sp is not None:  # a stack without SP (False), or SP required (True: where it divides)
            if kept_sp and tp > 1 and not sp:
                continue
            sp = kept_sp
        base = dict(tp=tp, cp=cp, pp=pp, ep=ep, pp_schedule=schedule, pp_virtual_stages=v, pp_layers_per_stage=split,
                    sequence_parallel=sp if tp > 1 or kept_sp is not None else recipe.parallel.sequence_parallel)
        explore_split(base, bound, dp)  # the recipe's cp_method: every method takes masks and the soft-cap
    _finalize(recipe, placement, found, result, top, dp_overlap)
    result.seconds = time.perf_counter() - t0
    result.cpu_seconds = time.process_time() - c0
    return result


def _explore_micro_batches(recipe, placement, par, gbs, dp, pp, found, result, top, dp_overlap, hopeless,
                           keep=None) -> None:
    """Grow the micro batch while something fits and its bound can still beat the K-th best; for
    each, the least recomputation that fits (a kept recomputation mode: that one, where it fits)."""
    per_dp = gbs // dp
    kept_ac = (keep or {}).get("train.activation_checkpointing")
    ladder = RECOMPUTE if kept_ac is None else (kept_ac,)
    if pp > 1 and par.get("pp_schedule", recipe.parallel.pp_schedule) in SPLIT_BACKWARD_SCHEDULES:
        ladder = tuple(mode for mode in ladder if mode not in SELECTIVE)  # plan/validate.py: not under a split backward
        if not ladder:
            return
    level = 0  # recomputation needed so far (more micro batches never need less)
    kept_mb = (keep or {}).get("train.micro_batch_size")
    for mb in [d for d in divisors(per_dp) if d <= max(MAX_MICRO_BATCH, kept_mb or 0) and kept_mb in (None, d)]:
        if (pp > 1 and per_dp // mb < pp) or hopeless(mb):
            break
        variant = make_variant(recipe, par, dict(micro_batch_size=mb, global_batch_size=gbs,
                                                 activation_checkpointing=ladder[0]))
        v = validate(variant, placement)  # the same rules as `llmtrain plan`, with the ladder's first recomputation
        if not v.valid:
            result.rejected_invalid += 1
            if any(e.path != "train.global_batch_size" for e in v.errors):
                break  # a rule about the layout itself: no micro batch size helps
            continue
        ranks = probe_ranks(v.dims.pp)

        def fits(mode: str) -> bool:
            trial = make_variant(variant, {}, dict(activation_checkpointing=mode))
            result.layouts_evaluated += 1
            ok = peak_bytes(trial, v.dims, v.batch, ranks) <= placement_capacity(recipe)
            result.rejected_memory += not ok
            return ok

        if not fits(ladder[-1]):
            break  # larger micro batches need more memory still
        level = next((i for i in range(level, len(ladder) - 1) if fits(ladder[i])), len(ladder) - 1)
        chosen = make_variant(variant, {}, dict(activation_checkpointing=ladder[level]))
        cost = estimate(chosen, v.dims, v.batch, placement, dp_overlap=dp_overlap, fast=True, hints=False)
        overrides = {f"parallel.{k}": val for k, val in par.items()}
        overrides.update({"train.micro_batch_size": mb, "train.activation_checkpointing": ladder[level]})
        found.append(Choice(0, overrides, v.dims, v.batch, cost))
        found.sort(key=lambda c: c.cost.time.step_s)
        if top:
            del found[4 * top:]


def placement_capacity(recipe: Recipe) -> float:
    return cluster_gpu(recipe.cluster.gpu).memory_bytes


def _finalize(recipe, placement, found, result, top, dp_overlap) -> None:
    """Re-price the best layouts on every pipeline rank (the search probed a few) and keep those
    that still fit, best first."""
    final = []
    for c in found:
        variant = recipe.model_copy(update={
            "parallel": recipe.parallel.model_copy(update={k.split(".", 1)[1]: v for k, v in c.overrides.items()
                                                          if k.startswith("parallel.")}),
            "train": recipe.train.model_copy(update={k.split(".", 1)[1]: v for k, v in c.overrides.items()
                                                    if k.startswith("train.")} | {"global_batch_size": c.batch.global_batch_size})})
        cost = estimate(variant, c.dims, c.batch, placement, dp_overlap=dp_overlap, hints=False)
        if cost.fits:
            final.append(Choice(0, c.overrides, c.dims, c.batch, cost))
        if len(final) == top:
            break
    final.sort(key=lambda c: c.cost.time.step_s)
    result.top = final
    explain(final)
