"""The in-process transport (the embedded default): controller and units are plain objects in this process.

Zero-copy reads: a unit hands the fetching rank its stored read-only copies by reference, and the rank packs them
into a reused buffer (the one copy a ready-to-use tensor needs). Producers and ranks are threads.

Read deadlines (as on Ray, ``read_timeout_s``): a plain ``StorageUnit``'s get waits on nothing but its lock, so a
rank reads it on its own thread with that wait bounded by the deadline; any other unit (a multimodal unit, a
fault-injecting wrapper, a user's) is read on a daemon reader thread and the rank waits for it up to the deadline.
Either way a unit hung in ``get`` raises ``ReadTimeoutError`` (the claim is undone) instead of blocking
``fetch_next`` and ``Prefetcher.close`` for ever. A hung reader thread is abandoned (it is a daemon: it never holds
up the interpreter's exit) and later reads use another one.
"""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Mapping, Sequence

from knittrans.dataplane.client import DataPlaneClient, PrepareConfig, UnitAPI
from knittrans.dataplane.controller import Controller, ControllerConfig, ControllerStats
from knittrans.dataplane.recovery import ControllerJournal
from knittrans.dataplane.storage import StorageUnit, UnitStats
from knittrans.dataplane.types import ReadTimeoutError, TrajectorySchema, UnitChunk

if TYPE_CHECKING:
    from knittrans.admission.base import AdmissionPolicy
    from knittrans.dataplane.faults import FaultPlan


class _DaemonReaders:
    """Runs unit reads on daemon threads, so a rank can stop waiting at its deadline. Hand-written because
    ``concurrent.futures.ThreadPoolExecutor`` joins its workers at interpreter exit: one read hung for ever would
    hang the exit too. An idle reader is reused (a read costs a queue hand-off, not a thread start); a hung one
    never comes back, and the next read starts another."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: list[queue.SimpleQueue] = []

    def submit(self, fn: Callable[[], object]) -> Future:
        fut: Future = Future()
        with self._lock:
            inbox = self._idle.pop() if self._idle else None
        if inbox is None:
            inbox = queue.SimpleQueue()
            threading.Thread(target=self._loop, args=(inbox,), name="knittrans-unit-read", daemon=True).start()
        inbox.put((fn, fut))
        return fut

    def _loop(self, inbox: queue.SimpleQueue) -> None:
        while True:
            fn, fut = inbox.get()
            try:
                fut.set_result(fn())
            except BaseException as e:  # noqa: BLE001 - handed to the waiting rank, which re-raises it
                fut.set_exception(e)
            del fn, fut  # drop the chunk: an idle reader must not keep a share's bytes alive
            with self._lock:
                self._idle.append(inbox)


_READERS = _DaemonReaders()


@dataclass(frozen=True)
class DeadlineGetter:
    """Reads a share's chunks from in-process units (one after another, as without a getter) within
    ``read_timeout_s`` (all units together); past it ``ReadTimeoutError`` names the unit still reading, and the
    client undoes the claim. None: read on the caller's thread, no deadline."""

    units: Mapping[str, UnitAPI]
    read_timeout_s: float | None = 300.0

    def __call__(self, requests: Sequence[tuple[str, tuple[int, ...]]], fields: Sequence[str],
                 unit_args: Mapping[str, tuple] | None = None) -> list[UnitChunk]:
        extra = unit_args or {}
        if self.read_timeout_s is None:
            return [self.units[u].get(ts, fields, *extra.get(u, ())) for u, ts in requests]
        if all(getattr(type(self.units[u]), "BOUNDED_GET", False) for u, _ in requests):
            # Plain units only wait on their lock, which ``lock_timeout`` bounds: read on this thread (a hop to a
            # reader thread costs a GIL hand-off per share, milliseconds when other threads hold the GIL).
            deadline, out = time.monotonic() + self.read_timeout_s, []
            for u, ts in requests:
                try:
                    out.append(self.units[u].get(ts, fields, *extra.get(u, ()), lock_timeout=deadline - time.monotonic()))  # type: ignore[call-arg]
                except ReadTimeoutError:
                    raise ReadTimeoutError(f"unit {u} did not answer a read within {self.read_timeout_s} s (the "
                                           f"claim is undone; retry, or report the unit lost)") from None
            return out
        at: list[str] = []  # the unit being read (named if the deadline passes)

        def read() -> list[UnitChunk]:
            out = []
            for u, ts in requests:
                at.append(u)
                out.append(self.units[u].get(ts, fields, *extra.get(u, ())))
            return out

        fut = _READERS.submit(read)
        try:
            return fut.result(timeout=self.read_timeout_s)
        except FutureTimeout:
            raise ReadTimeoutError(f"unit {at[-1] if at else '?'} did not answer a read within {self.read_timeout_s} "
                                   f"s (the claim is undone; retry, or report the unit lost)") from None


@dataclass
class InProcessDataPlane:
    """A controller and its units in this process; ``client(unit)`` gives a producer or rank its handle."""

    schema: TrajectorySchema
    controller: Controller
    units: dict[str, StorageUnit]
    prepare: PrepareConfig = field(default_factory=PrepareConfig)
    checksums: bool = False
    """Clients checksum every put and verify every fetch (``DataPlaneClient.checksums``)."""
    read_timeout_s: float | None = 300.0
    """Deadline of a rank's reads from units (as ``RayDataPlane.read_timeout_s``): a unit hung in ``get`` raises
    ``ReadTimeoutError`` (the claim is undone) instead of blocking ``fetch_next`` and ``Prefetcher.close`` for
    ever. None: reads run on the caller's thread without a deadline."""
    journal: ControllerJournal | None = None
    """The controller's journal (``build_inprocess(recoverable=True)``): ``restart_controller`` rebuilds from it."""

    def client(self, local_unit: str | None = None) -> DataPlaneClient:
        return DataPlaneClient(self.controller, self.units, self.schema, local_unit, self.prepare,
                               getter=DeadlineGetter(self.units, self.read_timeout_s), checksums=self.checksums)

    def wait_drained(self, timeout: float | None = None) -> int:
        """Drops happen inside the ack that releases a mini-batch on this transport (synchronously, in the thread
        that applies it: the caller's, or a client's ack sender with ``ack_delay_s``; ``Handoff.wait_drained``
        flushes its consumers' acks first): nothing is ever pending here."""
        return 0

    def unit_stats(self) -> list[UnitStats]:
        return [u.stats() for u in self.units.values()]

    def controller_stats(self) -> ControllerStats:
        return self.controller.stats()

    def close(self) -> None:
        self.controller.close()

    def restart_controller(self) -> int:
        """Simulate a controller crash and restart (what a Ray controller actor goes through, in process): the
        controller drops all its volatile state and is rebuilt from its journal and the live units' manifests;
        clients keep their handle and go on. Returns the number of restarts so far."""
        from knittrans.dataplane.types import UnitLostError

        if self.journal is None:
            raise RuntimeError("restart_controller needs build_inprocess(..., recoverable=True)")
        manifests = {}
        for u, unit in self.units.items():
            try:
                manifests[u] = unit.manifest()
            except UnitLostError:
                continue  # a lost unit: its unreleased trajectories become missing
        state = self.journal.attach()
        assert state is not None
        for u, ts in self.controller.restore(state, manifests).items():
            self.units[u].drop(ts)
        return state.restarts


def build_inprocess(schema: TrajectorySchema, unit_nodes: Mapping[str, str], rank_nodes: tuple[str, ...],
                    balance_slack: float = 0.05, equal_counts: bool = True,
                    prepare: PrepareConfig | None = None, checksums: bool = False,
                    faults: "FaultPlan | None" = None, policy: "AdmissionPolicy | None" = None,
                    read_timeout_s: float | None = 300.0, recoverable: bool = False,
                    records_window: int | None = None) -> InProcessDataPlane:
    """One unit per ``unit_nodes`` entry (unit id -> node), ``len(rank_nodes)`` trainer ranks. ``faults``
    (``knittrans.dataplane.faults.FaultPlan``) wraps the units it names in a ``FaultyUnit``; None: no wrapper.
    ``read_timeout_s``: ``InProcessDataPlane.read_timeout_s``; ``recoverable``: the controller keeps a journal
    (``knittrans.dataplane.recovery``) so ``restart_controller`` can rebuild it; ``records_window``:
    ``ControllerConfig.records_window``."""
    journal = ControllerJournal() if recoverable else None
    if journal is not None:
        journal.attach()  # the first controller: nothing to recover
    ctrl = Controller(schema, unit_nodes, ControllerConfig(tuple(rank_nodes), balance_slack, equal_counts,
                                                           records_window), policy, journal)
    units = {u: StorageUnit(u, n, schema) for u, n in unit_nodes.items()}
    if faults:
        from knittrans.dataplane.faults import FaultyUnit

        units = {u: FaultyUnit(unit, faults.for_unit(u)) if faults.for_unit(u) else unit for u, unit in units.items()}
    return InProcessDataPlane(schema, ctrl, units, prepare or PrepareConfig(), checksums, read_timeout_s, journal)
