"""The controller's production side: a put's records (or columns) checked against the controller's state and
registered. ``Controller.register`` is all-or-nothing: what a retried put repeats (idempotent puts) and which records
complete a trajectory are validated against the announced batches and the schema by pure functions of the state
they are handed (they raise, never mutate) before anything changes; ``PutRegistry`` is the part of ``Controller``
that then applies a put (a mixin: it works on the controller's state, under its lock)."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any, Container, Mapping, Sequence

import numpy as np

from knittrans.dataplane.columns import PutColumns, records_of
from knittrans.dataplane.recovery import CompleteEvent
from knittrans.dataplane.sources import Where
from knittrans.dataplane.types import (AdmissionStateError, DataPlaneClosedError, DuplicatePutError, MiniBatchKey,
                                       PutRecord, TrajectorySchema)
from knittrans.types import Trajectory


def strip_repeats(records: Sequence[PutRecord], trajs: Mapping[int, Any]) -> list[PutRecord]:
    """Drop what a retried put repeats (fields its unit already held with identical bytes and the controller
    registered, and the same completing metadata) so a retry whose first reply was lost is a no-op. Fields the
    unit held but the controller never registered (the first register call was lost) stay. A field registered on
    the same unit, of the same size and checksum, is a repeat even when the unit took it as new: the unit holds
    those bytes now (a register retried across a controller restart, whose rebuild learnt the field from the
    unit's manifest; or a re-put to a unit that had lost it). ``trajs``: trajectory id -> the controller's state."""
    out = []
    for r in records:
        st = trajs.get(r.traj_id)
        if st is None or st.unit_id != r.unit_id:
            if st is not None and st.unit_id is None and r.meta is not None and st.meta == r.meta:
                r = dataclasses.replace(r, meta=None)  # a lost trajectory's re-put carries its metadata again
            out.append(r)
            continue
        rep = {fm.name for fm in r.fields if st.fields.get(fm.name) == fm.nbytes
               and (fm.name in r.repeated or st.checksums.get(fm.name) == fm.checksum)}
        same_meta = r.meta is not None and st.meta == r.meta
        if rep or same_meta:
            keep = [i for i, fm in enumerate(r.fields) if fm.name not in rep]
            r = dataclasses.replace(r, fields=tuple(r.fields[i] for i in keep),
                                    where=tuple(r.where[i] for i in keep) if r.where else (),
                                    meta=None if same_meta else r.meta)
        if r.fields or r.meta is not None:
            out.append(r)
    return out


def check_completions(records: Sequence[PutRecord], trajs: Mapping[int, Any], groups: Mapping[int, tuple[int, int]],
                      arrived: Mapping[int, int], schema: TrajectorySchema, max_response_len: int) -> list[PutRecord]:
    """The records whose put completes a trajectory (it carries ``meta``), validated against the announced batches
    (``groups``: group -> (batch, declared size); ``arrived``: group -> completed trajectories) and the tensors:
    ``num_tokens`` against every field known so far (this put's and earlier ones'), since records and token budgets
    count it, so metadata that disagrees with the tensors is refused by name."""
    done = [r for r in records if r.meta is not None]
    extra: dict[int, int] = {}
    ids: set[int] = set()
    for r in done:
        m = r.meta
        if not isinstance(m, Trajectory) or m.traj_id != r.traj_id:
            raise AdmissionStateError(f"put of trajectory {r.traj_id} carries metadata of "
                                      f"{getattr(m, 'traj_id', type(m).__name__)!r}")
        st = trajs.get(r.traj_id)
        if (st is not None and st.meta is not None) or r.traj_id in ids:
            raise DuplicatePutError(f"trajectory {r.traj_id} was already completed (its metadata arrived before)")
        ids.add(r.traj_id)
        if m.group_id not in groups or groups[m.group_id][0] != m.batch_id:
            raise AdmissionStateError(f"trajectory {r.traj_id}: group {m.group_id} of batch {m.batch_id} was "
                                      f"never announced (add_batch first)")
        extra[m.group_id] = extra.get(m.group_id, 0) + 1
        size = groups[m.group_id][1]
        if arrived.get(m.group_id, 0) + extra[m.group_id] > size:
            raise AdmissionStateError(f"trajectory {r.traj_id}: group {m.group_id} already has its declared "
                                      f"{size} trajectories")
        if m.num_tokens > max_response_len:
            raise AdmissionStateError(f"trajectory {r.traj_id}: num_tokens={m.num_tokens} exceeds "
                                      f"max_response_len={max_response_len}")
        lengths = {} if st is None else {n: schema.rows_of(n, b) for n, b in st.fields.items() if b}
        lengths.update({fm.name: fm.length for fm in r.fields})
        schema.check_num_tokens(r.traj_id, m.num_tokens, lengths)
    return done


def columns_take_fast_path(cols: PutColumns, unit_id: str, trajs: Mapping[int, Any], released: Container[int],
                           consumed_after_loss: Container[int], groups: Mapping[int, tuple[int, int]] | None,
                           arrived: Mapping[int, int], schema: TrajectorySchema, max_response_len: int) -> bool:
    """Whether a columnar put (``columns``) registers as the plain case: every trajectory new, or held on this same
    unit without any of these fields (and, if this put completes it, not completed yet), and every completion valid
    as ``check_completions`` checks it (``groups`` None: no admission policy, metadata is ignored). False: the
    controller registers the put as records instead (``Controller.register``), which handles a re-put, a repeat or a
    refusal and names it. Pure: it raises nothing and changes nothing."""
    names = cols.names
    metas = cols.metas if groups is not None else None
    extra: dict[int, int] = {}
    resp, tok = schema.response_fields, schema.token_field
    kinds: dict[str, tuple[int, bool, bool]] = {}  # field -> (row bytes, response field, token field), once per put
    for i, t in enumerate(cols.traj_ids.tolist()):
        st = trajs.get(t)
        if t in consumed_after_loss or (st is None and t in released):
            return False
        if st is not None and (st.unit_id != unit_id or any(n in st.fields for n in names)):
            return False
        m = metas[i] if metas is not None else None
        if m is None:
            continue
        if m.traj_id != t or (st is not None and st.meta is not None):
            return False
        g = groups.get(m.group_id)  # type: ignore[union-attr]
        if g is None or g[0] != m.batch_id or m.num_tokens > max_response_len:
            return False
        extra[m.group_id] = extra.get(m.group_id, 0) + 1
        if arrived.get(m.group_id, 0) + extra[m.group_id] > g[1]:
            return False
        if st is not None:  # fields put before this one must agree with the metadata too (``schema.rows_of``)
            for n, b in st.fields.items():
                if not b:
                    continue
                k = kinds.get(n)
                if k is None:
                    k = kinds[n] = (schema.get(n).row_nbytes, n in resp, n == tok)
                rows = b // k[0] if k[0] else 0
                if (k[1] and rows != m.num_tokens) or (k[2] and rows < m.num_tokens):
                    return False
    return True


@dataclass
class _TrajState:
    unit_id: str | None  # None: missing (its unit was lost; waiting for a re-put)
    fields: dict[str, int] = field(default_factory=dict)  # produced field -> nbytes
    num_tokens: int | None = None
    admitted_in: MiniBatchKey | None = None
    checksums: dict[str, int] = field(default_factory=dict)  # produced field -> producer's checksum
    meta: Trajectory | None = None  # admission metadata, once the completing put arrived
    t_complete: float = 0.0  # when the completing put registered (seconds since the controller started)
    where: dict[str, Where] = field(default_factory=dict)
    """Produced field -> where its bytes lie in its unit's source (``sources``); a field without one is read
    through its unit."""


class PutRegistry:
    """``Controller``'s production side (a mixin: every attribute it uses is the controller's, and it runs under the
    controller's lock): ``register`` (records) and ``register_columns`` (columnar puts), and the hooks a subclass
    refines (``MMController``: its groups and image keys)."""

    def register(self, records: Sequence[PutRecord]) -> tuple[int, ...]:
        """Record that units hold these fields. All-or-nothing: a duplicate field, or a trajectory whose fields
        would span two units, rejects the whole call. A re-put of a missing trajectory (its unit was lost)
        restores it on the new unit. Returns the ids it did not need: re-puts of trajectories that were
        consumed in the meantime (the caller drops them from the unit). A closed controller refuses the call with
        ``DataPlaneClosedError`` (the put is rolled back at its unit, never silently dropped)."""
        with self._cv:
            if self._closed:
                ids = [r.traj_id for r in records][:8]
                raise DataPlaneClosedError(f"the data plane is closed: put of trajectories {ids} refused (nothing was "
                                           f"registered; put to a live handoff)")
            records = self._strip_repeats_locked(records)
            seen: set[tuple[int, str]] = set()
            # re-puts not needed: trajectories consumed since they went missing (their rank read them before the
            # unit died), or released while missing
            skip = {r.traj_id for r in records if r.traj_id in self._consumed_after_loss or (
                r.traj_id in self._trajs and self._trajs[r.traj_id].unit_id is None and r.traj_id not in self._missing)}
            for r in records:
                if r.unit_id not in self.unit_nodes:
                    raise AdmissionStateError(f"put of trajectory {r.traj_id} to unknown unit {r.unit_id!r}")
                if r.traj_id in skip:
                    continue
                if r.traj_id not in self._trajs and r.traj_id in self._released_ids:
                    raise DuplicatePutError(f"trajectory {r.traj_id} was consumed and released; it takes no more "
                                            f"fields (a regenerated trajectory needs a new id)")
                st = self._trajs.get(r.traj_id)
                if st is not None and st.unit_id is None:  # missing: a re-put, to any unit
                    if r.num_tokens is not None and st.num_tokens is not None and r.num_tokens != st.num_tokens:
                        raise DuplicatePutError(f"re-put of lost trajectory {r.traj_id} has {r.num_tokens} tokens; "
                                                f"the original had {st.num_tokens} (a re-put must be the same "
                                                f"trajectory)")
                    continue
                if st is not None and st.unit_id != r.unit_id:
                    raise DuplicatePutError(f"trajectory {r.traj_id} lives on unit {st.unit_id!r}; a put to unit "
                                            f"{r.unit_id!r} would split it across units")
                if st is not None and st.admitted_in is not None and self._mbs[st.admitted_in].released:
                    # A field may arrive after admission (e.g. logprobs from a later pass), but not once every
                    # rank has consumed the mini-batch and its units dropped it.
                    raise DuplicatePutError(f"trajectory {r.traj_id} was consumed and released with "
                                            f"{st.admitted_in}; it takes no more fields")
                for fm in r.fields:
                    if (st is not None and fm.name in st.fields) or (r.traj_id, fm.name) in seen:
                        raise DuplicatePutError(f"field {fm.name!r} of trajectory {r.traj_id} was already "
                                                f"produced (each field is produced exactly once)")
                    seen.add((r.traj_id, fm.name))
            completing = self._check_completions([r for r in records if r.traj_id not in skip])
            for r in records:
                if r.traj_id in skip:
                    continue
                st = self._trajs.setdefault(r.traj_id, _TrajState(unit_id=r.unit_id))
                if st.unit_id is None:  # restored: it now holds exactly what the re-put carried
                    st.unit_id = r.unit_id
                    st.fields.clear()
                    st.checksums.clear()
                    self._sources.release(st.where)
                    self._missing.discard(r.traj_id)
                st.fields.update({fm.name: fm.nbytes for fm in r.fields})
                st.checksums.update({fm.name: fm.checksum for fm in r.fields if fm.checksum is not None})
                if r.source is not None:
                    st.where.update(self._sources.add(r.source, r.unit_id,
                                                      [(fm.name, w) for fm, w in zip(r.fields, r.where)]))
                if r.num_tokens is not None:
                    st.num_tokens = r.num_tokens
            self._sources.end_put()
            self._registered_locked(records)
            for r in completing:
                self._complete_locked(r)
            if completing:
                if self._journal is not None:  # before the decisions they trigger (a replay asks at this point)
                    self._journal.complete(CompleteEvent(tuple(r.meta for r in completing),
                                                         self._trajs[completing[0].traj_id].t_complete),
                                           self._completed)
                self._admit_ready_locked()
            if records:
                self._cv.notify_all()  # a re-put may complete a share that claim_next waits for
            return tuple(sorted(skip))

    def register_columns(self, unit_id: str, cols: PutColumns, source: object = None) -> tuple[int, ...]:
        """``register`` for a columnar put (``columns``; ``source``: where its unit keeps it, one array per field
        of ``cols.names`` in order, as ``PutRecord.source``): the plain case -- every trajectory new or held on this
        unit without these fields, every completion valid (``puts.columns_take_fast_path``) -- without a record or
        a check per field per trajectory; any other case registers the same put as records (``register``), which
        decides it and names what it refuses."""
        with self._cv:
            if self._columns_plain_locked(unit_id, cols):
                self._register_columns_locked(unit_id, cols, source)
                return ()
        return self.register(records_of(unit_id, cols, source, self.schema))

    def register_columns_inline(self, unit_id: str, cols: PutColumns, source: object) -> bool:
        """``register_columns``' plain case, taken only for a later put of trajectories that unit ``unit_id``
        holds already and whose every registered field a rank reads from its source (``_sourced_locked``): a small
        put whose bytes ride with its registration (``source`` holds them), its unit's copy written after
        (``ray_transport.ControllerHost.register_inline``) -- so no share holding them is read through the unit,
        which may not hold them yet. False: nothing registered -- the caller writes the unit first and registers as
        ``register_columns``."""
        with self._cv:
            if not self._columns_plain_locked(unit_id, cols):
                return False
            trajs = self._trajs
            for t in cols.traj_ids.tolist():
                st = trajs.get(t)
                if st is None or st.unit_id != unit_id or not self._sourced_locked(t, st):
                    return False
            self._register_columns_locked(unit_id, cols, source)
            return True

    def _sourced_locked(self, traj_id: int, st: _TrajState) -> bool:
        """Whether every field registered for ``traj_id`` lies in a source (a claim's runs: read without its unit);
        a subclass whose shares need more (images' locations) says so."""
        return bool(st.fields) and all(n in st.where for n in st.fields)

    def _columns_plain_locked(self, unit_id: str, cols: PutColumns) -> bool:
        """Whether a columnar put registers as the plain case (``columns_take_fast_path``; lock held)."""
        policy = self.policy
        return (not self._closed and unit_id in self.unit_nodes and self._plain_registration()
                and np.unique(cols.traj_ids).shape[0] == len(cols)
                and columns_take_fast_path(cols, unit_id, self._trajs, self._released_ids,
                                           self._consumed_after_loss, None if policy is None else self._groups,
                                           self._arrived, self.schema,
                                           0 if policy is None else policy.constraints.max_response_len))

    def _plain_registration(self) -> bool:
        """A subclass that keeps per-trajectory state of its own at registration registers records only, unless it
        keeps that state for columns too (``_columns_registered_locked``)."""
        cls = type(self)
        return ((cls._registered_locked is PutRegistry._registered_locked
                 and cls._strip_repeats_locked is PutRegistry._strip_repeats_locked)
                or cls._columns_registered_locked is not PutRegistry._columns_registered_locked)

    def _columns_registered_locked(self, unit_id: str, cols: PutColumns) -> None:
        """Hook: the plain case of a columnar put is being registered, before any completion or admission it
        triggers (lock held). A subclass that keeps state at registration and overrides this takes columns."""

    def _register_columns_locked(self, unit_id: str, cols: PutColumns, source: object) -> None:
        self._columns_registered_locked(unit_id, cols)
        bounds = cols.byte_bounds(self.schema)
        key = None if source is None else self._sources.add_many(source, unit_id, len(cols) * len(cols.names))
        tokens = cols.token_lengths(self.schema)
        metas = cols.metas if self.policy is not None else None
        completing = []
        for i, t in enumerate(cols.traj_ids.tolist()):
            st = self._trajs.get(t)
            if st is None:
                st = self._trajs[t] = _TrajState(unit_id=unit_id)
            for j, name in enumerate(cols.names):
                a, b = bounds[j][i], bounds[j][i + 1]
                st.fields[name] = b - a
                if key is not None:
                    st.where[name] = (key, j, a, b)
            if tokens is not None:
                st.num_tokens = tokens[i]
            if metas is not None and metas[i] is not None:
                completing.append((t, metas[i]))
        for t, m in completing:
            self._complete_one(t, m)
        if completing:
            if self._journal is not None:  # before the decisions they trigger (a replay asks at this point)
                self._journal.complete(CompleteEvent(tuple(m for _, m in completing),
                                                     self._trajs[completing[0][0]].t_complete), self._completed)
            self._admit_ready_locked()
        if len(cols):
            self._cv.notify_all()

    def _strip_repeats_locked(self, records: Sequence[PutRecord]) -> list[PutRecord]:
        """Idempotent puts: what a retried put repeats is dropped (``puts.strip_repeats``; a subclass hook)."""
        return strip_repeats(records, self._trajs)

    def _check_completions(self, records: Sequence[PutRecord]) -> list[PutRecord]:
        """The records whose put completes a trajectory, validated before anything changes (``puts``)."""
        if self.policy is None:  # without a policy, metadata is ignored
            return []
        return check_completions(records, self._trajs, self._groups, self._arrived, self.schema,
                                 self.policy.constraints.max_response_len)

    def _registered_locked(self, records: Sequence[PutRecord]) -> None:
        """Hook: ``records`` were just registered, before any admission they trigger (lock held)."""

    def _complete_locked(self, r: PutRecord) -> None:
        assert r.meta is not None
        self._complete_one(r.traj_id, r.meta)

    def _complete_one(self, traj_id: int, meta: Trajectory) -> None:
        assert self.policy is not None
        st = self._trajs[traj_id]
        st.meta, st.t_complete = meta, time.perf_counter() - self._t0
        self._arrived[meta.group_id] = self._arrived.get(meta.group_id, 0) + 1
        self._completed += 1
        self.policy.on_complete(meta)
