"""What FSDP2 and ZeRO-1 store of each parameter on one data-parallel rank (the engine's
``parallel/data_parallel.py`` and ``parallel/zero1.py``), for the shapes of :mod:`llmtrain.plan.shards`:

- **FSDP2** (zero 2/3 with ``dp x cp > 1``) shards every parameter on dim 0 over
  ``dp_shard x cp`` with ``torch.chunk`` semantics: chunks of ``ceil(rows / n)`` rows, so the
  last ranks may hold fewer or none. This is exactly ``p._local_tensor.numel()``. Stacked expert
  weights whose rank-local expert count does not divide their shard count are split on their
  hidden dimension instead, evenly, when it divides (``ParamShape.hidden_dim``; the engine's
  ``expert_placement``).
- **ZeRO-1** (``zero 1`` with ``dp x cp > 1``) keeps full parameters and gradients and assigns
  each *whole* parameter's AdamW states to one rank of its data-parallel group (dp x cp for
  dense weights, dp_replicate x edp for EP experts), largest first onto the least-loaded rank
  (ties: lowest rank). :func:`zero1_loads` replays that greedy; the loads do
  not depend on how equal-sized parameters are ordered, so only the sizes are needed.
"""

from __future__ import annotations

import heapq
from functools import lru_cache

from llmtrain.plan.shards import ParamShape


def chunk_rows(rows: int, shards: int, index: int) -> int:
    """Rows of ``torch.chunk(t, shards)[index]`` (0 when that chunk does not exist), as FSDP2 shards."""
    if shards <= 1:
        return rows
    size = -(-rows // shards)
    return max(0, min(size, rows - index * size))


def fsdp_numel(p: ParamShape, shards: int, index: int) -> int:
    rows, rest = p.rows_rest
    if rows % shards and p.hidden_dim is not None and p.shape[p.hidden_dim] % shards == 0:
        return p.numel // shards  # stacked experts split on H (engine/parallel/data_parallel.py expert_placement)
    return chunk_rows(rows, shards, index) * rest


def fsdp_local_numel(params: tuple[ParamShape, ...], shards: int, index: int) -> int:
    """Elements of ``params`` that FSDP shard ``index`` of ``shards`` stores (cached: the search
    prices the same stage for many layouts)."""
    return _fsdp_local(params, shards, index if shards > 1 else 0)


@lru_cache(maxsize=16384)
def _fsdp_local(params: tuple[ParamShape, ...], shards: int, index: int) -> int:
    return sum(fsdp_numel(p, shards, index) * n for p, n in _counts(params))


@lru_cache(maxsize=4096)
def _counts(params: tuple[ParamShape, ...]) -> tuple[tuple[ParamShape, int], ...]:
    """Distinct shape objects and how often each occurs (blocks share theirs)."""
    counts: dict[ParamShape, int] = {}
    for p in params:
        counts[p] = counts.get(p, 0) + 1
    return tuple(counts.items())


def zero1_loads(numels, ranks: int) -> list[tuple[int, int]]:
    """(elements, parameters) owned by each rank under the engine's greedy ZeRO-1 partition."""
    numels = tuple(numels)
    if any(a < b for a, b in zip(numels, numels[1:])):
        numels = tuple(sorted(numels, reverse=True))
    return _zero1_loads(numels, ranks)


@lru_cache(maxsize=4096)
def _zero1_loads(numels: tuple[int, ...], ranks: int) -> list[tuple[int, int]]:
    load = [(0, r) for r in range(ranks)]  # (load, rank): heap order = least loaded, then lowest rank
    heapq.heapify(load)
    owned = [[0, 0] for _ in range(ranks)]
    for n in numels:
        current, r = heapq.heappop(load)
        owned[r][0] += n
        owned[r][1] += 1
        heapq.heappush(load, (current + n, r))
    return [(a, b) for a, b in owned]
