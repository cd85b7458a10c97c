"""The engine's own ceiling for KnitTrans's read path, measured on the same bytes in the same run.

What Ray itself allows a rank for a share whose rows live in the units' object-store objects: the refs and byte
ranges handed over (no claim, no control path), one ``ray.get`` of the refs, one copy of each run into the rank's
buffer (``client.pack_runs``, the very code KnitTrans's ranks run). The objects are the ones KnitTrans's own
units make for the same puts (a ``build_ray`` plane, the same stream and completion puts, the same share
assignment), so the only difference from ``knittrans-ray`` is the control path: claims, admission, acks and the
contention of the puts that complete at t0. A system's get bandwidth as a fraction of this one is what its design
leaves on the table (``repro.spec.transfer``: ``ray_fraction_of_ceiling``).

The raw pass: before t0 every field is put and every mini-batch admitted and claimed (untimed); at t0 each rank
actor gets its shares' runs as a call argument and reads them one after another (``RunsSource``). Its steady pass
is empty (nothing to hide behind: the ceiling is a raw-pass number).

Multimodal (``multimodal=True``): the same on KnitTrans's multimodal units and controller (``build_mm_ray``): a
share's runs are its fields' and its distinct images' (``MMShareRuns``), packed by the multimodal client's own
``_pack_runs`` (each distinct image copied once). Its raw pass is the least time any design that reads each share
through Ray and packs it once can take for the table's batch: the bound of a raw-transfer ratio against it.

In process (``in_process=True``: ``inproc-ceiling``): the same on an in-process plane (``build_inprocess``, the
units' arrays as the sources), the ranks as threads of the driver's process started together at t0, as
knittrans-inproc's ranks are: what this machine allows knittrans-inproc's gets (two threads of one process
copying the same shares at once) with no puts, no admission, no prefetcher and no feed beside them
(``inproc_ceiling_fraction_of_memcpy``).
"""

from __future__ import annotations

import time
from typing import Callable
from dataclasses import dataclass, field

from knittrans.bench.types import (COMPLETION_FIELDS, BenchLayout, Obtained, PassData, PassKind, PassResult,
                                   streamed_payload)
from knittrans.dataplane.types import MiniBatchKey, ShareLocation, TrajectoryPayload


@dataclass
class RunsSource:
    """A rank's shares as runs handed over by the driver (``StepSource``): step i maps those of share i's sources not
    mapped yet with one ``ray.get`` (in process: the units' arrays themselves; each source once per pass, as a
    KnitTrans rank keeps what it mapped until the source retires: ``client.SourceCache``) and packs its runs, timed
    as a KnitTrans get is (claim 0, read, pack, pack CPU)."""

    locs: tuple[ShareLocation, ...]
    plane: object  # the data plane whose client packs (its schema and prepare options)
    _client: object = field(default=None, repr=False)
    _held: dict = field(default_factory=dict, repr=False)

    def open(self, rank: int) -> None:
        self._client = self.plane.client()
        self._client._sources.retiring = True  # every source stays mapped for the pass (nothing retires it)

    def obtain(self, step: int) -> Obtained:
        loc, c = self.locs[step], self._client
        t1 = time.perf_counter()
        objects = c._resolve(loc.runs, c.getter, (loc.key, loc.rank))
        t2, c2 = time.perf_counter(), time.thread_time()
        share = c._pack_runs(loc, objects)  # ``client.pack_runs`` (multimodal: and each distinct image once)
        t3, c3 = time.perf_counter(), time.thread_time()
        del objects
        self._held[step] = share
        return Obtained(share.nbytes, share.num_tokens, t3 - t1, parts=(0.0, t2 - t1, t3 - t2, c3 - c2),
                        pixel_nbytes=getattr(share, "pixel_nbytes", 0))

    def release(self, step: int) -> None:
        self._held.pop(step, None)

    def close(self) -> None:
        self._held.clear()
        if self._client is not None:
            self._client._sources.clear()


class EngineCeilingSystem:
    """``TransferSystem`` of the engine ceiling (see the module docstring); raw passes only (``run_steady``
    raises: the ceiling has no rollout clock to hide behind)."""

    def __init__(self, name: str, layout: BenchLayout, session, multimodal: bool = False,  # noqa: ANN001
                 in_process: bool = False) -> None:
        self.name, self.layout, self.session, self.multimodal = name, layout, session, multimodal
        if in_process and multimodal:
            raise ValueError(f"{name}: the in-process ceiling is the text table's (no in-process multimodal claim)")
        self.in_process = in_process
        """Ranks as threads of this process reading an in-process plane (``inproc-ceiling``), not rank actors
        reading a Ray plane's objects."""
        self._plane = None

    def _dp(self, d: PassData):  # noqa: ANN202 - the data plane, built on first use
        if self._plane is None:
            from knittrans.handoff import HandoffConfig

            schema = HandoffConfig.grpo(len(d.plan.groups), d.group_size, d.num_minibatches, d.max_response_len,
                                        multimodal=self.multimodal).resolved_schema
            units, ranks = dict(self.layout.unit_nodes), self.layout.rank_nodes
            if self.in_process:
                from knittrans.dataplane.inprocess import build_inprocess

                self._plane = build_inprocess(schema, units, ranks)
            elif self.multimodal:
                from knittrans.mmdedup.plane_ray import build_mm_ray

                self._plane = build_mm_ray(units, ranks, schema, controller_restarts=0)
            else:
                from knittrans.dataplane.ray_transport import build_ray

                self._plane = build_ray(schema, units, ranks, controller_restarts=0)
        return self._plane

    def run_steady(self, batches, iters_per_token: float) -> PassResult:  # noqa: ANN001
        """No steady pass: an empty result (no exposed latency is measured for the ceiling)."""
        return PassResult(PassKind.STEADY)

    def run_raw(self, batch: PassData, source: Callable[..., RunsSource] = RunsSource,
                at_t0: Callable[[], None] | None = None) -> PassResult:
        """The raw pass (module docstring). ``source`` builds each rank's step source from its locations and the plane
        (a ``RunsSource`` or a subclass: ``knittrans.bench.bounds``); ``at_t0`` runs once the ranks are started at t0
        (load to put beside their reads)."""
        from knittrans.bench.loop import finish_raw

        dp = self._dp(batch)
        by_unit: dict[str, list] = {}
        for r in batch.rollouts:
            by_unit.setdefault(self.layout.unit(batch.producer_of[r.traj.traj_id]), []).append(r)
        for unit, rs in by_unit.items():  # as KnitTrans's units get them: the streamed fields, then completion's
            dp.client(unit).put([streamed_payload(r, self.multimodal) for r in rs])
            dp.client(unit).put([TrajectoryPayload(r.traj.traj_id, {k: r.tensors[k] for k in COMPLETION_FIELDS})
                                 for r in rs])
        ctrl, fields = dp.controller, dp.schema.names
        locs: list[list[ShareLocation]] = [[] for _ in range(self.layout.num_ranks)]
        for mb in batch.minibatches:
            ctrl.admit(mb)
            for r in range(self.layout.num_ranks):
                locs[r].append(ctrl.claim(MiniBatchKey(mb.batch_id, mb.index), r, fields))
        if any(loc.runs is None for ls in locs for loc in ls):
            raise RuntimeError(f"{self.name}: some share has no direct runs (a put below the object threshold?)")
        m = len(batch.minibatches)
        sources = [source(tuple(ls), dp) for ls in locs]
        traces, t0 = self._threads(sources, m, at_t0) if self.in_process else self._actors(sources, m, at_t0)
        res = finish_raw(traces, t0)
        for ls in locs:  # consumed: release the batch so the units drop it
            for loc in ls:
                ctrl.ack(loc.key, loc.rank, loc.fields)
        dp.wait_drained(timeout=600)
        return res

    def _actors(self, sources: list[RunsSource], m: int,
                at_t0: Callable[[], None] | None = None) -> tuple[list, float]:
        """Each rank actor reads its shares (the runs travel as the call's argument); t0 as the calls go out."""
        import ray

        from knittrans.bench.ray_ranks import RankRun

        t0 = time.perf_counter()
        runs = [rk.run.remote(src, RankRun(1, m, 0.0)) for rk, src in zip(self.session.ranks, sources)]
        if at_t0 is not None:
            at_t0()
        return ray.get(runs), t0

    @staticmethod
    def _threads(sources: list[RunsSource], m: int,
                 at_t0: Callable[[], None] | None = None) -> tuple[list, float]:
        """One thread per rank, started and waiting before t0, released together at t0 (knittrans-inproc's
        ranks: ``loop.rank_threads``)."""
        from knittrans.bench.loop import rank_threads

        def clock() -> float:
            t0 = time.perf_counter()
            if at_t0 is not None:
                at_t0()
            return t0

        return rank_threads(sources, 1, m, 0.0, clock, name="inproc-ceiling")

    def close(self) -> None:
        if self._plane is not None:
            self._plane.close()
            self._plane = None
