"""``plan --search`` as text: why each layout ranks where it does, its label and its ``--set`` flags."""

from __future__ import annotations

from typing import TYPE_CHECKING

from llmtrain.cluster.placement import Placement
from llmtrain.plan.search_keep import keep_text
from llmtrain.recipe.gpus import GPUS
from llmtrain.recipe.schema import Recipe

if TYPE_CHECKING:
    from llmtrain.plan.search import Choice, SearchResult


def explain(top: list[Choice]) -> None:
    """Why each layout ranks where it does: its largest overheads, relative to the winner."""
    if not top:
        return
    lead = top[0].cost.time
    for i, c in enumerate(top):
        c.rank = i + 1
        t = c.cost.time
        # stragglers are a share of the compute, the same for every layout of one search: not a layout's overhead
        costs = {k: v for k, v in t.breakdown.items() if k not in ("compute", "stragglers") and v > 0.005 * t.step_s}
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
            f"layouts priced, {res.rejected_memory} did not fit; time model {recipe.cluster.time_model}; {res.seconds:.2f} s")
    if res.kept:
        head += "\nonly layouts with " + keep_text(res.kept) + " (--keep)"
    if not res.top:
        if res.kept:
            return head + "\nno layout with these values fits: drop a --keep, or use more GPUs or a smaller batch per GPU"
        return head + "\nno layout fits: use more GPUs, a shorter sequence or a smaller global batch per GPU"
    lines = [head, f"{'#':>2} {'step s':>8} {'tokens/s/GPU':>13} {'TFLOP/s':>8} {'MFU':>6} {'peak GiB':>9}  layout"]
    for c in res.top:
        t = c.cost.time
        lines.append(f"{c.rank:>2} {t.step_s:>8.3g} {t.tokens_per_s_per_gpu:>13,.0f} {t.tflops_per_gpu:>8.0f} {t.mfu:>6.1%} "
                     f"{c.cost.worst.peak / 2**30:>9.1f}  {layout_label(c)}")
        lines.append(f"{'':>3}why: {c.reason}")
        lines.append(f"{'':>3}{set_flags(c)}")
    return "\n".join(lines)
