"""Progress events: the one machine-readable channel from the engine to the launcher.

Rank 0 of the engine prints, on its stdout, one event per line::

    @@llmtrain {"event": "start", "steps": 60, "world_size": 4}
    @@llmtrain {"event": "step", "step": 1, "steps": 60, "loss": 6.2, "lr": 0.0006,
                "grad_norm": 1.3, "tokens_per_s": 5400.0, "mfu": 0.0}
    @@llmtrain {"event": "end", "step": 60, "final_loss": 2.1, "tokens_per_s": 6100.0}

(each a single line). Every other line is ordinary log output. Parsing is forgiving: a line
that starts with the prefix but does not hold a JSON object with a string ``"event"`` key is
treated as an ordinary line, never as an error, so a stray or truncated print cannot crash
the launcher. Pure Python, no torch.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

PREFIX = "@@llmtrain "
MAX_EVENT_CHARS = 64 * 1024


def parse_event(line: str) -> dict[str, Any] | None:
    """Return the event object of an ``@@llmtrain {json}`` line, or ``None`` for any other line."""
    if not line.startswith(PREFIX) or len(line) > MAX_EVENT_CHARS:
        return None
    try:
        obj = json.loads(line[len(PREFIX):])
    except (ValueError, RecursionError):
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("event"), str):
        return None
    return obj


def format_event(event: str, **fields: Any) -> str:
    """The line (without newline) that announces ``event``: what the engine's rank 0 prints.

    Write it with one ``write`` call followed by a flush, e.g.
    ``sys.stdout.write(format_event("step", step=3, ...) + "\\n"); sys.stdout.flush()``.
    """
    return PREFIX + json.dumps({"event": event, **fields}, separators=(",", ":"))


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def _count(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return int(value)


@dataclass
class RunStats:
    """What the events said so far: drives the progress bar and the final summary."""

    steps: int | None = None
    world_size: int | None = None
    step: int = 0
    loss: float | None = None
    lr: float | None = None
    tokens_per_s: float | None = None
    mfu: float | None = None
    final_loss: float | None = None
    ended: bool = False
    events: int = 0
    last: dict[str, Any] = field(default_factory=dict)

    def update(self, event: dict[str, Any]) -> None:
        """Fold one event in; unknown events and missing or mistyped fields are ignored."""
        self.events += 1
        self.last = event
        kind = event.get("event")
        steps = _count(event.get("steps"))
        if steps is not None and steps > 0:
            self.steps = steps
        if kind == "start":
            world = _count(event.get("world_size"))
            self.world_size = world if world is not None else self.world_size
        step = _count(event.get("step"))
        if kind in ("step", "end") and step is not None:
            self.step = max(0, step)
        if kind == "step":
            for name in ("loss", "lr", "tokens_per_s", "mfu"):
                value = _number(event.get(name))
                if value is not None:
                    setattr(self, name, value)
        elif kind == "end":
            self.ended = True
            final = _number(event.get("final_loss"))
            self.final_loss = final if final is not None else self.loss
            tps = _number(event.get("tokens_per_s"))
            self.tokens_per_s = tps if tps is not None else self.tokens_per_s
