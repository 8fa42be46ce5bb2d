"""A run's summary lines: torchrun's failure report, the failing ranks, the Ctrl-C line.

Shared by the local and the SSH launcher (and the SSH node helper, which reads torchrun's
report on its node). Pure Python, no torch.
"""

from __future__ import annotations

import json
import re
import signal
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

from llmtrain.launch.events import RunStats

FAILURE_FIELD_RE = re.compile(r"^\s{2}(rank|exitcode|error_file)\s*:\s*(-?\d+|\S+)")


@dataclass(frozen=True)
class Failure:
    """One failed worker from torchrun's ``ChildFailedError`` report."""

    rank: int
    exitcode: str
    error_file: str | None = None  # written by a worker whose main is wrapped in torch's @record


def parse_failures(lines: Iterable[str]) -> list[Failure]:
    """The failed workers in torchrun's failure report (``Failures:``, ``Root Cause``), root cause first."""
    root: list[Failure] = []
    others: list[Failure] = []
    section: list[Failure] | None = None
    entry: dict[str, str] | None = None

    def close() -> None:
        if section is None or not entry or not entry.get("rank", "").isdigit():
            return
        rank, error_file = int(entry["rank"]), entry.get("error_file")
        if all(f.rank != rank for f in root + others):
            section.append(Failure(rank, entry.get("exitcode", "?"), None if error_file == "<N/A>" else error_file))

    for line in lines:
        if line.startswith(("Failures:", "Root Cause", "====")):
            close()
            section = others if line.startswith("Failures:") else root if line.startswith("Root Cause") else None
            entry = None
        elif section is not None and re.match(r"^\[\d+\]:\s*$", line):
            close()
            entry = {}
        elif entry is not None and (m := FAILURE_FIELD_RE.match(line)):
            entry.setdefault(m.group(1), m.group(2))
    close()
    return root + others


def error_file_message(path: str | None) -> str | None:
    """First line of the message in a torchelastic error file (``{"message": {"message": ...}}``)."""
    if not path:
        return None
    try:
        with open(path, encoding="utf-8", errors="replace") as fp:
            data = json.load(fp)
        message = data["message"]
        message = message["message"] if isinstance(message, dict) else message
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return str(message).strip().splitlines()[0][:500] if str(message).strip() else None


def signal_name(exitcode: str) -> str:
    """"-15" -> "SIGTERM" (torchrun reports a worker killed by a signal as a negative exit code)."""
    try:
        number = -int(exitcode)
    except ValueError:
        return ""
    if number <= 0:
        return ""
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def stats_summary(stats: RunStats) -> str:
    """``steps 12/12, final loss 1.2345, 5,400 tokens/s``: the summary's progress line."""
    steps = f"{stats.step}/{stats.steps}" if stats.steps else str(stats.step)
    loss = stats.final_loss if stats.final_loss is not None else stats.loss
    parts = [f"steps {steps}"]
    if loss is not None:
        parts.append(f"{'final ' if stats.ended else 'last '}loss {loss:.4f}")
    if stats.tokens_per_s is not None:
        parts.append(f"{stats.tokens_per_s:,.0f} tokens/s")
    return ", ".join(parts)


def interrupted_line(signame: str, code: int, ranks: int, nodes: int, processes: int | None, stats: RunStats,
                     logs: Path, hidden: int) -> str:
    """The one line a Ctrl-C'd launch ends with (after the launcher's own "stopping" line)."""
    where = f" on {nodes} nodes" if nodes > 1 else ""
    procs = f" ({processes} processes)" if processes else ""
    quiet = f"; {hidden} lines of output after the signal are only in {logs}" if hidden else f"; logs: {logs}"
    return (f"== run stopped by {signame}: exit code {code}; interrupted: stopped {ranks} ranks{where}{procs}; "
            f"{stats_summary(stats)}{quiet}")


def failure_lines(failures: list[Failure], rank_tails: dict[int, deque[str]], rank_log: Callable[[int], Path],
                  error_message: Callable[[Failure], str | None], host: str | None = None) -> list[str]:
    """Summary lines for torchrun's failed workers: the root cause with its last log lines and
    error-file message, then the ranks that were only stopped (by a signal) because of it."""
    out = []
    where = f" on {host}" if host else ""
    for n, failure in enumerate(failures):
        signame = signal_name(failure.exitcode)
        if n > 0 and signame:
            out.append(f"   rank {failure.rank}{where} was stopped by {signame} after the failure")
            continue
        out.append(f"   rank {failure.rank}{where} failed (exit code {failure.exitcode}{', ' + signame if signame else ''}); "
                   f"last lines of {rank_log(failure.rank)}:")
        out += [f"     | {line}" for line in list(rank_tails.get(failure.rank, []))[-10:]]
        message = error_message(failure)
        if message:
            out.append(f"     error: {message}")
    return out
