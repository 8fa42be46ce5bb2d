"""``--include`` / ``--exclude``: pick hosts and GPU slots from a hostfile (DeepSpeed syntax).

Syntax: hosts separated by ``@``, each optionally followed by ``:`` and comma-separated slot
(GPU) indices::

    --include worker-1@worker-2:0,2     all of worker-1, GPUs 0 and 2 of worker-2
    --exclude worker-3                  every host but worker-3
    --exclude worker-1:7                all GPUs of worker-1 but GPU 7

The two are mutually exclusive (as in DeepSpeed). The result keeps the hostfile's order, so
rank placement still follows it. A host reduced to a subset of its slots gets
``CUDA_VISIBLE_DEVICES`` set to those indices on that node (torchrun's local rank *k* then
uses the *k*-th listed GPU). Unknown hosts, out-of-range slots and a selection that leaves
nothing are errors naming the flag.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from llmtrain.errors import LLMTrainError, Problem
from llmtrain.launch.hostfile import HOST_RE, Hostfile

SLOTS_RE = re.compile(r"^\d{1,4}(,\d{1,4})*$")


@dataclass(frozen=True)
class Selection:
    """The filtered hostfile and, per host that lost some slots, the GPU indices it keeps."""

    hostfile: Hostfile
    visible_devices: dict[str, tuple[int, ...]]


def parse_filter(text: str, flag: str) -> dict[str, tuple[int, ...] | None]:
    """``"a@b:0,2"`` -> ``{"a": None, "b": (0, 2)}`` (None = all slots)."""
    out: dict[str, tuple[int, ...] | None] = {}
    problems = []
    for part in text.strip().split("@"):
        host, sep, slots = part.strip().partition(":")
        if not host or not HOST_RE.match(host):
            problems.append(Problem(flag, f"{part[:40]!r} is not a host name", "write host1@host2:0,2"))
            continue
        if host in out:
            problems.append(Problem(flag, f"host {host} named twice", "name each host once"))
            continue
        if sep:
            if not SLOTS_RE.match(slots):
                problems.append(Problem(flag, f"{host}:{slots[:40]} has no valid slot list",
                                        "write the GPU indices as comma-separated numbers, e.g. host:0,2"))
                continue
            indices = tuple(int(s) for s in slots.split(","))
            if len(set(indices)) != len(indices):
                problems.append(Problem(flag, f"{host}:{slots} repeats a slot", "list each GPU index once"))
                continue
            out[host] = tuple(sorted(indices))
        else:
            out[host] = None
    if problems:
        raise LLMTrainError(problems)
    return out


def select_hosts(hostfile: Hostfile, include: str | None = None, exclude: str | None = None) -> Selection:
    """Apply ``--include`` or ``--exclude`` to ``hostfile`` (neither: everything, unchanged)."""
    if include and exclude:
        raise LLMTrainError("--include and --exclude both given", "use one of them (as in DeepSpeed)", path="--include")
    if not include and not exclude:
        return Selection(hostfile, {})
    flag = "--include" if include else "--exclude"
    wanted = parse_filter(include or exclude or "", flag)
    by_name = {h.host: h for h in hostfile.hosts}
    problems = [Problem(flag, f"host {name} is not in {hostfile.source}", f"hosts there: {', '.join(by_name)[:200]}")
                for name in wanted if name not in by_name]
    for name, slots in wanted.items():
        entry = by_name.get(name)
        if entry is not None and slots and slots[-1] >= entry.slots:
            problems.append(Problem(flag, f"{name} has slots 0..{entry.slots - 1}, not {slots[-1]}",
                                    f"use indices below {entry.slots}"))
    if problems:
        raise LLMTrainError(problems)
    kept, visible = [], {}
    for entry in hostfile.hosts:
        if include:
            if entry.host not in wanted:
                continue
            keep = wanted[entry.host] or tuple(range(entry.slots))
        else:
            drop = wanted.get(entry.host, ())
            if entry.host in wanted and drop is None:
                continue
            keep = tuple(i for i in range(entry.slots) if i not in (drop or ()))
        if not keep:
            continue
        if len(keep) != entry.slots:
            visible[entry.host] = keep
            entry = entry.model_copy(update={"slots": len(keep)})
        kept.append(entry)
    if not kept:
        raise LLMTrainError(f"{flag} {include or exclude} leaves no hosts", "keep at least one host", path=flag)
    return Selection(replace(hostfile, hosts=tuple(kept)), visible)
