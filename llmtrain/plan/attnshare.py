"""Which share of a layer's attention scores the engine's kernels run, per method and mask: the FLOP count's
(:func:`attention_counted`: each kernel call's whole square, as ``FlopCounterMode`` counts it) and the time's
(:func:`attention_executed`: what the slowest rank's kernels execute), with context parallelism's blocks,
masks (packed rows, sliding windows, the soft-cap) and a windowed layer's score boxes (with ring CP
plan/ringwindow.py, without CP plan/localwindow.py). Split out of plan/flops.py (which re-exports these
names): one concept, the attention's executed share, apart from the model FLOPs per token.
"""

from __future__ import annotations

from llmtrain.plan.localwindow import local_window_work
from llmtrain.plan.ringwindow import exchange_tokens, ring_window_steps, ring_window_work, use_exchange


def attention_counted(cp: int, method: str, masked: float = 0.0) -> float:
    """Share of the full attention-score FLOPs in the hardware FLOP count (the convention of
    ``FlopCounterMode``: a causal kernel call counts its whole square) that the engine's
    context-parallel attention runs, per sequence: its kernel blocks, not the full ``S x S``.
    With ``2 cp`` zigzag chunks of ``c`` tokens, the ring (engine/parallel/context_ring.py) runs
    on each rank its causal diagonal (``(2c)^2``) and ``cp - 1`` blocks of ``2c^2`` (all its
    queries against half the keys, or half against all): ``(cp + 1) / (2 cp)`` of ``(2 cp c)^2``
    over the ranks; all-gather (context_blocks.PrefixCausalAttention) runs per chunk ``j`` its
    diagonal and its prefix, ``(j + 1) c^2``: ``(2 cp + 1) / (4 cp)``. Ulysses and no CP: whole
    causal calls, 1. Measured at cp 2 (benchmarks/planner_fidelity.py, the blocks on the math path):
    the remaining gap is that path's backward recomputing each block's scores, which the
    counter's SDPA formula (the CUDA kernels') does not count. ``masked``: the share of layers whose
    all-gather attention is one masked call of the rank's rows against the whole row
    (:func:`allgather_masked`): counted whole, 1, as without CP. The ring's masked blocks (packed rows,
    a window, the soft-cap) are the same blocks as its causal ones: the same count."""
    if cp == 1 or method == "ulysses":
        return 1.0
    if method == "ring":
        return (cp + 1) / (2 * cp)
    if method == "allgather":
        return masked + (1.0 - masked) * (2 * cp + 1) / (4 * cp)
    raise ValueError(f"attention_counted: unknown cp_method {method!r}")


def windowed(m, seq_len: int) -> float:
    """The share of layers whose attention the engine runs with a sliding window's mask: those not in
    ``full_attention_layers`` when the window is shorter than the sequence, else none."""
    if m.sliding_window is None or seq_len <= m.sliding_window:
        return 0.0
    return len(m.windowed_layers) / m.layers


def masked_layers(recipe) -> float:
    """The share of layers whose attention runs with an explicit mask: every layer for packed rows
    (``data.packing``: the block-diagonal sample mask, models/llama.py ``packed_mask``), else the
    windowed ones (:func:`windowed`)."""
    return 1.0 if recipe.data.packing else windowed(recipe.model, recipe.train.seq_len)


def allgather_masked(recipe) -> float:
    """The share of layers whose all-gather CP attention is one masked call over the gathered K/V
    (engine/parallel/context.py): every layer for packed rows and for the soft-capped kernel (its
    causal mask as the rank's rows), else the windowed ones; the others run the zigzag kernel blocks."""
    if recipe.data.packing or recipe.model.attention_softcap is not None:
        return 1.0
    return windowed(recipe.model, recipe.train.seq_len)


def cp_attention_shares(recipe, cp: int) -> tuple[float, float]:
    """``(counted, executed)``: :func:`attention_counted` and :func:`attention_executed` of a recipe at ``cp``,
    with ring CP's windowed layers (a window shorter than the sequence) by the blocks the ring runs: it
    runs only the chunk pairs inside the window (plan/ringwindow.py), which the FLOP count and the time count;
    its other layers as before (masked when packed)."""
    p, m, seq = recipe.parallel, recipe.model, recipe.train.seq_len
    counted = attention_counted(cp, p.cp_method, allgather_masked(recipe))
    executed = attention_executed(cp, p.cp_method, masked_layers(recipe))
    w = windowed(m, seq)
    if cp > 1 and p.cp_method == "ring" and w:
        window_counted, window_executed, _ = ring_window_work(cp, seq, m.sliding_window)
        counted = w * window_counted + (1.0 - w) * counted
        executed = w * window_executed + (1.0 - w) * attention_executed(cp, "ring", float(recipe.data.packing))
    elif runs_local(recipe, cp):  # without CP or under Ulysses: a windowed layer's boxes (plan/localwindow.py)
        local = local_window_work(seq, m.sliding_window)[0]
        counted = w * local + (1.0 - w) * counted
        executed = w * local + (1.0 - w) * attention_executed(cp, p.cp_method, float(recipe.data.packing))
    return counted, executed


def runs_local(recipe, cp: int) -> bool:
    """Whether the windowed layers run their score boxes instead of the dense masked call: without CP or
    under Ulysses (whole rows of the rank's heads), a window shorter than the row that the row's chunks fit,
    eager blocks (engine/models/window_attention.py)."""
    m, seq = recipe.model, recipe.train.seq_len
    return ((cp == 1 or recipe.parallel.cp_method == "ulysses") and windowed(m, seq) > 0 and not recipe.train.compile
            and local_window_work(seq, m.sliding_window) is not None)


def ring_step_shares(recipe, cp: int) -> tuple[float, ...] | None:
    """Each ring step's share of a layer's attention time on the most loaded rank, averaged over the
    layers: equal (None) but for the windowed layers' chunk pairs (plan/ringwindow.py), which leave
    steps with little to hide the ring's hops behind (plan/ringtime.py)."""
    m, seq = recipe.model, recipe.train.seq_len
    w = windowed(m, seq)
    if cp <= 1 or recipe.parallel.cp_method != "ring" or not w or exchanged(recipe, cp):
        return None  # (windowed layers that exchange their chunks are not on the ring: cp_exchange)
    return tuple(w * share + (1.0 - w) / cp for share in ring_window_steps(cp, seq, m.sliding_window))


def exchanged(recipe, cp: int) -> bool:
    """Whether ring CP's windowed layers fetch only their window's chunks from their owners instead of
    walking the ring (plan/ringwindow.py ``use_exchange``, engine/parallel/context_exchange.py)."""
    m, seq = recipe.model, recipe.train.seq_len
    return (cp > 1 and recipe.parallel.cp_method == "ring" and windowed(m, seq) > 0
            and use_exchange(cp, seq // (2 * cp), m.sliding_window))


def ring_layers_executed(recipe, cp: int) -> float | None:
    """:func:`attention_executed` of the layers on the ring when the windowed ones exchange their keys
    instead (:func:`exchanged`): the full-attention layers' blocks, whose kernels hide the ring's hops
    (plan/ringtime.py); None when every layer is on the ring (the blended share of
    :func:`cp_attention_shares` then)."""
    if not exchanged(recipe, cp):
        return None
    return attention_executed(cp, "ring", float(recipe.data.packing))


def softcap_call_keys(recipe, cp: int, ring_only: bool = False) -> int:
    """Keys per query of the soft-capped kernel's calls, averaged over the layers: it runs every score of its
    calls, under ring CP the ring's blocks ``(cp + 1) / (2 cp)`` of ``[s, S]`` (the diagonal block whole), a
    windowed layer only its pairs' boxes (plan/ringwindow.py); without CP whole rows, a windowed layer its
    boxes (:func:`runs_local`). ``ring_only``: the layers on the ring alone (the full-attention ones when the
    windowed ones exchange their keys: :func:`ring_layers_executed`)."""
    m, seq = recipe.model, recipe.train.seq_len
    if cp == 1 or recipe.parallel.cp_method != "ring":  # whole rows (Ulysses: of the rank's heads)
        w = windowed(m, seq) if runs_local(recipe, cp) else 0.0
        return round(seq * (w * local_window_work(seq, m.sliding_window)[0] + (1.0 - w))) if w else seq
    blocks = (cp + 1) / (2 * cp)
    w = 0.0 if ring_only else windowed(m, seq)
    window = ring_window_work(cp, seq, m.sliding_window)[1] if w else 0.0
    return round(seq * (w * window + (1.0 - w) * blocks))


def cp_exchange(recipe, cp: int, layers) -> tuple[int, float, float]:
    """comm.py's ``CommSpec.cp_exchange`` for a rank holding ``layers``: its windowed layers that exchange
    (:func:`exchanged`) and the busiest rank's K/V sent and received per forward pass, as shares of its
    local K/V (key positions over ``seq / cp``)."""
    if not exchanged(recipe, cp):
        return 0, 0.0, 0.0
    m, seq = recipe.model, recipe.train.seq_len
    n = sum(1 for i in layers if m.is_windowed(i))
    sent, received = exchange_tokens(cp, seq // (2 * cp), m.sliding_window)
    return (n, sent / (seq // cp), received / (seq // cp)) if n else (0, 0.0, 0.0)


def attention_executed(cp: int, method: str, masked: float = 0.0) -> float:
    """Share of the full (unmasked) attention-score FLOPs the engine's kernels execute on the
    slowest context-parallel rank (time, not the FLOP convention of MFU): 1/2 for every method.
    Causal SDPA without CP and Ulysses (each rank a causal kernel over the whole sequence of its
    heads) skip the masked half. The zigzag ring (engine/parallel/context_ring.py) runs one causal
    diagonal block and ``cp - 1`` unmasked half blocks per rank. All-gather CP shards zigzag too
    (Llama 3's 2 x cp chunks, engine/parallel/context.py): with ``c = S / 2 cp``, rank ``r``'s
    chunks at offsets ``r c`` and ``(2 cp - 1 - r) c`` run ``c (r c) + c (2 cp - 1 - r) c + c^2 =
    s_local S / 2`` scores (diagonals counted half) on every rank. (Contiguous all-gather shards,
    before, gave rank ``r`` ``(r + 1/2) / cp``, the last rank setting the pace.) ``method`` stays
    a parameter for a method that is not balanced.

    ``masked`` (the share of layers with a sliding window shorter than the sequence, :func:`windowed`,
    or every layer for packed rows: :func:`masked_layers`) executes all of its blocks, averaged over the layers (exact for the whole model, an average for a
    pipeline stage holding fewer or more windowed layers than its share): kernels given a mask execute
    every score block, visible or not (CUDA's memory-efficient kernel, CPU's flash kernel). Without CP and
    under Ulysses a windowed layer runs only its score boxes (:func:`cp_attention_shares` with
    :func:`runs_local`, plan/localwindow.py; since the forty-second session, before the dense band). The ring's masked blocks are its
    unmasked ones with a mask (context_ring.py): only the diagonal block runs whole instead of half,
    ``(2c)^2 / 2`` more of the ``4 cp c^2`` per rank: ``1/2 + masked / (2 cp)``. (Blocks that packed
    rows' samples leave empty still run: skipping them would make the work depend on the data; a
    windowed layer runs only the chunk pairs inside the window, :func:`cp_attention_shares`.)"""
    if method == "ring" and cp > 1:
        return 0.5 + 0.5 * masked / cp
    if cp == 1 or method in ("ulysses", "allgather"):
        return 0.5 + 0.5 * masked
    raise ValueError(f"attention_executed: unknown cp_method {method!r}")
