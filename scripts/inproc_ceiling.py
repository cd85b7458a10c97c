"""The in-process ceiling: what this machine allows knittrans-inproc's gets (``inproc_fraction_of_memcpy``).

    python scripts/inproc_ceiling.py 8

The text table's batch, put to an in-process plane (stream and completion puts, as knittrans-inproc's units get
them), every mini-batch admitted and every share claimed before t0; at t0 the ranks read and pack their shares one
after another through the client a knittrans-inproc rank uses (``DataPlaneClient.deliver``: one copy per run into
the reused buffer), with no puts, no admission and no prefetcher beside them. Two arms, alternating: both ranks as
threads of this process at once (knittrans-inproc's layout), and one rank alone. Prints each arm's get bandwidth as
the table computes it (bytes over summed get time) as a fraction of this machine's memcpy, median [min, max] over
the rounds. Timings are of this machine at this moment: compare within one run.
"""

from __future__ import annotations

import os
import statistics
import sys
import threading
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main(rounds: int) -> None:
    import torch

    from knittrans.bench.types import COMPLETION_FIELDS
    from knittrans.dataplane import TrajectoryPayload, build_inprocess
    from knittrans.dataplane.harness import memcpy_gbps
    from knittrans.dataplane.types import MiniBatchKey
    from knittrans.handoff import HandoffConfig
    from repro.transfer import TransferConfig, layout_of, passes_of

    torch.set_num_threads(1)
    cfg = TransferConfig(workload="text", systems=["knittrans-inproc"])
    layout = layout_of(cfg)
    src = passes_of(cfg)
    memcpy = memcpy_gbps()

    def one_pass(uid: int, ranks: range) -> float:
        d = src.make(uid, 1)
        schema = HandoffConfig.grpo(len(d.plan.groups), d.group_size, d.num_minibatches,
                                    d.max_response_len).resolved_schema
        dp = build_inprocess(schema, dict(layout.unit_nodes), layout.rank_nodes)
        by_unit: dict[str, list] = {}
        for r in d.rollouts:
            by_unit.setdefault(layout.unit(d.producer_of[r.traj.traj_id]), []).append(r)
        for unit, rs in by_unit.items():
            dp.client(unit).put([TrajectoryPayload(r.traj.traj_id, {k: v for k, v in r.tensors.items()
                                                                    if k not in COMPLETION_FIELDS}) for r in rs])
            dp.client(unit).put([TrajectoryPayload(r.traj.traj_id, {k: r.tensors[k] for k in COMPLETION_FIELDS})
                                 for r in rs])
        locs: list[list] = [[] for _ in range(layout.num_ranks)]
        for mb in d.minibatches:
            dp.controller.admit(mb)
            for r in range(layout.num_ranks):
                locs[r].append(dp.controller.claim(MiniBatchKey(mb.batch_id, mb.index), r, schema.names))
        clients = [dp.client() for _ in range(layout.num_ranks)]
        for c, ls in zip(clients, locs):  # warm: each rank's buffers exist, as after a table's warm-up pass
            c.pack_pool()
        got: list[tuple[int, float]] = []
        start = threading.Barrier(len(ranks))

        def rank(r: int) -> None:
            start.wait()
            for loc in locs[r]:
                t = time.perf_counter()
                share = clients[r].deliver(loc)
                got.append((share.nbytes, time.perf_counter() - t))
                del share

        threads = [threading.Thread(target=rank, args=(r,)) for r in ranks]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        dp.close()
        return sum(n for n, _ in got) / sum(s for _, s in got) / 1e9 / memcpy

    arms = {"both ranks as threads at once": range(layout.num_ranks), "one rank alone": range(1)}
    out: dict[str, list[float]] = {a: [] for a in arms}
    one_pass(0, arms["both ranks as threads at once"])  # warm-up
    for i in range(rounds):
        for name in (list(arms) if i % 2 == 0 else list(arms)[::-1]):
            out[name].append(one_pass(1 + i * 2 + (name == "one rank alone"), arms[name]))
    print(f"memcpy {memcpy:.2f} GB/s, {rounds} rounds")
    for name, xs in out.items():
        print(f"in-process ceiling, {name:30s} get {statistics.median(xs):.3f} [{min(xs):.3f}, {max(xs):.3f}] of memcpy")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 8)
