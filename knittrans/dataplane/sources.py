"""Where a share's bytes lie: the units' sources, as the controller keeps them and hands them to a reader.

A unit stores each put's fields back to back, one array per field (``storage.PutRuns``; on Ray one object-store
object the unit owns), and reports with every put record that source and the byte range of each of the record's
fields (``PutRecord.source`` / ``where``). The controller keeps, per trajectory and field, (source key, array, first
byte, end byte), and per source its handle and how many registered rows lie in it (``SourceTable``). A claim then
answers with the share's runs (``ShareRuns``): the handles of the few sources its rows lie in and, per field, the
rows merged into runs wherever consecutive rows of the share lie back to back -- a reader resolves the sources once
and copies each run once (``client.pack_runs``), no unit call. On Ray the controller's handle is an ``ObjectRef``
owned by the unit: holding it here keeps the object alive while any of its rows can still be claimed.

    >>> t = SourceTable()
    >>> src = (np.arange(6, dtype=np.int64),)          # one put: two trajectories' ids back to back
    >>> rows = [t.add(src, "u0", [("ids", (0, 0, 16))]), t.add(src, "u0", [("ids", (0, 16, 48))])]
    >>> t.end_put()
    >>> runs = t.runs(rows, ("ids",))                  # a share of both: one run
    >>> runs.runs[0].tolist(), runs.nbytes[0].tolist(), len(t)
    ([[0, 0, 0, 48]], [16, 32], 1)
    >>> t.release(rows[0]); t.release(rows[1]); len(t)  # its last row released: the source is forgotten
    0
"""

from __future__ import annotations

import uuid
from typing import Mapping, Sequence

import numpy as np

from knittrans.dataplane.types import Retired, ShareRuns

Where = tuple[int, int, int, int]
"""(source key, array of the source, first byte, end byte) of one stored row."""


RETIRED_KEPT = 1 << 16
"""Retired sources the table remembers for readers that have not polled since (``retired_since``); a reader further
behind is told to reset (``Retired.reset``)."""


class SourceTable:
    """The controller's sources: key -> [handle, unit id, rows registered in it]. Not thread-safe: the controller
    calls it under its lock.

    Retirement: a source whose last row is released will never be named in a claim again; on Ray its handle's
    object id (``ObjectRef.binary()``) joins a log that remote readers page through (``retired_since``), so a
    reader keeps each source it mapped (``client.SourceCache``) until it is retired instead of letting go of it
    between two shares that read it -- a reader never drops its last reference to an object it will be handed
    again."""

    def __init__(self) -> None:
        self._sources: dict[int, list] = {}
        self._next = 0
        self._ids: dict[int, int] = {}  # id(handle) -> key, for the put being registered (``begin`` / ``end``)
        self._retired: list[bytes] = []  # ids of retired remote sources, oldest first
        self._retired_base = 0  # retirements trimmed off the head of the log
        self._log = uuid.uuid4().hex  # this table's log (a restarted controller's is another one)

    def add(self, handle: object, unit_id: str, fields: Sequence[tuple[str, tuple[int, int, int] | None]]
            ) -> dict[str, Where]:
        """Register rows of ``handle`` (one put's source, held by ``unit_id``): ``fields`` are (name, (array, first
        byte, end byte) or None); returns each located field's ``Where``. Records of one put name the same handle,
        which is registered once."""
        key = self._ids.get(id(handle))
        if key is None:
            key, self._next = self._next, self._next + 1
            self._ids[id(handle)] = key
            self._sources[key] = [handle, unit_id, 0]
        out = {name: (key, *w) for name, w in fields if w is not None}
        self._sources[key][2] += len(out)
        return out

    def add_many(self, handle: object, unit_id: str, rows: int) -> int:
        """Register a put's source holding ``rows`` rows at once (a columnar put: the controller builds each row's
        ``Where`` from the key returned); ``rows`` > 0."""
        key, self._next = self._next, self._next + 1
        self._sources[key] = [handle, unit_id, rows]
        return key

    def end_put(self) -> None:
        """The put's records are registered: forget the handles' ids (a later put's handle may reuse one), and a
        source none of whose rows was new (every field a repeat)."""
        for key in self._ids.values():
            if self._sources[key][2] == 0:
                del self._sources[key]
        self._ids.clear()

    def release(self, where: dict[str, Where]) -> None:
        """These rows leave their sources (released, discarded, lost or replaced): a source left without rows is
        forgotten (on Ray the controller's reference to the unit's object goes; the unit frees it with its last
        row). Empties ``where``."""
        for key, *_ in where.values():
            src = self._sources.get(key)
            if src is not None:
                src[2] -= 1
                if src[2] <= 0:
                    del self._sources[key]
                    self._retire(src[0])
        where.clear()

    def _retire(self, handle: object) -> None:
        binary = getattr(handle, "binary", None)  # an ObjectRef (in process a source is arrays: nobody maps it)
        if binary is not None:
            self._retired.append(binary())
            if len(self._retired) > 2 * RETIRED_KEPT:
                del self._retired[:RETIRED_KEPT]
                self._retired_base += RETIRED_KEPT

    def retired_since(self, cursor: tuple[str, int] | None) -> Retired:
        """The sources retired since ``cursor`` (a reader's position in the log; None: a reader that holds
        nothing yet), and the reader's new position. ``reset``: the reader's position is not in this log (it fell
        behind what is kept, or it is a restarted controller's new log): it drops whatever it holds that no share
        it still holds reads."""
        end = self._retired_base + len(self._retired)
        if cursor is None:
            return Retired((), (self._log, end), False)
        log, pos = cursor
        if log != self._log or not self._retired_base <= pos <= end:
            return Retired((), (self._log, end), True)
        return Retired(tuple(self._retired[pos - self._retired_base:]), (self._log, end), False)

    def clear(self) -> None:
        self._sources.clear()
        self._ids.clear()

    def __len__(self) -> int:
        return len(self._sources)

    def runs(self, rows: Sequence[Mapping[str, Where]], fields: Sequence[str]) -> ShareRuns | None:
        """The runs of a share whose trajectories' rows are ``rows`` (in share order), or None unless every
        requested field of every trajectory has a location. Rows back to back in one array merge into one run."""
        got = self.runs_with(rows, fields, ())
        return None if got is None else got[0]

    def runs_with(self, rows: Sequence[Mapping[str, Where]], fields: Sequence[str], extra: Sequence[Where]
                  ) -> tuple[ShareRuns, np.ndarray] | None:
        """``runs``, plus ``extra`` rows (e.g. a multimodal share's distinct images) as (source, array, first byte,
        end byte) rows indexing the same ``sources``."""
        index: dict[int, int] = {}
        runs, sizes = [], []
        for name in fields:
            out: list[list[int]] = []
            nb = np.empty(len(rows), dtype=np.int64)
            for i, where in enumerate(rows):
                w = where.get(name)
                if w is None:
                    return None
                key, col, a, b = w
                o = index.setdefault(key, len(index))
                last = out[-1] if out else None
                if last is not None and last[0] == o and last[1] == col and last[3] == a:
                    last[3] = b
                else:
                    out.append([o, col, a, b])
                nb[i] = b - a
            runs.append(np.array(out, dtype=np.int64).reshape(-1, 4))
            sizes.append(nb)
        more = np.array([(index.setdefault(key, len(index)), col, a, b) for key, col, a, b in extra],
                        dtype=np.int64).reshape(-1, 4)
        keys = list(index)
        return ShareRuns(tuple(self._sources[k][0] for k in keys), tuple(self._sources[k][1] for k in keys),
                         tuple(runs), tuple(sizes)), more
