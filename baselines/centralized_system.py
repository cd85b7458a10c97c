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
from knittrans.bench.ray_ranks import RankRun, RaySession, actor_wait
from knittrans.bench.types import BenchLayout, Obtained, PassData, PassResult


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
                 overlap: CentralOverlap = CentralOverlap.BUILD_AHEAD) -> None:
        self.name, self.layout, self.session, self.config = name, layout, session, config
        self.overlap = CentralOverlap(overlap)

    def stage(self, d: PassData) -> list:
        """Rollout outputs (token fields) sit in the object store, one object per rollout worker, when the batch
        completes; a multimodal prompt's images are the driver's (its dataloader's)."""
        by_producer: dict[int, list] = {}
        for p in d.payloads():
            by_producer.setdefault(d.producer_of[p.traj_id], []).append(p)
        return [ray.put(ps) for _, ps in sorted(by_producer.items())]

    def prepare(self, refs: list, d: PassData) -> Prepared:
        gathered = ray.get(refs)  # 1. gather on the driver
        gather_bytes = sum(int(a.nbytes) for chunk in gathered for p in chunk for a in p.tensors.values())
        plan = balance_plan(d.minibatches, d.tokens, self.layout.num_ranks)  # 3. balance
        if d.multimodal:  # 2. concat, repeat (pixel_values too), pad
            batch = build_mm_dense_batch(gathered, d.prompts, d.prompt_of, d.group_size, plan, d.images, d.grids,
                                         self.config)
        else:
            batch = build_dense_batch(gathered, d.prompts, d.prompt_of, d.group_size, plan, self.config)
        chunks = batch.chunk(self.layout.num_ranks)  # 4. scatter (the chunks travel as call arguments)
        return Prepared(chunks, plan.per_minibatch, gather_bytes + sum(c.nbytes for c in chunks))

    def _scatter(self, prep: Prepared, t0: float, iters_per_token: float, batch: int, tag: int,
                 after_previous: bool, m: int) -> list:
        s = self.session
        return [rk.run.remote(ChunkSource(c, prep.per_minibatch, t0),
                              RankRun(1, m, iters_per_token, first_batch=batch, tag=tag, signals=s.signals,
                                      first_ask=t0, after_previous=after_previous))
                for rk, c in zip(s.ranks, prep.chunks)]

    def run_raw(self, batch: PassData) -> PassResult:
        refs = self.stage(batch)
        t0 = time.perf_counter()
        prep = self.prepare(refs, batch)
        traces = ray.get(self._scatter(prep, t0, 0.0, 0, batch.batch_id, False, batch.num_minibatches))
        return finish_raw(traces, t0, prep.bytes_moved)

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
