"""TransferQueue (``baselines.transferqueue_adapter``, optional) as a ``knittrans.bench.TransferSystem``.

Every trajectory is written before t0 with one ``kv_batch_put`` per batch (as every system writes what rollout
streams); each rank gets its share of mini-batch k with one ``kv_batch_get`` when it needs it -- TransferQueue's KV
API has no prefetcher -- on the same balanced rows the centralized baseline trains on. In a steady pass a rank
fetches batch b only once the driver signals it complete (t0[b]).

Multimodal (``multimodal=True``): as a TransferQueue user stores a VLM sample -- per trajectory, its token fields
plus ``pixel_values`` (its images' patches back to back, ``[patches, patch_dim]``) and ``image_grid_thw`` (one
``(t, h, w)`` row per image). TransferQueue has no content dedup, so every sample of a group carries (and every get
moves) its own copy of the prompt's images.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import ray

from baselines import transferqueue_adapter as tqa
from baselines.centralized import balance_plan
from knittrans.bench.loop import complete_key, completion_times, finish_raw, finish_steady
from knittrans.bench.ray_ranks import RankRun, RaySession, actor_wait
from knittrans.bench.types import BenchLayout, Obtained, PassData, PassResult
from knittrans.dataplane.types import FieldSpec, TrajectoryPayload, TrajectorySchema

_ATTACHED = False  # per process: a rank actor connects to the running TransferQueue once


@dataclass
class TQSource:
    """A rank's steps from TransferQueue: ``shares[b][k]`` are its trajectory ids of mini-batch k of batch b (in
    ``partitions[b]``); with ``signals``, batch b is fetched only once the driver announced it complete."""

    shares: list[list[tuple[int, ...]]]
    schema: TrajectorySchema
    partitions: list[str]
    signals: "ray.actor.ActorHandle | None" = None
    tag: int = 0

    def open(self, rank: int) -> None:
        global _ATTACHED
        if not _ATTACHED:
            tqa.attach()
            _ATTACHED = True

    def obtain(self, step: int) -> Obtained:
        b, k = divmod(step, len(self.shares[0]))
        if k == 0 and self.signals is not None:
            ray.get(self.signals.wait.remote(complete_key(self.tag, b), 600))
        s = tqa.get(self.shares[b][k], self.schema.names, self.schema, self.partitions[b])
        px = s.values.get(PIXELS)
        return Obtained(s.nbytes, s.tokens, s.get_s, 0 if px is None else int(px.nbytes))

    def release(self, step: int) -> None:
        pass

    def close(self) -> None:
        pass


PIXELS, GRIDS = "pixel_values", "image_grid_thw"


def mm_schema(base: TrajectorySchema, d: PassData) -> TrajectorySchema:
    """``base``'s fields plus the per-trajectory images (see the module docstring), shaped like ``d``'s."""
    img = next(iter(d.images.values()))[0]
    return TrajectorySchema((*base.fields, FieldSpec(PIXELS, str(img.dtype), tail=tuple(img.shape[1:])),
                             FieldSpec(GRIDS, "int64", tail=(3,))), base.token_field, base.same_length)


def tq_payloads(d: PassData, multimodal: bool) -> list[TrajectoryPayload]:
    """What a TransferQueue user puts per trajectory: its token fields (and, multimodal, its own image copies)."""
    if not multimodal:
        return d.payloads()
    out = []
    for r in d.rollouts:
        imgs = [np.asarray(im) for im in r.images]
        px = np.concatenate(imgs) if imgs else np.zeros((0, *d.images[d.prompt_of[r.traj.traj_id]][0].shape[1:]),
                                                        dtype=np.float32)
        grids = np.asarray([tuple(g) for g in r.grids], dtype=np.int64).reshape(-1, 3)
        out.append(TrajectoryPayload(r.traj.traj_id, {**r.tensors, PIXELS: px, GRIDS: grids}))
    return out


class TransferQueueSystem:
    """TransferQueue's KV API on the session's rank actors (see the module docstring). Start it only when
    ``tqa.transferqueue_available()``; Ray needs ``tqa.required_ray_cpus`` free logical CPUs."""

    def __init__(self, name: str, layout: BenchLayout, session: RaySession, schema: TrajectorySchema,
                 num_storage_units: int = 2, multimodal: bool = False) -> None:
        self.name, self.layout, self.session, self.base, self.multimodal = name, layout, session, schema, multimodal
        self.schema = schema  # multimodal: extended with the images on the first batch (their shape)
        tqa.start(tqa.TQConfig(num_storage_units=num_storage_units))

    def _put(self, d: PassData, part: str) -> None:
        if self.multimodal and self.schema is self.base:
            self.schema = mm_schema(self.base, d)
        tqa.put(tq_payloads(d, self.multimodal), self.schema, part)

    def _shares(self, d: PassData) -> list[list[tuple[int, ...]]]:
        """Per rank, per mini-batch: the balanced rows of the centralized baseline."""
        plan = balance_plan(d.minibatches, d.tokens, self.layout.num_ranks)
        per = plan.per_minibatch
        return [[plan.rows_per_rank[r][k * per:(k + 1) * per] for k in range(d.num_minibatches)]
                for r in range(self.layout.num_ranks)]

    def run_raw(self, batch: PassData) -> PassResult:
        part = f"pass{batch.batch_id}"
        self._put(batch, part)
        shares = self._shares(batch)
        t0 = time.perf_counter()
        m = batch.num_minibatches
        traces = ray.get([rk.run.remote(TQSource([shares[r]], self.schema, [part]), RankRun(1, m, 0.0, first_ask=t0))
                          for r, rk in enumerate(self.session.ranks)])
        tqa.clear([r.traj.traj_id for r in batch.rollouts], part)
        return finish_raw(traces, t0)

    def run_steady(self, batches: Sequence[PassData], iters_per_token: float) -> PassResult:
        parts = [f"pass{d.batch_id}" for d in batches]
        for d, part in zip(batches, parts):
            self._put(d, part)
        shares = [self._shares(d) for d in batches]  # [batch][rank][k]
        n, m, tag, s = len(batches), batches[0].num_minibatches, batches[0].batch_id, self.session
        self.layout.check(n, m)
        runs = [rk.run.remote(TQSource([shares[b][r] for b in range(n)], self.schema, parts, s.signals, tag),
                              RankRun(n, m, iters_per_token, tag=tag, signals=s.signals))
                for r, rk in enumerate(s.ranks)]
        t0 = completion_times(self.layout, n, m, tag, actor_wait(s.signals),
                              lambda b: ray.get(s.signals.set.remote(complete_key(tag, b), time.perf_counter())))
        traces = ray.get(runs)
        for d, part in zip(batches, parts):
            tqa.clear([r.traj.traj_id for r in d.rollouts], part)
        return finish_steady(traces, t0, self.layout.warmup_batches)

    def close(self) -> None:
        tqa.close()
