"""The launcher's hang detector: no step progress for too long means the job is stuck.

Exit codes alone do not reveal a hang: a rank blocked in a collective (a dead peer, a
deadlock, a partitioned node) waits for the process-group timeout (minutes) or forever, and
every other rank waits with it. The watchdog follows rank 0's progress events
(``@@llmtrain {"event": "step", ...}``, :mod:`llmtrain.launch.events`):

* before the first step event, the job has ``startup_timeout_s`` (imports, rendezvous, model
  build, first compile);
* after it, each next event must come within ``hang_timeout_s``.

When a limit passes, :meth:`Watchdog.check` returns a :class:`Hang` naming the ranks that went
*silent* -- no output line for at least half the limit (a rank that never printed counts as
silent; "half" because the rank that hangs usually says a last word just after the last step
event) -- and, for every rank, how long ago it last printed and what: in a real hang the rank
that stopped first and its last words are usually the clue. 0 disables a limit. Pure Python;
the clock is injectable for tests.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterable


@dataclass(frozen=True)
class Hang:
    waited_s: float
    limit_s: float
    last_step: int | None
    silent: tuple[int, ...]  # ranks without output for >= limit_s / 2
    last_output: dict[int, tuple[float, str]] = field(default_factory=dict)  # rank -> (seconds ago, last line)

    def summary(self) -> str:
        where = f"after step {self.last_step}" if self.last_step is not None else "before the first step"
        silent = _ranks(self.silent) if self.silent else "none (every rank still prints)"
        return f"no step progress for {self.waited_s:.0f} s {where} (limit {self.limit_s:g} s); silent ranks: {silent}"


def _ranks(ranks: Iterable[int]) -> str:
    ranks = sorted(ranks)
    parts, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            parts.append(str(start) if start == r else f"{start}-{r}")
            start = None
    return ", ".join(parts)


class Watchdog:
    def __init__(self, ranks: Iterable[int], hang_timeout_s: float, startup_timeout_s: float,
                 clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.hang_s, self.startup_s = hang_timeout_s, startup_timeout_s
        self.started = clock()
        self.last_progress: float | None = None
        self.last_step: int | None = None
        self.ranks = sorted(ranks)
        self.last_line: dict[int, tuple[float, str]] = {}

    def output(self, rank: int, line: str) -> None:
        self.last_line[rank] = (self.clock(), line)

    def progress(self, step: int | None = None) -> None:
        self.last_progress = self.clock()
        if step is not None:
            self.last_step = step

    def check(self) -> Hang | None:
        now = self.clock()
        if self.last_progress is None:
            limit, since = self.startup_s, self.started
        else:
            limit, since = self.hang_s, self.last_progress
        if not limit or now - since < limit:
            return None
        silent, last = [], {}
        for rank in self.ranks:
            when, line = self.last_line.get(rank, (self.started, ""))
            last[rank] = (now - when, line)
            if now - when >= limit / 2:
                silent.append(rank)
        return Hang(now - since, limit, self.last_step, tuple(silent), last)
