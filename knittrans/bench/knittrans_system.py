"""KnitTrans as the tables measure it: the ``knittrans.Handoff`` a user imports, on either transport.

Per pass, exactly what a user's RL loop does with the handoff: the batch plans are announced (``add_batch``); the
rollout engines stream each trajectory's fields (and a multimodal prompt's images) to the storage unit on their
node while they generate, and at completion put the rest with the trajectory's metadata through their
``Producer`` -- admission runs in the controller as those puts arrive; each trainer rank iterates its
``Consumer`` (prefetched: mini-batch k+1 is claimed, read and packed while k computes) and acks each share after
its step. Nothing is admitted by hand. ``prefetch=False`` fetches each share only when the rank asks for it
(still admitted by the controller, still acked after the step): what overlap buys. The raw pass runs the same
consumers without compute (with nothing to hide behind, the prefetcher's fetches run back to back: no overlap
credit).

Ranks are threads of this process (``Transport.INPROCESS``) or the session's ``RankActor``s (``Transport.RAY``;
controller and units are actors too). After every pass the system waits for the version to reach the steps
trained and for every unit's drop to be confirmed (``wait_drained``), then records what the units still hold
(``PassResult.live_bytes_after``: 0 when every byte was released).
"""

from __future__ import annotations

import dataclasses
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Sequence

from knittrans.bench.loop import completion_times, finish_raw, finish_steady, rank_threads
from knittrans.bench.types import (COMPLETION_FIELDS, BenchLayout, Obtained, PassData, PassKind, PassResult,
                                   streamed_payload)
from knittrans.dataplane.harness import RankTrace, Signals
from knittrans.dataplane import trace
from knittrans.dataplane.trace import CpuEvent, FlowEvent
from knittrans.dataplane.types import PackedShare
from knittrans.handoff import Consumer, Handoff, HandoffConfig, Rollout, Transport

ADMIT_TIMEOUT_S = 600.0
"""A rank (or the driver) waiting longer than this for a share or a signal fails the pass instead of hanging."""
DRAIN_CLAIM_WAIT_S = 5.0
"""Longest a drain pass waits, before its t0, for the ranks' feeds to claim the admitted shares."""


_KEPT: dict[str, Consumer] = {}
_KEPT_LOCK = threading.Lock()


def forget_consumer(key: str) -> None:
    """Close and drop the consumer kept under ``key`` in this process (``ConsumerSource.key``), if any."""
    with _KEPT_LOCK:
        c = _KEPT.pop(key, None)
    if c is not None:
        c.close()


@dataclass
class ConsumerSource:
    """A KnitTrans rank's steps from its handoff ``Consumer``: the prefetching iterator, or (``prefetch=False``)
    a fetch of the next admitted share when the rank asks. Either way the share is acked after the step.

    With ``key``, the consumer lives as long as the system, as a trainer's does: the process that iterates keeps the
    first one it is handed under ``key`` and reads ``count`` shares of it per pass (``Consumer.steps``: nothing is
    read past the pass, while the rank's claims keep arriving ahead); ``forget_consumer(key)`` closes it. Without,
    each pass iterates (and closes) a consumer of its own."""

    consumer: Consumer
    prefetch: bool = True
    count: int | None = None
    """Shares this pass reads (with ``key``)."""
    key: str | None = None
    _held: dict[int, PackedShare] = field(default_factory=dict)
    _turn: tuple[float, str] | None = None  # when the rank took its last share, and that share's trace key

    def open(self, rank: int) -> None:
        if rank != self.consumer.rank:
            raise ValueError(f"consumer of rank {self.consumer.rank} opened by rank {rank}")
        if self.key is not None and self.prefetch:
            if self.count is None:
                raise ValueError("ConsumerSource: a kept consumer reads `count` shares per pass; count is None")
            with _KEPT_LOCK:
                self.consumer = _KEPT.setdefault(self.key, self.consumer)
            self._it = self.consumer.steps(self.count)
            return
        self._it = iter(self.consumer) if self.prefetch else None

    def obtain(self, step: int) -> Obtained:
        c = self.consumer
        if self._turn is not None:  # a traced pass: the rank's turn between two shares (its step, the ack)
            trace.record(CpuEvent("turn", "", self._turn[0], time.perf_counter(), self._turn[1]))
        if self._it is not None:
            share = next(self._it, None)
            if share is None:
                raise RuntimeError(f"rank {c.rank}: the handoff ended before step {step}")
            get_s, timing = c.events[-1].fetch_s, c.events[-1].timing
        else:
            seq = c.start_seq + step
            c.client.controller.next_admitted(seq, ADMIT_TIMEOUT_S)  # the get's latency excludes the wait for it
            t = time.perf_counter()
            share = c.client.fetch_next(seq, c.rank, c.fields, timeout=ADMIT_TIMEOUT_S, ack=False)
            get_s, timing = time.perf_counter() - t, c.client.thread_timing()
        self._held[step] = share
        if trace.active() is not None:
            self._turn = (time.perf_counter(), f"r{share.rank}/s{share.seq}")
        parts = (timing.claim_s, timing.read_s, timing.pack_s, timing.pack_cpu_s) if timing is not None else ()
        return Obtained(share.nbytes, share.num_tokens, get_s, int(getattr(share, "pixel_nbytes", 0)), parts)

    def release(self, step: int) -> None:
        self.consumer.ack(self._held.pop(step))

    def close(self) -> None:
        if self.key is not None and self.prefetch:
            self.consumer.flush()  # kept for the next pass: only its acks are sent now
            return
        self.consumer.close()


class KnitTransSystem:
    """``TransferSystem`` over one ``Handoff`` (see the module docstring). ``session``: the table's
    ``ray_ranks.RaySession`` (required for ``Transport.RAY``)."""

    def __init__(self, name: str, layout: BenchLayout, transport: Transport, multimodal: bool = False,
                 prefetch: bool = True, session=None, dedup: bool = True,  # noqa: ANN001 - a RaySession
                 trace: bool = False, drain: bool = False) -> None:
        if Transport(transport) is Transport.RAY and session is None:
            raise ValueError(f"{name}: the Ray transport needs a RaySession (its rank actors and signal board)")
        if trace and Transport(transport) is not Transport.RAY:
            raise ValueError(f"{name}: trace=True records Ray object transfers; it needs the Ray transport")
        self.name, self.layout, self.transport = name, layout, Transport(transport)
        self.multimodal, self.prefetch, self.session, self.dedup = multimodal, prefetch, session, dedup
        self.trace = trace
        self.drain = drain
        """Raw passes drain the handoff: every trajectory is put and every mini-batch admitted before t0 -- and, once
        the ranks' consumers exist (every pass after the first), claimed by their feeds, as the engine ceiling's
        shares are claimed before its t0 -- then the ranks iterate their consumers with acks and no compute (the
        handoff's own read throughput)."""
        """Raw passes record their reads (``PassResult.trace``): per share, claim, source work, one pull per unit,
        unpickling and packing."""
        self._handoff: Handoff | None = None
        self._seq = 0  # mini-batches admitted so far (the next pass's consumers start here)
        self._producers: ThreadPoolExecutor | None = None  # the rollout engines' concurrent completing puts
        self._consumers: list[Consumer] = []  # one per rank, kept in the process that iterates it (``ConsumerSource``)
        self._key = f"{name}-{uuid.uuid4().hex[:12]}"

    # -- the handoff and the rollout side ----------------------------------------------------------------------

    def handoff(self, d: PassData) -> Handoff:
        """The system's handoff, built for ``d``'s batch shape on first use and kept across passes."""
        if self._handoff is None:
            lay = self.layout
            self._handoff = Handoff(HandoffConfig.grpo(
                prompts_per_batch=len(d.plan.groups), group_size=d.group_size, num_minibatches=d.num_minibatches,
                max_response_len=d.max_response_len, transport=self.transport,
                units=tuple(lay.unit_nodes.items()), rank_nodes=lay.rank_nodes, multimodal=self.multimodal,
                dedup=self.dedup, prefetch_depth=lay.prefetch_depth, admit_timeout_s=ADMIT_TIMEOUT_S,
                controller_node=lay.placement.controller if lay.placement is not None else None))
        return self._handoff

    def _by_unit(self, d: PassData) -> dict[str, list[Rollout]]:
        out: dict[str, list[Rollout]] = {}
        for r in d.rollouts:
            out.setdefault(self.layout.unit(d.producer_of[r.traj.traj_id]), []).append(r)
        return out

    def stream(self, h: Handoff, d: PassData) -> None:
        """What the rollout engines write while they generate (before t0): every field but the completion
        fields, and a multimodal prompt's images; no metadata yet, so nothing is complete or admitted."""
        for unit, rs in self._by_unit(d).items():
            h.plane.client(unit).put([streamed_payload(r, self.multimodal) for r in rs])

    def complete(self, h: Handoff, d: PassData) -> None:
        """At t0: each producer puts its trajectories' completion fields with their metadata, all at once (they
        are separate rollout engines, as the baselines' rollout workers, whose outputs the driver gathers in one
        ``ray.get``); the controller completes them and admits every mini-batch its policy commits."""
        puts = [(h.producer(unit), [Rollout(r.traj, {k: r.tensors[k] for k in COMPLETION_FIELDS}) for r in rs])
                for unit, rs in self._by_unit(d).items()]
        if len(puts) == 1:
            puts[0][0].put(puts[0][1])
            return
        if self._producers is None:
            self._producers = ThreadPoolExecutor(max_workers=len(puts), thread_name_prefix="producer")
        for f in [self._producers.submit(p.put, rs) for p, rs in puts]:
            f.result()

    # -- passes ----------------------------------------------------------------------------------------------

    def run_steady(self, batches: Sequence[PassData], iters_per_token: float) -> PassResult:
        if self.drain:  # a drain system measures raw drains only
            return PassResult(PassKind.STEADY)
        h = self.handoff(batches[0])
        n, m, tag = len(batches), batches[0].num_minibatches, batches[0].batch_id
        self.layout.check(n, m)
        for d in batches:
            h.add_batch(d.plan)
        for d in batches:  # written while generating, before t0 (as for every system)
            self.stream(h, d)
        traces, t0 = self._run(h, n, m, iters_per_token, self.prefetch, tag,
                               lambda b: self.complete(h, batches[b]), steady=True)
        return finish_steady(traces, t0, self.layout.warmup_batches, live_bytes_after=self._settle(h))

    def run_raw(self, batch: PassData) -> PassResult:
        h = self.handoff(batch)
        h.add_batch(batch.plan)
        self.stream(h, batch)
        complete = (lambda b: self.complete(h, batch))
        if self.drain:  # everything put and admitted before t0: what is timed is the ranks' drain alone
            claimed = h.plane.controller.stats().claims
            self.complete(h, batch)
            h.plane.controller.next_admitted(self._seq + batch.num_minibatches - 1, ADMIT_TIMEOUT_S)
            if self._consumers:  # and claimed, as the engine ceiling's shares are: the ranks' feeds bring them
                self._await_claims(h, claimed + self.layout.num_ranks * batch.num_minibatches)
            complete = (lambda b: None)
        traces, t0 = self._run(h, 1, batch.num_minibatches, 0.0, self.prefetch, batch.batch_id,
                               complete, steady=False, trace=self.trace)
        res = finish_raw(traces, t0[0], live_bytes_after=self._settle(h))
        return dataclasses.replace(res, trace=self._drain_trace(), t0=t0[0]) if self.trace else res

    def _kept_key(self, rank: int) -> str:
        """Where rank ``rank``'s process keeps this system's consumer (``ConsumerSource.key``)."""
        return f"{self._key}-r{rank}"

    @staticmethod
    def _await_claims(h: Handoff, count: int, timeout: float = DRAIN_CLAIM_WAIT_S) -> None:
        """Until the controller has made ``count`` claims (the kept consumers' feeds claim admitted shares ahead of
        their reads), at most ``timeout``: past it the drain starts anyway, its claims then inside the timed window."""
        deadline = time.perf_counter() + timeout
        while h.plane.controller.stats().claims < count and time.perf_counter() < deadline:
            time.sleep(0.002)

    def _drain_trace(self) -> tuple:
        """The rank actors' events of the last pass, with unit ids and blank nodes resolved to Ray nodes."""
        import ray

        units, ranks = self.layout.unit_nodes, self.layout.rank_nodes
        out = []
        for r, evs in enumerate(ray.get([rk.drain_trace.remote() for rk in self.session.ranks])):
            for e in evs:
                if isinstance(e, FlowEvent):
                    e = dataclasses.replace(e, src=units.get(e.src, e.src))
                elif not e.node:
                    e = dataclasses.replace(e, node=ranks[r])
                out.append(e)
        return tuple(out)

    def _run(self, h: Handoff, n: int, m: int, iters_per_token: float, prefetch: bool, tag: int,
             complete, steady: bool, trace: bool = False) -> tuple[list[RankTrace], dict[int, float]]:  # noqa: ANN001
        """Start every rank on its consumer of the next ``n * m`` shares, run the rollout clock, collect."""
        start, count = self._seq, n * m
        self._seq += count
        if prefetch:
            if not self._consumers:
                self._consumers = [h.consumer(r, start_seq=start) for r in range(self.layout.num_ranks)]
            sources = [ConsumerSource(c, True, count, self._kept_key(r)) for r, c in enumerate(self._consumers)]
        else:
            sources = [ConsumerSource(h.consumer(r, start_seq=start, count=count), False)
                       for r in range(self.layout.num_ranks)]
        if self.transport is Transport.RAY:
            import ray

            from knittrans.bench.ray_ranks import RankRun, actor_wait

            s = self.session
            # step signals only where the rollout clock waits for them (a steady pass); a raw pass's ranks announce
            # nothing, as the ceiling's and TransferQueue's raw ranks (each announcement is a call to the signal actor)
            signals = s.signals if steady else None
            runs = [rk.run.remote(src, RankRun(n, m, iters_per_token, tag=tag, signals=signals, trace=trace))
                    for rk, src in zip(s.ranks, sources)]
            t0 = self._clock(n, m, tag, actor_wait(s.signals), complete, steady)
            return ray.get(runs), t0
        signals = Signals()
        # in process: one thread per rank (torch ops release the GIL), started before the clock runs
        return rank_threads(sources, n, m, iters_per_token,
                            lambda: self._clock(n, m, tag, lambda k: signals.wait(k, ADMIT_TIMEOUT_S), complete,
                                                steady), notify=signals.set, tag=tag, name=self.name)

    def _clock(self, n: int, m: int, tag: int, wait_step, complete, steady: bool) -> dict[int, float]:  # noqa: ANN001
        if steady:
            return completion_times(self.layout, n, m, tag, wait_step, complete)
        t0 = {0: time.perf_counter()}
        complete(0)
        return t0

    def _settle(self, h: Handoff) -> int:
        """Wait until every step trained so far is acknowledged and every unit confirmed its drops; return the
        bytes the units still hold (fields, and encodings for multimodal)."""
        h.wait_version(self._seq, timeout=ADMIT_TIMEOUT_S)
        h.wait_drained(timeout=ADMIT_TIMEOUT_S)
        held = sum(u.nbytes for u in h.plane.unit_stats())
        live = getattr(h.plane, "live_bytes", None)
        return held + (live() if live is not None else 0)

    def close(self) -> None:
        if self._producers is not None:
            self._producers.shutdown()
            self._producers = None
        if self._consumers:  # the kept consumers first: they give back what their feeds claimed ahead
            keys = [self._kept_key(r) for r in range(len(self._consumers))]
            if self.transport is Transport.RAY:
                import ray

                ray.get([rk.forget.remote(k) for rk, k in zip(self.session.ranks, keys)])
            else:
                for k in keys:
                    forget_consumer(k)
            self._consumers = []
        if self._handoff is not None:
            self._handoff.close()
            self._handoff = None
