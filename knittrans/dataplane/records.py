"""The handoff's records: each trained trajectory's versions and times, kept compactly and, by default, bounded.

Why a log of its own: a long run trains millions of trajectories; one ``HandoffRecord`` object each would cost
~400 B of controller memory. Released records are kept here in columns, 64 B per row (6 ``int64`` and 2
``float64``), and only the last ``window`` rows of them (``RecordLog``): with a window the controller's memory is
flat however long the run. A ``sink`` receives every released row as it is released (a file, a W&B table, the
staleness report's accumulator), so nothing is lost when the window is bounded. Staleness is kept exactly over
every row ever released, as a histogram (``counts``: staleness value -> trajectories; a few entries, since
staleness is a small number of steps), so ``Handoff.staleness()`` never depends on the window.

    >>> log = RecordLog(window=2)
    >>> for t in range(3):
    ...     log.append((t, 0, 0, 5, 0, t, 0.0, 0.0))
    >>> [r.traj_id for r in log.rows()], log.total, sorted(log.counts.items())
    ([1, 2], 3, [(0, 1), (1, 1), (2, 1)])
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

INT_COLUMNS = ("traj", "group", "batch", "tokens", "v_gen", "v_train")
"""A released record's int columns, in ``HandoffRecord``'s field order; then t_complete, t_admit (floats)."""


@dataclass(frozen=True)
class HandoffRecord:
    """One trajectory's versions and times through the handoff (seconds since the controller started).
    ``v_train`` is the policy version of the step that trains it (its mini-batch's admission order); staleness
    ``v_train - v_gen`` (``knittrans.types``)."""

    traj_id: int
    group_id: int
    batch_id: int
    num_tokens: int
    v_gen: int
    v_train: int
    t_complete: float
    t_admit: float
    released: bool

    @property
    def staleness(self) -> int:
        return self.v_train - self.v_gen


Row = tuple[int, int, int, int, int, int, float, float]
"""A released record: the ``INT_COLUMNS`` values, then t_complete and t_admit."""


class RecordLog:
    """Released records in columns (``INT_COLUMNS`` + two times), the last ``window`` of them (None: all); every row
    also goes to ``sink`` (called with a list of ``HandoffRecord`` rows, once per released mini-batch). Not
    thread-safe: the controller calls it under its lock."""

    def __init__(self, window: int | None = None, sink: Callable[[list[HandoffRecord]], None] | None = None) -> None:
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 0):
            raise ValueError(f"RecordLog.window must be an int >= 0 or None, got {window!r}")
        self.window, self.sink = window, sink
        self._i, self._f = array("q"), array("d")
        self.total = 0  # rows ever appended (the window keeps the last ones)
        self.counts: dict[int, int] = {}  # staleness (v_train - v_gen) -> rows ever appended with it

    def append(self, row: Row) -> None:
        self.extend((row,))

    def extend(self, rows: Iterable[Row]) -> None:
        rows = list(rows)
        if not rows:
            return
        count_staleness(self.counts, rows)
        if self.window != 0:
            for r in rows:
                self._i.extend(r[:6])
                self._f.extend(r[6:])
        self.total += len(rows)
        if self.window is not None and len(self._f) > 2 * self.window * 2:  # trim in bulk: amortized O(1)
            self._trim()
        if self.sink is not None:
            self.sink([_record(r) for r in rows])

    def _trim(self) -> None:
        keep = self.window or 0
        del self._i[:len(self._i) - 6 * keep]
        del self._f[:len(self._f) - 2 * keep]

    def restore(self, rows_i: Sequence[int], rows_f: Sequence[float], total: int | None = None,
                counts: dict[int, int] | None = None) -> None:
        """The log as a journal kept it (flat columns and the staleness histogram; after a controller restart)."""
        self._i, self._f = array("q", rows_i), array("d", rows_f)
        self.total = len(self._f) // 2 if total is None else total
        if counts is None:
            counts = {}
            count_staleness(counts, (tuple(rows_i[6 * n:6 * n + 6]) for n in range(len(rows_f) // 2)))
        self.counts = dict(counts)
        if self.window is not None:
            self._trim()

    def rows(self) -> list[HandoffRecord]:
        """The kept rows, oldest first (at most ``window``)."""
        if self.window is not None:
            self._trim()
        i, f = self._i, self._f
        return [HandoffRecord(*i[6 * n:6 * n + 6], f[2 * n], f[2 * n + 1], True) for n in range(len(f) // 2)]

    def __len__(self) -> int:
        n = len(self._f) // 2
        return n if self.window is None else min(n, self.window)


def count_staleness(counts: dict[int, int], rows: Iterable[Sequence]) -> None:
    """Add each row's staleness (``v_train - v_gen``: columns 5 and 4) to the histogram ``counts``."""
    for r in rows:
        s = r[5] - r[4]
        counts[s] = counts.get(s, 0) + 1


def trim_rows(rows_i: array, rows_f: array, window: int | None) -> None:
    """Keep the last ``window`` rows of flat record columns (6 ints, 2 floats per row) once they hold twice as many
    (in bulk: amortized O(1) per row); None keeps all."""
    if window is not None and len(rows_f) > 4 * window:
        del rows_i[:len(rows_i) - 6 * window]
        del rows_f[:len(rows_f) - 2 * window]


def _record(r: Row) -> HandoffRecord:
    return HandoffRecord(*r[:6], r[6], r[7], True)
