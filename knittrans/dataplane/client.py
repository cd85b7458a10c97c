"""The data-plane client: ``put`` for rollout, ``fetch`` for a trainer rank, the same on every transport.

A producer writes to its local unit, then tells the controller (data first, then metadata, so metadata never
points at bytes that are not there; a put the controller rejects is rolled back at the unit). A rank claims its
share at the controller (metadata, exactly once), reads each trajectory from the unit that holds it, and packs
the fields into ready-to-use tensors: ragged fields back to back with ``cu_seqlens`` (varlen layout, no
padding), cast to the trainer's dtypes, pinned when a GPU will read them. That packing is the one copy the
in-process transport makes; the Ray transport adds one copy into the object store.

Example (in-process)::

    >>> import numpy as np
    >>> from knittrans.types import MiniBatch
    >>> from knittrans.dataplane import FieldSpec, TrajectorySchema, TrajectoryPayload, build_inprocess
    >>> schema = TrajectorySchema((FieldSpec("ids", "int64"),), token_field="ids")
    >>> dp = build_inprocess(schema, unit_nodes={"u0": "n0"}, rank_nodes=("n0", "n0"))
    >>> c = dp.client("u0")
    >>> c.put([TrajectoryPayload(t, {"ids": np.arange(t + 1)}) for t in range(4)])
    >>> _ = c.admit(MiniBatch(batch_id=0, index=0, traj_ids=(0, 1, 2, 3), group_ids=(0,), num_tokens=10))
    >>> share = c.fetch(MiniBatch(0, 0, (0, 1, 2, 3), (0,), 10), rank=0, fields=("ids",))
    >>> share.traj_ids, share["ids"].tolist(), share.fields["ids"].cu_seqlens.tolist()
    ((0, 3), [0, 0, 1, 2, 3], [0, 1, 5])
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Mapping, Protocol, Sequence

import numpy as np

from knittrans.dataplane import trace
from knittrans.dataplane.buffers import BufferPool, aligned, copy_rows, process_pool
from knittrans.dataplane.columns import PutColumns, check_columns, columns_of
from knittrans.dataplane.types import (AdmittedMiniBatch, DataPlaneClosedError, DataPlaneError, MiniBatchKey,
                                       PackedField, PackedShare, PutRecord, SchemaMismatchError, ShareLocation,
                                       ResolveStalledError, Retired, ShareRuns, ShareTooLargeError, TrajectoryPayload,
                                       TrajectorySchema, UnitChunk, UnitLostError)
from knittrans.types import MiniBatch

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

INLINE_PUT_BYTES = 64 << 10
"""A columnar put of at most this many bytes, completing trajectories its unit holds already (a completion put:
advantages, rewards), rides with its registration to a remote controller (``ControllerHost.register_inline``): the
ranks' shares carry its bytes, and its unit's copy is written beside the admission, not before it. Below Ray's own
inline limit for a call's arguments and replies (100 KiB), so it costs the controller no object-store work. The
multimodal raw pass went from 34.2 to 27.6 ms in median (four interleaved pairs, docs/experiments.md, session 46)."""


class ControllerAPI(Protocol):
    """What a client needs from a controller; ``Controller`` and the Ray proxy implement it."""

    def register(self, records: Sequence[PutRecord]) -> tuple[int, ...] | None: ...
    def register_columns(self, unit_id: str, cols: PutColumns, source: object = None) -> tuple[int, ...]: ...
    def admit(self, mb: MiniBatch) -> AdmittedMiniBatch: ...
    def next_admitted(self, seq: int, timeout: float | None = None) -> AdmittedMiniBatch: ...
    def claim(self, key: MiniBatchKey, rank: int, fields: Sequence[str],
              epoch: int | None = None) -> ShareLocation: ...
    def claim_next(self, seq: int, rank: int, fields: Sequence[str], timeout: float | None = None,
                   epoch: int | None = None) -> ShareLocation: ...
    def ack(self, key: MiniBatchKey, rank: int, fields: Sequence[str],
            epoch: int | None = None) -> tuple[tuple[str, tuple[int, ...]], ...]: ...
    def rank_epoch(self, rank: int) -> int: ...
    # faults and recovery (knittrans.dataplane.faults, docs/reliability.md)
    def lose_unit(self, unit_id: str) -> tuple[int, ...]: ...
    def missing(self) -> tuple[int, ...]: ...
    def discard(self, traj_ids: Sequence[int]) -> tuple[tuple[str, tuple[int, ...]], ...]: ...
    def unreleased(self, traj_ids: Sequence[int]) -> tuple[int, ...]: ...
    def untracked(self, traj_ids: Sequence[int]) -> tuple[int, ...]: ...
    def unclaim(self, key: MiniBatchKey, rank: int, fields: Sequence[str]) -> None: ...
    def recover_rank(self, rank: int) -> int: ...
    def wait_released(self, count: int, timeout: float | None = None) -> int: ...


class UnitAPI(Protocol):
    """What a client needs from a storage unit; ``StorageUnit`` and the Ray proxy implement it. ``drop`` may return
    before the unit has dropped (the Ray proxy's is fire-and-forget, off the critical path); a unit whose ``drop`` is
    asynchronous also has ``drop_sync``, which returns once it has (``drop_confirmed``)."""

    def put(self, payloads: Sequence[TrajectoryPayload]) -> list[PutRecord]: ...
    def get(self, traj_ids: Sequence[int], fields: Sequence[str]) -> UnitChunk: ...
    def drop(self, traj_ids: Sequence[int], fields: Sequence[str] | None = None) -> int: ...


def drop_confirmed(unit: UnitAPI, traj_ids: Sequence[int], fields: Sequence[str] | None = None) -> None:
    """Drop and return only once the unit has dropped: what a rollback or a ``discard`` needs, because the same
    trajectories may be put again right after (a drop still in flight on a threaded Ray unit actor could land after
    that re-put and take the new fields with it: registered at the controller, gone from the unit). In process a
    unit's ``drop`` is synchronous already; the Ray proxy's ``drop_sync`` waits for the unit's answer."""
    sync = getattr(unit, "drop_sync", None)
    (sync if sync is not None else unit.drop)(traj_ids, fields)


class UnitGetter(Protocol):
    """Reads chunks from several units at once (the Ray transport issues every get before waiting on any), and
    resolves a share's sources (``resolve``: in process the sources are the arrays; on Ray one ``ray.get`` of
    their object refs, no unit call). A frozen dataclass whose ``read_timeout_s`` is the deadline of one share's
    reads (a call with a shorter bound reads through a copy with less: ``DataPlaneClient.fetch_next``)."""

    read_timeout_s: float | None

    def __call__(self, requests: Sequence[tuple[str, tuple[int, ...]]], fields: Sequence[str],
                 unit_args: Mapping[str, tuple] | None = None) -> list[UnitChunk]: ...

    def resolve(self, runs: ShareRuns) -> Sequence[Sequence[np.ndarray]]: ...


@dataclass(frozen=True)
class PrepareConfig:
    """How a fetched share is prepared for the trainer."""

    casts: tuple[tuple[str, str], ...] = ()
    """(field, torch dtype name) pairs to cast on the consumer, e.g. (("advantages", "bfloat16"),)."""
    pin_memory: bool = True
    """Pin packed tensors when CUDA is available (ignored without a GPU), so the host-to-device copy is async."""
    reuse_buffers: bool = True
    """Pack each share into a buffer the rank reuses once nothing references its previous share
    (``knittrans.dataplane.buffers``): one copy per byte and no page faults per share. False: the plain twin, a
    fresh allocation per field (same bytes; what the buffer tests compare against). Shares a GPU will read
    (``pin_memory`` with CUDA) are packed into page-locked blocks of torch's caching host allocator instead."""
    pool_buffers: int = 16
    """Buffers the process keeps for reuse (``buffers.process_pool``, shared by its ranks; each about one share):
    a rank needs its prefetch depth + 2 (the share in training, the one being packed); beyond the pool a share
    gets an ordinary allocation."""
    direct_reads: bool = True
    """Read a share whose rows all lie in their units' sources straight from them (``ShareLocation.runs``: one
    resolve, one copy of a few runs, no unit call). False: every share through its units (``UnitAPI.get``), the
    plain twin the equivalence tests compare against."""


@dataclass(frozen=True)
class FetchTiming:
    """Where the time of one fetch went (seconds): metadata claim, unit reads, packing; and, apart from them, the
    wait for the mini-batch's admission inside ``fetch_next`` (``ShareLocation.waited_s``: not fetch work)."""

    claim_s: float
    read_s: float
    pack_s: float
    wait_s: float = 0.0
    pack_cpu_s: float = math.nan
    """The CPU time the packing thread spent in ``pack_s`` (``time.thread_time``): far below ``pack_s`` when the
    pack waited for a core or the GIL (other threads and processes busy on the same cores)."""


_INT32_MAX = 2**31 - 1


def _fence(epoch: int) -> int | None:
    """A share's claiming incarnation as the controller takes it: -1 (unfenced) is None."""
    return None if epoch < 0 else epoch


def cu_seqlens_int32(offs: np.ndarray, name: str, loc: ShareLocation) -> np.ndarray:
    """Row offsets as int32 (the varlen kernels' ``cu_seqlens`` dtype); a share past 2^31 - 1 rows raises
    ``ShareTooLargeError`` instead of wrapping to negative offsets (which would silently mix sequences)."""
    if offs.size and int(offs[-1]) > _INT32_MAX:
        raise ShareTooLargeError(f"share {loc.key} rank {loc.rank}: field {name!r} has {int(offs[-1])} rows, past "
                                 f"int32 cu_seqlens ({_INT32_MAX}); split the mini-batch across more ranks")
    return offs.astype(np.int32)


def _share_rows(loc: ShareLocation, chunks: Sequence[UnitChunk], name: str,
                order: Mapping[int, int]) -> list[np.ndarray]:
    """Field ``name`` of every trajectory of the share, in the share's order (``order``: trajectory -> position;
    views of the chunks, no copy)."""
    rows: list[np.ndarray | None] = [None] * len(loc.traj_ids)
    for ch in chunks:
        for t, a in zip(ch.traj_ids, ch.rows(ch.fields.index(name))):
            rows[order[t]] = a
    missing = [t for t, a in zip(loc.traj_ids, rows) if a is None]
    if missing:
        raise DataPlaneError(f"share {loc.key} rank {loc.rank}: no unit returned field {name!r} of trajectories "
                             f"{missing[:8]}")
    return rows  # type: ignore[return-value]


def pack_share(loc: ShareLocation, chunks: Sequence[UnitChunk], schema: TrajectorySchema,
               prepare: PrepareConfig = PrepareConfig(), pool: BufferPool | None = None) -> PackedShare:
    """Assemble the units' chunks into one tensor per field, in the share's trajectory order: every row is copied
    once, straight from the chunk (the unit's stored copy in process, an object-store view on Ray) into the packed
    tensor. ``pool``: write the share into a reused buffer (``knittrans.dataplane.buffers``; the buffer is
    reused only once nothing references this share any more); None: a fresh allocation per field."""
    import torch  # here, not at module top: producer, unit and controller processes never pay torch's import

    casts = dict(prepare.casts)
    pin = prepare.pin_memory and torch.cuda.is_available()
    plan = []  # (name, spec, rows, row counts (ragged), total rows, dtype, byte offset, bytes)
    total = 0
    order = {t: i for i, t in enumerate(loc.traj_ids)}
    for name in loc.fields:
        spec = schema.get(name)
        rows = _share_rows(loc, chunks, name, order)
        dtype = rows[0].dtype if rows else np.dtype(spec.dtype)
        lens = [a.shape[0] for a in rows] if spec.ragged else None
        n = sum(lens) if lens is not None else len(rows)
        nbytes = n * int(np.prod(spec.tail, dtype=np.int64)) * dtype.itemsize
        plan.append((name, spec, rows, lens, n, dtype, total, nbytes))
        total += aligned(nbytes)
    # Pinned: one page-locked block from torch's caching host allocator, each field a torch view of it (not a
    # numpy round trip: the allocator must recognise the storage to track an async copy still reading it).
    pinned = torch.empty(total, dtype=torch.uint8, pin_memory=True) if pin else None
    buf = pool.take(total) if pool is not None and pinned is None else None
    out: dict[str, PackedField] = {}
    tokens = 0
    for name, spec, rows, lens, n, dtype, off, nbytes in plan:
        shape = (n, *spec.tail)
        if pinned is not None:
            tensor = pinned[off:off + nbytes].view(torch.from_numpy(np.empty(0, dtype)).dtype).reshape(shape)
            values = tensor.numpy()
        else:
            values = (buf[off:off + nbytes].view(dtype).reshape(shape) if buf is not None
                      else np.empty(shape, dtype=dtype))
            tensor = torch.from_numpy(values)
        if rows:  # the one copy: every row from its chunk into the packed tensor (GIL held: ``copy_rows``)
            copy_rows(rows, values, spec.ragged)
        cu = None if lens is None else _cu_seqlens(lens, name, loc)
        out[name] = _packed_field(name, tensor, cu, casts.get(name), pin)
        tokens = n if name == schema.token_field else tokens
    return PackedShare(key=loc.key, rank=loc.rank, traj_ids=loc.traj_ids, fields=out, nbytes=loc.nbytes,
                       num_tokens=tokens, seq=loc.seq, group_ids=loc.group_ids, epoch=loc.epoch)


def _cu_seqlens(lens: Sequence[int] | np.ndarray, name: str, loc: ShareLocation) -> np.ndarray:
    """``cu_seqlens`` (int32) of rows of lengths ``lens``."""
    offs = np.zeros(len(lens) + 1, dtype=np.int64)
    np.cumsum(lens, out=offs[1:])
    return cu_seqlens_int32(offs, name, loc)


def _packed_field(name: str, tensor: "torch.Tensor", cu_seqlens: np.ndarray | None, cast: str | None,
                  pin: bool) -> PackedField:
    """A packed field: its ``cu_seqlens`` (ragged fields, ``_cu_seqlens``), the trainer's cast (pinned again when
    a GPU reads it: the cast made a new, pageable tensor)."""
    import torch

    cu = None if cu_seqlens is None else torch.from_numpy(cu_seqlens)
    if cast is not None:
        tensor = tensor.to(getattr(torch, cast))
        if pin:
            tensor = tensor.pin_memory()
    return PackedField(name, tensor, cu)


def pack_runs(loc: ShareLocation, objects: Sequence[Sequence[np.ndarray]], schema: TrajectorySchema,
              prepare: PrepareConfig = PrepareConfig(), pool: BufferPool | None = None) -> PackedShare:
    """Pack a share from its runs (``loc.runs``, ``ShareRuns``): ``objects[s]`` are the arrays of source ``s``
    (in process: the put's arrays themselves; on Ray: one ``ray.get`` of the sources' object refs, views of the
    object store). Every byte is copied once, one ``memoryview`` slice assignment per run (a few per field, not one
    per trajectory): CPython's ``memcpy`` with the GIL held for the whole share (~0.6 ms for a 5 MB share at
    memcpy speed), as ``buffers.copy_rows`` does. Not a copy that releases the GIL per run (``np.copyto``,
    ``np.concatenate``, ``torch.cat``, ``torch._foreach_copy_``: every torch call from Python drops the GIL too):
    beside one thread running Python in the same process -- a trainer's step, the feed's poll replies, producers'
    puts in process -- every re-acquisition waits out a switch interval (5 ms), and a 5.4 MB share of 112 runs took
    343 ms with ``np.copyto`` per run, 331 ms with ``np.concatenate`` per field, 74 ms with ``torch.cat`` per field
    and 0.68 ms held (2 packing threads + 1 busy thread, medians of 30; alone the four take 0.5-1.0 ms). Holding
    the GIL for one share's copy delays the trainer's Python by that copy's time once per step; releasing it per
    run delays the copy by up to 5 ms per run. The same holds for the views it hands out: numpy views wrapped by
    ``torch.from_numpy``, never a torch method (``Tensor.view`` / ``reshape`` drop the GIL: ~1 / ~4 ms each beside
    a busy thread; with them two rank threads of one process packed at 0.31-0.38 of memcpy, without 0.59-0.61).
    Same result as ``pack_share`` over the rows."""
    import torch  # here, not at module top: producer, unit and controller processes never pay torch's import

    runs = loc.runs
    assert runs is not None
    casts = dict(prepare.casts)
    pin = prepare.pin_memory and torch.cuda.is_available()
    flat = [[memoryview(_bytes_of(a)) for a in arrays] for arrays in objects]  # each source array's bytes
    layout = schema.row_layouts
    plan, total = [], 0
    for f, name in enumerate(loc.fields):
        spec, dtype, row = layout[name]
        nb = runs.nbytes[f]
        nbytes = int(nb.sum())
        plan.append((name, spec, dtype, nb // row if row else nb * 0, total, nbytes))
        total += aligned(nbytes)
    pinned = torch.empty(total, dtype=torch.uint8, pin_memory=True) if pin else None
    buf = pinned.numpy() if pinned is not None else (pool.take(total) if pool is not None
                                                     else np.empty(total, np.uint8))
    dst = memoryview(buf)
    for f, (name, spec, dtype, rows, off, nbytes) in enumerate(plan):
        at = off
        for o, c, a, b in runs.runs[f].tolist():  # the one copy of each run (GIL held: see the docstring)
            dst[at:at + b - a] = flat[o][c][a:b]
            at += b - a
    out: dict[str, PackedField] = {}
    tokens = 0
    last: tuple[np.ndarray, np.ndarray] | None = None  # the last ragged field's row counts and cu_seqlens
    for name, spec, dtype, rows, off, nbytes in plan:
        cu = None
        if spec.ragged:  # fields of one length group (ids, log-probs, mask) share their row counts: one cumsum
            if last is not None and np.array_equal(last[0], rows):
                cu = last[1].copy()  # each field its own tensor, as before
            else:
                cu = _cu_seqlens(rows, name, loc)
                last = (rows, cu)
            n = int(cu[-1])
        else:
            n = len(rows)
        shape = (n, *spec.tail)
        if pinned is not None:  # a torch view of the pinned block: the allocator must see its storage in use
            tensor = pinned[off:off + nbytes].view(torch.from_numpy(np.empty(0, dtype)).dtype).reshape(shape)
        else:  # numpy views: no torch method call, none that drops the GIL (see the docstring)
            tensor = torch.from_numpy(buf[off:off + nbytes].view(dtype).reshape(shape))
        out[name] = _packed_field(name, tensor, cu, casts.get(name), pin)
        tokens = n if name == schema.token_field else tokens
    return PackedShare(key=loc.key, rank=loc.rank, traj_ids=loc.traj_ids, fields=out, nbytes=loc.nbytes,
                       num_tokens=tokens, seq=loc.seq, group_ids=loc.group_ids, epoch=loc.epoch)


class _LocalAcks:
    """An in-process controller and its units behind ``feed.AckSender``'s ``ack_many``: each ack applied in order
    as ``DataPlaneClient``'s synchronous ack (the first failure raises; the acks before it stay applied)."""

    def __init__(self, controller, units: Mapping[str, object]) -> None:  # noqa: ANN001 - a Controller
        self.controller, self.units = controller, units

    def ack_many(self, acks: Sequence[tuple[MiniBatchKey, int, tuple[str, ...], int | None]]) -> None:
        for key, rank, fields, epoch in acks:
            for unit_id, ts in self.controller.ack(key, rank, fields, epoch):
                self.units[unit_id].drop(ts)


def _bytes_of(a: np.ndarray) -> np.ndarray:
    """``a``'s bytes as a flat ``uint8`` view (sources are contiguous: no copy)."""
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8)


class SourceCache:
    """The sources a remote reader has mapped: per object (``ObjectRef.binary()``), the ref its claims named and its
    arrays (one ``ray.get``: views of the object store), kept while a share it delivered and has not acked reads
    it and, with a feed (``retiring``), until the controller retires the source (``SourceTable``: its last row
    released; ``feed.ShareFeed`` hands each poll's ``Retired`` to ``retire``). So consecutive shares of one put map
    it once, and a reader never drops its last reference to an object that a later claim names again (the
    drop-and-borrow-again pattern behind the rare ``ray.get`` that never returned: docs/experiments.md, sessions 26
    and 33). Thread-safe (a rank's prefetch worker maps, its trainer thread acks, its feed retires)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[bytes, list] = {}  # id -> [ref, arrays or None, users: {(key, rank)}]
        self.retiring = False

    def __len__(self) -> int:
        return len(self._entries)

    def objects(self, runs: ShareRuns, user: tuple, resolve: Callable[[ShareRuns], Sequence]) -> list:
        """The arrays of each source of ``runs`` (in order), mapping with one ``resolve`` call those not mapped yet;
        ``user`` (the share) reads them until ``release``. A failed resolve maps nothing and leaves no mark."""
        ids = [h.binary() for h in runs.sources]
        with self._lock:
            for k, h in zip(ids, runs.sources):
                self._entries.setdefault(k, [h, None, set()])[2].add(user)
            need = [i for i, k in enumerate(ids) if self._entries[k][1] is None]
        if need:
            sub = dataclasses.replace(runs, sources=tuple(runs.sources[i] for i in need),
                                      source_units=tuple(runs.source_units[i] for i in need))
            try:
                got = resolve(sub)
            except BaseException:
                self.release(user, evict=[ids[i] for i in need])
                raise
            with self._lock:
                for i, arrays in zip(need, got):
                    self._entries[ids[i]][1] = arrays
        with self._lock:
            return [self._entries[k][1] for k in ids]

    def release(self, user: tuple, evict: Sequence[bytes] = ()) -> None:
        """``user`` (an acked or abandoned share) reads nothing any more; without a feed, a source no share reads is
        let go of (``evict``: let go of these even so -- a failed or stalled read)."""
        with self._lock:
            for k in list(self._entries):
                e = self._entries[k]
                e[2].discard(user)
                if k in evict or (not e[2] and not self.retiring):
                    del self._entries[k]

    def retire(self, retired: Retired) -> None:
        """Let go of the retired sources (none of them is ever named again); on ``reset``, of every source no
        unacked share reads."""
        with self._lock:
            for k in retired.ids:
                self._entries.pop(k, None)
            if retired.reset:
                for k in [k for k, e in self._entries.items() if not e[2]]:
                    del self._entries[k]

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()


@dataclass
class DataPlaneClient:
    """One process's handle on a data plane. ``local_unit`` is where this process's puts go (its node's unit)."""

    controller: ControllerAPI
    units: Mapping[str, UnitAPI]
    schema: TrajectorySchema
    local_unit: str | None = None
    prepare: PrepareConfig = field(default_factory=PrepareConfig)
    getter: UnitGetter | None = None  # None: read units one after another (fine in-process)
    _timings: dict = field(default_factory=dict, init=False, repr=False)  # thread id -> its last fetch's timing
    pool: BufferPool | None = field(default=None, init=False, repr=False)
    """Where shares are packed (``PrepareConfig.reuse_buffers``): the fetching process's pool, looked up on first
    use (it pickles empty)."""
    checksums: bool = False
    """Attach a CRC-32 per field to every put and verify every fetched field against it (``faults``): a corrupted
    message raises ``CorruptPayloadError`` instead of reaching training. Costs one pass over the bytes per side."""
    remote_controller: bool = False
    """The controller is another process (Ray): a rank's claims come by long poll (``feed``: ``ShareFeed``) and its
    acks are batched and sent asynchronously (``AckSender``; ``flush_acks`` waits for them), so neither round trip
    is on the rank's critical path. In process claims are plain calls, and acks too unless ``ack_delay_s``."""
    _acks: object = field(default=None, init=False, repr=False)  # the AckSender, created on first ack
    ack_delay_s: float = field(default=0.0, repr=False)
    """How long the ack sender waits after an ack for more before it applies them in one batch (``feed.AckSender``;
    with a remote controller 0 sends at once; in process 0 applies each ack in the caller's thread, > 0 queues
    them as a remote controller's are: a mini-batch's release -- the controller's compaction and the units' drops,
    ~1.4 ms of Python for 128 trajectories -- then leaves the rank's thread, and a share packing beside it on
    the same GIL, docs/experiments.md, session 50). ``knittrans.Consumer`` sets ``feed.ACK_DELAY_S``: it flushes
    its acks at the end of its stream, on ``flush`` and on ``close``; a caller of ``fetch`` / ``ack`` who reads the
    controller's view of its acks right after them calls ``flush_acks``."""
    _sources: SourceCache = field(default_factory=SourceCache, init=False, repr=False)
    """The sources this (remote) reader mapped, kept until retired (``SourceCache``)."""
    resolve_fallbacks: int = field(default=0, init=False)
    """Shares whose sources did not map within ``RESOLVE_TIMEOUT_S`` and were read through their units instead."""

    # -- rollout side ----------------------------------------------------------------------------------------

    def put(self, payloads: Sequence[TrajectoryPayload], unit: str | None = None) -> None:
        """Write trajectories' fields to ``unit`` (default: this client's local unit), then register them.
        All-or-nothing per call."""
        unit_id = unit or self.local_unit
        if unit_id is None or unit_id not in self.units:
            raise DataPlaneError(f"put needs a storage unit: got {unit_id!r}, known units {sorted(self.units)}")
        if not payloads:
            return
        if self.checksums:
            from knittrans.dataplane.faults import with_checksums

            payloads = with_checksums(payloads)
        unit_api = self.units[unit_id]
        cols = self._columns(payloads) if getattr(unit_api, "put_columns", None) is not None else None
        if cols is not None and self._inline(cols) and self.controller.register_inline(unit_id, *cols):
            return  # registered with its bytes and written to its unit (``INLINE_PUT_BYTES``)
        try:
            got = unit_api.put_columns(*cols) if cols is not None else None  # type: ignore[attr-defined]
            records = got if isinstance(got, list) else unit_api.put(payloads) if got is None else None
        except UnitLostError:
            self.controller.lose_unit(unit_id)  # whoever sees a unit die reports it (idempotent)
            raise
        if records is None:  # the plain case, stored as columns: registered as columns (``columns``)
            assert cols is not None
            c = cols[0]
            self._register(unit_api, lambda: self.controller.register_columns(unit_id, c, got),
                           lambda: [(c.traj_ids.tolist(), c.names)])
        else:
            self._register(unit_api, lambda: self.controller.register(records),
                           lambda: [([r.traj_id], [f.name for f in r.fields if f.name not in r.repeated])
                                    for r in records])

    def _inline(self, cols: tuple[PutColumns, tuple[np.ndarray, ...]]) -> bool:
        """Whether a columnar put goes to the controller with its bytes (``INLINE_PUT_BYTES``): a remote controller
        that takes it, no checksums (they travel as records), ranks that read shares from their sources (not through
        the units, which may not hold these bytes yet), and columns the unit would take as they are."""
        return (self.remote_controller and not self.checksums and self.prepare.direct_reads
                and cols[0].metas is not None and getattr(self.controller, "register_inline", None) is not None
                and sum(int(a.nbytes) for a in cols[1]) <= INLINE_PUT_BYTES and check_columns(self.schema, *cols))

    def _columns(self, payloads: Sequence[TrajectoryPayload]) -> tuple[PutColumns, tuple[np.ndarray, ...]] | None:
        """The put as columns (``columns_of``), or None: payload by payload."""
        return columns_of(payloads, self.schema)

    @staticmethod
    def _register(unit_api: "UnitAPI", register: Callable[[], tuple[int, ...] | None],
                  added: Callable[[], list[tuple[list[int], Sequence[str]]]]) -> None:
        """Register a put its unit stored. If the controller refuses it (e.g. the trajectory lives on another unit,
        or the plane is closed), take back exactly what the put added at the unit (``added``: (ids, fields) pairs),
        so nothing stale stays behind -- and wait for it, so that a re-put the producer sends next cannot be
        overtaken by this drop. Re-puts of lost trajectories that were consumed meanwhile are dropped (not
        needed)."""
        try:
            skipped = register()
        except (DataPlaneError, DataPlaneClosedError):
            for ids, names in added():
                if names:
                    drop_confirmed(unit_api, ids, names)
            raise
        if skipped:
            unit_api.drop(skipped)

    def discard(self, traj_ids: Sequence[int]) -> None:
        """Forget orphaned trajectories of a producer that died mid-group (never admitted, never completed):
        the controller forgets them and their units drop their fields, so the ids may be regenerated and put
        again (``Controller.discard``)."""
        for unit_id, ts in self.controller.discard(traj_ids):
            if unit_id in self.units:
                drop_confirmed(self.units[unit_id], ts)  # the regenerated ids may be put again at once

    # -- admission -------------------------------------------------------------------------------------------

    def admit(self, mb: MiniBatch) -> AdmittedMiniBatch:
        return self.controller.admit(mb)

    # -- trainer side ----------------------------------------------------------------------------------------

    def fetch(self, minibatch: MiniBatch | MiniBatchKey, rank: int, fields: Sequence[str] | None = None,
              ack: bool = True) -> PackedShare:
        """Rank ``rank``'s share of an admitted mini-batch, read directly from the units that hold it, packed.
        ``fields`` defaults to every schema field. Raises ``UnknownMiniBatchError``, ``FieldNotProducedError``,
        ``AlreadyConsumedError`` or ``DataLostError`` (``knittrans.dataplane.types``) before any byte moves;
        ``CorruptPayloadError`` or ``UnitLostError`` if the read fails, with the claim undone. ``ack=False``
        leaves the share claimed until ``ack(share)`` (after the optimizer step: a crashed rank gets it again)."""
        key = minibatch if isinstance(minibatch, MiniBatchKey) else MiniBatchKey(minibatch.batch_id, minibatch.index)
        names = tuple(fields) if fields is not None else self.schema.names
        if not isinstance(rank, int) or isinstance(rank, bool):
            raise SchemaMismatchError(f"rank must be an int, got {rank!r}")
        t0 = time.perf_counter()
        loc = self.controller.claim(key, rank, names)
        return self._deliver(loc, t0, ack)

    def fetch_next(self, seq: int, rank: int, fields: Sequence[str] | None = None,
                   timeout: float | None = None, ack: bool = True, epoch: int | None = None,
                   bound_reads: bool = True) -> PackedShare:
        """Rank ``rank``'s share of the ``seq``-th admitted mini-batch, waiting for its admission. ``timeout``
        bounds the whole call: the wait (``TimeoutError``, nothing claimed, if it is not admitted in time) and then
        the share's reads, within what is left of it or the plane's read deadline, whichever is shorter
        (``ReadTimeoutError`` past it, the claim undone: a unit stalled in a read costs the caller its timeout, not
        the 300 s read deadline). ``bound_reads=False``: ``timeout`` bounds only the wait and the reads keep the
        plane's deadline (the prefetcher, whose waits are sliced). ``epoch``: the rank's incarnation; a retry of a
        claim whose reply was lost then gets the same share (``Controller.claim``)."""
        names = tuple(fields) if fields is not None else self.schema.names
        if not isinstance(rank, int) or isinstance(rank, bool):
            raise SchemaMismatchError(f"rank must be an int, got {rank!r}")
        if not isinstance(seq, int) or isinstance(seq, bool) or seq < 0:
            raise SchemaMismatchError(f"seq must be an int >= 0 (the admission order), got {seq!r}")
        t0 = time.perf_counter()
        loc = self.controller.claim_next(seq, rank, names, timeout, epoch)
        deadline = t0 + timeout if timeout is not None and bound_reads else None
        return self._deliver(loc, t0, ack, deadline=deadline)

    def thread_timing(self) -> FetchTiming | None:
        """The timing of this thread's last fetch, taken once (a prefetcher's workers fetch concurrently; the
        entry is removed, so short-lived threads leave nothing behind)."""
        return self._timings.pop(threading.get_ident(), None)

    def ack(self, share: PackedShare) -> None:
        """Acknowledge a share fetched with ``ack=False`` (the rank has stepped on it); fully consumed
        trajectories are then dropped at their units. With a remote controller the ack is queued and sent off the
        rank's critical path (``AckSender``): a failure of an earlier ack is raised here or by ``flush_acks``."""
        self._ack(share.key, share.rank, tuple(share.fields), _fence(share.epoch))

    def _ack(self, key: MiniBatchKey, rank: int, fields: tuple[str, ...], epoch: int | None) -> None:
        self._sources.release((key, rank))
        if self.remote_controller or self.ack_delay_s > 0:
            if self._acks is None:
                from knittrans.dataplane.feed import AckSender

                target = self.controller if self.remote_controller else _LocalAcks(self.controller, self.units)
                self._acks = AckSender(target, self.ack_delay_s)
            self._acks.send(key, rank, fields, epoch)
            return
        _LocalAcks(self.controller, self.units).ack_many([(key, rank, fields, epoch)])

    def flush_acks(self, timeout: float | None = 60.0) -> None:
        """Wait until every ack this client sent is applied by the controller; re-raise the first that failed
        (a no-op in process without ``ack_delay_s``, where acks are synchronous). ``TimeoutError`` after
        ``timeout`` seconds."""
        if self._acks is not None:
            self._acks.flush(timeout)

    def close(self) -> None:
        """Send the queued acks and stop this client's sender thread (re-raises a failed ack)."""
        if self._acks is not None:
            self._acks.close()

    def feed(self, rank: int, fields: Sequence[str] | None, start_seq: int, count: int | None, window: int,
             epoch: int | None = None):  # noqa: ANN201 - a started ShareFeed
        """Rank ``rank``'s claims by long poll (``feed.ShareFeed``): take each share's location with ``get(seq)``,
        then ``deliver`` it."""
        from knittrans.dataplane.feed import ShareFeed

        names = tuple(fields) if fields is not None else self.schema.names
        self._sources.retiring = True  # the feed's polls say which sources are retired: keep them until then
        return ShareFeed(self.controller, rank, names, start_seq, count, window, epoch,
                         on_retired=self._sources.retire).start()

    def deliver(self, loc: ShareLocation, claim_s: float = 0.0, ack: bool = False,
                asked_at: float | None = None) -> PackedShare:
        """Read, verify and pack a share claimed through a ``feed`` (``claim_s``: the time its caller spent on the
        control path for it, for the fetch's timing; ``asked_at``: when the caller asked the feed for it, for a
        trace: the wait for its admission and location is the claim a cluster replay starts from)."""
        return self._deliver(loc, time.perf_counter(), ack, claim_s, asked_at)

    def _pack(self, loc: ShareLocation, chunks: Sequence[UnitChunk]) -> PackedShare:
        """Turn the units' chunks into the rank's share (``knittrans.mmdedup.plane.MMClient`` adds images)."""
        return pack_share(loc, chunks, self.schema, self.prepare, self.pack_pool())

    def pack_pool(self) -> BufferPool | None:
        """This client's reused pack buffers (None when ``prepare.reuse_buffers`` is off)."""
        if self.pool is None and self.prepare.reuse_buffers:
            self.pool = process_pool(self.prepare.pool_buffers)
        return self.pool

    def _deliver(self, loc: ShareLocation, t0: float, ack: bool = True, claim_s: float | None = None,
                 asked_at: float | None = None, deadline: float | None = None) -> PackedShare:
        """Read a claimed share, verify and pack it, ack it (after which fully consumed trajectories are dropped at
        their units). A share with runs (``loc.runs``) is read straight from its sources, no unit call; any other
        through its units. A failed read or check undoes the claim before re-raising. ``deadline``
        (``time.perf_counter``): the reads end by then at the latest (``ReadTimeoutError``)."""
        rec = trace.active()  # None unless a multi-node run records this process (knittrans.dataplane.trace)
        key = f"r{loc.rank}/s{loc.seq}"
        direct = loc.runs is not None and self.prepare.direct_reads
        getter = self._getter_by(deadline)
        try:
            with trace.keyed(key) if rec is not None else contextlib.nullcontext():
                if direct:
                    t1 = time.perf_counter()
                    try:
                        objects = self._resolve(loc.runs, getter, (loc.key, loc.rank))
                    except ResolveStalledError as e:  # the safety net: the same share through its units
                        self.resolve_fallbacks += 1
                        log.warning("rank %d share #%d: %s; read through its units instead (fallback %d)",
                                    loc.rank, loc.seq, e, self.resolve_fallbacks)
                        direct = False
                        chunks, _, t2 = self._read(loc, getter)
                    else:
                        t2 = time.perf_counter()
                else:
                    chunks, t1, t2 = self._read(loc, getter)
        except DataPlaneError as e:
            if isinstance(e, UnitLostError):
                self.controller.lose_unit(e.unit_id)  # whoever sees a unit die reports it (idempotent)
            self.controller.unclaim(loc.key, loc.rank, loc.fields)
            raise
        c2 = time.thread_time()
        try:
            if direct:
                share = self._pack_runs(loc, objects)
                del objects  # the object-store views: the share holds its own bytes now
                if loc.checksums:
                    from knittrans.dataplane.faults import verify_share

                    verify_share(loc, share)
            else:
                share = self._pack(loc, chunks)
        except DataPlaneError:
            self.controller.unclaim(loc.key, loc.rank, loc.fields)
            raise
        t3, c3 = time.perf_counter(), time.thread_time()
        if claim_s is None:  # claimed by this call: its round trip, less the controller's wait for admission
            wait = min(loc.waited_s, t1 - t0)  # measured inside the claim's round trip, so never longer than it
            claim_s = t1 - t0 - wait
        else:
            wait = 0.0
        self._timings[threading.get_ident()] = FetchTiming(claim_s, t2 - t1, t3 - t2, wait, c3 - c2)
        if rec is not None:
            rec.add(trace.CpuEvent("claim", "", t0 if asked_at is None else asked_at, t1, key))
            rec.add(trace.CpuEvent("pack", "", t2, t3, key))
        if ack:
            self._ack(loc.key, loc.rank, loc.fields, _fence(loc.epoch))
        return share

    @property
    def reads_through_units(self) -> bool:
        """Whether this client's shares are read through their units (round trips) rather than straight from their
        sources (``pack_runs``; ``PrepareConfig.direct_reads``); the prefetcher overlaps several shares' reads only
        then."""
        return not self.prepare.direct_reads

    def _pack_runs(self, loc: ShareLocation, objects: Sequence[Sequence[np.ndarray]]) -> PackedShare:
        """Pack a share read straight from its sources (``pack_runs``; ``MMClient`` adds the distinct images)."""
        return pack_runs(loc, objects, self.schema, self.prepare, self.pack_pool())

    def _getter_by(self, deadline: float | None) -> UnitGetter | None:
        """This client's getter, or a copy whose read deadline ends at ``deadline`` when that comes first."""
        if deadline is None or self.getter is None or not dataclasses.is_dataclass(self.getter):
            return self.getter
        left = max(0.0, deadline - time.perf_counter())
        current = self.getter.read_timeout_s
        if current is not None and current <= left:
            return self.getter
        return dataclasses.replace(self.getter, read_timeout_s=left)

    def _resolve(self, runs: ShareRuns, getter: UnitGetter | None = None,
                 user: tuple | None = None) -> Sequence[Sequence[np.ndarray]]:
        """The arrays of each of the share's sources: in process the sources themselves; on Ray one ``ray.get``
        (``ParallelRayGetter.resolve``) of those this reader has not mapped yet (``SourceCache``; ``user``: the
        share, which reads them until its ack)."""
        resolve = getattr(getter if getter is not None else self.getter, "resolve", None)
        if resolve is None:
            return runs.sources
        if user is None or not self.remote_controller:
            return resolve(runs)
        return self._sources.objects(runs, user, resolve)

    def _unit_args(self, loc: ShareLocation) -> Mapping[str, tuple] | None:
        """Hook: extra arguments of each unit's ``get`` for this share (None: none; ``MMClient`` names the
        images each unit ships)."""
        return None

    def _read(self, loc: ShareLocation, getter: UnitGetter | None = None) -> tuple[list[UnitChunk], float, float]:
        """The share's chunks from its units (all requested at once), checked against the claim's checksums."""
        getter = getter if getter is not None else self.getter
        t1 = time.perf_counter()
        requests: dict[str, list[int]] = {}
        for t, u in zip(loc.traj_ids, loc.unit_ids):
            requests.setdefault(u, []).append(t)
        reqs = [(u, tuple(ts)) for u, ts in requests.items()]
        args = self._unit_args(loc)
        if getter is not None:
            chunks = getter(reqs, loc.fields) if args is None else getter(reqs, loc.fields, args)
        else:
            chunks = [self.units[u].get(ts, loc.fields, *(args or {}).get(u, ())) for u, ts in reqs]
        if loc.checksums:
            from knittrans.dataplane.faults import verify_chunks

            verify_chunks(loc, chunks, {n: self.schema.get(n).ragged for n in loc.fields})
        t2 = time.perf_counter()
        return list(chunks), t1, t2
