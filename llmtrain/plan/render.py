"""Terminal rendering of a plan (rich). Works from :func:`plan_to_dict`, so text and JSON agree."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from llmtrain.plan.dims import MESH_DIMS

NODES_SHOWN = 4


def _count(n: int) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)


def _span(lo_hi: list[int]) -> str:
    lo, hi = lo_hi
    return str(lo) if lo == hi else f"{lo}-{hi}"


def render_plan(d: dict[str, Any], console: Console) -> None:
    status = "[green]valid[/]" if d["valid"] else f"[red]invalid: {len(d['errors'])} error(s)[/]"
    console.print(f"[bold]llmtrain plan[/] {d['recipe']}: {status}, world size {d['world_size']}")
    for e in d["errors"]:
        console.print(f"  [red]error[/]   {e['path']}: {e['message']}" + (f"; {e['hint']}" if e["hint"] else ""), highlight=False)
    for w in d["warnings"]:
        console.print(f"  [yellow]warning[/] {w['path']}: {w['message']}" + (f"; {w['hint']}" if w["hint"] else ""), highlight=False)

    m = d["model"]
    moe = m["moe"]
    params = f"{_count(m['params_total'])} parameters"
    if moe:
        params += f", {_count(m['params_active'])} active per token ({moe['num_experts']} experts, top-{moe['top_k']}" \
                  f"{', ' + str(moe['shared_experts']) + ' shared' if moe['shared_experts'] else ''})"
    lora = m.get("lora")
    if lora:
        share = m["trainable_params"] / max(1, m["params_total"])
        params += (f"; LoRA rank {lora['rank']}, alpha {lora['alpha']:g} (scale {lora['scale']:g})"
                   f"{', dropout ' + format(lora['dropout'], 'g') if lora['dropout'] else ''} on {' '.join(lora['targets'])}"
                   f"{' (and the routed experts)' if lora.get('experts') else ''}: "
                   f"{_count(m['trainable_params'])} trainable ({share:.2%}), the base frozen")
    console.print(f"\n[bold]Model[/] {m['preset'] or 'custom'}: {m['layers']} layers, hidden {m['hidden']}, "
                  f"{m['heads']} heads / {m['kv_heads']} kv, ffn {m['ffn_hidden']}, vocab {m['vocab_size']}; {params}", highlight=False)

    p = d["parallel"]
    degrees = " x ".join(f"{name} {p[name]}" for name in MESH_DIMS)
    extras = [f"ep {p['ep']}" if p["ep"] > 1 else "", f"data parallel: {p['dp_mode']}",
              f"schedule {p['pp_schedule']} (v={p['pp_virtual_stages']})" if p["pp_schedule"] else "",
              f"cp method {p['cp_method']}" if p["cp_method"] else "", "sequence parallel" if p["sequence_parallel"] else ""]
    console.print(f"[bold]Layout[/] {degrees}; " + "; ".join(x for x in extras if x), highlight=False)

    b = d["batch"]
    if b:
        console.print(f"[bold]Batch[/] global {b['global_batch_size']} sequences = micro {b['micro_batch_size']} x grad_accum "
                      f"{b['grad_accum']} x dp {b['dp']}; {b['microbatches']} microbatches/step; seq_len {b['seq_len']}; "
                      f"{b['tokens_per_step']:,} tokens/step", highlight=False)
    if d["pipeline"] and p["pp"] > 1:
        console.print(f"[bold]Pipeline[/] bubble {d['pipeline']['bubble_fraction']:.1%} of the step")
    if d["layout"]:
        _render_layout(d["layout"], console)
    if d.get("memory"):
        _render_cost(d, console)
    if d.get("launch"):
        _render_env(d["launch"], console)


def _render_env(launch: dict[str, Any], console: Console) -> None:
    if launch["env_error"]:
        console.print(f"[bold]Environment[/] [red]error[/] {escape(launch['env_error'])}", highlight=False)
        return
    env = launch["env"]
    pairs = "; ".join(f"{v['name']}={v['value']!r} ({v['source']})" for v in env) if env else "nothing from the policy"
    console.print(f"[bold]Environment on every node[/] {escape(pairs)}; plus {', '.join(launch['launcher_env'])} "
                  f"set per run", highlight=False, soft_wrap=True)


def _render_layout(layout: dict[str, Any], console: Console) -> None:
    nodes = layout["nodes"]
    table = Table(title="Ranks on nodes (coordinates in mesh order pp, dp_replicate, dp_shard, cp, tp)", title_justify="left")
    for col in ("node", "host", "ranks", *MESH_DIMS):
        table.add_column(col, justify="right" if col not in ("host",) else "left")
    detail = len(layout["rank_coords"]) <= 64
    shown = nodes if len(nodes) <= NODES_SHOWN else [*nodes[:2], None, nodes[-1]]
    for node in shown:
        if node is None:
            table.add_row("...", f"{len(nodes) - 3} more nodes", "", *[""] * len(MESH_DIMS))
            continue
        lo, hi = node["ranks"]
        if detail:
            for rank in range(lo, hi + 1):
                table.add_row(str(node["node"]) if rank == lo else "", escape(node["host"]) if rank == lo else "", str(rank),
                              *map(str, layout["rank_coords"][rank]))
        else:
            table.add_row(str(node["node"]), escape(node["host"]), f"{lo}-{hi}", *(_span(node["coords_range"][n]) for n in MESH_DIMS))
    console.print(table)
    groups = ", ".join(f"{name} group of rank 0 = {g['first'][:8]}{'...' if len(g['first']) > 8 else ''}"
                       + (" (crosses nodes)" if g["crosses_nodes"] else "")
                       for name, g in layout["groups"].items() if g["size"] > 1)
    if groups:
        console.print(f"[bold]Groups[/] {groups}", highlight=False)
    if layout["ep"]:
        console.print(f"[bold]Experts[/] {layout['ep']['explanation']}", highlight=False)


PP_SHOWN = 8


def _gib(x: float) -> str:
    """A size given in GiB, printed with a unit that keeps it readable (tiny CPU models: MiB)."""
    if x < 1:
        mib = x * 1024
        return f"{mib:.0f} MiB" if mib >= 100 else f"{mib:.3g} MiB"
    return f"{x:.2f} GiB" if x < 100 else f"{x:.0f} GiB"


def _render_cost(d: dict[str, Any], console: Console) -> None:
    """Memory, time and communication from the cost model (docs/planner.md)."""
    mem, t = d["memory"], d["time"]
    w = mem["worst_rank"]
    verdict = (f"[green]fits[/], {mem['headroom_gib']:.1f} GiB free" if mem["fits"]
               else f"[red]does not fit[/], {-mem['headroom_gib']:.1f} GiB over")
    console.print(f"\n[bold]Memory[/] peak {_gib(mem['peak_gib'])} of {mem['capacity_gib']:.1f} GiB ({mem['gpu']}) on rank "
                  f"{w['rank']} (pp {w['pp']}, at the {mem['phase']}): {verdict}; states {mem['dp_state']}", highlight=False)
    b = mem["breakdown_gib"]
    trainable = (f"; {_count(mem['trainable_params_per_rank'])} trainable per rank (LoRA adapters, before data-parallel sharding)"
                 if d["model"].get("lora") else "")
    console.print("  " + ", ".join(f"{k} {_gib(v)}" for k, v in b.items()) + trainable, highlight=False)
    for label, parts in (("activations", mem["activations_gib"]), ("other", mem["other_gib"])):
        shown = [f"{k.replace('_', ' ')} {_gib(v)}" for k, v in sorted(parts.items(), key=lambda kv: -kv[1]) if v > 0]
        if shown:
            console.print(f"  {label}: " + ", ".join(shown[:8]) + (", ..." if len(shown) > 8 else ""), highlight=False)
    per = mem["per_rank"]
    if len(per) > 1:
        rows = per if len(per) <= PP_SHOWN else [*per[:PP_SHOWN - 2], None, per[-1]]
        console.print("  per pipeline rank (peak GiB, worst data-parallel shard): " + ", ".join(
            "..." if r is None else f"pp{r['pp']} {_gib(r['peak_gib'])}" for r in rows), highlight=False)
    if not mem["fits"] and mem["hints"]:
        fixes = [h for h in mem["hints"] if h["fits"]]
        if fixes:
            console.print("  [bold]to fit[/]: " + "; ".join(
                f"--set {h['change']} -> {_gib(h['peak_gib'])}, {h['step_s']:.3g} s/step, MFU {h['mfu']:.0%}"
                for h in fixes[:3]), highlight=False)
        else:
            best = min(mem["hints"], key=lambda h: h["peak_gib"])
            console.print(f"  [bold]to fit[/]: no single change is enough; closest: --set {best['change']} -> "
                          f"{_gib(best['peak_gib'])}; combine changes or use more GPUs", highlight=False)
    bd = t["breakdown_s"]
    parts = " + ".join(f"{k.replace('_comm', '').upper() if k.endswith('_comm') else k} {v:.3g}"
                       for k, v in bd.items() if v > 0 or k == "compute")
    hw = (f"; hardware FLOPs {t['hw_tflops_per_gpu']:.3g} TFLOP/s/GPU"
          if t["hw_tflops_per_gpu"] > t["tflops_per_gpu"] * 1.001 else "")
    cap = t.get("mfu_peak_tflops", t["peak_tflops"])
    capped = (f", power-capped; MFU against the {cap:.3g} TFLOP/s datasheet peak"
              if cap > t["peak_tflops"] * 1.0001 else "")
    net = (f", network {t['network_gbps_per_gpu']:.3g} Gb/s per GPU between nodes"
           if "network_gbps_per_gpu" in t and len(d.get("layout", {}).get("nodes") or ()) > 1 else "")
    slowest = (f"; stragglers: every rank waits for the slowest of {d['world_size']:,} GPUs (cluster.gpu_variability)"
               if bd.get("stragglers") else "")
    how = (f"compute priced per operation, time model v2, {t['peak_tflops']:.3g} TFLOP/s peak"
           if t.get("time_model") == "v2" else
           f"compute modeled at {t['compute_efficiency']:.0%} of the {t['peak_tflops']:.3g} TFLOP/s peak")
    console.print(f"[bold]Time[/] {t['step_s']:.3g} s/step = {parts} s; {t['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU, "
                  f"{t['tflops_per_gpu']:.3g} TFLOP/s/GPU, [bold]MFU {t['mfu']:.1%}[/] ({how}{hw}{capped}{net}{slowest})", highlight=False)
    if t.get("planner_assumptions"):
        console.print(f"  [bold]assumes[/] (planner only; the bundled engine does not do this): "
                      f"{', '.join(t['planner_assumptions'])}", highlight=False)
    for rec in d.get("recommendations") or []:  # plan/hier.py
        console.print(f"  [bold]recommendation[/]: {escape(rec['message'])}", highlight=False)
    f = d["flops"]
    extra = (f"; hardware FLOPs (recomputation, MoE routers replicated over TP, context-parallel kernel blocks, "
             f"masked scores the kernels run) are "
             f"{f['recompute_overhead']:+.0%}" if abs(f["recompute_overhead"]) > 0.0005 else "")
    console.print(f"[bold]FLOPs[/] {f['model_flops_per_token']:.3g} per token, {f['model_flops_per_step']:.3g} per step "
                  f"({f['model_flops_per_gpu_per_step']:.3g} per GPU){extra}", highlight=False)
    if d["comm"]:
        console.print("[bold]Communication[/] per step, slowest pipeline rank (time if alone / exposed):", highlight=False)
        for c in d["comm"]:
            console.print(f"  {c['dim']:<3} {c['op']:<15} {c['group']:>6} ranks {c['bytes_per_step'] / 2**30:>9.3g} GiB "
                          f"{c['link']:<8} {c['seconds']:>8.3g} s / {c['exposed_s']:<8.3g} s  {escape(c['note'])}", highlight=False)
