"""The prefetcher: fetch and prepare mini-batch k+1 on a background thread while mini-batch k computes.

Why a thread and not bookkeeping: the trainer's wait for data is what the step pays; a background worker that
claims, reads and packs the next share while the current step computes (torch ops release the GIL) turns that
wait into overlap. The worker learns of mini-batch k+1 from ``controller.next_admitted`` -- a condition-variable
wait that returns only once the admission policy has committed it -- so it can never hand out a mini-batch
before admission. A bounded queue (``depth``) caps how far ahead it runs: at most ``depth`` prepared shares wait
in memory.

    >>> # for share in Prefetcher(client, rank=0, fields=("input_ids",)):  train_step(share)
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Iterator, Sequence

from knittrans.dataplane.client import DataPlaneClient
from knittrans.dataplane.types import DataPlaneClosedError, PackedShare

_WAKE_S = 0.5  # longest a blocked worker takes to notice close()


@dataclass(frozen=True)
class PrefetchConfig:
    """How far ahead a rank prepares."""

    depth: int = 1
    """Prepared shares held ahead of the trainer (1: exactly the next mini-batch)."""
    admit_timeout_s: float | None = None
    """Give up waiting for the next admission after this long (None: wait until closed)."""
    ack_on_fetch: bool = False
    """True: ack each share as soon as it is fetched (a rank that crashes before its step loses the prefetched
    shares: recovery resumes past them). False (the default, never loses data): a share is acked after the
    trainer's step -- by ``client.ack(share)``, or (``ack_on_next``) when the trainer asks for the next share --
    so a rank that crashes first gets it again (``Controller.recover_rank``, docs/reliability.md)."""
    ack_on_next: bool = True
    """With ``ack_on_fetch`` False: asking for the next share (or ending the iteration) acks the one handed out
    before it -- the trainer has stepped on it. False: the caller acks every share itself (``Handoff``)."""

    def __post_init__(self) -> None:
        if self.depth < 1:
            raise ValueError(f"PrefetchConfig.depth must be >= 1, got {self.depth}")


@dataclass(frozen=True)
class PrefetchEvent:
    """One handed-out share: when the worker began waiting for its admission, when it was prepared, when the
    trainer got it, and how long the fetch itself took (claim + read + pack, no waiting)."""

    seq: int
    t_wait: float
    t_ready: float
    t_handed: float
    fetch_s: float


@dataclass
class _Failure:
    error: BaseException


@dataclass
class _End:
    pass


@dataclass
class Prefetcher:
    """Iterates rank ``rank``'s shares of admitted mini-batches in admission order, ``count`` of them (None:
    until the data plane closes), starting with the ``start_seq``-th admitted mini-batch."""

    client: DataPlaneClient
    rank: int
    fields: Sequence[str] | None = None
    config: PrefetchConfig = field(default_factory=PrefetchConfig)
    start_seq: int = 0
    count: int | None = None
    events: list[PrefetchEvent] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._q: queue.Queue[tuple[PackedShare, int, float, float, float] | _Failure | _End] = queue.Queue(
            maxsize=self.config.depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"prefetch-rank{self.rank}", daemon=True)
        self._started = False
        self._finished = False
        self._handed: PackedShare | None = None  # handed out, not acked yet (ack_on_next)

    def start(self) -> "Prefetcher":
        if not self._started:
            self._started = True
            self._thread.start()
        return self

    def _run(self) -> None:
        seq = self.start_seq
        try:
            # This incarnation of the rank: after a crash, recover_rank supersedes it, and a zombie of this
            # prefetcher can then neither claim the new incarnation's share nor ack one (FencedError).
            self._epoch = self.client.controller.rank_epoch(self.rank)
            while not self._stop.is_set() and (self.count is None or seq < self.start_seq + self.count):
                t_wait = time.perf_counter()
                share = self._fetch_when_admitted(seq)
                if share is None:
                    break
                timing = self.client.last_timing
                fetch_s = timing.claim_s + timing.read_s + timing.pack_s if timing else 0.0
                self._put((share, seq, t_wait, time.perf_counter(), fetch_s))
                seq += 1
            self._put(_End())
        except DataPlaneClosedError:
            self._put(_End())
        except BaseException as e:  # noqa: BLE001 - forwarded to the trainer thread, which re-raises it
            self._put(_Failure(e))

    def _fetch_when_admitted(self, seq: int) -> PackedShare | None:
        """Wait for the ``seq``-th admission and fetch this rank's share (None: closed while waiting).
        The wait is the controller's condition variable (``claim_next``); it is sliced only so close() is
        honoured within _WAKE_S (a Ray controller cannot be interrupted mid-call)."""
        deadline = None if self.config.admit_timeout_s is None else time.perf_counter() + self.config.admit_timeout_s
        while not self._stop.is_set():
            left = _WAKE_S if deadline is None else min(_WAKE_S, deadline - time.perf_counter())
            if left <= 0:
                raise TimeoutError(f"rank {self.rank}: no mini-batch #{seq} admitted within "
                                   f"{self.config.admit_timeout_s} s")
            try:
                return self.client.fetch_next(seq, self.rank, self.fields, timeout=left,
                                              ack=self.config.ack_on_fetch, epoch=self._epoch)
            except TimeoutError:
                continue
        return None

    def _put(self, item: object) -> None:
        # Blocks while ``depth`` shares wait (backpressure); wakes periodically only to honour close().
        while not self._stop.is_set():
            try:
                self._q.put(item, timeout=_WAKE_S)  # type: ignore[arg-type]
                return
            except queue.Full:
                continue

    def next(self, timeout: float | None = None) -> PackedShare:
        """The next prepared share (blocks until it is ready). Raises ``StopIteration`` at the end, and
        re-raises any error the worker hit (e.g. ``AlreadyConsumedError``)."""
        self.start()
        self._ack_previous()
        if self._finished:
            raise StopIteration
        item = self._get(timeout)
        if isinstance(item, _End):
            self._finished = True
            raise StopIteration
        if isinstance(item, _Failure):
            self._finished = True
            raise item.error
        share, seq, t_wait, t_ready, fetch_s = item
        if not self.config.ack_on_fetch and self.config.ack_on_next:
            self._handed = share
        self.events.append(PrefetchEvent(seq, t_wait, t_ready, time.perf_counter(), fetch_s))
        return share

    def _ack_previous(self) -> None:
        """The trainer asks for the next share (or ends its loop): it has stepped on the one before -- ack it."""
        share, self._handed = self._handed, None
        if share is not None:
            self.client.ack(share)

    def _get(self, timeout: float | None) -> object:
        # Sliced so that a close() from another thread (which drains the queue and stops the worker before it
        # can enqueue its end marker) ends this wait too instead of leaving the trainer blocked for ever.
        deadline = None if timeout is None else time.perf_counter() + timeout
        while True:
            if self._stop.is_set() and self._q.empty():
                self._finished = True
                raise StopIteration
            left = _WAKE_S if deadline is None else min(_WAKE_S, deadline - time.perf_counter())
            if left <= 0:
                raise queue.Empty
            try:
                return self._q.get(timeout=left)
            except queue.Empty:
                continue

    def __iter__(self) -> Iterator[PackedShare]:
        while True:
            try:
                yield self.next()
            except StopIteration:
                return
            # (a loop left by an exception -- a crash in the step -- never asks again: its share stays unacked)

    def close(self) -> None:
        """Stop the worker after its current fetch (a share it already claimed is dropped with it)."""
        self._stop.set()
        try:
            while True:
                self._q.get_nowait()
        except queue.Empty:
            pass
        if self._started:
            self._thread.join(timeout=5.0)
