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

import os
import statistics
import sys

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main(rounds: int) -> None:
    import torch

    from knittrans.bench.bounds import CompletingPuts, Notifier, notified, puts_at_t0
    from knittrans.bench.ceiling import EngineCeilingSystem
    from knittrans.bench.ray_ranks import RaySession
    from knittrans.dataplane.harness import memcpy_gbps
    from repro.transfer import TransferConfig, layout_of, passes_of

    torch.set_num_threads(1)
    cfg = TransferConfig(workload="text", systems=["engine-ceiling"])
    layout = layout_of(cfg)
    src = passes_of(cfg)
    memcpy = memcpy_gbps()

    def with_puts_beside(system: EngineCeilingSystem, batch, other):  # noqa: ANN001, ANN202
        """``system.run_raw(batch)`` with ``other``'s completing puts started as the ranks' reads are."""
        return puts_at_t0(system, batch, CompletingPuts(system._dp(batch), other, layout))

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
        puts = CompletingPuts(system._dp(batch), other, layout)

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

    def notified_per_put(system: EngineCeilingSystem, batch, other, note):  # noqa: ANN001, ANN202
        """Reads of each half of the ranks' shares once ``note`` says that the first (then the second) of
        ``other``'s two completing puts is registered (the text batch's two puts admit two mini-batches each)."""
        return notified(system, batch, CompletingPuts(system._dp(batch), other, layout), note, waves=2)

    arms = ("alone", "with the completing puts beside it", "reads after the first put is registered",
            "reads once notified, per put, by an idle actor")
    out: dict[str, list[float]] = {a: [] for a in arms}
    parts: dict[str, list[tuple[float, ...]]] = {a: [] for a in arms}
    with RaySession(cfg.num_ranks, 8) as session:
        session.warm_object_store()  # as the tables: the whole store, the ranks' pages mapped
        note = Notifier.remote(2)  # one for the run: an actor started inside a pass would time its start-up
        system = EngineCeilingSystem("engine-ceiling", layout, session)
        try:
            system.run_raw(src.make(0, 0))  # warm-up: new actors, first touches
            uid = 1
            for r in range(rounds):
                for arm in arms[r % len(arms):] + arms[:r % len(arms)]:
                    batch, other = src.make(uid, 1), src.make(10_000 + uid, 1)
                    res = (system.run_raw(batch) if arm == arms[0] else with_puts_beside(system, batch, other)
                           if arm == arms[1] else after_first_put(system, batch, other, session)
                           if arm == arms[2] else notified_per_put(system, batch, other, note))
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
