"""Run many independent simulation points, serially or as Ray tasks, with a progress bar.

Ray is the project's engine for anything beyond one process; each point is a pure function of its spec, so the
sweep parallelizes as plain tasks. Points return small dataclasses (metrics), never the per-trajectory records.
"""

from __future__ import annotations

import os
from typing import Callable, Sequence, TypeVar

from tqdm import tqdm

S = TypeVar("S")
R = TypeVar("R")


def run_points(fn: Callable[[S], R], specs: Sequence[S], parallel: str = "ray", workers: int = 0,
               desc: str = "sweep") -> list[R]:
    """``fn`` over ``specs`` in order. ``parallel``: "ray" (local cluster with ``workers`` CPUs, 0 = all) or
    "none" (this process)."""
    if parallel not in ("ray", "none"):
        raise ValueError(f"parallel must be 'ray' or 'none', got {parallel!r}")
    if parallel == "none" or len(specs) <= 1:
        return [fn(s) for s in tqdm(specs, desc=desc, unit="run", mininterval=1.0)]
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    started_here = not ray.is_initialized()
    if started_here:
        ray.init(address="local", include_dashboard=False, num_cpus=workers or os.cpu_count(),
                 log_to_driver=False, configure_logging=False)
    try:
        task = ray.remote(num_cpus=1)(fn)
        refs = [task.remote(s) for s in specs]
        index = {r: i for i, r in enumerate(refs)}
        out: list = [None] * len(refs)
        pending = list(refs)
        with tqdm(total=len(refs), desc=desc, unit="run", mininterval=1.0) as bar:
            while pending:
                done, pending = ray.wait(pending, num_returns=1)
                for r in done:
                    out[index[r]] = ray.get(r)
                    bar.update(1)
        return out
    finally:
        if started_here:
            ray.shutdown()
