"""The engine ceiling with and without the raw pass's completing puts beside its reads: the bound on knittrans-ray's
raw-pass gets on this machine.

    python scripts/ceiling_under_load.py 8

The engine ceiling (``knittrans.bench.ceiling``) reads shares whose refs were handed over before t0, with nothing
else running. In knittrans-ray's raw pass the producers' completing puts (the advantages, ~4.6 MB per unit at the
default text size, put to the units and registered with the controller) run on the same cores while the ranks read.
This script runs the ceiling's raw pass alternately alone and with another batch's completing puts started as its
ranks start reading (two producer threads, as knittrans-ray's producers at t0; put and registered, never admitted,
then discarded), and prints the ceiling's get bandwidth as a fraction of this machine's memcpy for each, median
[min, max] over the rounds. Timings are of this machine at this moment: compare the arms within one run.

A third arm starts the reads where knittrans-ray's can start at the earliest: once the first producer's put is
stored and registered (its first admission needs it), with the second producer's put still running beside them.
Reads that overlap the whole of both puts (the second arm) are the pessimistic bound; this one is the overlap the
raw pass imposes on a design that reads each share as soon as it is admitted.

A fourth arm adds the least control path such a design can have: the ranks start at t0 with their refs but read
the first half of their shares only once an idle actor's reply tells them that the first put is registered, and the
second half once the second one is (the text batch's two completing puts admit two mini-batches each); the wait from
the notifier's stamp to the reply's arrival counts in the get, as knittrans-ray's claim does (admission -> the rank
holds the location). Its bandwidth is what the engine allows any design that admits as the puts register and hands
each admission's locations to the ranks in one message; ``per pass`` prints where each arm's get time went.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import sys
import threading
import time

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main(rounds: int) -> None:
    import ray
    import torch

    from knittrans.bench import ceiling as ceiling_mod
    from knittrans.bench.ceiling import EngineCeilingSystem, RunsSource
    from knittrans.bench.ray_ranks import RaySession
    from knittrans.bench.types import COMPLETION_FIELDS
    from knittrans.dataplane.harness import memcpy_gbps
    from knittrans.dataplane.types import TrajectoryPayload
    from repro.transfer import TransferConfig, layout_of, passes_of

    torch.set_num_threads(1)
    cfg = TransferConfig(workload="text", systems=["engine-ceiling"])
    layout = layout_of(cfg)
    src = passes_of(cfg)
    memcpy = memcpy_gbps()
    real_get = ray.get

    class OtherPuts:
        """``other``'s completing puts (its advantages, per unit, on threads), as knittrans-ray's producers put them
        at t0; ``start`` starts them once, ``first`` is set when one of them has returned (stored and registered);
        ``finish`` waits for them and discards the batch (put and registered, never admitted)."""

        def __init__(self, dp, other) -> None:  # noqa: ANN001
            self.dp, self.other, self.first = dp, other, threading.Event()
            by_unit: dict[str, list] = {}
            for r in other.rollouts:
                by_unit.setdefault(layout.unit(other.producer_of[r.traj.traj_id]), []).append(
                    TrajectoryPayload(r.traj.traj_id, {f: r.tensors[f] for f in COMPLETION_FIELDS}))
            self.threads = [threading.Thread(target=self._put, args=(u, ps)) for u, ps in by_unit.items()]
            self._started = False

        def _put(self, unit: str, payloads: list) -> None:
            self.dp.client(unit).put(payloads)
            self.first.set()

        def start(self) -> None:
            if not self._started:
                self._started = True
                for t in self.threads:
                    t.start()

        def finish(self) -> None:
            if self._started:
                for t in self.threads:
                    t.join()
            self.dp.client().discard([r.traj.traj_id for r in self.other.rollouts])

    def with_puts_beside(system: EngineCeilingSystem, batch, other):  # noqa: ANN001, ANN202
        """``system.run_raw(batch)`` with ``other``'s completing puts started as the ranks' reads are (the ceiling
        times its ranks from the ``ray.get`` of their runs: the first list of refs it waits on)."""
        puts = OtherPuts(system._dp(batch), other)

        def get(refs, *a, **k):  # noqa: ANN001, ANN002, ANN003, ANN202
            if isinstance(refs, list):
                puts.start()
            return real_get(refs, *a, **k)

        ray.get = get
        try:
            return system.run_raw(batch)
        finally:
            ray.get = real_get
            puts.finish()

    class _Delayed:
        """A rank actor whose ``run`` is submitted only once ``wait()`` returns (the first producer's put done)."""

        def __init__(self, handle, wait) -> None:  # noqa: ANN001
            self.handle, self.wait = handle, wait

        @property
        def run(self):  # noqa: ANN202
            handle, wait = self.handle, self.wait

            class _Method:
                @staticmethod
                def remote(*a, **k):  # noqa: ANN002, ANN003, ANN205
                    wait()
                    return handle.run.remote(*a, **k)
            return _Method

    def after_first_put(system: EngineCeilingSystem, batch, other, session):  # noqa: ANN001, ANN202
        """``system.run_raw(batch)`` whose ranks start reading once the first of ``other``'s two completing puts
        has returned (stored and registered), the second still running."""
        puts = OtherPuts(system._dp(batch), other)

        def wait() -> None:
            puts.start()
            puts.first.wait()

        ranks = session.ranks
        session.ranks = [_Delayed(h, wait) for h in ranks]
        try:
            return system.run_raw(batch)
        finally:
            session.ranks = ranks
            puts.finish()

    @ray.remote(num_cpus=0, max_concurrency=4)
    class Notifier:
        """The least control path of a design that admits as the puts register: per wave (a put registered), one
        reply of an idle actor to each rank."""

        def __init__(self) -> None:
            self.reset()

        def reset(self) -> None:
            self.told, self.at = [threading.Event(), threading.Event()], [0.0, 0.0]

        def tell(self, wave: int) -> None:
            self.at[wave] = time.perf_counter()  # the "admission": the notifier learns that a put is registered
            self.told[wave].set()

        def wait(self, wave: int) -> float:
            self.told[wave].wait()
            return self.at[wave]

    @dataclasses.dataclass
    class NotifiedRunsSource(RunsSource):
        """``RunsSource`` whose rank waits for ``notifier``'s reply before the first share of each half of the pass
        (wave 0: the first put registered; wave 1: both); that wait, from the notifier's stamp to the reply's
        arrival (the claim as knittrans-ray times it: admission -> the rank holds the location, 0 when the rank
        was told before it asked), is added to that get."""

        notifier: object = None

        def obtain(self, step: int):  # noqa: ANN201
            claim, half = 0.0, max(1, len(self.locs) // 2)
            if step % half == 0 and step // half < 2:
                t_ask = time.perf_counter()
                at = real_get(self.notifier.wait.remote(step // half))
                claim = max(0.0, time.perf_counter() - max(at, t_ask))
            got = RunsSource.obtain(self, step)
            return dataclasses.replace(got, get_s=got.get_s + claim, parts=(claim,) + tuple(got.parts[1:]))

    def notified(system: EngineCeilingSystem, batch, other, note):  # noqa: ANN001, ANN202
        """``system.run_raw(batch)`` whose ranks, started at t0 with their refs, read each half of their shares once
        an idle actor's reply tells them that the first (then the second) of ``other``'s completing puts is
        registered."""
        puts = OtherPuts(system._dp(batch), other)
        real_get(note.reset.remote())

        def tell() -> None:
            puts.first.wait()
            note.tell.remote(0)
            for t in puts.threads:
                t.join()
            note.tell.remote(1)

        teller = threading.Thread(target=tell)

        def get(refs, *a, **k):  # noqa: ANN001, ANN002, ANN003, ANN202
            if isinstance(refs, list) and not puts._started:
                puts.start()
                teller.start()
            return real_get(refs, *a, **k)

        ceiling_mod.RunsSource = lambda locs, dp: NotifiedRunsSource(locs, dp, notifier=note)
        ray.get = get
        try:
            return system.run_raw(batch)
        finally:
            ray.get, ceiling_mod.RunsSource = real_get, RunsSource
            if puts._started:
                teller.join()
            puts.finish()

    arms = ("alone", "with the completing puts beside it", "reads after the first put is registered",
            "reads once notified, per put, by an idle actor")
    out: dict[str, list[float]] = {a: [] for a in arms}
    parts: dict[str, list[tuple[float, ...]]] = {a: [] for a in arms}
    with RaySession(cfg.num_ranks, 8) as session:
        session.warm_object_store()  # as the tables: the whole store, the ranks' pages mapped
        note = Notifier.remote()  # one for the run: an actor started inside a pass would time its start-up
        real_get(note.reset.remote())
        system = EngineCeilingSystem("engine-ceiling", layout, session)
        try:
            system.run_raw(src.make(0, 0))  # warm-up: new actors, first touches
            uid = 1
            for r in range(rounds):
                for arm in arms[r % len(arms):] + arms[:r % len(arms)]:
                    batch, other = src.make(uid, 1), src.make(10_000 + uid, 1)
                    res = (system.run_raw(batch) if arm == arms[0] else with_puts_beside(system, batch, other)
                           if arm == arms[1] else after_first_put(system, batch, other, session)
                           if arm == arms[2] else notified(system, batch, other, note))
                    out[arm].append(res.get_gbps / memcpy)
                    parts[arm].extend(res.get_parts)
                    uid += 1
        finally:
            system.close()
    print(f"memcpy {memcpy:.2f} GB/s, {rounds} rounds")
    for what, xs in out.items():
        print(f"engine ceiling {what:48s} get {statistics.median(xs):.3f} [{min(xs):.3f}, {max(xs):.3f}] of memcpy")
        if parts[what]:
            sums = [sum(p[i] for p in parts[what]) / len(xs) * 1e3 for i in range(3)]
            print(f"{'':63s} per pass (ms, mean): claim {sums[0]:.2f} + read {sums[1]:.2f} + pack {sums[2]:.2f}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 8)
