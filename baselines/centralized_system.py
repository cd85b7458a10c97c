"""The verl-style centralized baseline as a ``knittrans.bench.TransferSystem``: the DataProto path of
``baselines.centralized`` (text) and ``baselines.centralized_mm`` (images), driven the way verl's trainers drive it.

Per batch, at t0 (train-batch admission: the driver acts only once the whole batch is complete): 1. gather every
rollout worker's output from the object store onto the driver; 2. concat, repeat the prompt batch n times (with
its images: one copy per sample), pad; 3. balance rows over the data-parallel ranks; 4. chunk and scatter through
the Ray object store to the session's ``RankActor``s, which split their chunk into mini-batches.

Across batches (verl's one-step-off and fully-async recipes): generation of b+1 overlaps training of b, but the
driver scatters b+1 only after batch b's synchronous ``update_actor`` returns. ``CentralOverlap.BUILD_AHEAD``
(one-step-off at best) gathers, pads and balances b+1 while b trains; ``SERIAL`` (fully-async pulls its samples at
the top of the next step) does it after.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from enum import Enum
from typing import Sequence

import numpy as np
import ray

from baselines.centralized import (CentralizedConfig, DenseBatch, balance_plan, build_dense_batch, rank_minibatches,
                                   real_tokens)
from baselines.centralized_mm import MMDenseBatch, build_mm_dense_batch
from knittrans.bench.loop import finish_raw, finish_steady, merge_traces, step_key
from knittrans.bench.ray_ranks import RankRun, RaySession, actor_wait, pinned
from knittrans.bench.types import BenchLayout, Obtained, PassData, PassResult
from knittrans.dataplane.harness import RankTrace
from knittrans.dataplane.trace import CpuEvent, FlowEvent


@ray.remote(num_cpus=0)
def _rollout_output(payloads: list) -> list:
    """A rollout worker's output, created in its node's object store (the task runs there and returns it)."""
    return payloads


def traced_gather(refs: list, sources: Sequence[tuple[str, int]], driver: str) -> tuple[list, list]:
    """``ray.get(refs)`` on the driver split into one pull per rollout output (a "gather" flow each, from its
    ``sources`` entry: (node, payload bytes)) and the unpickle ("deser"). Returns the outputs and the events."""
    t0 = time.perf_counter()
    pending, arrived = list(refs), {}
    while pending:
        ready, pending = ray.wait(pending, num_returns=1, fetch_local=True)
        arrived[ready[0]] = time.perf_counter()
    events: list = [FlowEvent("gather", src, driver, nb, t0, arrived[ref]) for ref, (src, nb) in zip(refs, sources)]
    t1 = time.perf_counter()
    out = ray.get(refs)
    events.append(CpuEvent("deser", driver, t1, time.perf_counter()))
    return out, events


class CentralOverlap(str, Enum):
    """What the driver overlaps with batch b's training (the scatter of b+1 always waits for b's update)."""

    BUILD_AHEAD = "build_ahead"
    """Gather, pad and balance b+1 during batch b (verl's one-step-off at best)."""
    SERIAL = "serial"
    """Nothing: gather, build and scatter after b's update returns (verl's fully-async)."""


@dataclass
class ChunkSource:
    """A rank's scattered chunk (it arrived as the call's argument, through the object store), split into its
    mini-batches; step k materializes mini-batch k's tensors. Mini-batch 0's get latency is t0 -> the call
    started (gather, build and scatter); the rest were local."""

    chunk: DenseBatch
    per_minibatch: int
    t0: float

    def open(self, rank: int) -> None:
        self._t_start = time.perf_counter()
        self._mbs = rank_minibatches(self.chunk, self.per_minibatch)

    def obtain(self, step: int) -> Obtained:
        import torch

        mb = self._mbs[step]
        _ = {n: torch.from_numpy(np.asarray(a)) for n, a in mb.tensors.items()}  # ready-to-use tensors
        pixels = mb.pixel_nbytes if isinstance(mb, MMDenseBatch) else 0
        return Obtained(mb.nbytes, real_tokens(mb), (self._t_start - self.t0) if step == 0 else 0.0, pixels)

    def release(self, step: int) -> None:
        pass

    def close(self) -> None:
        self._mbs = []


@dataclass(frozen=True)
class Prepared:
    """A batch as the driver scatters it: one dense chunk per rank, and the bytes it moved."""

    chunks: list[DenseBatch]
    per_minibatch: int
    bytes_moved: int  # gathered (ragged) + scattered (dense)


class CentralizedSystem:
    """The verl driver path (see the module docstring) on a ``RaySession``'s rank actors."""

    def __init__(self, name: str, layout: BenchLayout, session: RaySession, config: CentralizedConfig,
                 overlap: CentralOverlap = CentralOverlap.BUILD_AHEAD, trace: bool = False) -> None:
        self.name, self.layout, self.session, self.config = name, layout, session, config
        self.overlap = CentralOverlap(overlap)
        self.trace = trace
        """Raw passes record the driver's path (``PassResult.trace``): one pull per rollout worker's output, the
        unpickle, the build, per rank the serialization of its chunk and its pull to the rank, the rank's tail."""
        self._events: list = []
        self._chunk_bytes: dict[int, int] = {}

    def stage(self, d: PassData) -> list:
        """Rollout outputs (token fields) sit in the object store, one object per rollout worker, when the batch
        completes; a multimodal prompt's images are the driver's (its dataloader's). On a cluster
        (``layout.placement``) each worker's output is created on its rollout node (unit ``producer mod U``'s)."""
        by_producer: dict[int, list] = {}
        for p in d.payloads():
            by_producer.setdefault(d.producer_of[p.traj_id], []).append(p)
        place = self.layout.placement
        if place is None:
            return [ray.put(ps) for _, ps in sorted(by_producer.items())]
        refs = [_rollout_output.options(**pinned(place.unit_nodes[p % len(place.unit_nodes)])).remote(ps)
                for p, ps in sorted(by_producer.items())]
        ray.wait(refs, num_returns=len(refs), fetch_local=False)  # written before t0, on the rollout nodes
        self._sources = [place.unit_nodes[p % len(place.unit_nodes)] for p in sorted(by_producer)]
        self._source_bytes = [sum(int(a.nbytes) for x in ps for a in x.tensors.values())
                              for _, ps in sorted(by_producer.items())]
        return refs

    def _traced_gather(self, refs: list) -> list:
        out, events = traced_gather(refs, list(zip(self._sources, self._source_bytes)),
                                    self.layout.placement.driver_node)
        self._events += events
        return out

    def prepare(self, refs: list, d: PassData) -> Prepared:
        traced = self.trace and self.layout.placement is not None
        gathered = self._traced_gather(refs) if traced else ray.get(refs)  # 1. gather on the driver
        t_build = time.perf_counter()
        gather_bytes = sum(int(a.nbytes) for chunk in gathered for p in chunk for a in p.tensors.values())
        plan = balance_plan(d.minibatches, d.tokens, self.layout.num_ranks)  # 3. balance
        if d.multimodal:  # 2. concat, repeat (pixel_values too), pad
            batch = build_mm_dense_batch(gathered, d.prompts, d.prompt_of, d.group_size, plan, d.images, d.grids,
                                         self.config)
        else:
            batch = build_dense_batch(gathered, d.prompts, d.prompt_of, d.group_size, plan, self.config)
        chunks = batch.chunk(self.layout.num_ranks)  # 4. scatter (the chunks travel as call arguments)
        if traced:
            self._events.append(CpuEvent("build", self.layout.placement.driver_node, t_build, time.perf_counter()))
        return Prepared(chunks, plan.per_minibatch, gather_bytes + sum(c.nbytes for c in chunks))

    def _scatter(self, prep: Prepared, t0: float, iters_per_token: float, batch: int, tag: int,
                 after_previous: bool, m: int) -> list:
        s, out = self.session, []
        for r, (rk, c) in enumerate(zip(s.ranks, prep.chunks)):
            t = time.perf_counter()  # .remote() serializes the chunk into the driver's object store
            out.append(rk.run.remote(ChunkSource(c, prep.per_minibatch, t0),
                                     RankRun(1, m, iters_per_token, first_batch=batch, tag=tag, signals=s.signals,
                                             first_ask=t0, after_previous=after_previous)))
            if self.trace and self.layout.placement is not None:
                self._events.append(CpuEvent("ser", self.layout.placement.driver_node, t, time.perf_counter(),
                                             f"r{r}"))
                self._chunk_bytes[r] = int(c.nbytes)
        return out

    def run_raw(self, batch: PassData) -> PassResult:
        refs = self.stage(batch)
        self._events = []
        t0 = time.perf_counter()
        prep = self.prepare(refs, batch)
        traces = ray.get(self._scatter(prep, t0, 0.0, 0, batch.batch_id, False, batch.num_minibatches))
        res = finish_raw(traces, t0, prep.bytes_moved)
        if not (self.trace and self.layout.placement is not None):
            return res
        return dataclasses.replace(res, trace=self._scatter_trace(traces), t0=t0)

    def _scatter_trace(self, traces: Sequence[RankTrace]) -> tuple:
        """The pass's events plus, per rank, its chunk's pull (serialized -> the rank's call started: the chunk is
        the call's argument) and its tail (call started -> its last mini-batch in hand)."""
        place, ser = self.layout.placement, {e.key: e for e in self._events if e.label == "ser"}
        out = list(self._events)
        for tr in sorted(traces, key=lambda t: t.rank):
            first = min(tr.timings, key=lambda m: (m.batch, m.index))
            started = first.t_ask + first.fetch_s  # ChunkSource: mini-batch 0's get latency ends when the call ran
            e = ser[f"r{tr.rank}"]
            node = place.rank_nodes[tr.rank]
            out.append(FlowEvent("scatter", place.driver_node, node, self._chunk_bytes[tr.rank], e.t_end, started,
                                 f"r{tr.rank}"))
            out.append(CpuEvent("tail", node, started, max(m.t_got for m in tr.timings), f"r{tr.rank}"))
        return tuple(out)

    def run_steady(self, batches: Sequence[PassData], iters_per_token: float) -> PassResult:
        refs = [self.stage(d) for d in batches]  # written while generating, before t0 (as for every system)
        m, tag = batches[0].num_minibatches, batches[0].batch_id
        self.layout.check(len(batches), m)
        wait = actor_wait(self.session.signals)
        t0: dict[int, float] = {}
        finished: list = []
        running: list | None = None
        moved = 0
        for b, d in enumerate(batches):
            if b:  # batch b completes while batch b-1 trains
                wait(step_key(tag, b - 1, m - self.layout.lead_steps))
            t0[b] = time.perf_counter()
            ahead = b == 0 or self.overlap is CentralOverlap.BUILD_AHEAD
            prep = self.prepare(refs[b], d) if ahead else None
            if running is not None:
                finished.append(ray.get(running))  # the driver is blocked in batch b-1's update_actor
            if prep is None:
                prep = self.prepare(refs[b], d)
            running = self._scatter(prep, t0[b], iters_per_token, b, tag, b > 0, m)
            moved = prep.bytes_moved
            del prep
        finished.append(ray.get(running))
        return finish_steady(merge_traces(finished), t0, self.layout.warmup_batches, moved)

    def close(self) -> None:
        pass
