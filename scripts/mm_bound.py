"""The bound of a one-message design on the multimodal raw pass, against the centralized baseline in the same run.

    python scripts/mm_bound.py 18

What ``mm_transfer_latency_ratio`` (centralized's raw pass over knittrans-ray's) could reach with the least control
path the issue's design allows, measured, not modelled. Four arms on the multimodal table's batch (``repro.transfer``'s
config), one raw pass each per round, the order rotated per round, after one warm-up pass each:

- ``ceiling alone``: the engine ceiling (``knittrans.bench.ceiling``): refs handed over before t0, one ``ray.get``,
  one pack per share, nothing else running;
- ``one-message bound``: the same ranks, started at t0 with their refs, wait for one reply of an idle actor saying
  that both producers' completing puts are registered (the table's groups are spread over both rollout nodes: no
  mini-batch is admissible before both), while two producer threads put and register another batch's completing
  fields beside them, as knittrans-ray's producers do at t0 (inline, with their metadata, that batch's streamed
  fields written before t0; put and registered, never admitted, then discarded). The reply's wait counts in the
  get, as knittrans-ray's claim does. No admission, no claim, no location on the way: what any design that hands
  the ranks their shares in one message after the last put pays;
- ``centralized`` and ``knittrans-ray``: the table's systems.

Prints each arm's raw pass (median [min, max] over rounds) and centralized's raw pass over each other arm's as the
table forms it: per pass the median of three consecutive rounds of each (``raw_repeats=3``), median [min, max] over
those passes. Timings are of this machine at this moment: compare the arms within one run.
"""

from __future__ import annotations

import os
import statistics
import sys

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

ARMS = ("ceiling alone", "one-message bound", "centralized", "knittrans-ray")


def main(rounds: int) -> None:
    import torch

    from knittrans.bench.bounds import CompletingPuts, Notifier, notified
    from knittrans.bench.ceiling import EngineCeilingSystem
    from knittrans.bench.ray_ranks import RaySession
    from repro.transfer import TransferConfig, layout_of, passes_of
    from repro.transfer_systems import System, make_system

    torch.set_num_threads(1)
    cfg = TransferConfig(workload="multimodal", systems=["engine-ceiling", "centralized", "knittrans-ray"])
    layout = layout_of(cfg)
    src = passes_of(cfg)

    def bound(system: EngineCeilingSystem, batch, other, note):  # noqa: ANN001, ANN202
        # another batch's completing puts, streamed before t0 and put with their metadata (inline) at t0, as
        # knittrans-ray's producers; one wave: the table's groups span both rollout nodes
        puts = CompletingPuts(system._dp(batch), other, layout, streamed=True, multimodal=True)
        return notified(system, batch, puts, note, waves=1)

    out: dict[str, list[float]] = {a: [] for a in ARMS}
    with RaySession(cfg.num_ranks, 8) as session:
        session.warm_object_store()  # as the tables: the whole store, the ranks' pages mapped
        note = Notifier.remote(1)  # one actor for the run (a new actor per pass would time its start-up)
        ceiling = EngineCeilingSystem("engine-ceiling", layout, session, multimodal=True)
        others = {a: make_system(System(a), cfg, layout, session) for a in ("centralized", "knittrans-ray")}
        systems = [ceiling, *others.values()]
        try:
            uid = 0
            for s in systems:  # warm-up: new actors, first touches
                s.run_raw(src.make(uid, 0))
                uid += 1
            for r in range(rounds):
                for arm in ARMS[r % len(ARMS):] + ARMS[:r % len(ARMS)]:
                    session.settle()
                    batch = src.make(uid, 1)
                    res = (ceiling.run_raw(batch) if arm == ARMS[0]
                           else bound(ceiling, batch, src.make(100_000 + uid, 1), note) if arm == ARMS[1]
                           else others[arm].run_raw(batch))
                    out[arm].append(res.raw_s)
                    uid += 1
        finally:
            for s in systems:
                s.close()
    print(f"{rounds} rounds (multimodal raw pass, ms: median [min, max])")
    for arm, xs in out.items():
        print(f"  {arm:20s} {statistics.median(xs) * 1e3:7.1f} [{min(xs) * 1e3:.1f}, {max(xs) * 1e3:.1f}]")
    passes = rounds // 3
    print(f"centralized / arm, as the table forms it ({passes} passes of three rounds: median [min, max])")
    for arm in ("ceiling alone", "one-message bound", "knittrans-ray"):
        ratios = [statistics.median(out["centralized"][3 * p:3 * p + 3]) / statistics.median(out[arm][3 * p:3 * p + 3])
                  for p in range(passes)]
        print(f"  centralized / {arm:20s} {statistics.median(ratios):.2f} [{min(ratios):.2f}, {max(ratios):.2f}]")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 18)
