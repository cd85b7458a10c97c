"""The trainer rank's loop and the rollout clock, shared by every system and both transports.

A rank asks for step i's data, gets it (``StepSource.obtain``), computes on it (emulated, ``harness``), then
releases it (KnitTrans: the ack after the optimizer step). Rank 0 announces the start of each step; the driver's
rollout clock (``completion_times``) completes batch b+1 when rank 0 starts step ``M - lead_steps`` of batch b, so
the trainer's own progress paces the rollout in every system alike.

    >>> from knittrans.bench.types import Obtained
    >>> class Const:
    ...     def open(self, rank): pass
    ...     def obtain(self, step): return Obtained(nbytes=8, tokens=4, get_s=0.0)
    ...     def release(self, step): pass
    ...     def close(self): pass
    >>> tr = rank_loop(0, Const(), num_batches=2, num_minibatches=2, iters_per_token=0.0)
    >>> [(m.batch, m.index, m.nbytes) for m in tr.timings]
    [(0, 0, 8), (0, 1, 8), (1, 0, 8), (1, 1, 8)]
"""

from __future__ import annotations

import statistics
import threading
import time
from typing import Callable, Hashable, Mapping, Sequence, TypeVar

from knittrans.bench.types import BenchLayout, PassKind, PassResult, StepSource
from knittrans.dataplane.harness import MiniBatchTiming, RankTrace, emulate_compute, steady_state_exposed

Notify = Callable[[Hashable, float], None]
"""(signal key, timestamp) -> None: how rank 0 announces a step (a ``Signals.set`` or a signal actor's)."""


def step_key(tag: int, batch: int, k: int) -> tuple:
    """Signal: rank 0 starts step k of batch ``batch`` of the pass tagged ``tag`` (its first batch id)."""
    return ("step", tag, batch, k)


def complete_key(tag: int, batch: int) -> tuple:
    """Signal: every trajectory of batch ``batch`` of pass ``tag`` is complete (value: t0)."""
    return ("complete", tag, batch)


def rank_loop(rank: int, source: StepSource, num_batches: int, num_minibatches: int, iters_per_token: float,
              first_ask: float | None = None, first_batch: int = 0, notify: Notify | None = None,
              tag: int = 0) -> RankTrace:
    """``num_batches * num_minibatches`` steps of obtain -> compute -> release (batch ``first_batch + i // M``,
    mini-batch ``i % M``). ``first_ask`` backdates the first request (a rank that was ready since then but
    received its data only as a call argument). Rank 0 calls ``notify(step_key(...), t)`` as each step starts."""
    source.open(rank)
    out = []
    try:
        for i in range(num_batches * num_minibatches):
            b, k = divmod(i, num_minibatches)
            t_ask = first_ask if (i == 0 and first_ask is not None) else time.perf_counter()
            got = source.obtain(i)
            t_got = time.perf_counter()
            if notify is not None and rank == 0:
                notify(step_key(tag, first_batch + b, k), t_got)
            emulate_compute(got.tokens, iters_per_token)
            source.release(i)
            out.append(MiniBatchTiming(k, t_ask, t_got, time.perf_counter(), got.get_s, got.nbytes, got.tokens,
                                       batch=first_batch + b, pixel_nbytes=got.pixel_nbytes, fetch_parts=got.parts))
    finally:
        source.close()
    return RankTrace(rank, tuple(out))


T = TypeVar("T")


def rank_threads(sources: Sequence[StepSource], num_batches: int, num_minibatches: int, iters_per_token: float,
                 clock: Callable[[], T], notify: Notify | None = None, tag: int = 0,
                 name: str = "ranks") -> tuple[list[RankTrace], T]:
    """In-process ranks: one thread each running ``rank_loop`` over its source (torch ops release the GIL), all
    started and waiting before ``clock()`` runs on this thread (it takes t0 and, in a steady pass, runs the rollout
    clock); returns the ranks' traces and what ``clock`` returned. A rank thread's error is re-raised here (a
    ``RuntimeError`` naming ``name``, caused by it)."""
    traces: list[RankTrace | None] = [None] * len(sources)
    errors: list[BaseException] = []
    started = threading.Barrier(len(sources) + 1)

    def rank_thread(r: int) -> None:
        started.wait()
        try:
            traces[r] = rank_loop(r, sources[r], num_batches, num_minibatches, iters_per_token, notify=notify,
                                  tag=tag)
        except BaseException as e:  # noqa: BLE001 - re-raised on the calling thread below
            errors.append(e)

    threads = [threading.Thread(target=rank_thread, args=(r,), name=f"rank{r}") for r in range(len(sources))]
    for th in threads:
        th.start()
    started.wait()
    try:
        t0 = clock()
    finally:
        for th in threads:
            th.join()
    if errors:
        raise RuntimeError(f"{name}: a rank thread failed") from errors[0]
    return [t for t in traces if t is not None], t0


def completion_times(layout: BenchLayout, num_batches: int, num_minibatches: int, tag: int,
                     wait_step: Callable[[tuple], float], complete: Callable[[int], None]) -> dict[int, float]:
    """The rollout clock of a steady pass: batch 0 completes now; batch b >= 1 when rank 0 starts step
    ``M - lead_steps`` of batch b-1. ``complete(b)`` runs at t0[b] (the producers' completing puts, or the
    driver's notice that the batch is whole)."""
    t0: dict[int, float] = {}
    for b in range(num_batches):
        if b:
            wait_step(step_key(tag, b - 1, num_minibatches - layout.lead_steps))
        t0[b] = time.perf_counter()
        complete(b)
    return t0


def merge_traces(per_call: Sequence[Sequence[RankTrace]]) -> list[RankTrace]:
    """Each rank's traces of consecutive calls (one per batch) joined into one trace."""
    by_rank: dict[int, list[MiniBatchTiming]] = {}
    for traces in per_call:
        for tr in traces:
            by_rank.setdefault(tr.rank, []).extend(tr.timings)
    return [RankTrace(r, tuple(ts)) for r, ts in sorted(by_rank.items())]


def _last_batch_bytes(traces: Sequence[RankTrace]) -> tuple[int, int]:
    last = max(m.batch for tr in traces for m in tr.timings)
    ms = [m for tr in traces for m in tr.timings if m.batch == last]
    return sum(m.nbytes for m in ms), sum(m.pixel_nbytes for m in ms)


def finish_raw(traces: Sequence[RankTrace], t0: float, bytes_moved: int | None = None,
               live_bytes_after: int | None = None) -> PassResult:
    """A raw pass: t0 -> every rank holds every share. Bytes: what the ranks received, unless the system moved
    more on the way (``bytes_moved``: the centralized gather + scatter)."""
    got, pixels = _last_batch_bytes(traces)
    return PassResult(PassKind.RAW, raw_s=max(m.t_got for tr in traces for m in tr.timings) - t0,
                      get_s=tuple(m.fetch_s for tr in traces for m in tr.timings),
                      get_nbytes=tuple(m.nbytes for tr in traces for m in tr.timings),
                      get_parts=_parts([m.fetch_parts for tr in traces for m in tr.timings]),
                      bytes_moved=got if bytes_moved is None else bytes_moved, pixel_nbytes=pixels,
                      live_bytes_after=live_bytes_after,
                      rank_gbps=tuple(sum(m.nbytes for m in tr.timings)
                                      / max(1e-9, tr.timings[-1].t_got - max(t0, tr.timings[0].t_ask)) / 1e9
                                      for tr in traces if tr.timings))


def _parts(parts: list[tuple[float, ...]]) -> tuple[tuple[float, ...], ...]:
    """Every get's (claim, read, pack, pack CPU), or () unless every get recorded them (so they align with
    ``get_s``)."""
    return tuple(parts) if parts and all(len(p) == 4 for p in parts) else ()


def finish_steady(traces: Sequence[RankTrace], t0: Mapping[int, float], warmup: int,
                  bytes_moved: int | None = None, live_bytes_after: int | None = None) -> PassResult:
    """A steady pass: per measured batch, per mini-batch exposed latency (``harness.steady_state_exposed``)."""
    got, pixels = _last_batch_bytes(traces)
    rows = steady_state_exposed(traces, t0, warmup)
    return PassResult(PassKind.STEADY, exposed=tuple(tuple(r) for r in rows),
                      get_s=tuple(m.fetch_s for tr in traces for m in tr.timings if m.batch >= warmup),
                      bytes_moved=got if bytes_moved is None else bytes_moved, pixel_nbytes=pixels,
                      live_bytes_after=live_bytes_after)


def median_raw(results: Sequence[PassResult]) -> PassResult:
    """Several raw passes of one system as one: the median time (a single one-batch sample is at the mercy of
    whatever else the machine runs), every get, the last pass's bytes, the most any pass left behind."""
    if not results or any(r.kind is not PassKind.RAW for r in results):
        raise ValueError("median_raw combines one or more raw-pass results")
    lives = [r.live_bytes_after for r in results if r.live_bytes_after is not None]
    med = statistics.median(r.raw_s for r in results)
    nearest = min(results, key=lambda r: abs(r.raw_s - med))  # its trace (if recorded) stands for the median
    return PassResult(PassKind.RAW, raw_s=med,
                      get_s=tuple(g for r in results for g in r.get_s),
                      get_nbytes=tuple(b for r in results for b in r.get_nbytes),
                      get_parts=tuple(p for r in results for p in r.get_parts) if all(r.get_parts for r in results)
                      else (), bytes_moved=results[-1].bytes_moved,
                      pixel_nbytes=results[-1].pixel_nbytes, live_bytes_after=max(lives) if lives else None,
                      trace=nearest.trace, t0=nearest.t0, rank_gbps=nearest.rank_gbps)
