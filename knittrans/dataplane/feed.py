"""A rank's control path off its critical path: claims by long poll, acks batched and asynchronous.

Why: on a remote controller every claim and every ack is a round trip (~1-3 ms on a loaded 2-core machine, more
across nodes), which for a ~10 MB share is as long as moving its bytes. So a rank never waits for either:

- ``ShareFeed``: one outstanding long poll per rank (``Controller.claim_many``) that returns every share admitted
  since the last one, at most ``window`` ahead of what the rank has taken. By the time a prefetch worker asks for
  share k+1, its location is usually here already; the rank then goes straight to the bytes.
- ``AckSender``: an ack is queued and the rank moves on; a sender thread sends everything queued in one call
  (``Controller.ack_many``) and keeps the first failure, which the rank's next ``ack`` or ``flush`` re-raises
  (nothing fails silently: a fenced zombie's ack, a controller that is gone).

Exactly-once is unchanged: the controller claims each (mini-batch, rank, field) once, in admission order; a share
claimed by the feed and never taken (the consumer closed) is returned to the pool (``unclaim``); a rank that dies
gets everything it claimed and did not ack again through ``recover_rank``.

    >>> # feed = ShareFeed(controller, rank=0, fields=("input_ids",), start_seq=0, count=None, window=3).start()
    >>> # loc, claim_s = feed.get(0, timeout=10.0)
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass
from typing import Callable, Sequence

from knittrans.dataplane.types import CLOCK_DOMAIN, DataPlaneClosedError, MiniBatchKey, Retired, ShareLocation

POLL_S = 0.5
"""Longest single wait of the long poll (sliced so that ``close`` is honoured: a remote call cannot be
interrupted)."""
FEED_WINDOW = 8
"""Shares a prefetching rank's feed claims ahead of what it has taken (at least its prefetch depth + 1). Claims are
metadata: a wider window costs no memory, and each poll it saves is a round trip whose handling takes the controller
~0.3-2 ms of CPU on the cores the ranks pack on (a window of depth + 1 polled once per share taken)."""
ACK_DELAY_S = 0.02
"""How long the ack sender waits after an ack for more before it sends them all in one call (delayed acks, as
TCP's): a rank acks one share per optimizer step, and every ack call costs the controller a journal flush and its
units a drop, CPU taken from the reads running beside them. 20 ms is far below a training step and bounds how late
a release (``Handoff.version``) sees the step; ``flush`` (the end of the stream, ``Consumer.flush``,
``Handoff.version``) sends at once."""


@dataclass(frozen=True)
class _Got:
    loc: ShareLocation
    transit_s: float  # the control path's time after the admission (``_since_admission``)
    t_arrived: float


def _since_admission(loc: ShareLocation, now: float, estimate: float) -> float:
    """How long the share's location took to reach this reader after its mini-batch was admitted: ``now`` less the
    controller's admission stamp where both clocks are one (``ShareLocation.clock``: same machine), else
    ``estimate`` (the poll's round trip less the controller's wait for the admission; 0 for a poll's later
    shares). The estimate errs both ways: a poll queued at a busy controller until after the admission counts the
    queueing before the admission as control time, and a poll woken by the admission counts its wait for the
    controller's GIL as waiting for data."""
    if loc.clock == CLOCK_DOMAIN and not math.isnan(loc.admitted_at):
        return max(0.0, now - loc.admitted_at)
    return max(0.0, estimate)


@dataclass(frozen=True)
class _Stop:
    error: BaseException | None  # None: the stream ended (sealed, count reached, closed)


class ShareFeed:
    """Rank ``rank``'s claims of shares ``start_seq, start_seq + 1, ...`` (``count`` of them; None: to the end of
    the stream), fetched by one long poll at a time, at most ``window`` claimed ahead of ``get``. ``epoch``: the
    rank's incarnation; None: the one current when the first poll reaches the controller (``Controller.poll``
    answers it, and ``epoch`` holds it from then on). ``on_retired``: called with every poll's ``Retired`` (the
    sources the reader may let go of: ``client.SourceCache.retire``)."""

    def __init__(self, controller, rank: int, fields: Sequence[str], start_seq: int, count: int | None,  # noqa: ANN001
                 window: int, epoch: int | None = None,
                 on_retired: Callable[[Retired], None] | None = None) -> None:
        if window < 1:
            raise ValueError(f"ShareFeed.window must be >= 1, got {window}")
        self.controller, self.rank, self.fields, self.epoch = controller, rank, tuple(fields), epoch
        self.on_retired = on_retired
        self._cursor: tuple[str, int] | None = None  # position in the controller's log of retired sources
        self.start_seq, self.window = start_seq, window
        self.end = None if count is None else start_seq + count
        self._cv = threading.Condition()
        self._got: dict[int, _Got | _Stop] = {}
        self._next = start_seq  # the next seq the poll asks for
        self._taken = start_seq  # seqs below this were taken by get
        self._stop = False
        self._thread = threading.Thread(target=self._run, name=f"share-feed-rank{rank}", daemon=True)

    def start(self) -> "ShareFeed":
        self._thread.start()
        return self

    def _run(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._stop or self._next - self._taken < self.window)
                if self._stop:
                    return
                seq = self._next
                if self.end is not None and seq >= self.end:
                    self._got[seq] = _Stop(None)
                    self._cv.notify_all()
                    return
                limit = self.window - (seq - self._taken)
                if self.end is not None:
                    limit = min(limit, self.end - seq)
            t = time.perf_counter()
            try:
                epoch, locs, retired = self.controller.poll(seq, self.rank, self.fields, limit, POLL_S, self.epoch,
                                                            self._cursor)
            except DataPlaneClosedError:  # closed or sealed: the stream ends at this seq
                self._post(seq, _Stop(None))
                return
            except BaseException as e:  # noqa: BLE001 - handed to whoever asks for this seq
                self._post(seq, _Stop(e))
                return
            now = time.perf_counter()
            with self._cv:
                self.epoch = epoch  # the incarnation the first poll was fenced by (``Controller.poll``)
                self._cv.notify_all()
            self._cursor = retired.cursor
            if locs:  # (none: nothing admitted within the poll's timeout)
                transit = [_since_admission(loc, now, now - t - loc.waited_s if i == 0 else 0.0)
                           for i, loc in enumerate(locs)]
                with self._cv:
                    if self._stop:  # closed while the poll was out: give the claims back
                        self._unclaim(locs)
                        return
                    for i, loc in enumerate(locs):
                        self._got[seq + i] = _Got(loc, transit[i], now)
                    self._next = seq + len(locs)
                    self._cv.notify_all()
            # After the shares are handed on, never before: letting go of the sources retired since the last poll
            # (the previous batch's objects, ~0.3 ms of CPU) is on no share's path, and a rank's other threads hold
            # the GIL meanwhile (a pack): done first, it held the new shares back 0.2-9 ms (docs/experiments.md,
            # session 44). The retired sources are never named again, so no share posted here reads them.
            if self.on_retired is not None and (retired.ids or retired.reset):
                self.on_retired(retired)

    def _post(self, seq: int, item: _Stop) -> None:
        with self._cv:
            self._got[seq] = item
            self._cv.notify_all()

    def get(self, seq: int, timeout: float | None = None) -> tuple[ShareLocation, float]:
        """The location of the ``seq``-th share and the time its caller spent on the control path for it (0 when the
        poll had brought it before the caller asked; else at most the poll's transit, never the wait for
        admission). Raises the poll's error at that seq, ``DataPlaneClosedError`` past the end of the stream, and
        ``TimeoutError`` after ``timeout`` seconds."""
        t_ask = time.perf_counter()
        with self._cv:
            if not self._cv.wait_for(lambda: seq in self._got or self._stop or self._ended_before(seq), timeout):
                raise TimeoutError(f"rank {self.rank}: share #{seq} not admitted within {timeout} s")
            item = self._got.pop(seq, None)
            if item is None:
                raise DataPlaneClosedError(f"rank {self.rank}: the feed ended before share #{seq}")
            if isinstance(item, _Stop):
                self._got[seq] = item  # later callers of this seq see the same end
                if item.error is not None:
                    raise item.error
                raise DataPlaneClosedError(f"rank {self.rank}: the stream ended before share #{seq}")
            self._taken = max(self._taken, seq + 1)
            self._cv.notify_all()
        t_got = time.perf_counter()
        claim_s = 0.0 if item.t_arrived <= t_ask else min(item.transit_s, t_got - t_ask)
        return item.loc, claim_s

    def _ended_before(self, seq: int) -> bool:
        return any(isinstance(v, _Stop) and k <= seq for k, v in self._got.items())

    def _unclaim(self, locs: Sequence[ShareLocation]) -> None:
        for loc in locs:
            try:
                self.controller.unclaim(loc.key, loc.rank, loc.fields)
            except Exception:  # noqa: BLE001 - best effort: a closed controller has nothing to return them to
                pass

    def close(self) -> None:
        """Stop polling and give back every share claimed and never taken (a later consumer of this rank gets
        them)."""
        with self._cv:
            self._stop = True
            left = [g.loc for g in self._got.values() if isinstance(g, _Got)]
            self._got.clear()
            self._cv.notify_all()
        self._unclaim(left)
        if self._thread.ident is not None:
            self._thread.join(timeout=POLL_S + 5.0)


class AckSender:
    """Queues a rank's acks and sends them off its critical path, all queued ones in one ``ack_many`` call, at most
    ``delay_s`` after the first of them (``ACK_DELAY_S``; at once on ``flush``); the first failure is kept and
    re-raised by the next ``send`` or ``flush`` (and every later one: the rank's acks are no longer reaching the
    controller)."""

    def __init__(self, controller, delay_s: float = 0.0) -> None:  # noqa: ANN001 - a proxy with ack_many
        self.controller = controller
        self.delay_s = delay_s
        self._cv = threading.Condition()
        self._queue: list[tuple[MiniBatchKey, int, tuple[str, ...], int | None]] = []
        self._sending = 0  # acks taken by the sender and not yet answered
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._closed = False
        self._urgent = 0  # flushes waiting: send what is queued without the delay

    def send(self, key: MiniBatchKey, rank: int, fields: Sequence[str], epoch: int | None) -> None:
        with self._cv:
            if self._error is not None:
                raise self._error
            self._queue.append((key, rank, tuple(fields), epoch))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="ack-sender", daemon=True)
                self._thread.start()
            self._cv.notify_all()

    def _run(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: bool(self._queue) or self._closed)
                if not self._queue:
                    return
                if self.delay_s > 0:  # delayed acks: more may come (none is ever held past a flush)
                    self._cv.wait_for(lambda: self._closed or self._urgent > 0, self.delay_s)
                batch, self._queue = self._queue, []
                self._sending = len(batch)
            try:
                self.controller.ack_many(batch)
            except BaseException as e:  # noqa: BLE001 - kept for the rank's next send/flush
                with self._cv:
                    self._error = self._error or e
            with self._cv:
                self._sending = 0
                self._cv.notify_all()

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every queued ack is answered; re-raise the first failure. ``TimeoutError`` after ``timeout``."""
        with self._cv:
            self._urgent += 1
            self._cv.notify_all()
            try:
                if not self._cv.wait_for(lambda: not self._queue and not self._sending, timeout):
                    raise TimeoutError(f"{len(self._queue) + self._sending} acks unanswered after {timeout} s")
            finally:
                self._urgent -= 1
            if self._error is not None:
                raise self._error

    def close(self, timeout: float | None = 10.0) -> None:
        """Send what is queued, then stop the sender (re-raises a failure as ``flush``)."""
        try:
            self.flush(timeout)
        finally:
            with self._cv:
                self._closed = True
                self._cv.notify_all()
