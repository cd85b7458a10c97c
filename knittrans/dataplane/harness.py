"""Measurement primitives shared by the transfer benchmark (``knittrans.bench``) and its tests: emulated compute,
per-mini-batch timings, exposed latency, memcpy bandwidth.

Compute emulation: a trainer step is charged ``round(tokens * iters_per_token)`` 128x128 fp32 matmuls on one
torch thread. That is real CPU work (it competes with a prefetch thread for cores, as a real step competes for
memory bandwidth and PCIe), proportional to the tokens the step computes on, and identical across systems
because ``iters_per_token`` is calibrated once per run and passed to every system. No sleeps: a sleeping
"compute" would hide transfer work behind an idle CPU and flatter every overlap.

Exposed latency of mini-batch k on a rank (DESIGN.md, "Definitions"): the time the rank waits for its data
after it is ready to compute, ``t_got - max(t_ready, t0)``, where ``t_ready`` is the end of step k-1 (for k=0,
the moment the rank asked), and ``t0`` the moment the trajectories were complete. Timestamps are
``time.perf_counter()`` (CLOCK_MONOTONIC, comparable across processes of one machine).

Steady state (``steady_state_exposed``): ranks train ``N`` consecutive batches; batch b's trajectories are complete
at ``t0[b]`` (for b >= 1, while the trainer still computes batch b-1), so mini-batch (b, k) is exposed by
``t_got - max(t_ask, t0[b])``, the slowest rank's counting. The first ``warmup`` batches are excluded: their
mini-batch 0 finds an idle trainer, which a running RL loop never has.

    >>> m = lambda b, k, ask, got: MiniBatchTiming(k, ask, got, got + 1.0, 0.0, 1, 1, batch=b)
    >>> tr = RankTrace(0, (m(0, 0, 0.0, 0.5), m(0, 1, 1.5, 1.5), m(1, 0, 2.5, 2.75), m(1, 1, 3.75, 3.75)))
    >>> steady_state_exposed([tr], {0: 0.0, 1: 2.0}, warmup=1)
    [[0.25, 0.0]]
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Hashable, Mapping, Sequence

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
    batch: int = 0  # which training batch (0-based within a multi-batch pass)
    pixel_nbytes: int = 0  # of ``nbytes``, the pixel_values bytes (multimodal)
    fetch_parts: tuple[float, ...] = ()  # (claim, read, pack, pack CPU) seconds of ``fetch_s``, map fallbacks


@dataclass(frozen=True)
class RankTrace:
    rank: int
    timings: tuple[MiniBatchTiming, ...]

    def exposed(self, t0: float) -> list[float]:
        return [max(0.0, m.t_got - max(m.t_ask, t0)) for m in self.timings]

    def exposed_by_batch(self, t0: Mapping[int, float]) -> dict[tuple[int, int], float]:
        """``(batch, mini-batch index) -> exposed seconds``, each batch against its own completion time."""
        return {(m.batch, m.index): max(0.0, m.t_got - max(m.t_ask, t0[m.batch])) for m in self.timings}


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


def steady_state_exposed(traces: Sequence[RankTrace], t0: Mapping[int, float], warmup: int = 1) -> list[list[float]]:
    """Per measured batch (``batch >= warmup``, in order), the per-mini-batch exposed latency: the slowest rank's
    wait for data after it was ready, counted from ``max(t_ask, t0[batch])``. Every rank must have recorded the
    same (batch, mini-batch) pairs."""
    per_rank = [tr.exposed_by_batch(t0) for tr in traces]
    keys = sorted(per_rank[0]) if per_rank else []
    if any(sorted(p) != keys for p in per_rank):
        raise ValueError("steady_state_exposed: ranks recorded different (batch, mini-batch) pairs")
    out: dict[int, list[float]] = {}
    for b, k in keys:
        if b >= warmup:
            out.setdefault(b, []).append(max(p[(b, k)] for p in per_rank))
    return [out[b] for b in sorted(out)]


@dataclass
class Signals:
    """A thread-safe board of one-shot events with a value (a timestamp): ``set(key, value)`` once, ``wait(key)``
    blocks on a condition variable until it is set. The multi-batch benchmark uses it for "rank 0 started step
    (b, k)" (what makes batch b+1's rollout complete) and "batch b is complete at t0" (what a rank without a
    data plane waits for)."""

    _values: dict[Hashable, float] = field(default_factory=dict)
    _cv: threading.Condition = field(default_factory=threading.Condition)

    def set(self, key: Hashable, value: float) -> None:
        with self._cv:
            self._values.setdefault(key, value)
            self._cv.notify_all()

    def wait(self, key: Hashable, timeout: float | None = None) -> float:
        with self._cv:
            if not self._cv.wait_for(lambda: key in self._values, timeout=timeout):
                raise TimeoutError(f"signal {key!r} not set within {timeout} s")
            return self._values[key]
