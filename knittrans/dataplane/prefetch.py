"""The prefetcher: fetch and prepare mini-batch k+1 on a background thread while mini-batch k computes.

Why a thread and not bookkeeping: the trainer's wait for data is what the step pays; a background worker that
claims, reads and packs the next share while the current step computes (torch ops release the GIL) turns that
wait into overlap. The worker learns of mini-batch k+1 from ``controller.next_admitted`` -- a condition-variable
wait that returns only once the admission policy has committed it -- so it can never hand out a mini-batch
before admission. ``depth`` caps how far ahead it runs: at most ``depth`` prepared shares wait in memory (and one
more is in flight), and ``depth`` workers fetch at once, so with several mini-batches admitted the next share's
claim and reads overlap this one's (shares are still handed out in admission order).

    >>> # for share in Prefetcher(client, rank=0, fields=("input_ids",)):  train_step(share)
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque
import time
from dataclasses import dataclass, field
from typing import Iterator, Sequence

from knittrans.dataplane.client import DataPlaneClient, FetchTiming
from knittrans.dataplane.feed import FEED_WINDOW
from knittrans.dataplane.types import DataPlaneClosedError, PackedShare, UnitLostError
from knittrans.types import require_int, require_real

log = logging.getLogger(__name__)

_WAKE_S = 0.5  # longest a blocked worker takes to notice close()
_HANDOFF_S = 0.05  # longest a worker waits for a blocked trainer to take the share it just posted
EVENTS_KEPT = 4096
"""Handed-out shares whose ``PrefetchEvent`` a prefetcher keeps (the last ones): a long run's timings stay bounded
(~200 B each) instead of growing by one per step for ever."""


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
    wait_for_reput: bool = True
    """A storage unit that dies under a share's read (``UnitLostError``: the client reported the loss, the claim was
    undone) does not end the iteration: the share is claimed again once its producers re-put the lost trajectories
    (``Controller.missing`` names them; ``claim_next`` waits for the re-put, within ``admit_timeout_s``), so the
    trainer goes on without rebuilding its consumer. False: the iteration ends with the ``UnitLostError``."""

    def __post_init__(self) -> None:
        require_int("PrefetchConfig", "depth", self.depth, 1)
        require_real("PrefetchConfig", "admit_timeout_s", self.admit_timeout_s, 0.0, strict=True, optional=True)


@dataclass(frozen=True)
class PrefetchEvent:
    """One handed-out share: when the worker began waiting for its admission, when it was prepared, when the
    trainer got it, and how long the fetch itself took (claim + read + pack, no waiting)."""

    seq: int
    t_wait: float
    t_ready: float
    t_handed: float
    fetch_s: float
    timing: FetchTiming | None = None
    """Where ``fetch_s`` went: claim, unit reads, packing (the client's ``FetchTiming``)."""


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
    events: deque[PrefetchEvent] = field(default_factory=lambda: deque(maxlen=EVENTS_KEPT))
    """The last ``EVENTS_KEPT`` handed-out shares' timings, oldest first."""
    read_limit: int | None = None
    """Reads start only for seqs below this one (None: no bound but ``count``); ``allow_reads`` raises it. Claims
    are not bounded by it: the feed keeps bringing locations ahead (metadata only), so a rank whose reads were held
    back starts on bytes, not on a round trip, when they are allowed (``Consumer.steps``)."""

    def __post_init__(self) -> None:
        # Up to ``depth + 1`` shares are taken ahead of the trainer (``depth`` prepared and waiting, the next in
        # flight, as a single worker behind a queue of ``depth``; a feed claims further ahead, ``FEED_WINDOW``:
        # metadata only), and ``depth`` workers fetch at once: with
        # several shares admitted, the next one's claim and reads overlap this one's instead of waiting for them
        # (each fetch is a few round trips to the controller and the units, mostly waiting on other processes).
        self._slots = threading.Semaphore(self.config.depth + 1)
        self._cv = threading.Condition()
        self._ready: dict[int, tuple[PackedShare, int, float, float, float] | _Failure | _End] = {}
        self._next_claim = self.start_seq  # the next seq a worker takes
        self._next_hand = self.start_seq  # the next seq the trainer gets
        self._last: int | None = None  # the seq of the end marker or failure, once a worker posted it
        self._stop = threading.Event()
        self._epoch: int | None = None
        self._epoch_lock = threading.Lock()
        # Workers: one when a share's bytes move without a round trip (its claim comes by the feed or a plain call,
        # its bytes by one resolve and copies: CPU work a second worker on the same cores only competes with); with
        # reads through the units (round trips), ``depth`` so that one share's reads overlap another's.
        workers = self.config.depth if self.client.reads_through_units else 1
        workers = workers if self.count is None else max(1, min(workers, self.count))
        self._threads = [threading.Thread(target=self._run, name=f"prefetch-rank{self.rank}-{i}", daemon=True)
                         for i in range(workers)]
        self._started = False
        self._finished = False
        self._waiting: int | None = None  # the seq the trainer is blocked on in ``next`` (None: not blocked)
        self._handed: PackedShare | None = None  # handed out, not acked yet (ack_on_next)
        self._feed = None  # the rank's long-poll claims (``feed.ShareFeed``) when its controller is remote
        self.unit_losses = 0
        """Reads that a storage unit's death interrupted and that were claimed again after the re-put
        (``PrefetchConfig.wait_for_reput``)."""

    def start(self) -> "Prefetcher":
        if not self._started:
            if self.client.remote_controller and self._feed is None:
                # claims by long poll, up to ``depth + 1`` ahead of the workers (metadata only: the bytes are read
                # by the workers, within their own bound); the rank's incarnation comes with the first poll's answer
                # (no round trip of its own before the first share)
                self._feed = self.client.feed(self.rank, self.fields, self.start_seq, self.count,
                                              max(self.config.depth + 1, FEED_WINDOW), None)
            # started only once the threads run: a close() from another thread in between must not join a thread
            # that is not started yet (RuntimeError); the workers check the stop flag before their first claim
            for th in self._threads:
                th.start()
            self._started = True
        return self

    def _rank_epoch(self) -> int:
        """This incarnation of the rank, asked once (by the first worker that needs it; with a feed, the one its
        first poll was fenced by): after a crash, recover_rank supersedes it, and a zombie of this prefetcher can
        then neither claim the new incarnation's share nor ack one (FencedError)."""
        with self._epoch_lock:
            if self._epoch is None:
                adopted = self._feed.epoch if self._feed is not None else None
                self._epoch = adopted if adopted is not None else self.client.controller.rank_epoch(self.rank)
            return self._epoch

    def _take_seq(self) -> int | None:
        """The next seq to fetch (None: stop -- closed, or past the end or a failure). Holds one slot on return."""
        while not self._slots.acquire(timeout=_WAKE_S):
            if self._stop.is_set():
                return None
        with self._cv:
            seq = self._next_claim
            if self._stop.is_set() or (self._last is not None and seq >= self._last):
                self._slots.release()
                return None
            self._next_claim += 1
        if self.count is not None and seq >= self.start_seq + self.count:
            self._post(seq, _End())
            return None
        with self._cv:
            while self.read_limit is not None and seq >= self.read_limit and not self._stop.is_set():
                self._cv.wait(_WAKE_S)  # held back until ``allow_reads`` (the slot stays taken)
        return None if self._stop.is_set() else seq

    def _run(self) -> None:
        while True:
            seq = self._take_seq()
            if seq is None:
                return
            try:
                t_wait = time.perf_counter()
                share = self._fetch_when_admitted(seq)
                if share is None:  # closed while waiting
                    self._post(seq, _End())
                    return
                timing = self.client.thread_timing()
                fetch_s = timing.claim_s + timing.read_s + timing.pack_s if timing else 0.0
                item, share = (share, seq, t_wait, time.perf_counter(), fetch_s, timing), None
                self._post(seq, item)
                # this worker keeps no reference to what it handed over: once the trainer lets the share go, its
                # pack buffer is free for the next pack (``BufferPool`` hands out a buffer nothing else references;
                # with this local still holding it a draining rank alternated two buffers, session 38)
                del item
            except DataPlaneClosedError:
                self._post(seq, _End())
                return
            except BaseException as e:  # noqa: BLE001 - forwarded to the trainer thread, which re-raises it
                self._post(seq, _Failure(e))
                return

    @property
    def next_seq(self) -> int:
        """The seq ``next`` hands out next."""
        return self._next_hand

    def allow_reads(self, upto: int | None) -> None:
        """Let reads start for every seq below ``upto`` (None: unbounded); never lowers the bound (an unbounded
        prefetcher stays unbounded)."""
        with self._cv:
            if self.read_limit is not None:
                self.read_limit = None if upto is None else max(self.read_limit, upto)
            self._cv.notify_all()

    def _post(self, seq: int, item: object) -> None:
        """``item`` is the ``seq``-th share (or the end, or a failure there: nothing after it is handed out).

        A share the trainer is already waiting for is handed over before this worker goes on: the worker waits
        (the GIL released) until the trainer has taken it. Otherwise the worker's next pack, which holds the GIL
        for its whole copy (``client.pack_runs``), would keep the woken trainer from running until a switch
        interval (5 ms) forces the GIL over: measured as a share delivered 3-5.6 ms before the trainer got it."""
        with self._cv:
            if isinstance(item, (_End, _Failure)):
                self._last = seq if self._last is None else min(self._last, seq)
            self._ready[seq] = item  # type: ignore[assignment]
            self._cv.notify_all()
            if self._waiting == seq and not isinstance(item, (_End, _Failure)):
                self._cv.wait_for(lambda: self._next_hand > seq or self._stop.is_set(), _HANDOFF_S)

    def _fetch_when_admitted(self, seq: int) -> PackedShare | None:
        """Wait for the ``seq``-th admission and fetch this rank's share (None: closed while waiting).
        The wait is the controller's condition variable (``claim_next``); it is sliced only so close() is
        honoured within _WAKE_S (a Ray controller cannot be interrupted mid-call)."""
        deadline = None if self.config.admit_timeout_s is None else time.perf_counter() + self.config.admit_timeout_s
        feed = self._feed
        while not self._stop.is_set():
            left = _WAKE_S if deadline is None else min(_WAKE_S, deadline - time.perf_counter())
            if left <= 0:
                raise TimeoutError(f"rank {self.rank}: no mini-batch #{seq} admitted within "
                                   f"{self.config.admit_timeout_s} s")
            try:
                if feed is not None:
                    t_ask = time.perf_counter()
                    loc, claim_s = feed.get(seq, timeout=left)
                    return self.client.deliver(loc, claim_s, ack=self.config.ack_on_fetch, asked_at=t_ask)
                return self.client.fetch_next(seq, self.rank, self.fields, timeout=left,
                                              ack=self.config.ack_on_fetch, epoch=self._rank_epoch(),
                                              bound_reads=False)
            except TimeoutError:
                continue
            except UnitLostError as e:
                if not self.config.wait_for_reput:
                    raise
                # The client reported the loss and undid the claim: claim #seq again, directly (the feed has moved
                # past it); the controller's claim_next waits until the lost trajectories are re-put.
                self.unit_losses += 1
                feed = None
                log.warning("rank %d: %s; share #%d is claimed again once its trajectories are re-put",
                            self.rank, e, seq)
        return None

    def next(self, timeout: float | None = None) -> PackedShare:
        """The next prepared share (blocks until it is ready). Raises ``StopIteration`` at the end, and
        re-raises any error the worker hit (e.g. ``AlreadyConsumedError``)."""
        self.start()
        self._ack_previous()
        if self._finished:
            raise StopIteration
        item = self._get(timeout)
        if not isinstance(item, (_End, _Failure)):
            self._slots.release()  # the trainer holds it now: a worker may claim one more
        if isinstance(item, _End):
            self._finished = True
            self.client.flush_acks()  # the stream ended: nothing is left to overlap the acks with
            raise StopIteration
        if isinstance(item, _Failure):
            self._finished = True
            raise item.error
        share, seq, t_wait, t_ready, fetch_s, timing = item
        if not self.config.ack_on_fetch and self.config.ack_on_next:
            self._handed = share
        self.events.append(PrefetchEvent(seq, t_wait, t_ready, time.perf_counter(), fetch_s, timing))
        return share

    def _ack_previous(self) -> None:
        """The trainer asks for the next share (or ends its loop): it has stepped on the one before -- ack it."""
        share, self._handed = self._handed, None
        if share is not None:
            self.client.ack(share)

    def _get(self, timeout: float | None) -> object:
        # Sliced so that a close() from another thread (which stops the workers before they can post the end
        # marker) ends this wait too instead of leaving the trainer blocked for ever.
        deadline = None if timeout is None else time.perf_counter() + timeout
        with self._cv:
            try:
                while True:
                    item = self._ready.pop(self._next_hand, None)
                    if item is not None:
                        self._next_hand += 1
                        if self._waiting is not None:  # a worker waits for the hand-over (``_post``)
                            self._cv.notify_all()
                        return item
                    if self._stop.is_set():
                        self._finished = True
                        raise StopIteration
                    left = _WAKE_S if deadline is None else min(_WAKE_S, deadline - time.perf_counter())
                    if left <= 0:
                        raise queue.Empty
                    self._waiting = self._next_hand
                    self._cv.wait(left)
            finally:
                self._waiting = None

    def __iter__(self) -> Iterator[PackedShare]:
        while True:
            try:
                yield self.next()
            except StopIteration:
                return
            # (a loop left by an exception -- a crash in the step -- never asks again: its share stays unacked)

    def close(self) -> None:
        """Stop the workers after their current fetches (a share already claimed is dropped with them; one the
        feed claimed and no worker took is given back)."""
        self._stop.set()
        with self._cv:
            self._ready.clear()
            self._cv.notify_all()
        if self._feed is not None:
            self._feed.close()
        if self._started:
            for th in self._threads:
                if th.is_alive() or th.ident is not None:
                    th.join(timeout=5.0)
