"""A put's records checked against the controller's state before anything changes (``Controller.register`` is
all-or-nothing): what a retried put repeats (idempotent puts) and which records complete a trajectory, each
validated against the announced batches and the schema. Pure functions of the state they are handed (the
controller calls them under its lock); they raise, never mutate."""

from __future__ import annotations

import dataclasses
from typing import Any, Container, Mapping, Sequence

from knittrans.dataplane.columns import PutColumns
from knittrans.dataplane.types import AdmissionStateError, DuplicatePutError, PutRecord, TrajectorySchema
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
        if st is not None:  # fields put before this one must agree with the metadata too
            for n, b in st.fields.items():
                rows = schema.rows_of(n, b) if b else None
                if rows is not None and ((n in schema.response_fields and rows != m.num_tokens)
                                         or (n == schema.token_field and rows < m.num_tokens)):
                    return False
    return True
