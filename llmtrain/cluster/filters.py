"""``--include`` / ``--exclude``: pick hosts and GPU slots from a hostfile (DeepSpeed syntax).

Syntax: hosts separated by ``@``, each optionally followed by ``:`` and comma-separated slot
(GPU) indices::

    --include worker-1@worker-2:0,2     all of worker-1, GPUs 0 and 2 of worker-2
    --exclude worker-3                  every host but worker-3
    --exclude worker-1:7                all GPUs of worker-1 but GPU 7

A host named twice is merged, as DeepSpeed's launcher does: ``worker-0:0,1@worker-0:1`` is
GPUs 0 and 1 of worker-0, ``worker-0@worker-0:1`` (or ``worker-0@worker-0``) all of it;
repeated indices collapse (``worker-0:1,1`` is GPU 1). An empty value (``--include ''``) is
an error rather than "no filter". The two are mutually exclusive (as in DeepSpeed). The
result keeps the hostfile's order, so rank placement still follows it. A host reduced to a subset of its slots gets
``CUDA_VISIBLE_DEVICES`` set to those indices on that node (torchrun's local rank *k* then
uses the *k*-th listed GPU). Unknown hosts, out-of-range slots and a selection that leaves
nothing are errors naming the flag.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from llmtrain.errors import LLMTrainError, Problem
from llmtrain.cluster.hostfile import HOST_RE, Hostfile
from llmtrain.safeio import printable

SLOTS_RE = re.compile(r"^\d{1,4}(,\d{1,4})*$")


@dataclass(frozen=True)
class Selection:
    """The filtered hostfile and, per host that lost some slots, the GPU indices it keeps."""

    hostfile: Hostfile
    visible_devices: dict[str, tuple[int, ...]]


def parse_filter(text: str, flag: str) -> dict[str, tuple[int, ...] | None]:
    """``"a@b:0,2"`` -> ``{"a": None, "b": (0, 2)}`` (None = all slots); a host named twice is
    merged (its slot lists united; all slots wins), repeated indices collapse."""
    if not text.strip():
        raise LLMTrainError("no host named (the value is empty)", f"name hosts (host1@host2:0,2), or drop {flag}",
                            path=flag)
    out: dict[str, tuple[int, ...] | None] = {}
    problems = []
    for part in text.strip().split("@"):
        host, sep, slots = part.strip().partition(":")
        if not host or not HOST_RE.match(host):
            problems.append(Problem(flag, f"{printable(part, 40)!r} is not a host name", "write host1@host2:0,2"))
            continue
        indices: tuple[int, ...] | None = None
        if sep:
            if not SLOTS_RE.match(slots):
                problems.append(Problem(flag, f"{host}:{printable(slots, 40)} has no valid slot list",
                                        "write the GPU indices as comma-separated numbers, e.g. host:0,2"))
                continue
            indices = tuple(sorted({int(s) for s in slots.split(",")}))
        if host in out:
            before = out[host]
            indices = None if before is None or indices is None else tuple(sorted(set(before) | set(indices)))
        out[host] = indices
    if problems:
        raise LLMTrainError(problems)
    return out


def select_hosts(hostfile: Hostfile, include: str | None = None, exclude: str | None = None) -> Selection:
    """Apply ``--include`` or ``--exclude`` to ``hostfile`` (neither: everything, unchanged)."""
    if include is not None and exclude is not None:
        raise LLMTrainError("--include and --exclude both given", "use one of them (as in DeepSpeed)", path="--include")
    if include is None and exclude is None:
        return Selection(hostfile, {})
    flag = "--include" if include is not None else "--exclude"
    wanted = parse_filter(include if include is not None else exclude or "", flag)
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
        if include is not None:
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
        raise LLMTrainError(f"{flag} {printable(include or exclude, 80)} leaves no hosts", "keep at least one host",
                            path=flag)
    return Selection(replace(hostfile, hosts=tuple(kept)), visible)
