"""Transfer traces: what crossed between nodes (a ``FlowEvent``) and the CPU work around it (a ``CpuEvent``), as
recorded by a running system for ``knittrans.sim.cluster_model``.

Off by default: nothing is recorded unless a process opened a ``recording()`` (the bench's rank actors do, when a
multi-node run asks for a trace). Times are ``time.perf_counter()`` (CLOCK_MONOTONIC: one clock for every process
of a machine, so the driver's t0 and a rank actor's read times compare directly). A flow is a pull of one object
from the node that holds it to the node that reads it: ``t_start`` when the object existed at its source (its
bytes serialized there), ``t_end`` when it was local at ``dst``. ``src`` / ``dst`` are node names (Ray node ids on
a cluster); a recorder that knows only a storage unit's id records the unit id and the reader maps it.

    >>> with recording() as rec:
    ...     record(CpuEvent("pack", "n0", 1.0, 1.5))
    ...     got = rec.drain()
    >>> [e.label for e in got], active() is None
    (['pack'], True)
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from dataclasses import dataclass, field
from typing import Iterator, Union

import numpy as np


@dataclass(frozen=True)
class FlowEvent:
    """One object pulled from ``src`` to ``dst``: ``nbytes`` of payload between ``t_start`` and ``t_end``."""

    label: str
    src: str
    dst: str
    nbytes: int
    t_start: float
    t_end: float
    key: str = ""
    """What the flow belongs to (e.g. ``"r0/k1"``: rank 0's share of mini-batch 1), for the model's graph."""


@dataclass(frozen=True)
class CpuEvent:
    """CPU work (claim, serialization at the source, deserialization and packing, a driver's build) on ``node``."""

    label: str
    node: str
    t_start: float
    t_end: float
    key: str = ""


TraceEvent = Union[FlowEvent, CpuEvent]


@dataclass
class Recorder:
    """A thread-safe list of events (a rank's prefetch thread records while its trainer thread runs)."""

    events: list[TraceEvent] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, event: TraceEvent) -> None:
        with self._lock:
            self.events.append(event)

    def drain(self) -> list[TraceEvent]:
        with self._lock:
            out, self.events = self.events, []
        return out


_ACTIVE: Recorder | None = None


def active() -> Recorder | None:
    """This process's open recorder, or None (then nothing is recorded)."""
    return _ACTIVE


def record(event: TraceEvent) -> None:
    rec = _ACTIVE
    if rec is not None:
        rec.add(event)


def start() -> Recorder:
    """Open this process's recorder (idempotent: an open one is kept)."""
    global _ACTIVE
    if _ACTIVE is None:
        _ACTIVE = Recorder()
    return _ACTIVE


def stop() -> list[TraceEvent]:
    """Close the recorder; returns what it held."""
    global _ACTIVE
    rec, _ACTIVE = _ACTIVE, None
    return rec.drain() if rec is not None else []


@contextlib.contextmanager
def recording() -> Iterator[Recorder]:
    rec = start()
    try:
        yield rec
    finally:
        stop()


_LOCAL = threading.local()


@contextlib.contextmanager
def keyed(key: str) -> Iterator[None]:
    """Events recorded by this thread inside the block carry ``key`` (a client names the share it reads)."""
    prev = getattr(_LOCAL, "key", "")
    _LOCAL.key = key
    try:
        yield
    finally:
        _LOCAL.key = prev


def current_key() -> str:
    return getattr(_LOCAL, "key", "")


def payload_nbytes(obj: object) -> int:
    """Array bytes inside ``obj`` (dataclasses, tuples, lists, dicts of numpy arrays or tensors, at any depth):
    what a pull of it moves, up to pickle's few bytes of framing."""
    if isinstance(obj, np.ndarray):
        return int(obj.nbytes)
    if hasattr(obj, "element_size") and hasattr(obj, "numel"):  # a torch tensor, without importing torch
        return int(obj.element_size() * obj.numel())
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return sum(payload_nbytes(getattr(obj, f.name)) for f in dataclasses.fields(obj))
    if isinstance(obj, (tuple, list)):
        return sum(payload_nbytes(x) for x in obj)
    if isinstance(obj, dict):
        return sum(payload_nbytes(x) for x in obj.values())
    return 0
