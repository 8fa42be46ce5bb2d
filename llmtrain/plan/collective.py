"""One priced collective (:class:`Comm`) and how one is made (:func:`make`): the record every
per-dimension volume in plan/comm.py and plan/comm_tp.py produces and plan/steptime.py and
plan/commtime.py price. Its own module so that both volume modules can build them (comm.py
re-exports both names)."""

from __future__ import annotations

from dataclasses import dataclass, field

from llmtrain.plan.links import Link, collective_time


@dataclass
class Comm:
    """One kind of collective of one dimension, per step, as seen by one rank."""

    dim: str
    op: str
    group: int  # ranks in the collective
    message_bytes: float  # one collective's (unsharded) message
    count: float  # collectives per step
    link: str
    seconds: float  # all of them, if nothing overlapped
    phase: str  # "step" (once per step), "microbatch" (per micro batch, on the critical path), "pipeline"
    exposed_s: float = 0.0  # filled by the step-time model
    note: str = ""
    per_item_s: float = field(default=0.0, repr=False)
    bucket_bytes: float = 0.0  # phase "step-overlap": the bucket size (the last one is exposed)
    ready: tuple = ()  # phase "step-overlap": per chunk (lead, hooked), plan/schedule.py gradient_ready
    exposed_share: float = 1.0  # phase "cp-ring": share on the critical path (plan/ringtime.py)
    units: int = 1  # separate collectives one message is issued as (FSDP units, DP buckets): v2 prices each one's latency
    after_step: bool = False  # ZeRO-1's updated parameters: after the optimizer step, not the rank's backward

    def to_dict(self) -> dict:
        return {"dim": self.dim, "op": self.op, "group": self.group, "message_bytes": self.message_bytes,
                "count": self.count, "bytes_per_step": self.message_bytes * self.count, "link": self.link,
                "seconds": self.seconds, "exposed_s": self.exposed_s, "note": self.note}


def make(dim: str, op: str, group: int, message: float, count: float, lk: Link, phase: str, note: str = "") -> Comm:
    one = collective_time(op, message, group, lk)
    return Comm(dim, op, group, message, count, lk.kind, one * count, phase, note=note, per_item_s=one)
