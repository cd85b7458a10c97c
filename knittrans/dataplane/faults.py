"""Fault injection and recovery for the data plane: lost units, corrupted messages, crashed trainer ranks.

The handoff sits between expensive rollout and expensive training, so the data plane must lose nothing and
deliver nothing twice when parts of it fail. This module holds the mechanisms (docs/reliability.md states their
semantics) and a typed way to inject the faults they survive:

- **Integrity.** ``field_checksum`` (CRC-32 of a field's dtype, shape and bytes) is computed by the producer
  (``DataPlaneClient(checksums=True)``), checked by the unit on receipt and by the rank on fetch against the copy
  the controller keeps: a corrupted message raises ``CorruptPayloadError`` naming trajectory and field, the
  rank's claim is undone, nothing stored changes, and a retry reads the good bytes.
- **Unit loss.** A unit that dies takes its trajectories with it; ``Controller.lose_unit`` marks the ones still
  needed as missing; a fetch touching them raises ``DataLostError`` (a prefetcher waits instead), never a
  partial share. ``ProducerBuffer`` keeps each payload until its mini-batch is released and re-puts the missing
  ones to a live unit.
- **Rank crash.** A rank acks a share only after its optimizer step (``fetch(..., ack=False)``, then ``ack``);
  on restart ``Controller.recover_rank`` re-delivers what it claimed and did not ack (at-least-once), and the
  ``StepLedger`` keyed by (batch, mini-batch index) applies each step once: exactly-once steps.

Faults are injected with a ``FaultPlan`` handed to ``build_inprocess`` / ``build_ray`` (default: none, and then
no wrapper exists at all -- zero overhead). ``FaultyUnit`` wraps a ``StorageUnit`` and fires the plan's faults
at the configured put / get counts.

    >>> plan = FaultPlan((UnitLoss("u1", on_put=3), CorruptGet("u0", on_get=2, field="input_ids")))
    >>> [type(f).__name__ for f in plan.for_unit("u1")]
    ['UnitLoss']
"""

from __future__ import annotations

import threading
import time
import zlib
from dataclasses import dataclass, replace
from typing import Callable, Generic, Mapping, Sequence, TypeVar, Union

import numpy as np

from knittrans.dataplane.types import (CorruptPayloadError, MiniBatchKey, PutRecord, ShareLocation,
                                       TrajectoryPayload, UnitChunk, UnitLostError, as_numpy)

# -- integrity ------------------------------------------------------------------------------------------------


_HEADS: dict[tuple[str, tuple[int, ...]], int] = {}  # (dtype, shape) -> CRC-32 of its description


def field_checksum(arr: np.ndarray) -> int:
    """CRC-32 of an array's dtype, shape and bytes (~4 GB/s; zero-copy for contiguous arrays). Shape and dtype
    are mixed in so a truncated or reinterpreted field cannot pass with the same bytes. The description's CRC is
    cached per (dtype, shape) (formatting it cost ~2 of the ~3 us a small field took; a trajectory's fields are
    summed three times: producer, unit, rank), and the bytes go to zlib as the array's own buffer."""
    a = np.ascontiguousarray(arr)
    key = (a.dtype.str, a.shape)
    head = _HEADS.get(key)
    if head is None:
        head = zlib.crc32(f"{a.dtype.str}{a.shape}".encode())
        if len(_HEADS) < 4096:  # shapes are per-trajectory lengths: bounded in practice, capped regardless
            _HEADS[key] = head
    if a.dtype.hasobject:  # no byte buffer to read (numpy refuses the view, as before)
        a.view(np.uint8)
    return zlib.crc32(a, head)


def with_checksums(payloads: Sequence[TrajectoryPayload]) -> list[TrajectoryPayload]:
    """The payloads with their producer-side checksums attached (what a checksumming client sends)."""
    out = []
    for p in payloads:
        sums = {name: field_checksum(as_numpy(p.traj_id, name, v)) for name, v in p.tensors.items()}
        # the constructor, not ``dataclasses.replace`` (~3 us a call), unless a subclass carries more fields
        out.append(TrajectoryPayload(p.traj_id, p.tensors, sums, p.meta) if type(p) is TrajectoryPayload
                   else replace(p, checksums=sums))
    return out


def verify_checksums(traj_id: int, arrays: Mapping[str, np.ndarray], sums: Mapping[str, int | None],
                     where: str) -> None:
    """Raise ``CorruptPayloadError`` naming the trajectory and field whose bytes do not match ``sums``."""
    for name, arr in arrays.items():
        want = sums.get(name)
        if want is not None and field_checksum(arr) != want:
            _corrupt(traj_id, name, arr, want, where)


def _corrupt(traj_id: int, name: str, arr: np.ndarray, want: int, where: str) -> None:
    raise CorruptPayloadError(f"trajectory {traj_id}: field {name!r} is corrupt on {where} (checksum "
                              f"{field_checksum(arr):#010x}, producer's {want:#010x}); nothing was stored or "
                              f"consumed, retry the {where}")


def verify_chunks(loc: ShareLocation, chunks: Sequence[UnitChunk], ragged: Mapping[str, bool]) -> None:
    """Check every trajectory's row of every field in the units' chunks (either ``UnitChunk`` form) against the
    claim's checksums. ``ragged`` is no longer needed (a chunk knows its rows); kept for callers."""
    if not loc.checksums:
        return
    want = {name: dict(zip(loc.traj_ids, col)) for name, col in zip(loc.fields, loc.checksums)}
    for ch in chunks:
        for f, name in enumerate(ch.fields):
            sums = want.get(name, {})
            for t, arr in zip(ch.traj_ids, ch.rows(f)):
                s = sums.get(t)
                if s is not None and field_checksum(arr) != s:
                    _corrupt(t, name, arr, s, f"fetch from unit {ch.unit_id}")


def verify_share(loc: ShareLocation, share) -> None:  # noqa: ANN001 - a PackedShare
    """Check every trajectory's row of every field of a share packed from its runs (``client.pack_runs``) against
    the claim's checksums: the rows as the producer shaped them (ragged: ``cu_seqlens`` slices; fixed: one row
    each)."""
    if not loc.checksums:
        return
    for name, col in zip(loc.fields, loc.checksums):
        pf = share.fields[name]
        values = pf.values.numpy()
        cu = None if pf.cu_seqlens is None else pf.cu_seqlens.numpy()
        for i, (t, want) in enumerate(zip(loc.traj_ids, col)):
            if want is None:
                continue
            arr = values[cu[i]:cu[i + 1]] if cu is not None else values[i]
            if field_checksum(arr) != want:
                _corrupt(t, name, arr, want, "fetch")


# -- the fault plan ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class UnitLoss:
    """Unit ``unit_id`` dies during its ``on_put``-th put call (1-based): the call fails with ``UnitLostError``
    and everything the unit held is gone. Later calls fail the same way until ``FaultyUnit.restart``."""

    unit_id: str
    on_put: int


@dataclass(frozen=True)
class CorruptGet:
    """The ``on_get``-th reply of unit ``unit_id`` has one byte of ``field`` flipped on its way to the rank."""

    unit_id: str
    on_get: int
    field: str


@dataclass(frozen=True)
class CorruptPut:
    """The ``on_put``-th put to unit ``unit_id`` arrives with one byte of ``field`` (first payload) flipped."""

    unit_id: str
    on_put: int
    field: str


@dataclass(frozen=True)
class SlowGet:
    """The ``on_get``-th get of unit ``unit_id`` hangs for ``seconds`` before answering (a unit stuck in a read)."""

    unit_id: str
    on_get: int
    seconds: float


Fault = Union[UnitLoss, CorruptGet, CorruptPut, SlowGet]


@dataclass(frozen=True)
class FaultPlan:
    """Which faults fire where. The empty plan (the default everywhere) builds no wrapper at all."""

    faults: tuple[Fault, ...] = ()

    def __post_init__(self) -> None:
        for f in self.faults:
            n = getattr(f, "on_put", None) or getattr(f, "on_get", None)
            if not isinstance(n, int) or n < 1:
                raise ValueError(f"FaultPlan: {f} must fire on a call number >= 1")

    def for_unit(self, unit_id: str) -> tuple[Fault, ...]:
        return tuple(f for f in self.faults if f.unit_id == unit_id)

    def __bool__(self) -> bool:
        return bool(self.faults)


def _flip_one_byte(arr: np.ndarray) -> np.ndarray:
    out = np.array(arr, copy=True)
    if out.nbytes:
        out.reshape(-1).view(np.uint8)[out.nbytes // 2] ^= 0x5A
    return out


class FaultyUnit:
    """A ``StorageUnit`` that fires its faults from a ``FaultPlan`` (same API; used only when a plan names it)."""

    def __init__(self, inner, faults: Sequence[Fault]) -> None:  # inner: StorageUnit
        self.inner = inner
        self.unit_id, self.node, self.schema = inner.unit_id, inner.node, inner.schema
        self.faults = tuple(faults)
        self.lost = False
        self.fired: list[Fault] = []
        self._puts = 0
        self._gets = 0
        self._lock = threading.Lock()

    def _fire(self, kind: type, count: int) -> list:
        hit = [f for f in self.faults if isinstance(f, kind) and getattr(f, "on_put", getattr(f, "on_get", 0)) == count]
        self.fired += hit
        return hit

    def _check_alive(self) -> None:
        if self.lost:
            raise UnitLostError(self.unit_id)

    def put(self, payloads: Sequence[TrajectoryPayload], copy: bool = True) -> list[PutRecord]:
        with self._lock:
            self._check_alive()
            self._puts += 1
            if self._fire(UnitLoss, self._puts):
                self.lose()
                raise UnitLostError(self.unit_id, f"died during put #{self._puts} (injected)")
            corrupt = self._fire(CorruptPut, self._puts)
        if corrupt and payloads:
            p = payloads[0]
            name = corrupt[0].field if corrupt[0].field in p.tensors else next(iter(p.tensors))  # field by field
            bad = {**p.tensors, name: _flip_one_byte(as_numpy(p.traj_id, name, p.tensors[name]))}
            payloads = [replace(p, tensors=bad), *payloads[1:]]
        # A faulty unit's rows are read through its get (where its read faults fire): no direct sources.
        return [replace(r, source=None, where=()) for r in self.inner.put(payloads, copy=copy)]

    def get(self, traj_ids: Sequence[int], fields: Sequence[str]) -> UnitChunk:
        with self._lock:
            self._check_alive()
            self._gets += 1
            corrupt = self._fire(CorruptGet, self._gets)
            slow = self._fire(SlowGet, self._gets)
        for s in slow:
            time.sleep(s.seconds)  # the injected hang itself (nothing waits on it: it is what a reader must survive)
        chunk = self.inner.get(traj_ids, fields)
        for c in corrupt:
            if c.field in chunk.fields:
                f = chunk.fields.index(c.field)
                values = list(chunk.values)
                if isinstance(values[f], tuple):  # rows form: the middle trajectory's row, as a copy
                    rows = list(values[f])
                    if rows:
                        rows[len(rows) // 2] = _flip_one_byte(rows[len(rows) // 2])
                    values[f] = tuple(rows)
                else:
                    values[f] = _flip_one_byte(values[f])
                chunk = replace(chunk, values=tuple(values))
        return chunk

    def drop(self, traj_ids: Sequence[int], fields: Sequence[str] | None = None) -> int:
        return 0 if self.lost else self.inner.drop(traj_ids, fields)

    def manifest(self) -> list[PutRecord]:
        self._check_alive()
        return self.inner.manifest()

    def lose(self) -> int:
        """The unit dies now: everything it held is gone."""
        self.lost = True
        return self.inner.clear()

    def clear(self) -> int:
        return self.inner.clear()

    def restart(self) -> None:
        """The unit comes back empty under the same id (producers may put to it again)."""
        self.lost = False

    def stats(self):  # noqa: ANN201 - UnitStats
        return self.inner.stats()


# -- recovery helpers ---------------------------------------------------------------------------------------------


class ProducerBuffer:
    """A producer that keeps every payload until its mini-batch is released, so a lost unit's trajectories can be
    re-put (``reput_missing``). ``prune`` forgets released ones: memory is bounded by what is not yet consumed.

    ``client`` is a ``DataPlaneClient``; puts go to ``client.local_unit`` (or ``fallback_units`` in order when it
    is lost)."""

    def __init__(self, client, fallback_units: Sequence[str] = ()) -> None:
        self.client = client
        self.units = [u for u in (client.local_unit, *fallback_units) if u is not None]
        self.kept: dict[int, TrajectoryPayload] = {}
        self.reputs = 0
        self.fallbacks = 0  # puts that went to a fallback unit because an earlier one was lost

    def put(self, payloads: Sequence[TrajectoryPayload]) -> str:
        """Put to the first live unit; returns the unit that took them. ``UnitLostError`` only if all are lost."""
        for p in payloads:
            self.kept[p.traj_id] = _merged(self.kept.get(p.traj_id), p)
        return self._put_somewhere(list(payloads), [self.kept[p.traj_id] for p in payloads])

    def _put_somewhere(self, payloads: list[TrajectoryPayload],
                       whole: list[TrajectoryPayload] | None = None) -> str:
        """``payloads`` to the first live unit; a fallback unit gets ``whole`` (every field put so far), since
        the fields put before went down with the lost unit."""
        err: Exception | None = None
        for i, u in enumerate(self.units):
            try:
                self.client.put(payloads if i == 0 or whole is None else whole, unit=u)
                return u
            except UnitLostError as e:
                err = e
                self.fallbacks += 1
        raise UnitLostError(",".join(self.units), f"no live unit for trajectories "
                                                  f"{[p.traj_id for p in payloads][:8]}") from err

    def reput_missing(self) -> tuple[int, ...]:
        """Re-put this producer's trajectories that the controller lists as missing, or no longer knows at all (a
        restarted controller never heard of a trajectory lost with its unit before admission); returns their ids."""
        ids = [t for t in self.client.controller.missing() if t in self.kept]
        if self.kept:
            ids += [t for t in self.client.controller.untracked(tuple(self.kept)) if t not in ids]
        if ids:
            self._put_somewhere([self.kept[t] for t in ids])
            self.reputs += len(ids)
        return tuple(ids)

    def prune(self) -> int:
        """Forget payloads whose mini-batch was released; returns how many are still kept."""
        if self.kept:
            still = set(self.client.controller.unreleased(tuple(self.kept)))
            self.kept = {t: p for t, p in self.kept.items() if t in still}
        return len(self.kept)


def _merged(old: TrajectoryPayload | None, new: TrajectoryPayload) -> TrajectoryPayload:
    """Everything a producer put for one trajectory, field by field (a re-put after a unit loss must carry every
    field, not only the last put's). Checksums and metadata merge the same way."""
    if old is None:
        return new
    sums = None if old.checksums is None and new.checksums is None else {**(old.checksums or {}),
                                                                         **(new.checksums or {})}
    return replace(old, tensors={**old.tensors, **new.tensors}, checksums=sums,
                   meta=new.meta if new.meta is not None else old.meta)


R = TypeVar("R")


class StepLedger(Generic[R]):
    """Exactly-once optimizer steps under at-least-once delivery: ``apply(key, step)`` runs ``step`` only the
    first time ``key`` (a ``MiniBatchKey``) is seen and returns its recorded result on a replay. The policy
    version is the number of distinct keys applied. It belongs with the trainer's checkpoint (saved atomically
    with the weights and optimizer state), so it survives the crash it protects against.

        >>> led = StepLedger()
        >>> led.apply(MiniBatchKey(0, 0), lambda: "stepped"), led.apply(MiniBatchKey(0, 0), lambda: "again")
        (('stepped', True), ('stepped', False))
        >>> led.version, led.replays
        (1, 1)
    """

    def __init__(self) -> None:
        self._done: dict[MiniBatchKey, R] = {}
        self.replays = 0
        self._lock = threading.Lock()

    def apply(self, key: MiniBatchKey, step: Callable[[], R]) -> tuple[R, bool]:
        with self._lock:
            if key in self._done:
                self.replays += 1
                return self._done[key], False
        result = step()  # the step itself runs outside the lock (one trainer applies one key at a time)
        with self._lock:
            self._done[key] = result
        return result, True

    def applied(self, key: MiniBatchKey) -> bool:
        with self._lock:
            return key in self._done

    @property
    def version(self) -> int:
        with self._lock:
            return len(self._done)

    @property
    def keys(self) -> tuple[MiniBatchKey, ...]:
        with self._lock:
            return tuple(self._done)


class InjectedCrash(RuntimeError):
    """A trainer rank crash injected by a test or the reliability table (``RankCrash``)."""


@dataclass(frozen=True)
class RankCrash:
    """Trainer rank ``rank`` crashes at its ``at_seq``-th admitted mini-batch: before its optimizer step
    (``after_step=False``: the step must run after the restart) or after the step and before its ack
    (``after_step=True``: the re-delivered share must not be stepped again)."""

    rank: int
    at_seq: int
    after_step: bool = False


def run_rank(client, rank: int, ledger: StepLedger, start_seq: int, count: int,
             step: Callable[[object], object], crash: RankCrash | None = None,
             fields: Sequence[str] | None = None, timeout: float | None = 60.0) -> list[MiniBatchKey]:
    """A trainer rank's loop with ack-after-step: fetch share ``seq`` (claimed, not acked), apply its step through
    the ledger, then ack. Returns the keys whose step ran here. ``crash`` raises ``InjectedCrash`` at its point;
    the caller restarts with ``client.controller.recover_rank(rank)`` as the new ``start_seq``."""
    ran = []
    for seq in range(start_seq, count):
        share = client.fetch_next(seq, rank, fields, timeout=timeout, ack=False)
        if crash is not None and crash.rank == rank and crash.at_seq == seq and not crash.after_step:
            raise InjectedCrash(f"rank {rank} crashed before the step of {share.key}")
        _, fresh = ledger.apply(share.key, lambda: step(share))
        if fresh:
            ran.append(share.key)
        if crash is not None and crash.rank == rank and crash.at_seq == seq and crash.after_step:
            raise InjectedCrash(f"rank {rank} crashed after the step of {share.key}, before its ack")
        client.ack(share)
    return ran
