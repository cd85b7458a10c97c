"""Interleaved raw passes of chosen transfer systems, with each get's profile: where a data-plane change is measured.

    python scripts/rawprof.py knittrans-ray,knittrans-ray-drain,engine-ceiling 8

Runs the text table's default batch (``repro.transfer``'s config) through the named systems (``repro.transfer_systems
.System`` values), one raw pass each per round, the order rotated per round, after one unrecorded warm-up pass each,
and prints per system: its get bandwidth as a fraction of this machine's memcpy (median [range] over rounds), the
slowest rank's rate (what the drain claim measures), the raw pass's median time, and the median get's parts (claim,
read, pack and the pack's CPU, ms; means beside them: the first share's claim dominates the mean). Timings are of
this machine at this moment: compare systems within one run, never across runs. ``RAWPROF_WORKLOAD=multimodal``
runs the multimodal table's batch instead; ``RAWPROF_SETTLE=0`` skips ``RaySession.settle`` before each pass (the
tables call it: ``interleaved_passes(settle=...)``).
"""

from __future__ import annotations

import os
import statistics
import sys

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main(names: list[str], rounds: int) -> None:
    import numpy as np
    import torch

    from knittrans.bench.ray_ranks import RaySession
    from knittrans.dataplane.harness import memcpy_gbps
    from repro.transfer import TransferConfig, layout_of, passes_of
    from repro.transfer_systems import System, make_system

    torch.set_num_threads(1)
    cfg = TransferConfig(workload=os.environ.get("RAWPROF_WORKLOAD", "text"), systems=names)
    layout = layout_of(cfg)
    src = passes_of(cfg)
    memcpy = memcpy_gbps()
    settle = os.environ.get("RAWPROF_SETTLE", "1") != "0"
    out: dict[str, list] = {n: [] for n in names}
    with RaySession(cfg.num_ranks, 8) as session:
        session.warm_object_store()  # as the tables: the whole store, the ranks' pages mapped
        systems = [make_system(System(n), cfg, layout, session) for n in names]
        uid = 0
        try:
            for s in systems:  # warm-up: new actors, first touches
                s.run_raw(src.make(uid, 0))
                uid += 1
            for r in range(rounds):
                for s in systems[r % len(systems):] + systems[:r % len(systems)]:
                    if settle:
                        session.settle()
                    out[s.name].append(s.run_raw(src.make(uid, 1)))
                    uid += 1
        finally:
            for s in systems:
                s.close()
    print(f"memcpy {memcpy:.2f} GB/s, {rounds} rounds, settle={settle}")
    for name, results in out.items():
        frac = [r.get_gbps / memcpy for r in results]
        rank = [r.slowest_rank_gbps / memcpy for r in results]
        print(f"{name:26s} get {statistics.median(frac):.3f} [{min(frac):.3f}, {max(frac):.3f}] of memcpy, "
              f"slowest rank {statistics.median(rank):.3f}, raw {statistics.median(r.raw_s for r in results) * 1e3:.1f} ms")
        if all(r.get_parts for r in results):
            parts = np.array([p for r in results for p in r.get_parts]) * 1e3
            gets = np.array([g for r in results for g in r.get_s]) * 1e3
            med, mean = np.median(parts, axis=0), parts.mean(axis=0)
            print(f"{'':26s} per get (ms): median {np.median(gets):.2f} = claim {med[0]:.2f} + read {med[1]:.2f} + "
                  f"pack {med[2]:.2f} (pack CPU {med[3]:.2f}); means {gets.mean():.2f} = {mean[0]:.2f} + "
                  f"{mean[1]:.2f} + {mean[2]:.2f}")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    main(sys.argv[1].split(","), int(sys.argv[2]) if len(sys.argv) > 2 else 5)
