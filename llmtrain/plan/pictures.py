"""Pictures of a plan: the pipeline timeline (text or PNG) and the rank layout on nodes (PNG).

matplotlib is imported inside the PNG functions only (``llmtrain plan`` must stay fast and
never pay for it unless a picture is asked for); the Agg backend needs no display.

- :func:`schedule_text`: one line per pipeline rank, three characters per time unit (F = 1
  unit, B = 2, zero-bubble's B and W 1 each): ``F 3`` is micro batch 3's forward, ``B``/``W``
  the backward passes, ``·`` idle time, i.e. the bubble.
- :func:`schedule_png`: the same timeline as coloured bars (stage chunk in the label).
- :func:`layout_png`: one row per node, one cell per GPU, coloured by pipeline stage and
  labelled with the rank and its (dp_replicate, dp_shard, cp, tp) coordinates.
"""

from __future__ import annotations

import io
from pathlib import Path

from llmtrain.plan.dims import ParallelDims
from llmtrain.cluster.placement import Placement
from llmtrain.plan.schedule import Timeline

IDLE = " · "
SPLIT = ("zero-bubble", "zbv", "dualpipev")  # schedules whose backward is drawn as B (input) + W (weights)
UNIT_CHARS = 3


def schedule_text(tl: Timeline, max_width: int = 180) -> str:
    """The timeline as text; wider timelines are cut (and say so)."""
    units = int(round(tl.makespan))
    shown = min(units, max(1, (max_width - 8) // UNIT_CHARS))
    lines = []
    for r in range(tl.pp):
        row = [IDLE] * shown
        for s in tl.slots:
            if s.rank != r:
                continue
            chunk = s.op.stage // tl.pp
            tag = f"{s.op.kind}{s.op.mb % 10}" + ("" if tl.virtual == 1 or tl.schedule in ("gpipe", "1f1b")
                                                  else "abcdefgh"[chunk % 8])
            for u in range(int(round(s.start)), int(round(s.end))):
                if u < shown:
                    row[u] = f"{tag:<3}"[:3]
        lines.append(f"rank {r:>2} " + "".join(row))
    head = (f"{tl.schedule}: pp {tl.pp}, {tl.microbatches} micro batches"
            + (f", {tl.virtual} chunks per rank (a, b, ... = chunk)" if tl.virtual > 1 and tl.schedule not in ("gpipe", "1f1b") else "")
            + f"; F = 1 unit, B = 2{' (B 1 + W 1)' if tl.schedule in SPLIT else ''}; "
            + f"idle '·' = bubble {tl.bubble_fraction:.1%} of compute")
    tail = [] if shown == units else [f"... cut at {shown} of {units} time units"]
    return "\n".join([head, *lines, *tail])


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def schedule_png(tl: Timeline, path: str | Path) -> Path:
    plt = _pyplot()
    colors = {"F": "#4C72B0", "B": "#DD8452", "W": "#55A868"}
    fig_w = min(40.0, max(8.0, tl.makespan * 0.25))
    fig, ax = plt.subplots(figsize=(fig_w, 0.5 * tl.pp + 1.5))
    for s in tl.slots:
        y = tl.pp - 1 - s.rank
        shade = 0.55 + 0.45 * (1 - (s.op.stage // tl.pp) / max(1, tl.virtual))
        ax.barh(y, s.end - s.start, left=s.start, height=0.8, color=colors[s.op.kind], alpha=shade, edgecolor="black",
                linewidth=0.4)
        if s.end - s.start >= 0.9:
            ax.text((s.start + s.end) / 2, y, str(s.op.mb), ha="center", va="center", fontsize=7, color="white")
    ax.set_yticks(range(tl.pp), [f"rank {r}" for r in reversed(range(tl.pp))])
    ax.set_xlim(0, tl.makespan)
    ax.set_xlabel("time (forward = 1 unit)")
    ax.set_title(f"{tl.schedule}: pp {tl.pp}, {tl.microbatches} micro batches, v {tl.virtual}; "
                 f"bubble {tl.bubble_fraction:.1%} (white gaps)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for k, c in colors.items() if any(s.op.kind == k for s in tl.slots)]
    labels = [{"F": "forward", "B": "backward" if tl.schedule not in SPLIT else "backward (input)",
               "W": "backward (weights)"}[k] for k in colors if any(s.op.kind == k for s in tl.slots)]
    ax.legend(handles, labels, loc="upper right", fontsize=8)
    fig.tight_layout()
    path = Path(path)
    return _save(plt, fig, path)


def layout_png(dims: ParallelDims, placement: Placement, path: str | Path, max_nodes: int = 16) -> Path:
    """Ranks on nodes: rows = nodes (the first and last ones when there are many), cells = GPUs."""
    plt = _pyplot()
    nodes = list(range(len(placement.nodes)))
    if len(nodes) > max_nodes:
        nodes = nodes[: max_nodes - 2] + [None] + nodes[-1:]
    width = max(n.slots for n in placement.nodes)
    cmap = plt.get_cmap("tab20")
    fig, ax = plt.subplots(figsize=(max(6.0, 1.3 * width), 0.8 * len(nodes) + 1.6))
    for row, node in enumerate(nodes):
        y = len(nodes) - 1 - row
        if node is None:
            ax.text(width / 2, y + 0.5, f"... {len(placement.nodes) - max_nodes + 1} more nodes ...", ha="center",
                    va="center", fontsize=9)
            continue
        first = placement.first_ranks[node]
        for g in range(placement.nodes[node].slots):
            rank = first + g
            c = dims.coord_dict(rank)
            ax.add_patch(plt.Rectangle((g, y), 0.95, 0.9, color=cmap(c["pp"] % 20), alpha=0.85))
            ax.text(g + 0.47, y + 0.45, f"r{rank}\nd{c['dp_replicate']}.{c['dp_shard']} c{c['cp']} t{c['tp']}",
                    ha="center", va="center", fontsize=6)
        ax.text(-0.1, y + 0.45, placement.nodes[node].host, ha="right", va="center", fontsize=8)
    ax.set_xlim(-1.5, width)
    ax.set_ylim(0, len(nodes))
    ax.axis("off")
    shape = " x ".join(f"{n} {getattr(dims, n)}" for n in ("pp", "dp_replicate", "dp_shard", "cp", "tp"))
    ax.set_title(f"{dims.world_size} ranks: {shape}" + (f", ep {dims.ep}" if dims.ep > 1 else "")
                 + "\ncolour = pipeline stage; label = rank, d<replica>.<shard>, c<cp>, t<tp>", fontsize=9)
    fig.tight_layout()
    path = Path(path)
    return _save(plt, fig, path)


def _save(plt, fig, path: str | Path) -> Path:
    """Render to memory, then write through safeio (temp file + rename: a failed write never
    leaves half a PNG over the previous one). The caller checked ``path`` with output_file."""
    from llmtrain.safeio import write_file

    buf = io.BytesIO()
    fig.savefig(buf, dpi=110, format="png")
    plt.close(fig)
    return write_file(Path(path), buf.getvalue(), "--out")
