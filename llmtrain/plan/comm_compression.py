"""Gradient compression on the wire (``parallel.grad_compression``): the bytes each compressed
averaging sends, as engine/parallel/compression.py runs it (PowerSGD's per-tensor rank choice and
warm-up, top-k's gathered values and indices). Pure byte math; plan/comm.py turns it into
collectives (``compressed_grad_comms``)."""

from __future__ import annotations

from math import ceil


POWERSGD_MIN_RATE = 2.0  # torch's PowerSGDState.min_compression_rate (engine/parallel/compression.py)


def powersgd_rank_of(shape: tuple[int, ...], rank: int) -> int:
    """The engine's choice (``compression.powersgd_plan``, torch's ``_should_compress``): the rank a
    gradient of ``shape`` is approximated with, as matrix ``(shape[0], rest)``; 0 = sent whole."""
    if len(shape) < 2:
        return 0
    n = shape[0]
    cols = 1
    for x in shape[1:]:
        cols *= x
    r = min(rank, n, cols)
    return r if (n + cols) * r * POWERSGD_MIN_RATE < n * cols else 0


def powersgd_start(recipe) -> int:
    """``parallel.powersgd_start_step`` as the engine runs it: the recipe's value, or torch's advice
    (``PowerSGDState`` docstring: start with 10 % of the training steps, no fewer than the
    learning-rate warm-up) when it is left out."""
    p, t = recipe.parallel, recipe.train
    if p.powersgd_start_step is not None:
        return p.powersgd_start_step
    return max(t.schedule.warmup_steps, ceil(t.steps / 10))


def compressed_grad_bytes(kind: str, shapes: tuple, rank: int, ratio: float, group: int) -> list[tuple[str, str, int]]:
    """(op, what, message bytes) of each collective one compressed gradient averaging issues per
    step, as engine/parallel/compression.py does: PowerSGD one fp32 all-reduce of the
    uncompressed tensors, one of every ``P`` (``n x r``), one of every ``Q`` (``m x r``); top-k one
    all-gather of ``k`` fp32 values + ``k`` int32 indices per rank (message: the gathered size)."""
    if kind == "topk":
        numel = sum(_numel(s) for s in shapes)
        k = min(numel, max(1, ceil(ratio * numel))) if numel else 0
        return [("all-gather", "top-k values + int32 indices", group * 8 * k)] if k else []
    plain = ps = qs = 0
    for s in shapes:
        r = powersgd_rank_of(s, rank)
        if r:
            ps += s[0] * r
            qs += _numel(s) // s[0] * r
        else:
            plain += _numel(s)
    out = [("all-reduce", "uncompressed (1-D, small)", 4 * plain), ("all-reduce", "PowerSGD P", 4 * ps),
           ("all-reduce", "PowerSGD Q", 4 * qs)]
    return [o for o in out if o[2]]


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for x in shape:
        n *= x
    return n
