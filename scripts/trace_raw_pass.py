"""Where a multimodal raw pass of knittrans-ray spends its time: the gate's workload (16 prompts x n=16, one 224px
image each, M=2, group placement, 2 ranks, 2 units), N raw passes after 3 warm-ups, each traced per share (claim:
from the ask to the share's location, incl. waiting for admission; source: the unit's get until its answer exists
in the object store; read: the pull; deser: unpickling; pack: into the rank's buffer). Prints the median raw time
with its range and each phase's median per share.

    python scripts/trace_raw_pass.py [N]        # from a worktree: PYTHONPATH=$PWD (Ray workers import that code)
"""

from __future__ import annotations

import collections
import statistics
import sys

import torch

from knittrans.bench.knittrans_system import KnitTransSystem
from knittrans.bench.ray_ranks import RaySession
from knittrans.bench.types import BenchLayout
from knittrans.handoff import Transport
from repro.transfer import MMTransferWorkload, TransferConfig, passes_of


def main(n: int = 15) -> None:
    torch.set_num_threads(1)
    cfg = TransferConfig(workload="multimodal", systems=["knittrans-ray"], num_batches=3, num_minibatches=2,
                         lead_steps=2, multimodal=MMTransferWorkload(prompts_per_batch=16, group_size=16,
                                                                     image_side=224, placement="group"),
                         compute_s_per_minibatch=0.25, logger="none")
    layout = BenchLayout(cfg.num_ranks, cfg.num_units, cfg.lead_steps, cfg.warmup_batches, cfg.prefetch_depth)
    src = passes_of(cfg)
    phases: dict[str, list[float]] = collections.defaultdict(list)
    raws = []
    with RaySession(cfg.num_ranks, cfg.ray_num_cpus) as session:
        system = KnitTransSystem("knittrans-ray", layout, Transport.RAY, multimodal=True, session=session,
                                 trace=True)
        try:
            for i in range(n + 3):
                r = system.run_raw(src.make(100 + i, cfg.num_batches))
                if i < 3:
                    continue
                raws.append(r.raw_s)
                per: dict[str, float] = collections.defaultdict(float)
                shares = {e.key for e in r.trace}
                for e in r.trace:
                    per[e.label] += e.t_end - e.t_start
                for k, v in per.items():
                    phases[k].append(v / max(1, len(shares)))
        finally:
            system.close()
    print(f"raw pass: median {1e3 * statistics.median(raws):.1f} ms [{1e3 * min(raws):.1f}, {1e3 * max(raws):.1f}]"
          f" over {len(raws)} passes")
    for k, v in sorted(phases.items()):
        print(f"  {k:7s} {1e3 * statistics.median(v):6.1f} ms per share (median)")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 15)
