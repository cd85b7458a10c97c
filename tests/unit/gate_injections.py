"""Regressions injected into PRODUCT code for the transfer and speedup gate tests (tests/unit/test_gate_*.py).

Each function monkeypatches what a user imports -- the handoff's consumer, the multimodal plane, the encoding store,
the dedup trainer path -- in the driver. The Ray systems are built in the driver and reach the actors through their
arguments (a ``Consumer`` pickled into each rank actor, the unit actors' class and constructor arguments), so the
regressions travel with them: this module is shipped to Ray workers by value.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Callable

import ray
import ray.cloudpickle

from knittrans.dataplane.prefetch import PrefetchEvent
from knittrans.dataplane.storage import StorageUnit
from knittrans.handoff import Consumer, Handoff
from knittrans.mmdedup import gather, plane, plane_ray

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


class OnDemandConsumer(Consumer):
    """The regression "the consumer stops prefetching": each share is claimed, read and packed only when the rank
    asks for it (still admitted by the controller, still acked after the step)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self._events: list[PrefetchEvent] = []
        self._seq = self.start_seq

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self._events = []
        self._seq = self.start_seq

    def __iter__(self):  # noqa: ANN204
        while self.count is None or self._seq < self.start_seq + self.count:
            yield self._fetch()

    def steps(self, count: int):  # noqa: ANN201 - the same, ``count`` shares at a time (a kept consumer's passes)
        for _ in range(count):
            yield self._fetch()

    def _fetch(self):  # noqa: ANN202
        t = time.perf_counter()
        share = self.client.fetch_next(self._seq, self.rank, self.fields, timeout=self.admit_timeout_s, ack=False)
        now = time.perf_counter()
        self._events.append(PrefetchEvent(self._seq, t, now, now, now - t))
        self._seq += 1
        return share

    @property
    def events(self) -> list:
        return self._events


def consumers_stop_prefetching(monkeypatch) -> None:  # noqa: ANN001 - pytest's MonkeyPatch
    def consumer(self, rank=0, fields=None, start_seq=0, count=None):  # noqa: ANN001, ANN202
        return OnDemandConsumer(self.plane, rank, None if fields is None else tuple(fields),
                                self.config.prefetch_depth, self.config.admit_timeout_s, start_seq, count)
    monkeypatch.setattr(Handoff, "consumer", consumer)


def dedup_off_in_the_plane(monkeypatch) -> None:  # noqa: ANN001
    """The multimodal plane's units store and move every image occurrence (its dedup switch forced off)."""
    build_ray, build_inproc = plane_ray.build_mm_ray, plane.build_mm_inprocess
    monkeypatch.setattr(plane_ray, "build_mm_ray", lambda *a, **kw: build_ray(*a, **{**kw, "dedup": False}))
    monkeypatch.setattr(plane, "build_mm_inprocess", lambda *a, **kw: build_inproc(*a, **{**kw, "dedup": False}))


class LeakyHost(plane_ray.MMUnitHost):
    """A multimodal unit whose drop forgets the fields but never releases the images' references."""

    def drop(self, traj_ids, fields=None, *after) -> int:  # noqa: ANN001, ANN002 - ``UnitHost.drop``'s signature
        return StorageUnit.drop(self.unit, traj_ids, fields)


def units_leak_encodings(monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setattr(plane_ray, "MMStorageUnitActor", ray.remote(num_cpus=0, max_concurrency=8)(LeakyHost))
    monkeypatch.setattr(plane.MMStorageUnit, "drop", lambda self, ids, fields=None: StorageUnit.drop(self, ids, fields))


def encoder_runs_per_occurrence(monkeypatch) -> None:  # noqa: ANN001
    """The dedup trainer path's encoder-once gather disabled: the vision tower encodes every occurrence and each
    occurrence takes the output of its image's first one."""
    import torch

    def encode_every_occurrence(model, batch):  # noqa: ANN001, ANN202
        occ = list(batch.occurrence)
        pixels = torch.cat([batch.images.pixels[i] for i in occ])
        grids = torch.tensor([batch.images.grids[i] for i in occ], dtype=torch.int64)
        out = model.model.get_image_features(pixels, grids, return_dict=True).pooler_output
        first: dict[int, torch.Tensor] = {}
        for i, o in zip(occ, out):
            first.setdefault(i, o)
        return [first.get(i) for i in range(len(batch.images.pixels))]
    monkeypatch.setattr(gather, "encode_distinct", encode_every_occurrence)


@dataclass(frozen=True)
class PerTrajectoryGetter:
    """Reads a share one trajectory at a time: one unit call (on Ray: one actor round trip and one object) per
    trajectory instead of one per unit -- the per-trajectory access pattern the data plane's unit chunks replace."""

    inner: Callable

    def __call__(self, requests, fields, unit_args=None):  # noqa: ANN001, ANN204
        extra = () if unit_args is None else (unit_args,)  # multimodal: the images each unit serves the share
        return [ch for u, ts in requests for t in ts for ch in self.inner([(u, (t,))], fields, *extra)]


class PerTrajectoryReadsConsumer(Consumer):
    """A handoff consumer whose client ignores the claims' runs (no direct reads from the units' sources) and reads
    through ``PerTrajectoryGetter`` (prefetching as usual): the per-trajectory access pattern that both the
    direct reads (issue 25) and the units' chunks replace."""

    @property
    def client(self):  # noqa: ANN201
        import dataclasses

        c = super().client
        if not isinstance(c.getter, PerTrajectoryGetter):
            c.getter = PerTrajectoryGetter(c.getter)
            c.prepare = dataclasses.replace(c.prepare, direct_reads=False)
        return c


def reads_one_trajectory_at_a_time(monkeypatch) -> None:  # noqa: ANN001
    """The regression "one unit call per trajectory": every consumer's reads split per trajectory."""
    def consumer(self, rank=0, fields=None, start_seq=0, count=None):  # noqa: ANN001, ANN202
        return PerTrajectoryReadsConsumer(self.plane, rank, None if fields is None else tuple(fields),
                                          self.config.prefetch_depth, self.config.admit_timeout_s, start_seq, count)
    monkeypatch.setattr(Handoff, "consumer", consumer)
