"""Controller recovery: a small journal of what only the controller knows, and the rebuild after a restart.

Why: the controller holds metadata only, but it is the only holder of decisions -- which mini-batches were
admitted and how they were split into shares, which ranks acked them, which were released, each rank's
incarnation. The payloads themselves survive a controller in the storage units, which can re-report what they hold
(``StorageUnit.manifest``: trajectory ids, fields, sizes, checksums, token counts). So a restarted controller is
rebuilt from two sources:

- the **units' manifests**: where every surviving trajectory lives and what it holds;
- the **journal** (``ControllerJournal``, outside the controller: a plain object in process; on Ray a file on the
  controller's node that outlives its process, ``journal_file``): the admission policy's inputs of batches not yet wholly released (batch plans, completed trajectories'
  metadata, in order), every unreleased admitted mini-batch with its shares and acks, released mini-batches and
  trajectory ids (as ranges), rank incarnations, the sealed flag and counters, and the released trajectories'
  handoff records (when the controller keeps them).

The controller writes each entry before it answers the call that made it (write-ahead, under its lock), so what
a client was told survives. What is not journaled is what may be redone: claims (a claim whose reply was lost is
claimed again by the same rank incarnation after the restart: at-least-once delivery, and the trainer's
``StepLedger`` makes the step exactly once) and registrations (the units hold them). The admission policy is
rebuilt by replaying its inputs into a fresh policy; every mini-batch it commits again must match the journal
(``RecoveryError`` otherwise: a policy that is not deterministic cannot be recovered this way), and one it
commits that the journal lacks (the controller died between a completion and its admission) is admitted anew.

Memory: the journal holds what is in flight (unreleased mini-batches, the policy inputs of unfinished batches), the
released ids as ranges, one key per step, and the records if kept -- the same bound as the controller's own state.
The multimodal controller's own state (``MMController``: each trajectory's group and its images' content keys) is
not journaled: the units re-report it with their manifests (``MMStorageUnit.manifest``), the encodings stay in the
units' stores, and which unit ships each distinct image is chosen at every claim from those keys.
Not covered: the journal's own loss (on Ray the controller's node going down, with the driver placed there by
default and the units on it; a controller pinned elsewhere by ``controller_node`` shares its node's fate). A
trajectory never admitted nor completed that sat on a unit lost while the controller was down is unknown to the
rebuilt controller (no unit reports it): ``Controller.untracked`` names it, and a producer that keeps payloads
until release re-puts it (``ProducerBuffer.reput_missing``).
"""

from __future__ import annotations

import threading
import time
from array import array
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Mapping, Sequence

from knittrans.dataplane.idset import IdRanges
from knittrans.dataplane.records import count_staleness, trim_rows
from knittrans.dataplane.wire import from_wire, to_wire
from knittrans.dataplane.types import AdmittedMiniBatch, DataPlaneError, MiniBatchKey, PutRecord
from knittrans.types import BatchPlan, Trajectory

if TYPE_CHECKING:
    from knittrans.dataplane.controller import Controller


class RecoveryError(DataPlaneError):
    """A restarted controller could not rebuild a consistent state (e.g. the replayed admission policy committed
    a mini-batch other than the journaled one); the handoff must be restarted."""


@dataclass(frozen=True)
class BatchEvent:
    """Policy input: ``add_batch(plan)``."""

    plan: BatchPlan


@dataclass(frozen=True)
class CompleteEvent:
    """Policy input: these trajectories completed in one register call (the policy was asked for decisions after
    all of them, so a replay asks at the same points), at time ``t``."""

    metas: tuple[Trajectory, ...]
    t: float

    def __reduce__(self):  # noqa: ANN204 - to the journal actor: the metas as columns (``wire``), not 1 object each
        return (_complete_event, (to_wire(self.metas), self.t))


def _complete_event(metas: tuple, t: float) -> CompleteEvent:
    return CompleteEvent(tuple(from_wire(metas)), t)


@dataclass(frozen=True)
class Released:
    """A mini-batch every rank consumed: its trajectories, their record rows (``records.INT_COLUMNS`` then
    t_complete, t_admit; empty when records are not kept) and the batches it finished (all their trajectories
    released: their policy inputs leave the journal)."""

    key: MiniBatchKey
    traj_ids: tuple[int, ...]
    rows: tuple[tuple, ...] = ()
    done_batches: tuple[int, ...] = ()
    keep: int | None = None
    """How many record rows the journal keeps (the controller's ``records_window``; None: all): the journal's rows
    are bounded as the controller's are, and its staleness histogram counts every row."""


@dataclass(frozen=True)
class JournalState:
    """A snapshot of the journal: everything a restarted controller needs besides the units' manifests."""

    events: tuple[BatchEvent | CompleteEvent, ...]
    admitted: tuple[tuple[AdmittedMiniBatch, float], ...]  # unreleased, in admission order, with t_admit
    acked: Mapping[MiniBatchKey, frozenset[tuple[int, str]]]
    log: tuple[MiniBatchKey, ...]  # every admitted key, in admission order
    released_keys: frozenset[MiniBatchKey]
    released_ranges: tuple[tuple[int, int], ...]
    epochs: Mapping[int, int]
    sealed: bool
    counters: Mapping[str, int]  # planned, completed, discarded, units_lost, skipped
    rows_i: array  # released records, flat: 6 int columns per row (``records.INT_COLUMNS``)
    rows_f: array  # and 2 float columns per row (t_complete, t_admit)
    t0_wall: float  # wall time (time.time) of the first controller's start: times stay on one clock
    restarts: int
    staleness: Mapping[int, int] = field(default_factory=dict)  # staleness -> released trajectories (all of them)
    rows_total: int = 0  # record rows ever released (the journal keeps the last ``Released.keep``)


class ControllerJournal:
    """The durable log (see the module doc). Thread-safe; every method is idempotent for a repeated entry, so a
    controller retrying a write after a lost reply changes nothing twice."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._events: list[BatchEvent | CompleteEvent] = []
        self._admitted: dict[MiniBatchKey, tuple[AdmittedMiniBatch, float]] = {}
        self._acked: dict[MiniBatchKey, set[tuple[int, str]]] = {}
        self._log: list[MiniBatchKey] = []
        self._released_keys: set[MiniBatchKey] = set()
        self._released = IdRanges()
        self._epochs: dict[int, int] = {}
        self._sealed = False
        self._counters: dict[str, int] = {}
        self._rows_i = array("q")  # records in columns as the controller keeps them: 64 B per trajectory
        self._rows_f = array("d")
        self._staleness: dict[int, int] = {}
        self._rows_total = 0
        self._t0_wall = time.time()
        self._attached = False
        self._restarts = 0

    def __getstate__(self) -> dict:  # a snapshot of the journal (``journal_file``): everything but the lock
        state = self.__dict__.copy()
        del state["_lock"]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    # -- written by the controller --------------------------------------------------------------------------

    def batch(self, plan: BatchPlan, planned: int) -> None:
        with self._lock:
            if not any(isinstance(e, BatchEvent) and e.plan.batch_id == plan.batch_id for e in self._events):
                self._events.append(BatchEvent(plan))
            self._counters["planned"] = planned

    def complete(self, event: CompleteEvent, completed: int) -> None:
        with self._lock:
            if not any(isinstance(e, CompleteEvent) and e.metas == event.metas for e in self._events[-4:]):
                self._events.append(event)
            self._counters["completed"] = completed

    def admit(self, adm: AdmittedMiniBatch, t_admit: float) -> None:
        with self._lock:
            if adm.key in self._admitted or adm.key in self._released_keys:
                return
            self._admitted[adm.key] = (adm, t_admit)
            self._acked[adm.key] = set()
            self._log.append(adm.key)

    def ack(self, key: MiniBatchKey, rank: int, fields: Sequence[str], released: Released | None = None) -> None:
        with self._lock:
            if key in self._acked:
                self._acked[key].update((rank, n) for n in fields)
            if released is not None and released.key not in self._released_keys:
                self._admitted.pop(released.key, None)
                self._acked.pop(released.key, None)
                self._released_keys.add(released.key)
                self._released.update(released.traj_ids)
                count_staleness(self._staleness, released.rows)
                self._rows_total += len(released.rows)
                if released.keep != 0:
                    for row in released.rows:
                        self._rows_i.extend(row[:6])
                        self._rows_f.extend(row[6:])
                    trim_rows(self._rows_i, self._rows_f, released.keep)
                if released.done_batches:  # their policy inputs are no longer needed by a replay
                    done = set(released.done_batches)
                    kept: list[BatchEvent | CompleteEvent] = []
                    for e in self._events:
                        if isinstance(e, BatchEvent):
                            if e.plan.batch_id not in done:
                                kept.append(e)
                        elif any(m.batch_id not in done for m in e.metas):
                            kept.append(CompleteEvent(tuple(m for m in e.metas if m.batch_id not in done), e.t))
                    self._events = kept

    def epoch(self, rank: int, epoch: int) -> None:
        with self._lock:
            self._epochs[rank] = max(epoch, self._epochs.get(rank, 0))

    def seal(self) -> None:
        with self._lock:
            self._sealed = True

    def count(self, name: str, value: int) -> None:
        with self._lock:
            self._counters[name] = value

    WRITES = ("batch", "complete", "admit", "ack", "epoch", "seal", "count")
    """The controller's write methods (what ``write`` applies)."""

    def write(self, entries: Sequence[tuple[str, tuple]]) -> None:
        """Apply queued writes in order: ``(method, args)`` pairs, each method one of ``WRITES`` (a Ray controller
        applies and appends what it wrote under its lock in one batch before it answers: ``journal_file.FileJournal``,
        which replays the same batches after a restart)."""
        for name, args in entries:
            if name not in self.WRITES:
                raise ValueError(f"not a journal write: {name!r} (one of {self.WRITES})")
            getattr(self, name)(*args)

    # -- read by a (re)starting controller ------------------------------------------------------------------

    def attach(self) -> JournalState | None:
        """Called by every controller as it starts: None for the first (nothing to recover), the state for a
        restarted one (and the restart is counted)."""
        with self._lock:
            if not self._attached:
                self._attached = True
                return None
            self._restarts += 1
            return JournalState(tuple(self._events), tuple(self._admitted[k] for k in self._log if k in self._admitted),
                                {k: frozenset(v) for k, v in self._acked.items()}, tuple(self._log),
                                frozenset(self._released_keys), tuple(self._released.ranges), dict(self._epochs),
                                self._sealed, dict(self._counters), array("q", self._rows_i), array("d", self._rows_f),
                                self._t0_wall, self._restarts, dict(self._staleness), self._rows_total)

    def t0_wall(self) -> float:
        return self._t0_wall

    def size(self) -> dict[str, int]:
        """Entries held (tests check the journal stays bounded by what is in flight)."""
        with self._lock:
            return {"events": len(self._events), "admitted": len(self._admitted), "log": len(self._log),
                    "released_ranges": len(self._released.ranges), "rows": len(self._rows_f) // 2}


@dataclass
class Rebuilt:
    """What ``rebuild`` hands back: drops the units must make (trajectories released before the restart, or
    duplicates of a trajectory held by another unit), and the trajectories that must be re-put."""

    drops: dict[str, list[int]] = field(default_factory=dict)
    missing: tuple[int, ...] = ()


def rebuild(ctrl: "Controller", state: JournalState, manifests: Mapping[str, Sequence[PutRecord]]) -> Rebuilt:
    """Fill a freshly reset controller (lock held, no state) from the journal and the live units' manifests (a unit
    absent from ``manifests`` is lost). A friend of ``Controller``: it writes the controller's private state, in the
    order the controller's own methods would have."""
    from knittrans.dataplane.controller import _MiniBatchState, _TrajState

    out = Rebuilt()
    c = state.counters
    ctrl._t0 = time.perf_counter() - (time.time() - state.t0_wall)
    ctrl._log = list(state.log)
    ctrl._released_keys = set(state.released_keys)
    ctrl._released = len(state.released_keys)
    ctrl._released_ids = IdRanges.of_ranges(state.released_ranges)
    ctrl._epochs = dict(state.epochs)
    ctrl._sealed = state.sealed
    ctrl._planned, ctrl._completed = c.get("planned", 0), c.get("completed", 0)
    ctrl._discarded, ctrl._units_lost = c.get("discarded", 0), c.get("units_lost", 0)
    ctrl._restarts = state.restarts
    ctrl._records.restore(state.rows_i, state.rows_f, state.rows_total, state.staleness)
    # 1. where every surviving trajectory lives (a released one is dropped; of two copies -- a put whose rollback had
    # not landed yet -- the one with more fields stays, ties by unit id)
    best: dict[int, PutRecord] = {}
    for unit_id in sorted(manifests):
        for r in manifests[unit_id]:
            t = r.traj_id
            if t in ctrl._released_ids:
                out.drops.setdefault(unit_id, []).append(t)
            elif t not in best or len(r.fields) > len(best[t].fields):
                if t in best:
                    out.drops.setdefault(best[t].unit_id, []).append(t)
                best[t] = r
            else:
                out.drops.setdefault(unit_id, []).append(t)
    for t, r in best.items():
        ctrl._trajs[t] = _TrajState(r.unit_id, {fm.name: fm.nbytes for fm in r.fields}, r.num_tokens,
                                    checksums={fm.name: fm.checksum for fm in r.fields if fm.checksum is not None})
    ctrl._registered_locked(tuple(best.values()))  # a subclass's per-trajectory state (MMController: groups, keys)
    # 2. the unreleased admitted mini-batches, as journaled (shares are never re-assigned)
    for adm, t_admit in state.admitted:
        acked = set(state.acked.get(adm.key, ()))
        ctrl._mbs[adm.key] = _MiniBatchState(adm, claimed=set(acked), acked=acked, t_admit=t_admit, restored=True)
        for rank, share in enumerate(adm.shares):
            read = {n for r, n in acked if r == rank}  # fields this rank acked: it holds them whatever happens
            for t in share:
                st = ctrl._trajs.get(t)
                if st is None:  # its unit is gone: missing, unless its rank had consumed it already
                    st = ctrl._trajs[t] = _TrajState(None, {n: 0 for n in read})
                    if not read:
                        ctrl._missing.add(t)
                st.admitted_in = adm.key
    # 3. the admission policy, replayed from its inputs; decisions must match the journal
    if ctrl.policy is not None:
        for ev in state.events:
            if isinstance(ev, BatchEvent):
                ctrl.policy.add_batch(ev.plan)
                ctrl._note_batch_locked(ev.plan)
            else:
                for m in ev.metas:
                    ctrl.policy.on_complete(m)
                    ctrl._arrived[m.group_id] = ctrl._arrived.get(m.group_id, 0) + 1
                    if m.traj_id in ctrl._released_ids:
                        ctrl._released_in_batch[m.batch_id] = ctrl._released_in_batch.get(m.batch_id, 0) + 1
                    st = ctrl._trajs.get(m.traj_id)
                    if st is None and m.traj_id not in ctrl._released_ids:  # completed, then its unit was lost
                        st = ctrl._trajs[m.traj_id] = _TrajState(None, {})  # its token count comes with the re-put
                        ctrl._missing.add(m.traj_id)
                    if st is not None:
                        st.meta, st.t_complete = m, ev.t
            _replay_decisions(ctrl)
        ctrl._skip_base = c.get("skipped", 0) - getattr(ctrl.policy.stats, "skipped_minibatches", 0)
    out.missing = tuple(sorted(ctrl._missing))
    return out


def _replay_decisions(ctrl: "Controller") -> None:
    """Ask the replayed policy for its decisions: a journaled one is already restored (checked equal), a released
    one is done, a new one is admitted now (and journaled)."""
    from knittrans.dataplane.types import MiniBatchKey as Key

    while mbs := ctrl.policy.on_trainer_ready(time.perf_counter() - ctrl._t0):
        for mb in mbs:
            key = Key(mb.batch_id, mb.index)
            if key in ctrl._released_keys:
                continue
            st = ctrl._mbs.get(key)
            if st is None:
                ctrl._admit_locked(mb)
            elif tuple(st.admitted.traj_ids) != tuple(mb.traj_ids):
                raise RecoveryError(f"replayed admission of {key} committed {mb.traj_ids}, the journal has "
                                    f"{st.admitted.traj_ids}: the admission policy is not deterministic")
