"""Measurement primitives shared by the transfer benchmark and its tests: emulated compute, per-mini-batch
timings, exposed latency, memcpy bandwidth.

Compute emulation: a trainer step is charged ``round(tokens * iters_per_token)`` 128x128 fp32 matmuls on one
torch thread. That is real CPU work (it competes with a prefetch thread for cores, as a real step competes for
memory bandwidth and PCIe), proportional to the tokens the step computes on, and identical across systems
because ``iters_per_token`` is calibrated once per run and passed to every system. No sleeps: a sleeping
"compute" would hide transfer work behind an idle CPU and flatter every overlap.

Exposed latency of mini-batch k on a rank (DESIGN.md, "Definitions"): the time the rank waits for its data
after it is ready to compute, ``t_got - max(t_ready, t0)``, where ``t_ready`` is the end of step k-1 (for k=0,
the moment the rank asked), and ``t0`` the moment the trajectories were complete. Timestamps are
``time.perf_counter()`` (CLOCK_MONOTONIC, comparable across processes of one machine).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np

MATMUL_DIM = 128


@dataclass(frozen=True)
class MiniBatchTiming:
    """One rank's record of one mini-batch."""

    index: int
    t_ask: float  # the rank is ready for this mini-batch's data (previous step done)
    t_got: float  # the rank holds the prepared share
    t_done: float  # its emulated compute finished
    fetch_s: float  # duration of the get itself (claim + read + pack; 0 when data arrived as an argument)
    nbytes: int
    tokens: int


@dataclass(frozen=True)
class RankTrace:
    rank: int
    timings: tuple[MiniBatchTiming, ...]

    def exposed(self, t0: float) -> list[float]:
        return [max(0.0, m.t_got - max(m.t_ask, t0)) for m in self.timings]


def emulate_compute(tokens: int, iters_per_token: float) -> None:
    """Burn ``round(tokens * iters_per_token)`` matmuls (see the module docstring for why not sleep)."""
    import torch

    n = int(round(tokens * iters_per_token))
    if n <= 0:
        return
    a = torch.full((MATMUL_DIM, MATMUL_DIM), 1.0 / MATMUL_DIM)
    out = torch.empty_like(a)
    for _ in range(n):
        torch.mm(a, a, out=out)


def calibrate_iters_per_token(target_s: float, tokens: int, probe_iters: int = 400) -> float:
    """``iters_per_token`` such that a step of ``tokens`` tokens takes about ``target_s`` on this machine."""
    if target_s <= 0:
        return 0.0
    emulate_compute(probe_iters, 1.0)  # warm-up
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        emulate_compute(probe_iters, 1.0)
        best = min(best, (time.perf_counter() - t) / probe_iters)
    return target_s / (best * max(1, tokens))


def memcpy_gbps(nbytes: int = 256 << 20, repeats: int = 5) -> float:
    """Best-of-``repeats`` single-thread ``memcpy`` bandwidth of this machine, in GB/s (1e9 B/s), counting the
    bytes copied once (not read + write)."""
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t)
    return nbytes / best / 1e9


def summarize_exposed(traces: Sequence[RankTrace], t0: float) -> list[float]:
    """Per mini-batch exposed latency: the slowest rank's (a step starts when every rank can start it)."""
    per_rank = [tr.exposed(t0) for tr in traces]
    return [max(col) for col in zip(*per_rank)]
