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
