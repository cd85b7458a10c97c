"""The one-message bound's harness: the engine ceiling's reads with another batch's completing puts beside them, told
when to read by one message per admission wave (``scripts/ceiling_under_load.py``, text; ``scripts/mm_bound.py``,
multimodal).

The least control path a design that admits as the completing puts register can have: the ranks start at t0 holding
their shares' refs (the engine ceiling, ``knittrans.bench.ceiling``), and read each wave of their shares only once an
idle actor's reply says that the wave's put is registered, while producer threads put and register another batch's
completing fields on the same cores as knittrans-ray's producers do at t0. The reply's wait -- from the notifier's
stamp to the reply's arrival, 0 when the rank was told before it asked -- counts in the get, as knittrans-ray's claim
does (admission -> the rank holds the location).
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import time
from typing import Callable

import ray

from knittrans.bench.ceiling import EngineCeilingSystem, RunsSource
from knittrans.bench.types import COMPLETION_FIELDS, BenchLayout, Obtained, PassData, PassResult, streamed_payload
from knittrans.dataplane.types import TrajectoryPayload


class CompletingPuts:
    """``other``'s completing puts (its ``COMPLETION_FIELDS``), one thread per unit, as knittrans-ray's producers put
    them at t0: ``start`` starts them once; ``first`` is set when one of them has returned (stored and registered);
    ``finish`` waits for them and discards the batch (put and registered, never admitted). ``streamed``: ``other``'s
    other fields are written first (here, before t0), as a rollout engine streams them while it generates, and the
    completing puts carry the trajectories' metadata -- knittrans-ray's form (a small one then rides with its
    registration: ``client.INLINE_PUT_BYTES``); False: the completion fields alone, registered as plain puts.
    ``multimodal``: the streamed fields include the prompts' images."""

    def __init__(self, dp, other: PassData, layout: BenchLayout, streamed: bool = False,  # noqa: ANN001
                 multimodal: bool = False) -> None:
        self.dp, self.other, self.first = dp, other, threading.Event()
        stream: dict[str, list] = {}
        completing: dict[str, list] = {}
        for r in other.rollouts:
            unit = layout.unit(other.producer_of[r.traj.traj_id])
            completing.setdefault(unit, []).append(TrajectoryPayload(
                r.traj.traj_id, {f: r.tensors[f] for f in COMPLETION_FIELDS}, meta=r.traj if streamed else None))
            if streamed:
                stream.setdefault(unit, []).append(streamed_payload(r, multimodal))
        for unit, ps in stream.items():
            dp.client(unit).put(ps)
        self.threads = [threading.Thread(target=self._put, args=(u, ps)) for u, ps in completing.items()]
        self.started = False

    def _put(self, unit: str, payloads: list) -> None:
        self.dp.client(unit).put(payloads)
        self.first.set()

    def start(self) -> None:
        if not self.started:
            self.started = True
            for t in self.threads:
                t.start()

    def finish(self) -> None:
        if self.started:
            for t in self.threads:
                t.join()
        self.dp.client().discard([r.traj.traj_id for r in self.other.rollouts])


@ray.remote(num_cpus=0, max_concurrency=4)
class Notifier:
    """The one message per admission wave: ``tell(w)`` stamps wave ``w`` registered; every ``wait(w)`` returns the
    stamp then. One actor for a run (``reset`` before each pass): an actor started inside a timed pass can time its
    own start-up (docs/experiments.md, session 49)."""

    def __init__(self, waves: int = 2) -> None:
        self.waves = waves
        self.reset()

    def reset(self) -> None:
        self.told, self.at = [threading.Event() for _ in range(self.waves)], [0.0] * self.waves

    def tell(self, wave: int) -> None:
        self.at[wave] = time.perf_counter()
        self.told[wave].set()

    def wait(self, wave: int) -> float:
        self.told[wave].wait()
        return self.at[wave]


@dataclasses.dataclass
class NotifiedRunsSource(RunsSource):
    """``RunsSource`` whose rank waits for ``notifier``'s reply before the first share of each of ``waves`` equal parts
    of its pass; that wait, from the notifier's stamp to the reply's arrival (0 when told before it asked), is added to
    that get."""

    notifier: object = None
    waves: int = 2

    def obtain(self, step: int) -> Obtained:
        claim, part = 0.0, max(1, len(self.locs) // self.waves)
        if step % part == 0 and step // part < self.waves:
            t_ask = time.perf_counter()
            at = ray.get(self.notifier.wait.remote(step // part))
            claim = max(0.0, time.perf_counter() - max(at, t_ask))
        got = RunsSource.obtain(self, step)
        return dataclasses.replace(got, get_s=got.get_s + claim, parts=(claim,) + tuple(got.parts[1:]))


def puts_at_t0(system: EngineCeilingSystem, batch: PassData, puts: CompletingPuts, also=None,  # noqa: ANN001
               source: Callable[..., RunsSource] = RunsSource) -> PassResult:
    """``system.run_raw(batch, source)`` with ``puts`` started as its ranks are at t0 (``run_raw``'s ``at_t0``),
    ``also`` (a thread's target, or None) started with them; the puts are finished and discarded after the pass."""
    helper = threading.Thread(target=also) if also is not None else None

    def start() -> None:
        puts.start()
        if helper is not None:
            helper.start()

    try:
        return system.run_raw(batch, source=source, at_t0=start)
    finally:
        if helper is not None and puts.started:
            helper.join()
        puts.finish()


def notified(system: EngineCeilingSystem, batch: PassData, puts: CompletingPuts, note, waves: int) -> PassResult:  # noqa: ANN001
    """``system.run_raw(batch)`` whose ranks, started at t0 with their refs, read each of ``waves`` parts of their
    shares once ``note`` says that wave is registered: with two waves, the first once one of ``puts`` has returned
    and the second once all have; with one, once all have."""
    ray.get(note.reset.remote())

    def tell() -> None:
        if waves > 1:
            puts.first.wait()
            note.tell.remote(0)
        for t in puts.threads:
            t.join()
        note.tell.remote(waves - 1)

    return puts_at_t0(system, batch, puts, also=tell,
                      source=functools.partial(NotifiedRunsSource, notifier=note, waves=waves))
