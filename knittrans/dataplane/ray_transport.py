"""The Ray transport: storage units and the controller as Ray actors, behind the same client API.

Why Ray: producers and trainer ranks are separate processes (and, on a cluster, separate nodes); Ray's object
store moves numpy arrays between them with one copy into shared memory and zero-copy reads on the same node.
A unit actor's ``get`` returns the stored arrays; Ray writes them once into the object store of the unit's node
and the rank maps them (same node) or pulls them node to node (different node) -- never through a driver.

The controller actor is threaded (``max_concurrency``), so a prefetcher blocked in ``next_admitted`` (a
condition-variable wait inside the actor) does not stall claims, puts or admissions from other callers.

Controller restarts: the controller actor is created with ``max_restarts``, pinned to one node, and appends its
journal (``knittrans.dataplane.recovery``) to a file on that node before it answers (``journal_file``). When it
dies, Ray restarts it there (the constructor runs again with its original arguments: a fresh admission policy) and
it rebuilds itself from the journal file and the units' manifests; calls that were in flight are retried by Ray (``max_task_retries``) against the
rebuilt actor, which every controller call tolerates (puts, acks, admissions and batch announcements are
idempotent; a claim whose reply was lost is claimed again by the same rank). Clients never see the restart.

Multi-node: start Ray on the cluster (``ray start --head`` on one node, ``ray start --address=HEAD:6379`` on the
others), call ``ray.init(address="auto")`` in the driver, and name units and ranks by Ray node id
(``ray.nodes()[i]["NodeID"]``): a unit whose node is a live Ray node id is pinned there with
``NodeAffinitySchedulingStrategy``, so its producers' writes and its local ranks' reads stay on that node. Any
other node string is a logical label (one machine, several "nodes"), which is how the tests run.

    >>> # dp = build_ray(TEXT_SCHEMA, {"u0": "n0", "u1": "n1"}, rank_nodes=("n0", "n1"))
    >>> # client = dp.client("u0")  # picklable: pass it (or dp) to producer and trainer actors
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, ClassVar, Mapping, Sequence

import numpy as np
import ray

from knittrans.dataplane import trace
from knittrans.dataplane.columns import PutColumns, payloads_of
from knittrans.dataplane.wire import WireList, array_layout, from_wire, join_arrays, split_arrays, to_wire, unwrap
from knittrans.dataplane.client import DataPlaneClient, PrepareConfig
from knittrans.dataplane.controller import Controller, ControllerConfig, ControllerStats, HandoffRecord
from knittrans.dataplane.heap import freeze_startup_heap
from knittrans.dataplane.buffers import BufferPool
from knittrans.dataplane.journal_file import FileJournal, journal_path
from knittrans.dataplane.recovery import JournalState
from knittrans.dataplane.storage import StorageUnit, UnitStats, packed_chunk, pop_fields
from knittrans.dataplane.types import (AdmittedMiniBatch, ControllerLostError, DataPlaneClosedError, DataPlaneError,
                                       FieldNotProducedError, InlineSource, MiniBatchKey, Polled, PutRecord,
                                       ReadTimeoutError, ResolveStalledError, ShareLocation, ShareRuns,
                                       TrajectoryPayload, TrajectorySchema, UnitChunk, UnitLostError)
from knittrans.types import BatchPlan, MiniBatch

if TYPE_CHECKING:
    from knittrans.admission.base import AdmissionPolicy
    from knittrans.dataplane.faults import FaultPlan


log = logging.getLogger(__name__)

RESOLVE_TIMEOUT_S = 10.0
"""Longest a rank waits for its share's sources to map (one ``ray.get``: well under a millisecond on the units' node,
a pull across nodes at link speed) before it reads the share through its units (``ResolveStalledError``): a safety
net, counted (``DataPlaneClient.resolve_fallbacks``) and logged, for a ``ray.get`` of a live unit's object that never
returns (seen twice in ~40 CI runs before ranks kept what they mapped until its retirement, ``client.SourceCache``;
docs/experiments.md)."""

STORE_MIN_BYTES = 0
"""A put whose arrays reach this many bytes becomes one object-store object the unit owns and keeps, which ranks
read straight from (``RayUnitProxy.put``); 0: every put whose payloads carry arrays (Ray still inlines a small
call's arguments: the unit's ``ray.put`` is its one copy). 100 KiB until issue 25, when smaller puts were copied
into the unit's memory: a multimodal batch's completing put (its advantages, ~25 KB per unit) then sent every share
through its units."""


class StoredObjects:
    """A unit actor's object-store objects: one per put that travelled as an object (``UnitHost.put_stored``),
    owned by the unit and kept while any row of it is stored (the controller and the readers hold their own
    references: Ray frees the object once every holder let go). Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._refs: dict[int, list] = {}  # key -> [ObjectRef, rows still stored]
        self._rows: dict[int, dict[str, int]] = {}  # traj_id -> field -> key of the object it lies in
        self._next = 0

    def add(self, ref: "ray.ObjectRef", rows: Sequence[tuple[int, str]]) -> None:
        """Rows (traj_id, field) newly stored from ``ref``'s arrays."""
        with self._lock:
            key, self._next = self._next, self._next + 1
            for t, name in rows:
                held = self._rows.setdefault(t, {})
                old = held.get(name)
                if old is not None:
                    self._release(old)
                held[name] = key
            if rows:
                self._refs[key] = [ref, len(rows)]

    def _release(self, key: int) -> None:
        entry = self._refs.get(key)
        if entry is not None:
            entry[1] -= 1
            if entry[1] <= 0:
                del self._refs[key]  # the unit's last reference: Ray frees the object once no other holder has it

    def drop(self, traj_ids: Sequence[int], fields: Sequence[str] | None) -> None:
        with self._lock:
            for _, _, key in pop_fields(self._rows, traj_ids, fields):
                self._release(key)

    def clear(self) -> None:
        with self._lock:
            self._refs.clear()
            self._rows.clear()

    @property
    def num_objects(self) -> int:
        return len(self._refs)


def _node_id() -> str:
    return ray.get_runtime_context().get_node_id()


class UnitHost:
    """The body of a storage-unit actor: forwards the unit API to ``self.unit`` (set by ``__init__``). Undecorated
    so that other unit kinds (``knittrans.mmdedup.plane_ray``) can extend it before becoming actors."""

    unit: StorageUnit

    def __init__(self, unit_id: str, node: str, schema: TrajectorySchema, faults: tuple = ()) -> None:
        self.unit = StorageUnit(unit_id, node, schema)
        if faults:  # knittrans.dataplane.faults: only a unit a FaultPlan names carries the wrapper
            from knittrans.dataplane.faults import FaultyUnit

            self.unit = FaultyUnit(self.unit, faults)
        self._direct = not faults  # a fault-injecting unit's rows are read through its get (where its faults fire)
        freeze_startup_heap()

    STORED_PUTS: ClassVar[bool] = True
    """Keep a put's object-store arrays as the stored rows (no copy; ``put_stored``). A unit kind whose ``put``
    takes no ``copy`` argument sets it False: it copies the rows, and the object is freed after the put."""

    def put(self, payloads: Sequence[TrajectoryPayload] | WireList) -> WireList:
        """``StorageUnit.put`` of a small put, copied into this unit's memory: its rows are read through the unit
        (``get``), so the records name no source (the unit's arrays never travel to the controller). Payloads and
        records travel in their compact wire form (``wire``)."""
        return WireList([dataclasses.replace(r, source=None, where=()) if r.source is not None else r
                         for r in self.unit.put(unwrap(payloads))])

    def put_stored(self, wire: tuple, arrays: tuple[np.ndarray, ...]) -> WireList:
        """A large put: its arrays (``arrays``, a few contiguous ones, one per field: ``wire.split_arrays``) and the
        rest (``wire``). The unit's stored copy is one object-store object of its own (``ray.put``: owned by this
        actor, so it outlives the producer; the same one copy per byte as ``StorageUnit``'s copy on put), and the
        rows it stores are that object's read-only views. Each record names the object (``PutRecord.source``) and
        where its fields lie in it (``where``), so that the controller can hand a rank its share as runs of the
        object: the rank reads them with one ``ray.get``, no call to this unit. The unit keeps the object while any
        of its rows is stored."""
        if not self.STORED_PUTS:
            return self.put(from_wire(join_arrays(wire, arrays)))
        ref = ray.put(tuple(arrays))
        stored = ray.get(ref)
        return self._stored_records(from_wire(join_arrays(wire, stored)), ref, stored, array_layout(wire, "tensors"))

    COLUMNS_FALLBACK: ClassVar[bool] = True
    """A columnar put the unit does not take is stored here payload by payload (``put_columns``). False: answered
    None, and the client puts its payloads themselves (a unit kind whose payloads are more than their columns)."""

    def put_columns(self, cols: PutColumns, arrays: tuple[np.ndarray, ...]) -> "ray.ObjectRef | WireList | None":
        """A columnar put (``columns``): its arrays become one object of this unit's, as ``put_stored``'s, and in
        the plain case (``StorageUnit.put_columns``) the unit answers with that object alone: the producer registers
        the columns it already has (``Controller.register_columns``). Any other case -- a column check that fails, a
        field held already, a fault-injecting unit -- is stored payload by payload and answered with records, as
        ``put_stored`` answers (or None where ``COLUMNS_FALLBACK`` is off)."""
        if not self.STORED_PUTS:
            return self.put(payloads_of(cols, arrays))
        ref = ray.put(tuple(arrays))
        stored = ray.get(ref)
        fast = getattr(self.unit, "put_columns", None) if self._direct else None
        if fast is not None and fast(cols, stored) is not None:
            self._objects().add(ref, [(t, n) for t in cols.traj_ids.tolist() for n in cols.names])
            return ref
        if not self.COLUMNS_FALLBACK:
            return None
        layout = (cols.names, 0, tuple(cols.offsets(j) for j in range(len(cols.names))))
        return self._stored_records(payloads_of(cols, stored), ref, stored, layout)

    def _stored_records(self, payloads: list[TrajectoryPayload], ref: "ray.ObjectRef", stored: tuple,
                        layout: tuple | None) -> WireList:
        """Store ``payloads`` (views of this unit's object ``ref``, whose arrays are ``stored``; ``layout``: where
        each payload's fields lie in them, ``wire.array_layout``) and answer with their records, each naming the
        object and its rows' byte ranges."""
        records = self._put_views(payloads)
        rows, out = [], []
        col = {} if layout is None else {k: layout[1] + j for j, k in enumerate(layout[0])}
        for i, (p, r) in enumerate(zip(payloads, records)):
            where = []
            for fm in r.fields:
                c = col.get(fm.name)
                view = p.tensors.get(fm.name)
                if c is None or view is None or fm.name in r.repeated or view.flags.writeable:
                    where.append(None)  # not a stored view of the object (a repeat, or written by the unit)
                    continue
                step = stored[c].strides[0] if stored[c].ndim else stored[c].itemsize
                j = c - layout[1]
                where.append((c, int(layout[2][j][i]) * step, int(layout[2][j][i + 1]) * step))
                rows.append((p.traj_id, fm.name))
            located = self._direct and any(w is not None for w in where)
            out.append(dataclasses.replace(r, source=ref, where=tuple(where)) if located else r)
        self._objects().add(ref, rows)
        return WireList(out)

    def _put_views(self, payloads: list[TrajectoryPayload]) -> list[PutRecord]:
        """Store payloads whose arrays are read-only views of this unit's object (``put_stored``)."""
        return self.unit.put(payloads, copy=False)

    def _objects(self) -> StoredObjects:
        if not hasattr(self, "_stored"):
            self._stored = StoredObjects()
        return self._stored

    def get(self, traj_ids: Sequence[int], fields: Sequence[str]) -> UnitChunk:
        """The unit's rows packed into one of this actor's reused buffers (``storage.packed_chunk``): Ray then
        copies a few contiguous arrays into the object store, and the rank maps them without a copy. The read path
        of a share whose rows have no direct source (a small put, a multimodal or fault-injecting unit, a
        trajectory restored after a controller restart)."""
        self._gets = getattr(self, "_gets", 0) + 1  # a racy count under concurrent reads only loses a count
        return self._packed(self._rows(lambda: self.unit.get(traj_ids, fields)))

    COPY_WAIT_S: ClassVar[float] = 5.0
    """How long a read through this unit waits for a field it does not hold yet before it raises
    ``FieldNotProducedError``: a small completing put is registered with its bytes and its copy here written after
    the ranks are answered (``ControllerHost.register_inline``), so a rank reading through its units (its own
    ``direct_reads=False``, a stalled resolve's fallback) can ask before the copy lands."""

    def _rows(self, read: "Callable[[], UnitChunk]") -> UnitChunk:
        delay, deadline = 0.001, None
        while True:
            try:
                return read()
            except FieldNotProducedError:
                now = time.monotonic()
                deadline = deadline if deadline is not None else now + self.COPY_WAIT_S
                if now >= deadline:
                    raise
                time.sleep(delay)
                delay = min(2 * delay, 0.05)

    def get_count(self) -> int:
        """Reads this unit answered (``get``): none for shares read straight from the unit's objects."""
        return getattr(self, "_gets", 0)

    def _packed(self, chunk: UnitChunk) -> UnitChunk:
        if not hasattr(self, "_pool"):
            self._pool = BufferPool(max_buffers=8)  # one per concurrent get (the actor's max_concurrency)
        return packed_chunk(chunk, self._pool)

    def drop(self, traj_ids: Sequence[int], fields: Sequence[str] | None = None, *after: object) -> int:
        """Drop rows (all their fields, or ``fields``). ``after``: the replies of writes this drop must follow
        (``ControllerHost.register_inline``: Ray runs the call once they are done, so a copy written late is never
        left behind by the drop that was meant for it)."""
        freed = self.unit.drop(traj_ids, fields)
        self._objects().drop(traj_ids, fields)
        return freed

    def store_columns(self, cols: PutColumns, arrays: tuple[np.ndarray, ...]) -> BaseException | None:
        """The unit's copy of a put the controller registered with its bytes (``ControllerHost.register_inline``): a
        small put, kept in this unit's memory as ``put`` keeps one (no object: ranks read the controller's copy, and
        after a controller restart every field is read through its unit anyway), as columns, or payload by payload
        where this unit does not take them (a fault-injecting unit; a repeat of what it holds: idempotent). Never
        raises -- the controller's drops wait on this reply, and a failed write must not fail them -- but answers
        the error, which the controller raises to the producer."""
        try:
            arrays = tuple(np.array(a) for a in arrays)  # this unit's own bytes, not views of the call's message
            fast = getattr(self.unit, "put_columns", None) if self._direct else None
            if fast is None or fast(cols, arrays) is None:
                self.unit.put(payloads_of(cols, arrays))
            return None
        except Exception as e:  # noqa: BLE001 - answered, raised by the controller to the producer
            return e

    def stats(self) -> UnitStats:
        return self.unit.stats()

    def num_objects(self) -> int:
        """Object-store objects this unit still keeps (0 once every stored row was dropped)."""
        return self._objects().num_objects

    def manifest(self) -> list[PutRecord]:
        """What the unit holds (``StorageUnit.manifest``): read by a restarted controller."""
        return self.unit.manifest()

    def lose(self) -> int:
        """Fault injection: the unit dies now (needs a ``FaultPlan`` naming it)."""
        freed = self.unit.lose()
        self._objects().clear()
        return freed

    def restart(self) -> None:
        self.unit.restart()


# A StorageUnit in its own process (threaded: several ranks read at once).
StorageUnitActor = ray.remote(num_cpus=0, max_concurrency=8)(UnitHost)

def _resolve(actor: "ray.actor.ActorHandle | str") -> "ray.actor.ActorHandle":
    """An actor handle, or the name of a named one. A restartable actor takes the actors it talks to by name: Ray
    treats an actor handle among constructor arguments as an object-store argument, which a restart may fail to
    find (ray-project/ray#53727)."""
    return ray.get_actor(actor) if isinstance(actor, str) else actor


def _flushing(method):  # noqa: ANN001, ANN202
    """A ``ControllerActor`` method that flushes the journal before it answers (also when it raises: a call may
    change state before it fails)."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        try:
            return method(self, *args, **kwargs)
        finally:
            self._flush_and_show()

    return wrapper


class ControllerHost:
    """The body of ``ControllerActor``: a ``Controller`` in its own process; threaded so blocking waits do not
    serialize other calls. Every public method but ``poll`` (``_UNFLUSHED``) flushes the journal before it answers
    (``FileJournal``). ``plane``: the plane's name, when the controller is restartable: its journal is
    ``journal_path(plane)`` on this node (a restarted actor, on the same node, finds it there)."""

    def __init__(self, schema: TrajectorySchema, unit_nodes: Mapping[str, str], config: ControllerConfig,
                 unit_actors: Mapping[str, "ray.actor.ActorHandle"],
                 controller_cls: type[Controller] = Controller,  # a subclass: knittrans.mmdedup.plane
                 policy: "AdmissionPolicy | None" = None, plane: str | None = None) -> None:
        # unit_actors: handles, or names when the actor is restartable (``_resolve``)
        journal = FileJournal(journal_path(plane)) if plane is not None else None
        extra = {"journal": journal} if journal is not None else {}  # by keyword: subclasses add parameters
        self.ctrl = controller_cls(schema, unit_nodes, config, policy, **extra)
        self.unit_actors = {u: _resolve(a) for u, a in unit_actors.items()}
        self._drops: list[tuple[str, ray.ObjectRef]] = []  # drops sent and not yet confirmed
        self._writes: dict[str, list[list]] = {}  # unit -> slots: replies of copies being written
        self._drops_lock = threading.Lock()
        self._drops_cv = threading.Condition(self._drops_lock)  # a unit's copy sent (``register_inline``)
        self._journal = journal
        if journal is not None:
            state = journal.attach()
            if state is not None:  # Ray restarted this actor: rebuild from the journal and the units
                self._restore(state)
            journal.flush()
            # an admission is shown to the polls once the journal holds it: written by the admitting call itself
            self.ctrl.show_durable_only(journal.flush)
        freeze_startup_heap()

    def _flush_and_show(self) -> None:
        """Journal what the calls so far decided, then show their admissions: the waiters may answer now."""
        if self._journal is not None:
            admitted = self.ctrl.admitted_count()
            self._journal.flush()
            self.ctrl.show(admitted)

    def _restore(self, state: JournalState) -> None:
        refs = {u: a.manifest.remote() for u, a in self.unit_actors.items()}
        manifests = {}
        for u, ref in refs.items():
            try:
                manifests[u] = ray.get(ref, timeout=60)
            except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError, ray.exceptions.GetTimeoutError):
                continue  # a dead, lost or hung unit: its unreleased trajectories become missing (re-put)
        for unit_id, ts in self.ctrl.restore(state, manifests).items():  # released before the restart: drop now
            self._drops.append((unit_id, self.unit_actors[unit_id].drop.remote(tuple(ts))))

    def register(self, records: Sequence[PutRecord] | WireList) -> tuple[int, ...]:
        return self.ctrl.register(unwrap(records))

    def register_columns(self, unit_id: str, cols: PutColumns, source: list) -> tuple[int, ...]:
        return self.ctrl.register_columns(unit_id, cols, source[0])  # [ref]: see RayControllerProxy.register_columns

    def register_inline(self, unit_id: str, cols: PutColumns, arrays: tuple[np.ndarray, ...]) -> bool:
        """A small put (``INLINE_PUT_BYTES``) registered with its bytes, before its unit holds it: the controller
        registers it (``Controller.register_columns_inline``: the plain case of a later put only; else False and
        nothing changes), journals what that decided and shows its admissions, so the ranks' polls are answered with
        the bytes themselves (``types.InlineSource``); then it writes the unit's copy (``UnitHost.store_columns``)
        and answers once that copy exists. So the producer -> unit -> producer hops leave the path from a
        completing put to the ranks, and what a producer is told is stored is still in its unit: a controller that
        dies before answering is restarted and this call retried (``max_task_retries``), which writes again (a
        repeat: no-op). Drops sent while the copy is written wait for it (``_writes``). The unit lost: reported
        (``lose_unit``) and raised, as a producer's failed put."""
        if unit_id not in self.unit_actors:
            return False
        slot: list = [None]  # the unit's copy's reply, once sent: drops to this unit wait for it (``_apply_acks``)
        with self._drops_cv:
            self._writes.setdefault(unit_id, []).append(slot)
        try:
            if not self.ctrl.register_columns_inline(unit_id, cols, InlineSource(arrays)):
                return False
            self._flush_and_show()  # the admissions it made are written and shown before the unit's copy
            write = self.unit_actors[unit_id].store_columns.remote(cols, arrays)
            with self._drops_cv:
                slot[0] = write
                self._drops_cv.notify_all()
            try:
                err = _call(write, unit_id)
            except UnitLostError:
                self.ctrl.lose_unit(unit_id)
                raise
        finally:
            with self._drops_cv:
                self._writes[unit_id].remove(slot)
                self._drops_cv.notify_all()
        if err is not None:  # not stored: a put the unit refused raises to its producer, as a put does
            raise err
        return True

    def admit(self, mb: MiniBatch) -> AdmittedMiniBatch:
        return self.ctrl.admit(mb)

    def next_admitted(self, seq: int, timeout: float | None = None) -> AdmittedMiniBatch:
        return self.ctrl.next_admitted(seq, timeout)

    def claim(self, key: MiniBatchKey, rank: int, fields: Sequence[str], epoch: int | None = None) -> ShareLocation:
        return self.ctrl.claim(key, rank, fields, epoch)

    def claim_next(self, seq: int, rank: int, fields: Sequence[str], timeout: float | None = None,
                   epoch: int | None = None) -> ShareLocation:
        return self.ctrl.claim_next(seq, rank, fields, timeout, epoch)

    def claim_many(self, seq: int, rank: int, fields: Sequence[str], limit: int, timeout: float | None = None,
                   epoch: int | None = None) -> tuple[ShareLocation, ...]:
        return self.ctrl.claim_many(seq, rank, fields, limit, timeout, epoch)

    def poll(self, seq: int, rank: int, fields: Sequence[str], limit: int, timeout: float | None = None,
             epoch: int | None = None, retired_since: tuple[str, int] | None = None) -> Polled:
        return self.ctrl.poll(seq, rank, fields, limit, timeout, epoch, retired_since)

    def rank_epoch(self, rank: int) -> int:
        return self.ctrl.rank_epoch(rank)

    def ack_many(self, acks: Sequence[tuple[MiniBatchKey, int, tuple[str, ...], int | None]]) -> None:
        """A rank's batched acks (``feed.AckSender``), applied in order as ``ack`` (the first failure raises; the
        acks before it stay applied and their drops are sent), with one journal flush for the whole batch."""
        self._apply_acks(acks)

    def ack(self, key: MiniBatchKey, rank: int, fields: Sequence[str], epoch: int | None = None) -> None:
        """Record the ack and, when it completes the mini-batch, tell the units to drop it (from here, so the
        rank's ack is one fire-and-forget message off its critical path)."""
        self._apply_acks([(key, rank, fields, epoch)])

    def _apply_acks(self, acks: Sequence[tuple[MiniBatchKey, int, tuple[str, ...], int | None]]) -> None:
        """Apply ``acks`` in order; the releases they complete are journaled (one flush for all of them) before any
        unit is told to drop their bytes. The releases and the registration of their drops happen under one lock
        that ``wait_drained`` also takes: a caller that saw the version advance (``wait_version``) and then waits
        for the drops always finds this mini-batch's among them. (Not a public method: the journal flush that
        every public method makes before it answers is made once, by the caller's.)"""
        with self._drops_cv:
            drops: list[tuple[str, tuple[int, ...]]] = []
            try:
                for key, rank, fields, epoch in acks:
                    drops.extend(self.ctrl.ack(key, rank, fields, epoch))
            finally:
                if drops and self._journal is not None:
                    self._journal.flush()  # the releases are journaled before any unit drops their bytes
                for unit_id, ts in drops:  # after the unit's copies still being written (``register_inline``)
                    slots = self._writes.get(unit_id, [])
                    # a copy registered and not sent yet is sent within microseconds (the wait releases the lock)
                    self._drops_cv.wait_for(lambda: all(sl[0] is not None for sl in slots), timeout=60.0)
                    self._drops.append((unit_id, self.unit_actors[unit_id].drop.remote(
                        ts, None, *(sl[0] for sl in slots if sl[0] is not None))))

    def wait_drained(self, timeout: float | None = None) -> int:
        """Block until every drop sent so far is confirmed by its unit (no polling: waits on the drops' own
        replies); returns the bytes they freed. ``TimeoutError`` if they are not all confirmed in time (they stay
        pending for the next call); a unit that died raises ``UnitLostError``."""
        with self._drops_lock:
            pending = list(self._drops)
        refs = [r for _, r in pending]
        ready, not_ready = ray.wait(refs, num_returns=len(refs), timeout=timeout) if refs else ([], [])
        if not_ready:
            raise TimeoutError(f"{len(not_ready)} of {len(refs)} unit drops unconfirmed after {timeout} s")
        freed = 0
        for unit_id, r in pending:
            freed += _call(r, unit_id)
        with self._drops_lock:
            done = {id(r) for r in refs}
            self._drops = [(u, r) for u, r in self._drops if id(r) not in done]
        return freed

    # admission (knittrans.handoff)
    def add_batch(self, plan: BatchPlan) -> None:
        self.ctrl.add_batch(plan)

    def seal(self) -> None:
        self.ctrl.seal()

    def version(self) -> int:
        return self.ctrl.version

    def wait_version(self, version: int, timeout: float | None = None) -> int:
        return self.ctrl.wait_version(version, timeout)

    def records(self) -> list[HandoffRecord]:
        return self.ctrl.records()

    def staleness_counts(self) -> tuple[tuple[int, int], ...]:
        return self.ctrl.staleness_counts()

    def close(self) -> None:
        self.ctrl.close()
        if self._journal is not None:
            self._journal.close()  # nothing will be recovered: the file goes

    def journal_size(self) -> dict[str, int] | None:
        """The journal's entries and file bytes (``FileJournal.size``; None without a journal)."""
        return None if self._journal is None else self._journal.size()

    def stats(self) -> ControllerStats:
        return self.ctrl.stats()

    # faults and recovery (docs/reliability.md)
    def lose_unit(self, unit_id: str) -> tuple[int, ...]:
        return self.ctrl.lose_unit(unit_id)

    def missing(self) -> tuple[int, ...]:
        return self.ctrl.missing()

    def discard(self, traj_ids: Sequence[int]) -> tuple[tuple[str, tuple[int, ...]], ...]:
        return self.ctrl.discard(traj_ids)

    def unreleased(self, traj_ids: Sequence[int]) -> tuple[int, ...]:
        return self.ctrl.unreleased(traj_ids)

    def untracked(self, traj_ids: Sequence[int]) -> tuple[int, ...]:
        return self.ctrl.untracked(traj_ids)

    def unclaim(self, key: MiniBatchKey, rank: int, fields: Sequence[str]) -> None:
        self.ctrl.unclaim(key, rank, fields)

    def recover_rank(self, rank: int) -> int:
        return self.ctrl.recover_rank(rank)

    def wait_released(self, count: int, timeout: float | None = None) -> int:
        return self.ctrl.wait_released(count, timeout)


_UNFLUSHED = frozenset({"poll"})
"""Public methods that answer without the journal flush: a poll writes nothing (claims are not journaled; a restart
returns them to the pool) and answers with admissions already shown, i.e. written (``show_durable_only``). Its
flush only waited for other calls' writes -- and for the controller's lock, to count admissions -- between the
admission reaching the poll and the poll's answer leaving (0.2-4.3 ms per pass, session 41)."""

for _name, _fn in list(vars(ControllerHost).items()):
    if callable(_fn) and not _name.startswith("_") and _name not in _UNFLUSHED:
        setattr(ControllerHost, _name, _flushing(_fn))
del _name, _fn

ControllerActor = ray.remote(num_cpus=0, max_concurrency=64)(ControllerHost)


def _call(ref: "ray.ObjectRef", unit_id: str | None = None, timeout: float | None = None):  # noqa: ANN202
    """``ray.get`` that re-raises a data-plane error raised inside an actor as itself (same class, same
    message), so callers catch ``AlreadyConsumedError`` etc. on every transport alike. A storage unit's actor
    that died (``unit_id`` given) raises ``UnitLostError``; a read past ``timeout`` raises ``ReadTimeoutError``."""
    try:
        return ray.get(ref, timeout=timeout)
    except ray.exceptions.GetTimeoutError:
        raise ReadTimeoutError(f"unit {unit_id or '?'} did not answer a read within {timeout} s (the claim is "
                               f"undone; retry, or report the unit lost)") from None
    except ray.exceptions.RayTaskError as e:
        if isinstance(e.cause, (DataPlaneError, DataPlaneClosedError, TimeoutError)):
            raise e.cause from None
        raise
    except ray.exceptions.RayActorError as e:
        if unit_id is not None:
            raise UnitLostError(unit_id, f"its actor died ({type(e).__name__})") from None
        raise ControllerLostError(f"the data plane's controller actor died ({type(e).__name__}) and was not "
                                  f"restarted (built without a journal, or its restarts are used up): stop and "
                                  f"restart the handoff") from None


@dataclass(frozen=True)
class RayControllerProxy:
    """``ControllerAPI`` over a ``ControllerActor`` handle (picklable: travels to any actor)."""

    actor: "ray.actor.ActorHandle"

    def register(self, records: Sequence[PutRecord]) -> tuple[int, ...]:
        return _call(self.actor.register.remote(WireList(records)))

    def register_columns(self, unit_id: str, cols: PutColumns, source: object = None) -> tuple[int, ...]:
        # the unit's ObjectRef travels in a list: a top-level ref argument would arrive as the object's value
        return _call(self.actor.register_columns.remote(unit_id, cols, [source]))

    def register_inline(self, unit_id: str, cols: PutColumns, arrays: tuple[np.ndarray, ...]) -> bool:
        """``ControllerHost.register_inline``: True once registered and written to the unit; False: not taken."""
        return _call(self.actor.register_inline.remote(unit_id, cols, arrays))

    def admit(self, mb: MiniBatch) -> AdmittedMiniBatch:
        return _call(self.actor.admit.remote(mb))

    def next_admitted(self, seq: int, timeout: float | None = None) -> AdmittedMiniBatch:
        return _call(self.actor.next_admitted.remote(seq, timeout))

    def claim(self, key: MiniBatchKey, rank: int, fields: Sequence[str], epoch: int | None = None) -> ShareLocation:
        return _call(self.actor.claim.remote(key, rank, tuple(fields), epoch))

    def claim_next(self, seq: int, rank: int, fields: Sequence[str], timeout: float | None = None,
                   epoch: int | None = None) -> ShareLocation:
        return _call(self.actor.claim_next.remote(seq, rank, tuple(fields), timeout, epoch))

    def claim_many(self, seq: int, rank: int, fields: Sequence[str], limit: int, timeout: float | None = None,
                   epoch: int | None = None) -> tuple[ShareLocation, ...]:
        return _call(self.actor.claim_many.remote(seq, rank, tuple(fields), limit, timeout, epoch))

    def poll(self, seq: int, rank: int, fields: Sequence[str], limit: int, timeout: float | None = None,
             epoch: int | None = None, retired_since: tuple[str, int] | None = None) -> Polled:
        return _call(self.actor.poll.remote(seq, rank, tuple(fields), limit, timeout, epoch, retired_since))

    def rank_epoch(self, rank: int) -> int:
        return _call(self.actor.rank_epoch.remote(rank))

    def ack_many(self, acks: Sequence[tuple[MiniBatchKey, int, tuple[str, ...], int | None]]
                 ) -> tuple[tuple[str, tuple[int, ...]], ...]:
        _call(self.actor.ack_many.remote(list(acks)))
        return ()  # the controller actor drops released trajectories at their units itself

    def ack(self, key: MiniBatchKey, rank: int, fields: Sequence[str],
            epoch: int | None = None) -> tuple[tuple[str, tuple[int, ...]], ...]:
        # Waited for (one round trip per mini-batch): a fire-and-forget ack that failed (a zombie rank's claim
        # fenced off, a controller restart) would never release the mini-batch and leave producers waiting in
        # wait_released for ever. The controller actor still drops released trajectories at their units itself.
        _call(self.actor.ack.remote(key, rank, tuple(fields), epoch))
        return ()

    def lose_unit(self, unit_id: str) -> tuple[int, ...]:
        return _call(self.actor.lose_unit.remote(unit_id))

    def missing(self) -> tuple[int, ...]:
        return _call(self.actor.missing.remote())

    def discard(self, traj_ids: Sequence[int]) -> tuple[tuple[str, tuple[int, ...]], ...]:
        return _call(self.actor.discard.remote(tuple(traj_ids)))

    def unreleased(self, traj_ids: Sequence[int]) -> tuple[int, ...]:
        return _call(self.actor.unreleased.remote(tuple(traj_ids)))

    def untracked(self, traj_ids: Sequence[int]) -> tuple[int, ...]:
        return _call(self.actor.untracked.remote(tuple(traj_ids)))

    def unclaim(self, key: MiniBatchKey, rank: int, fields: Sequence[str]) -> None:
        _call(self.actor.unclaim.remote(key, rank, tuple(fields)))

    def recover_rank(self, rank: int) -> int:
        return _call(self.actor.recover_rank.remote(rank))

    def wait_released(self, count: int, timeout: float | None = None) -> int:
        return _call(self.actor.wait_released.remote(count, timeout))

    def add_batch(self, plan: BatchPlan) -> None:
        _call(self.actor.add_batch.remote(plan))

    def seal(self) -> None:
        _call(self.actor.seal.remote())

    @property
    def version(self) -> int:
        return _call(self.actor.version.remote())

    def wait_version(self, version: int, timeout: float | None = None) -> int:
        return _call(self.actor.wait_version.remote(version, timeout))

    def records(self) -> list[HandoffRecord]:
        return _call(self.actor.records.remote())

    def staleness_counts(self) -> tuple[tuple[int, int], ...]:
        return _call(self.actor.staleness_counts.remote())

    def stats(self) -> ControllerStats:
        return _call(self.actor.stats.remote())

    def wait_drained(self, timeout: float | None = None) -> int:
        return _call(self.actor.wait_drained.remote(timeout))


@dataclass(frozen=True)
class RayUnitProxy:
    """``UnitAPI`` over a ``StorageUnitActor`` handle."""

    actor: "ray.actor.ActorHandle"
    unit_id: str | None = None  # named in UnitLostError when the actor dies
    read_timeout_s: float | None = 300.0  # a unit hung in get raises ReadTimeoutError instead of blocking a rank

    def put(self, payloads: Sequence[TrajectoryPayload]) -> list[PutRecord]:
        """A put whose payloads carry arrays (>= ``STORE_MIN_BYTES``): the arrays travel as a few contiguous ones
        beside the rest of the call, and the unit keeps them as an object-store object of its own
        (``UnitHost.put_stored``), which ranks read straight from. Any other put is copied into the unit's memory
        (``UnitHost.put``)."""
        rest, arrays = split_arrays(to_wire(payloads))
        if arrays and sum(int(a.nbytes) for a in arrays) >= max(1, STORE_MIN_BYTES):
            return unwrap(_call(self.actor.put_stored.remote(rest, arrays), self.unit_id))
        return unwrap(_call(self.actor.put.remote(WireList(payloads)), self.unit_id))

    def put_columns(self, cols: PutColumns, arrays: tuple[np.ndarray, ...]) -> "ray.ObjectRef | list[PutRecord] | None":
        """A columnar put (``UnitHost.put_columns``): the unit's object (the plain case), the records of the
        same put stored payload by payload, or None (not taken: put the payloads)."""
        got = _call(self.actor.put_columns.remote(cols, arrays), self.unit_id)
        return unwrap(got) if isinstance(got, WireList) else got

    def get(self, traj_ids: Sequence[int], fields: Sequence[str]) -> UnitChunk:
        return _call(self.actor.get.remote(tuple(traj_ids), tuple(fields)), self.unit_id, self.read_timeout_s)

    def drop(self, traj_ids: Sequence[int], fields: Sequence[str] | None = None) -> int:
        # Fire and forget: freeing memory is off the critical path; ordering per actor keeps it after the reads.
        self.actor.drop.remote(tuple(traj_ids), None if fields is None else tuple(fields))
        return 0

    def drop_sync(self, traj_ids: Sequence[int], fields: Sequence[str] | None = None) -> int:
        """``drop``, waited for: a put's rollback and ``discard`` return only once the unit has dropped, so a re-put of
        the same trajectories that follows at once cannot be overtaken by the drop on the threaded unit actor
        (issue 29: 16 of 300 re-put trajectories were registered and then gone). Returns the bytes freed."""
        return _call(self.actor.drop.remote(tuple(traj_ids), None if fields is None else tuple(fields)), self.unit_id)


@dataclass(frozen=True)
class ParallelRayGetter:
    """Reads a share: ``resolve`` maps its sources (the units' objects) with one ``ray.get``; ``__call__`` reads
    a share without direct sources through its units, every unit's read issued before waiting on any."""

    units: Mapping[str, RayUnitProxy]
    read_timeout_s: float | None = 300.0
    """Deadline of one share's reads (all sources or units together); past it ``ReadTimeoutError`` and the claim
    is undone."""

    def resolve(self, runs: ShareRuns) -> list:
        """The arrays of every source of the share: one ``ray.get`` of their object refs (zero-copy on the unit's
        node; from another node Ray's object manager pulls each object once and keeps it in the node's store while
        referenced). A source whose owner -- its unit -- died raises ``UnitLostError`` naming that unit; past the
        deadline ``ReadTimeoutError``."""
        if any(isinstance(h, InlineSource) for h in runs.sources):  # bytes that came with the claim: no get
            objs = [i for i, h in enumerate(runs.sources) if not isinstance(h, InlineSource)]
            out = [getattr(h, "arrays", None) for h in runs.sources]
            if objs:
                got = self.resolve(dataclasses.replace(runs, sources=tuple(runs.sources[i] for i in objs),
                                                       source_units=tuple(runs.source_units[i] for i in objs)))
                for i, arrays in zip(objs, got):
                    out[i] = arrays
            return out
        rec = trace.active()
        refs = list(runs.sources)
        deadline = None if self.read_timeout_s is None else time.monotonic() + self.read_timeout_s
        stalled = time.monotonic() + RESOLVE_TIMEOUT_S
        if rec is not None:  # a multi-node run's trace: the lookup ("source"), one pull per object, the map ("deser")
            pulls, t_local = self._traced_wait(rec, refs, time.perf_counter(), deadline)
        try:
            objects = ray.get(refs, timeout=_left(stalled if deadline is None else min(deadline, stalled)))
        except ray.exceptions.GetTimeoutError:
            if deadline is None or stalled < deadline:
                self._check_alive(runs)  # a dead unit is a loss (``UnitLostError``), not a stall
                raise ResolveStalledError(f"the objects of units {sorted(set(runs.source_units))} did not map within "
                                          f"{RESOLVE_TIMEOUT_S} s") from None
            raise ReadTimeoutError(f"units {sorted(set(runs.source_units))} did not answer a read within "
                                   f"{self.read_timeout_s} s (the claim is undone; retry, or report the unit "
                                   f"lost)") from None
        except (ray.exceptions.ObjectLostError, ray.exceptions.OwnerDiedError, ray.exceptions.RayActorError):
            raise UnitLostError(self._lost_unit(runs), "its stored objects are lost") from None
        if rec is not None:
            dst, key, t_end = ray.get_runtime_context().get_node_id(), trace.current_key(), time.perf_counter()
            rec.add(trace.CpuEvent("deser", dst, t_local, t_end, key))
            for ref, u, arrays, (a, b) in zip(refs, runs.source_units, objects, pulls):
                if ref.binary() not in _TRACED_PULLS:  # a whole object crosses once, then stays in this node's store
                    _TRACED_PULLS.add(ref.binary())
                    rec.add(trace.FlowEvent("read", u, dst, sum(int(x.nbytes) for x in arrays), a, b, key))
        return objects

    def _check_alive(self, runs: ShareRuns) -> None:
        """Raise ``UnitLostError`` if a unit of ``runs`` is dead (its objects are lost with it)."""
        for u in sorted(set(runs.source_units)):
            try:
                ray.get(self.units[u].actor.stats.remote(), timeout=RESOLVE_TIMEOUT_S)
            except ray.exceptions.RayActorError:
                raise UnitLostError(u, "its actor died while its objects did not map") from None
            except ray.exceptions.GetTimeoutError:
                raise ReadTimeoutError(f"unit {u} did not answer while its objects did not map (the claim is undone; "
                                       f"retry, or report the unit lost)") from None

    @staticmethod
    def _lost_unit(runs: ShareRuns) -> str:
        """The unit whose objects are gone (the owner of a lost object is its unit)."""
        for ref, u in zip(runs.sources, runs.source_units):
            try:
                ray.get(ref, timeout=0)
            except ray.exceptions.GetTimeoutError:
                continue
            except Exception:  # noqa: BLE001 - any failure to map a unit's own object means that unit is gone
                return u
        return runs.source_units[0]

    def __call__(self, requests: Sequence[tuple[str, tuple[int, ...]]], fields: Sequence[str],
                 unit_args: Mapping[str, tuple] | None = None) -> list[UnitChunk]:
        extra = unit_args or {}
        t_sub = time.perf_counter()
        refs = [self.units[u].actor.get.remote(ts, tuple(fields), *extra.get(u, ())) for u, ts in requests]
        deadline = None if self.read_timeout_s is None else time.monotonic() + self.read_timeout_s
        rec = trace.active()
        if rec is not None:  # a multi-node run's trace: split each read into source work, the pull, the unpickle
            pulls, t_local = self._traced_wait(rec, refs, t_sub, deadline)
        chunks = [_call(r, u, _left(deadline)) for r, (u, _) in zip(refs, requests)]
        if rec is not None:
            dst, key, t_end = ray.get_runtime_context().get_node_id(), trace.current_key(), time.perf_counter()
            rec.add(trace.CpuEvent("deser", dst, t_local, t_end, key))
            for (u, _), c, (t0, t1) in zip(requests, chunks, pulls):
                rec.add(trace.FlowEvent("read", u, dst, trace.payload_nbytes(c), t0, t1, key))
        return chunks

    @staticmethod
    def _traced_wait(rec: trace.Recorder, refs: list, t_sub: float,
                     deadline: float | None) -> tuple[list[tuple[float, float]], float]:
        """Wait until every unit's answer exists at its unit's node (the claim-free part of the read: request,
        the unit's get, serialization into its node's object store: CPU work, recorded as "source"), then until
        every one is local here (one pull per object, concurrent, as an untraced ``ray.get`` pulls them; recorded per
        object by the caller, each ending when the last arrived). Pulls start only after every answer exists (a few
        ms later than untraced reads, the same for every share). One wait for all of them, not one per object: a
        ``ray.wait`` per arrival (until session 35) took a few ms each on a loaded machine, time the traced pass paid
        and no untraced read does, which the model's replay then missed (knittrans-ray predicted 15% short)."""
        ray.wait(refs, num_returns=len(refs), timeout=_left(deadline), fetch_local=False)
        t_created = time.perf_counter()
        rec.add(trace.CpuEvent("source", ray.get_runtime_context().get_node_id(), t_sub, t_created,
                               trace.current_key()))
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=_left(deadline), fetch_local=True)
        now = time.perf_counter()  # past the deadline (not every ref ready): the caller raises ReadTimeoutError
        return [(t_created, now) for _ in refs], now


_TRACED_PULLS: set[bytes] = set()  # objects this process read while tracing (their later reads move no bytes)


def _left(deadline: float | None) -> float | None:
    """Seconds left before ``deadline`` (``time.monotonic``), never negative; None without a deadline."""
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def _node_affinity(node: str):  # noqa: ANN202 - a Ray scheduling strategy, or None for a logical label
    alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
    if node in alive:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        return NodeAffinitySchedulingStrategy(node_id=node, soft=False)
    return None


def controller_options(node: str | None) -> dict:
    """Ray options pinning the controller actor to ``node`` when it is a live Ray node id (else none)."""
    strategy = _node_affinity(node) if node is not None else None
    return {"scheduling_strategy": strategy} if strategy is not None else {}


@dataclass
class RayDataPlane:
    """Handles on the actors of one Ray data plane; picklable, so it can be passed to producer/rank actors."""

    schema: TrajectorySchema
    controller_actor: "ray.actor.ActorHandle"
    unit_actors: dict[str, "ray.actor.ActorHandle"]
    prepare: PrepareConfig = field(default_factory=PrepareConfig)
    checksums: bool = False
    """Clients checksum every put and verify every fetch (``DataPlaneClient.checksums``, docs/reliability.md)."""
    read_timeout_s: float | None = 300.0
    """Deadline of a rank's reads from units: a unit hung in ``get`` raises ``ReadTimeoutError`` (the claim is
    undone) instead of blocking ``fetch_next`` and ``Prefetcher.close`` for ever."""
    restartable: bool = False
    """The controller journals (``journal_file``) and Ray restarts it when it dies (``controller_restarts`` > 0)."""

    def client(self, local_unit: str | None = None) -> DataPlaneClient:
        units = {u: RayUnitProxy(a, u, self.read_timeout_s) for u, a in self.unit_actors.items()}
        return DataPlaneClient(RayControllerProxy(self.controller_actor), units, self.schema, local_unit,
                               self.prepare, getter=ParallelRayGetter(units, self.read_timeout_s),
                               checksums=self.checksums, remote_controller=True)

    def unit_stats(self) -> list[UnitStats]:
        return ray.get([a.stats.remote() for a in self.unit_actors.values()])

    def controller_stats(self) -> ControllerStats:
        return ray.get(self.controller_actor.stats.remote())

    @property
    def controller(self) -> RayControllerProxy:
        """The controller API (``ControllerAPI`` plus admission, versions and records) over its actor."""
        return RayControllerProxy(self.controller_actor)

    def wait_drained(self, timeout: float | None = None) -> int:
        """Block until every unit confirmed the drops of every released mini-batch (see ``ControllerActor``)."""
        return self.controller.wait_drained(timeout)

    def restart_controller(self, timeout: float = 60.0) -> int:
        """Fault injection: kill the controller actor as a crash would (Ray restarts it; it rebuilds itself from
        its journal and the units) and wait until the rebuilt one answers; returns the number of restarts so far.
        ``TimeoutError`` if it is not back within ``timeout`` s."""
        if not self.restartable:
            raise RuntimeError("restart_controller needs a controller built with a journal (controller_restarts > 0)")
        before = self.controller_stats().restarts
        ray.kill(self.controller_actor, no_restart=False)
        deadline = time.monotonic() + timeout
        while (n := self.controller_stats().restarts) <= before:  # a call that reached the old actor before it died
            if time.monotonic() > deadline:
                raise TimeoutError(f"the controller actor was not restarted within {timeout} s")
            time.sleep(0.01)
        return n

    def journal_size(self) -> dict[str, int] | None:
        """The controller's journal: entries held and file bytes (None: not restartable)."""
        return ray.get(self.controller_actor.journal_size.remote())

    def close(self) -> None:
        """Wake waiters (the controller removes its journal file), then end the actors."""
        try:
            ray.get(self.controller_actor.close.remote(), timeout=10)
        finally:
            for a in [self.controller_actor, *self.unit_actors.values()]:
                ray.kill(a)


def check_restarts(who: str, controller_restarts: object) -> None:
    if isinstance(controller_restarts, bool) or not isinstance(controller_restarts, int) or controller_restarts < 0:
        raise ValueError(f"{who}: controller_restarts must be an int >= 0, got {controller_restarts!r}")


def start_actors(schema: TrajectorySchema, unit_nodes: Mapping[str, str], cfg: ControllerConfig,
                 unit_actor, unit_args, controller_cls, policy,  # noqa: ANN001 - actor class, callables, a policy
                 controller_restarts: int, controller_node: str | None):  # noqa: ANN201
    """Start one unit actor per unit (``unit_actor.remote(*unit_args(unit_id, node))``, pinned to its node when
    the node is a Ray node id) and the ``ControllerActor`` running ``controller_cls``, pinned to ``controller_node``
    when it is a live Ray node id. With ``controller_restarts`` the actors are named (a plane-unique prefix: a
    restarted controller finds its units by name, see ``_resolve``), the controller journals to a file
    (``journal_file``) and is restartable -- on the same node: without a ``controller_node`` it is pinned to this
    process's node, where its journal file stays. Returns (controller actor, unit actors, whether it is
    restartable). Shared by ``build_ray`` and ``knittrans.mmdedup.plane_ray``."""
    plane = f"knittrans-{uuid.uuid4().hex[:12]}"
    units, names = {}, {}
    for u, node in unit_nodes.items():
        strategy = _node_affinity(node)
        opts: dict = {"scheduling_strategy": strategy} if strategy is not None else {}
        names[u] = f"{plane}-unit-{u}"
        units[u] = unit_actor.options(name=names[u], **opts).remote(*unit_args(u, node))
    if controller_restarts:
        node = controller_node if controller_options(controller_node) else _node_id()  # restarts stay on one node
        ctrl = ControllerActor.options(max_restarts=controller_restarts, max_task_retries=-1,
                                       **controller_options(node)).remote(
            schema, dict(unit_nodes), cfg, names, controller_cls, policy, plane)
    else:
        ctrl = ControllerActor.options(**controller_options(controller_node)).remote(
            schema, dict(unit_nodes), cfg, units, controller_cls, policy)
    return ctrl, units, bool(controller_restarts)


def build_ray(schema: TrajectorySchema, unit_nodes: Mapping[str, str], rank_nodes: tuple[str, ...],
              balance_slack: float = 0.05, equal_counts: bool = True,
              prepare: PrepareConfig | None = None, checksums: bool = False,
              faults: "FaultPlan | None" = None, policy: "AdmissionPolicy | None" = None,
              read_timeout_s: float | None = 300.0, controller_restarts: int = 8,
              controller_node: str | None = None, records_window: int | None = None) -> RayDataPlane:
    """Start one ``StorageUnitActor`` per unit (pinned to its node when the node is a Ray node id) and one
    ``ControllerActor``. Ray must already be initialized. ``checksums``: every put carries a CRC-32 per field,
    verified by the unit and by the fetching rank; ``faults``: a ``knittrans.dataplane.faults.FaultPlan``;
    ``policy``: an admission policy the controller actor runs (``knittrans.handoff``); ``read_timeout_s``:
    ``RayDataPlane.read_timeout_s``; ``controller_restarts``: how often a dead controller actor is restarted and
    rebuilt from its journal (0: never; it then raises ``ControllerLostError``); ``controller_node``: a Ray node id
    to pin the controller actor to (None, or a label that is no live node id: Ray places it); ``records_window``:
    ``ControllerConfig.records_window``."""
    if not ray.is_initialized():
        raise RuntimeError("build_ray: call ray.init(...) first (see the module docstring for clusters)")
    check_restarts("build_ray", controller_restarts)
    cfg = ControllerConfig(tuple(rank_nodes), balance_slack, equal_counts, records_window)
    ctrl, units, restartable = start_actors(schema, unit_nodes, cfg, StorageUnitActor,
                                            lambda u, node: (u, node, schema, faults.for_unit(u) if faults else ()),
                                            Controller, policy, controller_restarts, controller_node)
    dp = RayDataPlane(schema, ctrl, units, prepare or PrepareConfig(), checksums, read_timeout_s, restartable)
    ray.get([ctrl.stats.remote(), *(a.stats.remote() for a in units.values())])  # wait until all are up
    return dp
