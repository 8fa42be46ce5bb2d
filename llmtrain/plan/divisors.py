"""Divisors of a degree, and the short "{a, b, ...}" list of them that an error's fix names."""

from __future__ import annotations


def divisors(n: int, limit: int | None = None) -> list[int]:
    """The divisors of ``n`` in increasing order (those up to ``limit`` when given)."""
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    out = sorted(set(small + [n // d for d in small]))
    return [d for d in out if limit is None or d <= limit]


def choices(values: list[int], cap: int = 12) -> str:
    """``values`` as a set literal for a hint, the first ``cap`` of them."""
    text = ", ".join(map(str, values[:cap]))
    return "{" + text + (", ..." if len(values) > cap else "") + "}"
