"""The Ray controller's journal: a ``ControllerJournal`` in the controller's own process, every flushed batch of
writes appended to a file on the controller's node before the controller answers.

Why a file and not a journal actor: write-ahead means a reply waits for its entries to be durable, and an admission
is on the first share's critical path (a rank's long poll wakes at the admission and answers once it is
journaled). Through a journal actor that wait was one round trip to another process, 5-11 ms while producers' puts
and ranks' reads kept both cores busy (the write itself took 0.07 ms there); an append to a file the controller
holds open takes ~0.05 ms and schedules no other process. What the journal must survive is the controller
*process* (Ray restarts a killed actor): a file outlives it in the node's page cache, as the journal actor did.
Ray restarts the controller on the same node (``start_actors`` pins it: to ``controller_node``, else to the node of
the process that builds the plane), where the new process replays the file into a fresh ``ControllerJournal``. The
node itself failing takes the driver process with it (the default placement) and every unit on it; a journal actor
placed elsewhere would not have saved the run either.

The file is a sequence of frames (8-byte little-endian length, then a pickle): ``("writes", entries)`` for each
flush (``ControllerJournal.write``'s entries, in the controller's lock order), and ``("snapshot", journal)`` -- the
whole compacted journal -- which starts the file anew whenever what was appended since the last one passes
``SNAPSHOT_BYTES`` and twice the last snapshot's size, so the file stays bounded by what is in flight (as the
journal itself is: ``ControllerJournal``'s compaction). A frame cut short by a kill mid-append is ignored on
replay: its flush never returned, so no caller was told anything it holds. ``close`` removes the file.

    >>> import tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), "plane.journal")
    >>> j = FileJournal(path)
    >>> j.attach() is None          # a first start: nothing to recover
    True
    >>> j.seal(); j.flush()
    >>> FileJournal(path).attach().sealed   # what a restarted controller process reads back
    True
"""

from __future__ import annotations

import os
import pickle
import struct
import tempfile
import threading
from typing import Sequence

from knittrans.dataplane.recovery import (CompleteEvent, ControllerJournal, JournalState, RecoveryError, Released)
from knittrans.dataplane.types import AdmittedMiniBatch, MiniBatchKey
from knittrans.types import BatchPlan

SNAPSHOT_BYTES = 4 << 20
"""Bytes appended after which the next flush rewrites the file as one snapshot (when that is also more than twice
the last snapshot's size)."""

_HEADER = struct.Struct("<Q")


def journal_path(plane: str) -> str:
    """Where the controller of plane ``plane`` keeps its journal on its node (evaluated in the controller's process,
    so a restart on the same node finds the same file)."""
    return os.path.join(tempfile.gettempdir(), "knittrans-journals", f"{plane}.journal")


class FileJournal:
    """The controller's journal with group commit (see the module doc). The controller writes under its lock; a
    write here only queues the entry (in the lock's order), and ``flush`` applies every entry queued so far to the
    in-process journal and appends them to the file in one write. Every public ``ControllerActor`` method flushes
    before it answers, so nothing a caller is told (an admission, a claim's share, an ack taken) is unjournaled.
    Flushes are serialized, so the file holds entries in the order the controller wrote them."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.journal = ControllerJournal()
        self._pending: list[tuple[str, tuple]] = []
        self._queued = 0  # entries queued so far
        self._written = 0  # entries in the file
        self._broken: RecoveryError | None = None
        self._queue_lock = threading.Lock()
        self._flush_lock = threading.Lock()
        self._fd: int | None = None
        self._since_snapshot = 0
        self._snapshot_size = 0
        self._file_bytes = 0
        self._closed = False

    # -- start and restart ---------------------------------------------------------------------------------------

    def attach(self) -> JournalState | None:
        """Called once as the controller process starts: None for the plane's first controller (it creates the file),
        the journal's state for a restarted one (replayed from the file; the restart is counted and journaled)."""
        with self._flush_lock:
            if not os.path.exists(self.path):
                os.makedirs(os.path.dirname(self.path), exist_ok=True)
                self.journal.attach()  # marks the first start
                self._rewrite()  # the file starts with a snapshot: the first controller's wall-clock origin
                return None
            self.journal = self._replay()  # attached by the first controller (its snapshot says so)
            state = self.journal.attach()  # counts this restart
            self._rewrite()  # ... durably: the next restart counts on from it
            return state

    def _replay(self) -> ControllerJournal:
        journal = ControllerJournal()
        with open(self.path, "rb") as f:
            data = f.read()
        at = 0
        while at + _HEADER.size <= len(data):
            (n,) = _HEADER.unpack_from(data, at)
            if at + _HEADER.size + n > len(data):
                break  # cut short by a kill mid-append: that flush never returned
            kind, body = pickle.loads(data[at + _HEADER.size:at + _HEADER.size + n])
            if kind == "snapshot":
                journal = body
            else:
                journal.write(body)
            at += _HEADER.size + n
        return journal

    def _rewrite(self) -> None:
        """Start the file anew as one snapshot of the journal (atomically: a new file renamed over the old)."""
        blob = pickle.dumps(("snapshot", self.journal), protocol=pickle.HIGHEST_PROTOCOL)
        tmp = f"{self.path}.tmp"
        with open(tmp, "wb") as f:
            f.write(_HEADER.pack(len(blob)) + blob)
        os.replace(tmp, self.path)
        if self._fd is not None:
            os.close(self._fd)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        self._snapshot_size, self._since_snapshot = len(blob), 0
        self._file_bytes = _HEADER.size + len(blob)

    # -- writes ----------------------------------------------------------------------------------------------

    def _queue(self, method: str, *args: object) -> None:
        with self._queue_lock:
            self._pending.append((method, args))
            self._queued += 1

    def flush(self) -> None:
        """Block until every entry queued before this call is in the file (one write carries all of them; a flush
        that finds its entries written by a concurrent one returns at once)."""
        with self._queue_lock:
            target = self._queued
        with self._flush_lock:
            if self._broken is not None:
                raise self._broken
            if self._written >= target or self._closed:  # nothing new, or closed (the plane is gone)
                return
            if self._fd is None:
                raise RuntimeError("FileJournal.flush before attach(): the controller attaches as it starts")
            with self._queue_lock:
                batch, self._pending, upto = self._pending, [], self._queued
            try:
                self.journal.write(batch)
                blob = pickle.dumps(("writes", batch), protocol=pickle.HIGHEST_PROTOCOL)
                os.write(self._fd, _HEADER.pack(len(blob)) + blob)
                self._since_snapshot += len(blob)
                self._file_bytes += _HEADER.size + len(blob)
                if self._since_snapshot > max(SNAPSHOT_BYTES, 2 * self._snapshot_size):
                    self._rewrite()
            except OSError as e:
                self._broken = RecoveryError(f"the controller's journal file {self.path} could not be written ({e}): "
                                             f"the controller can no longer be recovered after a restart; stop and "
                                             f"restart the handoff")
                raise self._broken from None
            self._written = upto

    def batch(self, plan: BatchPlan, planned: int) -> None:
        self._queue("batch", plan, planned)

    def complete(self, event: CompleteEvent, completed: int) -> None:
        self._queue("complete", event, completed)

    def admit(self, adm: AdmittedMiniBatch, t_admit: float) -> None:
        self._queue("admit", adm, t_admit)

    def ack(self, key: MiniBatchKey, rank: int, fields: Sequence[str], released: Released | None = None) -> None:
        self._queue("ack", key, rank, tuple(fields), released)

    def epoch(self, rank: int, epoch: int) -> None:
        self._queue("epoch", rank, epoch)

    def seal(self) -> None:
        self._queue("seal")

    def count(self, name: str, value: int) -> None:
        self._queue("count", name, value)

    # -- reads and the end -----------------------------------------------------------------------------------

    def size(self) -> dict[str, int]:
        """The journal's entries (``ControllerJournal.size``) and the file's bytes."""
        with self._flush_lock:
            out = self.journal.size()
            out["file_bytes"] = self._file_bytes
            return out

    def close(self) -> None:
        """Remove the file (the plane is closed: nothing will be recovered)."""
        with self._flush_lock:
            self._closed = True
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
            for p in (self.path, f"{self.path}.tmp"):
                try:
                    os.remove(p)
                except FileNotFoundError:
                    pass
