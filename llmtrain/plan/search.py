"""``plan --search``: every valid layout for a recipe and a cluster, ranked by modeled throughput.

Search space: tp, cp, pp with its schedule and virtual stages, dp_replicate / dp_shard (HSDP),
ep, zero, micro batch size and activation recomputation; the model, the sequence length and the
global batch (tokens per step) stay as the recipe says. Every layout that is evaluated is first
checked by :func:`llmtrain.plan.validate.validate` itself (no second set of rules to drift),
then priced by :func:`llmtrain.plan.costmodel.estimate`; layouts that do not fit are dropped.

Pruning (so that Llama 3 405B on 16,384 GPUs takes about a second; docs/planner.md):

- tp divides every node's GPUs and the model's head/kv-head/ffn/vocab sizes (validate's rule),
  cp keeps at least 2,048 tokens per rank, pp is a divisor of the world and at most the layer
  count; layer splits that do not divide evenly get a balanced ``pp_layers_per_stage``;
- a layout whose parameters and optimizer states alone do not fit even fully sharded is skipped
  with all its variants;
- branch and bound: each (tp, cp, pp, schedule, ep) split gets a lower bound on its step time
  (compute at the calibrated rate, TP/CP/EP communication, the bubble at its smallest), and
  splits are evaluated in bound order until the bound exceeds the K-th best step time found;
- within a split, the least recomputation that fits is taken (more recomputation never helps
  throughput in the model), and micro batches grow while they fit.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from math import gcd

from llmtrain.plan.batch import BatchMath
from llmtrain.plan.bubble import bubble_fraction
from llmtrain.plan.costmodel import CostModel, estimate, peak_bytes, probe_ranks
from llmtrain.plan.dims import ParallelDims
from llmtrain.plan.flops import flops_per_token
from llmtrain.plan.placement import Placement
from llmtrain.plan.steptime import efficiency
from llmtrain.plan.memory import compute_bytes
from llmtrain.plan.validate import divisors, validate
from llmtrain.recipe.gpus import GPUS
from llmtrain.recipe.schema import Recipe

RECOMPUTE = ("none", "selective", "full")
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

    def to_dict(self) -> dict:
        return {"recipe": self.recipe, "world_size": self.world_size, "seconds": self.seconds,
                "cpu_seconds": self.cpu_seconds, "splits": self.splits,
                "splits_evaluated": self.splits_evaluated, "layouts_evaluated": self.layouts_evaluated,
                "rejected_invalid": self.rejected_invalid, "rejected_memory": self.rejected_memory,
                "top": [c.summary() for c in self.top]}


def balanced_split(layers: int, stages: int) -> list[int] | None:
    """None when the layers divide evenly; else counts differing by at most one, the extra layers
    on the middle stages (the first and last also hold the embedding and the output layer)."""
    if layers % stages == 0:
        return None
    base, extra = divmod(layers, stages)
    counts = [base] * stages
    order = sorted(range(stages), key=lambda i: abs(i - (stages - 1) / 2))
    for i in order[:extra]:
        counts[i] += 1
    return counts


def _schedules(recipe: Recipe, pp: int, layers: int) -> list[tuple[str, int]]:
    if pp == 1:
        return [("1f1b", 1)]
    out = [("1f1b", 1)] + [("interleaved-1f1b", v) for v in (2, 4, 8) if pp * v <= layers]
    own = recipe.parallel.pp_schedule
    if own in ("zbv", "dualpipev") and 2 * pp <= layers:
        out.append((own, 2))
    elif own == "zero-bubble":
        out += [(own, v) for v in (2, 4) if pp * v <= layers]
    elif own == "gpipe":
        out.append((own, 1))
    return out


def _variant(recipe: Recipe, par: dict, train: dict) -> Recipe:
    return recipe.model_copy(update={"parallel": recipe.parallel.model_copy(update=par),
                                     "train": recipe.train.model_copy(update=train)})


def _state_bytes(recipe: Recipe) -> float:
    """Model-state bytes per parameter: 16 (fp32 weight, gradient, AdamW); LoRA: 4, the frozen
    weights only (the adapters' states make the real number larger: still a lower bound)."""
    return 4.0 if recipe.train.lora is not None else 16.0


def _state_lower_bound(recipe: Recipe, tp: int, pp: int, ep: int, dpcp: int) -> float:
    """Bytes of parameters + gradients + AdamW states per rank if everything were sharded over dp x cp."""
    m = recipe.model
    from llmtrain.plan.params import count_params  # noqa: PLC0415

    pc = count_params(m)
    per_rank = (pc.total - (pc.per_moe_block and (m.layers - m.moe.first_dense_layers) * m.moe.num_experts * pc.expert
                            * (1 - 1 / ep))) / (tp * pp)
    return _state_bytes(recipe) * per_rank / max(1, dpcp)


def search(recipe: Recipe, placement: Placement, top: int = 5, dp_overlap: bool = False,
           exhaustive: bool = False) -> SearchResult:
    """The ``top`` fastest layouts that validate and fit. ``exhaustive`` turns the bounds off (every
    split and micro batch is priced): the tests use it to check that pruning loses nothing."""
    t0, c0 = time.perf_counter(), time.process_time()
    m, t = recipe.model, recipe.train
    world = placement.world_size
    gpu = GPUS[recipe.cluster.gpu]
    slots = [n.slots for n in placement.nodes]
    result = SearchResult(recipe.name, world)
    own = validate(recipe, placement)
    gbs = t.global_batch_size or (own.batch.global_batch_size if own.batch else t.micro_batch_size * world)
    tp_common = 0
    for value in (m.heads, m.kv_heads, m.ffn_hidden, m.vocab_size) + ((m.expert_ffn,) if m.is_moe else ()):
        tp_common = gcd(tp_common, value)
    tps = [x for x in divisors(tp_common, min(slots)) if all(s % x == 0 for s in slots) and world % x == 0]
    cps = [c for c in divisors(world) if c == 1 or (t.seq_len % (2 * c) == 0 and t.seq_len // c >= MIN_CP_TOKENS)]
    capacity = gpu.memory_bytes
    rate = gpu.peak_flops_bf16 * efficiency(gpu)
    tokens_gpu = gbs * t.seq_len / world
    moe_tok = _moe_flops_per_token(m, t.seq_len)
    dense_tok = flops_per_token(m, t.seq_len, t.lora) - moe_tok  # LoRA: fewer FLOPs, the floor must stay a lower bound

    splits = []
    for tp in tps:
        for cp in cps:
            if world % (tp * cp):
                continue
            for pp in divisors(world // (tp * cp)):
                if pp > m.layers:
                    break
                dp = world // (tp * cp * pp)
                if gbs % dp:
                    continue
                eps = [e for e in divisors(m.moe.num_experts) if (dp * cp) % e == 0] if m.is_moe else [1]
                # compute (MoE blocks are replicated over TP ranks; causal SDPA skips half the
                # scores, as in the step-time model) and TP communication, per GPU
                skip = _skipped_attention(recipe, cp)
                floor = (dense_tok - skip + moe_tok * tp) * tokens_gpu / rate + _tp_floor(recipe, gpu, tp, pp, cp, dp, gbs)
                for schedule, v in _schedules(recipe, pp, m.layers):
                    for ep in eps:
                        if _state_lower_bound(recipe, tp, pp, ep, dp * cp) > capacity:
                            continue
                        ep_floor = _ep_floor(recipe, gpu, tp, pp, cp, dp, gbs, ep)
                        bound = (floor + ep_floor) * (1 + bubble_fraction(schedule, pp, v, gbs // dp))
                        splits.append((bound, tp, cp, pp, schedule, v, ep, dp))
    result.splits = len(splits)
    splits.sort()
    found: list[Choice] = []

    def kth() -> float:
        if exhaustive:
            return float("inf")
        return found[top - 1].cost.time.step_s if len(found) >= top else float("inf")

    for bound, tp, cp, pp, schedule, v, ep, dp in splits:
        if bound >= kth():
            break
        split = balanced_split(m.layers, pp * v) if pp > 1 else None
        sp = tp > 1 and (t.seq_len // cp) % tp == 0
        base = dict(tp=tp, cp=cp, pp=pp, ep=ep, pp_schedule=schedule, pp_virtual_stages=v, pp_layers_per_stage=split,
                    sequence_parallel=sp if tp > 1 else recipe.parallel.sequence_parallel)
        if kth() < float("inf") and _needs_full_recompute(recipe, placement, base, gbs, dp, capacity):
            # the recomputed forward is part of every layout of this split
            if bound + _recompute_tok(recipe, tp, cp) * tokens_gpu / rate >= kth():
                continue
        result.splits_evaluated += 1
        for zero in (0, 1, 2, 3):
            if (zero and dp * cp == 1) or (zero == 3 and pp > 1):  # pp > 1: the engine runs zero 3 as zero 2
                continue
            reps = [1]
            if zero >= 2:
                reps += [r for r in divisors(dp)[1:-1] if (dp // r) * cp * tp in (min(slots), 2 * min(slots), 8 * min(slots))
                         and (dp // r * cp) % ep == 0]  # EP borrows from dp_shard x cp
            for rep in reps:
                if _zero_lower_bound(recipe, tp, pp, ep, dp, cp, zero, rep) > capacity:
                    continue
                par = dict(base, zero=zero, dp_replicate=rep, dp_shard=dp // rep)
                floor = bound / (1 + bubble_fraction(schedule, pp, v, gbs // dp))
                _explore_micro_batches(recipe, placement, par, gbs, dp, pp, found, result, 0 if exhaustive else top, dp_overlap,
                                       lambda mb: floor * (1 + bubble_fraction(schedule, pp, v, gbs // dp // mb)) >= kth())
    _finalize(recipe, placement, found, result, top, dp_overlap)
    result.seconds = time.perf_counter() - t0
    result.cpu_seconds = time.process_time() - c0
    return result


def _skipped_attention(recipe: Recipe, cp: int) -> float:
    """Attention FLOPs per token that causal SDPA never executes (see costmodel.estimate)."""
    m, p = recipe.model, recipe.parallel
    causal = cp == 1 or p.cp_method == "ulysses"
    return 6.0 * m.hidden * recipe.train.seq_len * m.layers if causal else 0.0


def _recompute_tok(recipe: Recipe, tp: int, cp: int) -> float:
    """Hardware FLOPs per token of full recomputation, summed over the TP group's ranks / tp."""
    from llmtrain.plan.flops import recompute_flops_per_token  # noqa: PLC0415

    m, seq = recipe.model, recipe.train.seq_len
    total = -_skipped_attention(recipe, cp) / 3
    for layer in range(m.layers):
        split, rep = recompute_flops_per_token(m, layer, seq, "full", recipe.train.lora)
        total += split + rep * tp
    return total


def _moe_flops_per_token(m, seq_len: int) -> float:
    """The MoE blocks' share of the model FLOPs per token (router and experts)."""
    from llmtrain.plan.flops import block_flops_per_token  # noqa: PLC0415

    if not m.is_moe:
        return 0.0
    return (m.layers - m.moe.first_dense_layers) * block_flops_per_token(m, m.layers - 1, seq_len)[1]


def _ep_floor(recipe: Recipe, gpu, tp: int, pp: int, cp: int, dp: int, gbs: int, ep: int) -> float:
    """Seconds of EP all-to-all per step on one rank over NVLink (a lower bound)."""
    m, t = recipe.model, recipe.train
    if ep == 1 or not m.is_moe:
        return 0.0
    from llmtrain.plan.comm import link  # noqa: PLC0415

    e = compute_bytes(t.precision)
    tokens = gbs // dp * t.seq_len // cp
    moe_layers = (m.layers - m.moe.first_dense_layers) / pp
    return 4 * (ep - 1) / ep * e * tokens * m.moe.top_k * m.hidden * moe_layers / link(gpu, False).bandwidth


def _needs_full_recompute(recipe: Recipe, placement: Placement, base: dict, gbs: int, dp: int, capacity: float) -> bool:
    """Whether even the most sharded state (zero 3, or 2 with pp > 1; no HSDP) with micro batch 1
    and selective recomputation overflows: then every layout of the split recomputes fully.

    With LoRA, selective recomputation can keep MORE than none (it saves the frozen projections'
    outputs and the adapters', which a frozen weight's backward does not need), so there both are
    tried."""
    zero = 2 if base["pp"] > 1 else 3
    for mode in ("selective",) if recipe.train.lora is None else ("selective", "none"):
        variant = _variant(recipe, dict(base, zero=zero, dp_replicate=1, dp_shard=dp),
                           dict(micro_batch_size=1, global_batch_size=gbs, activation_checkpointing=mode))
        v = validate(variant, placement)
        if not v.valid:
            return False
        if peak_bytes(variant, v.dims, v.batch, probe_ranks(v.dims.pp)) <= capacity:
            return False
    return True


def _zero_lower_bound(recipe: Recipe, tp: int, pp: int, ep: int, dp: int, cp: int, zero: int, rep: int) -> float:
    """Model-state bytes of an average rank for this zero mode (a lower bound for the worst rank)."""
    per = _state_bytes(recipe)
    full = _state_lower_bound(recipe, tp, pp, ep, 1) / per  # parameters per rank
    e = compute_bytes(recipe.train.precision)
    if zero == 0 or dp * cp == 1:
        return per * full
    if zero == 1:  # LoRA: frozen weights are never sharded by ZeRO-1
        return per * full if recipe.train.lora is not None else 8.0 * full + 8.0 * full / (dp * cp)
    shard = dp // rep * cp
    unsharded = e * full if (zero == 2 or pp > 1) else 0.0
    return per * full / shard + unsharded


def _tp_floor(recipe: Recipe, gpu, tp: int, pp: int, cp: int, dp: int, gbs: int) -> float:
    """Seconds of TP communication per step on one rank (no recomputation, NVLink): a lower bound."""
    if tp == 1:
        return 0.0
    from llmtrain.plan.comm import link  # noqa: PLC0415

    m, t = recipe.model, recipe.train
    e = compute_bytes(t.precision)
    tokens = gbs // dp * t.seq_len // cp
    volume = 4 * 2 * (tp - 1) / tp * e * tokens * m.hidden * m.layers / pp
    return volume / link(gpu, False).bandwidth


def _explore_micro_batches(recipe, placement, par, gbs, dp, pp, found, result, top, dp_overlap, hopeless) -> None:
    """Grow the micro batch while something fits and its bound can still beat the K-th best; for
    each, the least recomputation that fits."""
    per_dp = gbs // dp
    level = 0  # recomputation needed so far (more micro batches never need less)
    for mb in [d for d in divisors(per_dp) if d <= MAX_MICRO_BATCH]:
        if (pp > 1 and per_dp // mb < pp) or hopeless(mb):
            break
        variant = _variant(recipe, par, dict(micro_batch_size=mb, global_batch_size=gbs))
        v = validate(variant, placement)  # the same rules as `llmtrain plan`; recomputation is not among them
        if not v.valid:
            result.rejected_invalid += 1
            if any(e.path != "train.global_batch_size" for e in v.errors):
                break  # a rule about the layout itself: no micro batch size helps
            continue
        ranks = probe_ranks(v.dims.pp)

        def fits(mode: str) -> bool:
            trial = _variant(variant, {}, dict(activation_checkpointing=mode))
            result.layouts_evaluated += 1
            ok = peak_bytes(trial, v.dims, v.batch, ranks) <= placement_capacity(recipe)
            result.rejected_memory += not ok
            return ok

        if not fits(RECOMPUTE[-1]):
            break  # larger micro batches need more memory still
        level = next((i for i in range(level, len(RECOMPUTE) - 1) if fits(RECOMPUTE[i])), len(RECOMPUTE) - 1)
        chosen = _variant(variant, {}, dict(activation_checkpointing=RECOMPUTE[level]))
        cost = estimate(chosen, v.dims, v.batch, placement, dp_overlap=dp_overlap, fast=True, hints=False)
        overrides = {f"parallel.{k}": val for k, val in par.items()}
        overrides.update({"train.micro_batch_size": mb, "train.activation_checkpointing": RECOMPUTE[level]})
        found.append(Choice(0, overrides, v.dims, v.batch, cost))
        found.sort(key=lambda c: c.cost.time.step_s)
        if top:
            del found[4 * top:]


def placement_capacity(recipe: Recipe) -> float:
    return GPUS[recipe.cluster.gpu].memory_bytes


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
    _explain(final)


def _explain(top: list[Choice]) -> None:
    """Why each layout ranks where it does: its largest overheads, relative to the winner."""
    if not top:
        return
    lead = top[0].cost.time
    for i, c in enumerate(top):
        c.rank = i + 1
        t = c.cost.time
        costs = {k: v for k, v in t.breakdown.items() if k != "compute" and v > 0.005 * t.step_s}
        worst = sorted(costs.items(), key=lambda kv: -kv[1])[:2]
        parts = ", ".join(f"{k.replace('_comm', ' comm')} {v / t.step_s:.0%}" for k, v in worst) or "almost pure compute"
        if i == 0:
            c.reason = f"fastest: {parts} of the step; peak {c.cost.worst.peak / 2**30:.0f} GiB"
        else:
            extra = {k: t.breakdown.get(k, 0) - lead.breakdown.get(k, 0) for k in t.breakdown}
            loss = max(extra.items(), key=lambda kv: kv[1])
            c.reason = (f"{t.step_s / lead.step_s - 1:+.1%} step time vs #1, mostly {loss[0].replace('_comm', ' comm')} "
                        f"(+{loss[1]:.3g} s); {parts}")


def layout_label(c: Choice) -> str:
    o = {k.split(".", 1)[1]: v for k, v in c.overrides.items()}
    pipe = f"pp {o['pp']}" + (f" {o['pp_schedule']} v{o['pp_virtual_stages']}" if o["pp"] > 1 else "")
    dp = f"dp {o['dp_replicate']}x{o['dp_shard']}" if o["dp_replicate"] > 1 else f"dp {o['dp_shard']}"
    parts = [f"tp {o['tp']}" + (" sp" if o["tp"] > 1 and o["sequence_parallel"] else ""), pipe, dp,
             f"cp {o['cp']}" if o["cp"] > 1 else "", f"ep {o['ep']}" if o["ep"] > 1 else "", f"zero {o['zero']}",
             f"micro {o['micro_batch_size']}", f"recompute {o['activation_checkpointing']}"]
    return ", ".join(x for x in parts if x)


def set_flags(c: Choice) -> str:
    flags = []
    for k, v in c.overrides.items():
        if k.endswith("pp_layers_per_stage"):
            if v is not None:
                flags.append(f"--set {k}=[{','.join(map(str, v))}]")
            continue
        flags.append(f"--set {k}={str(v).lower() if isinstance(v, bool) else v}")
    return " ".join(flags)


def format_result(res: SearchResult, recipe: Recipe, placement: Placement) -> str:
    gpu = GPUS[recipe.cluster.gpu]
    head = (f"llmtrain plan --search {res.recipe}: {res.world_size:,} GPUs ({len(placement.nodes)} nodes, {gpu.name}); "
            f"{res.splits} splits (tp, cp, pp, schedule, ep), {res.splits_evaluated} explored, {res.layouts_evaluated} "
            f"layouts priced, {res.rejected_memory} did not fit; {res.seconds:.2f} s")
    if not res.top:
        return head + "\nno layout fits: use more GPUs, a shorter sequence or a smaller global batch per GPU"
    lines = [head, f"{'#':>2} {'step s':>8} {'tokens/s/GPU':>13} {'TFLOP/s':>8} {'MFU':>6} {'peak GiB':>9}  layout"]
    for c in res.top:
        t = c.cost.time
        lines.append(f"{c.rank:>2} {t.step_s:>8.3g} {t.tokens_per_s_per_gpu:>13,.0f} {t.tflops_per_gpu:>8.0f} {t.mfu:>6.1%} "
                     f"{c.cost.worst.peak / 2**30:>9.1f}  {layout_label(c)}")
        lines.append(f"{'':>3}why: {c.reason}")
        lines.append(f"{'':>3}{set_flags(c)}")
    return "\n".join(lines)
