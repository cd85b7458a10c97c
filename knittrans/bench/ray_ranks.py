"""Trainer ranks as Ray actors, the signal board they share with the driver, and one Ray session for a table.

A ``RankActor`` is one trainer rank in its own process (one torch thread, like one GPU's host thread). It runs
``loop.rank_loop`` over whatever ``StepSource`` the driver ships it: a KnitTrans ``Consumer`` (the rank pulls its
shares), a scattered chunk (the centralized driver pushed it), a TransferQueue reader. The same actors serve every
system of a table, so the trainer side is identical across the rows.

``SignalActor`` is ``harness.Signals`` behind an actor (threaded: waiters do not block setters): rank 0's "step
(b, k) started" and the driver's "batch b is complete" travel through it.
"""

from __future__ import annotations

import contextlib
import gc
import os
from dataclasses import dataclass, field
from typing import Hashable

import numpy as np
import ray

from knittrans.bench.loop import Notify, rank_loop
from knittrans.bench.types import StepSource
from knittrans.dataplane import trace
from knittrans.dataplane.harness import RankTrace, Signals
from knittrans.dataplane.heap import freeze_startup_heap


@ray.remote(num_cpus=0, max_concurrency=64)
class SignalActor:
    """``Signals`` shared by the driver and the rank actors."""

    def __init__(self) -> None:
        self.signals = Signals()

    def set(self, key: Hashable, value: float) -> None:
        self.signals.set(key, value)

    def wait(self, key: Hashable, timeout: float | None = None) -> float:
        return self.signals.wait(key, timeout)


MADV_POPULATE_READ = 22  # linux/mman.h, Linux >= 5.14


def map_object_store() -> int:
    """Map the written pages of this process's view of the local Ray object store (``/dev/shm/plasma*`` in
    ``/proc/self/maps``; the pages ``mincore`` finds resident) with ``madvise(MADV_POPULATE_READ)``: what a
    long-running trainer process has done by the time anyone measures it (every page it reads faulted in once), here
    before the first pass instead of inside whichever pass first lands on each page -- a 5 MB share's first copy
    took 0.74 ms with its page faults and 0.23 ms without (session 39). Pages nothing has written are left alone
    (mapping them would allocate the whole store). Called in every process that reads the store for a system (the
    rank actors, verl's workers). Returns the bytes mapped; 0 where there is nothing to map or the kernel lacks the
    advice (a Linux before 5.14, another OS): the passes then pay the faults as before."""
    import ctypes
    import mmap

    try:
        with open("/proc/self/maps") as f:
            maps = f.read().splitlines()
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return 0
    libc.madvise.argtypes = libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    page, done = mmap.PAGESIZE, 0
    for line in maps:
        parts = line.split()
        if len(parts) < 6 or not parts[5].startswith("/dev/shm/plasma"):
            continue
        lo, hi = (int(v, 16) for v in parts[0].split("-"))
        resident = np.zeros((hi - lo) // page, dtype=np.uint8)
        if libc.mincore(lo, hi - lo, resident.ctypes.data) != 0:
            return done
        edges = np.flatnonzero(np.diff(np.concatenate(([0], resident & 1, [0])).astype(np.int8)))
        for a, b in zip(edges[0::2], edges[1::2]):  # runs of resident pages
            if libc.madvise(lo + int(a) * page, int(b - a) * page, MADV_POPULATE_READ) != 0:
                return done
            done += int(b - a) * page
    return done


def actor_notify(signals: "ray.actor.ActorHandle | None") -> Notify | None:
    """Fire-and-forget ``set`` on a ``SignalActor`` (a rank never waits for its own announcement)."""
    return None if signals is None else (lambda key, t: signals.set.remote(key, t))


def actor_wait(signals: "ray.actor.ActorHandle", timeout: float = 600.0):  # noqa: ANN201 - key -> float
    return lambda key: ray.get(signals.wait.remote(key, timeout))


@dataclass(frozen=True)
class RankRun:
    """What one ``RankActor.run`` call trains: ``num_batches`` x ``num_minibatches`` steps."""

    num_batches: int
    num_minibatches: int
    iters_per_token: float
    first_batch: int = 0
    tag: int = 0
    """The pass's tag in step signals (``loop.step_key``)."""
    signals: "ray.actor.ActorHandle | None" = None
    first_ask: float | None = None
    """The rank has been ready since then (the centralized raw pass: idle since t0)."""
    after_previous: bool = False
    """The rank has been ready since its previous call ended (the centralized driver's next batch)."""
    trace: bool = False
    """Record this call's reads (``knittrans.dataplane.trace``); ``RankActor.drain_trace`` hands them over."""


@ray.remote(num_cpus=0)
class RankActor:
    """One trainer rank (see the module docstring)."""

    def __init__(self, rank: int) -> None:
        import torch

        torch.set_num_threads(1)
        self.rank = rank
        self.last_done: float | None = None  # end of this rank's last step (when it was ready for the next)
        self.events: list = []  # trace events of calls with RankRun.trace
        freeze_startup_heap()  # every system's steps run in these actors: the same process set-up for all

    def ready(self) -> int:
        return self.rank

    def run(self, source: StepSource, run: RankRun) -> RankTrace:
        first_ask = run.first_ask
        if run.after_previous and self.last_done is not None:
            first_ask = self.last_done
        with trace.recording() if run.trace else contextlib.nullcontext() as rec:
            out = rank_loop(self.rank, source, run.num_batches, run.num_minibatches, run.iters_per_token,
                            first_ask=first_ask, first_batch=run.first_batch, notify=actor_notify(run.signals),
                            tag=run.tag)
            if rec is not None:
                self.events += rec.drain()
        if out.timings:
            self.last_done = out.timings[-1].t_done
        return out

    def settle(self) -> int:
        """Collect, then freeze what is alive (``heap.freeze_startup_heap``), between passes: whatever a system's
        client left in this process -- TransferQueue's and verl's modules, imported on first use, are ~160k
        objects -- is not walked again by a full collection inside another system's timed pass (one took 45-136
        ms here, where a drain pass takes ~10 ms). Returns how many objects are frozen."""
        return freeze_startup_heap()

    def map_object_store(self) -> int:
        """``map_object_store`` in this rank's process (``RaySession.warm_object_store``)."""
        return map_object_store()

    def forget(self, key: str) -> None:
        """Close the consumer this actor kept under ``key`` (``knittrans_system.ConsumerSource``)."""
        from knittrans.bench.knittrans_system import forget_consumer

        forget_consumer(key)

    def drain_trace(self) -> list:
        """The trace events recorded since the last drain."""
        out, self.events = self.events, []
        return out


def start_ray(num_cpus: int) -> bool:
    """Start a local Ray instance unless one is running (a test may have started it, e.g. with a worker setup
    hook); returns whether this call started it (and should shut it down)."""
    if ray.is_initialized():
        return False
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(address="local", include_dashboard=False, log_to_driver=False, configure_logging=False,
             num_cpus=num_cpus)
    return True


def pinned(node: str | None) -> dict:
    """Ray actor options that pin an actor to Ray node ``node`` (None: no options, Ray places it)."""
    if node is None:
        return {}
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(node_id=node, soft=False)}


WARM_CHUNK = 256 << 20
"""Bytes per object ``RaySession.warm_object_store`` writes."""


@dataclass
class RaySession:
    """Ray, ``num_ranks`` rank actors and a signal board, started once per table run and shared by its systems.
    ``rank_nodes`` / ``signal_node``: Ray node ids to pin rank r / the signal board to (a multi-node cluster,
    ``knittrans.bench.cluster``); None: Ray places them."""

    num_ranks: int
    num_cpus: int = 8
    ranks: list = field(default_factory=list)
    signals: "ray.actor.ActorHandle | None" = None
    rank_nodes: tuple[str, ...] | None = None
    signal_node: str | None = None
    _owns_ray: bool = False
    _froze_driver: bool = False
    _warmed: int = 0

    def __enter__(self) -> "RaySession":
        if self.rank_nodes is not None and len(self.rank_nodes) != self.num_ranks:
            raise ValueError(f"RaySession: {len(self.rank_nodes)} rank nodes for {self.num_ranks} ranks")
        self._owns_ray = start_ray(self.num_cpus)
        nodes = self.rank_nodes or (None,) * self.num_ranks
        self.ranks = [RankActor.options(**pinned(n)).remote(r) for r, n in enumerate(nodes)]
        self.signals = SignalActor.options(**pinned(self.signal_node)).remote()
        ray.get([r.ready.remote() for r in self.ranks])
        return self

    def warm_object_store(self, nbytes: int | None = None) -> int:
        """Write once through ``nbytes`` of the object store (None, and at most: 80% of it), in chunks of
        ``WARM_CHUNK`` held together (the driver never holds more than one chunk). The first write to fresh
        shared-memory pages pays page faults that would otherwise be charged to whichever system first lands on
        them: ~1.7x longer exposed passes for the first system of a table, and the centralized baseline's raw pass
        202-507 ms instead of 69-79 ms when it followed verl's ~1 GB passes into untouched pages with only the
        pages of two of its batches warmed (session 40). Then every rank actor maps the store's written pages
        (``map_object_store``: the page faults of its reads, paid once per process as a long-running trainer has).
        Once per session: a later call with no more bytes than already written does nothing. Returns the bytes
        written by this call."""
        cap = int(0.8 * ray.available_resources().get("object_store_memory", 0))
        n = cap if nbytes is None else min(int(nbytes), cap)
        if n <= self._warmed:
            return 0
        chunk = np.ones(min(n, WARM_CHUNK), dtype=np.uint8)
        refs = [ray.put(chunk[:min(chunk.size, n - at)]) for at in range(0, n, chunk.size)]
        ray.get(refs)
        del refs
        self._warmed = n
        ray.get([r.map_object_store.remote() for r in self.ranks])
        return n

    def settle(self) -> None:
        """Before a timed pass (``interleaved_passes(settle=...)``): every rank actor's heap, and the driver's,
        collected and frozen (``RankActor.settle``), so the same for every system. The driver's frozen objects
        are handed back to the collector when the session ends (``gc.unfreeze``): the driver may be a long-lived
        process (a test session) whose later garbage must still be found."""
        ray.get([r.settle.remote() for r in self.ranks])
        freeze_startup_heap()
        self._froze_driver = True

    def __exit__(self, *exc: object) -> None:
        for a in [*self.ranks, *([self.signals] if self.signals is not None else [])]:
            ray.kill(a)
        self.ranks, self.signals = [], None
        if self._froze_driver:
            gc.unfreeze()
            self._froze_driver = False
        if self._owns_ray:
            ray.shutdown()
