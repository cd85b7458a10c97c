"""The multimodal data plane on the Ray transport: ``MMStorageUnit``s as actors, the ``MMController`` in the
ordinary ``ControllerActor``, ``MMClient`` in any producer or rank process.

A unit actor's ``get`` returns an ``MMUnitChunk``: the fields and each distinct image of the requested
trajectories once (only those the claim's ``image_sources`` give it, when a group's copies sit on several units),
as numpy arrays (one object-store copy, zero-copy reads on the same node), straight to the rank -- never through a
driver. Everything else (claim, prefetch, ack, release, the drop that frees encoding
slots) is ``knittrans.dataplane.ray_transport``'s.

    >>> # dp = build_mm_ray({"u0": "n0", "u1": "n1"}, rank_nodes=("n0", "n1"))
    >>> # dp.client("u0").put([MMPayload(...), ...]); share = dp.client().fetch(mb, rank=0)  # an MMShare
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from dataclasses import dataclass
from typing import Collection, Mapping, Sequence

import ray

from knittrans.dataplane.client import PrepareConfig
from knittrans.dataplane.controller import ControllerConfig
from knittrans.dataplane.heap import freeze_startup_heap
from knittrans.dataplane.ray_transport import RayDataPlane, UnitHost, check_restarts, start_actors
from knittrans.dataplane.types import TrajectorySchema, UnitChunk
from knittrans.mmdedup.keys import HashFn, ImageKey, encoding_hash_fn
from knittrans.mmdedup.plane import MM_SCHEMA, MMClient, MMController, MMStorageUnit, as_mm_client
from knittrans.mmdedup.store import StoreStats


class MMUnitHost(UnitHost):
    """An ``MMStorageUnit`` behind the storage-unit actor API, plus its encoding-store statistics."""

    COLUMNS_FALLBACK = False  # a columnar put it does not take is a first put: the client sends its MMPayloads

    def __init__(self, unit_id: str, node: str, schema: TrajectorySchema, hash_fn: HashFn, dedup: bool = True) -> None:
        import torch

        torch.set_num_threads(1)
        self.unit = MMStorageUnit(unit_id, node, schema, hash_fn, dedup)
        self._direct = True  # its puts' records name their objects: ranks read them straight from there
        freeze_startup_heap()

    def _put_views(self, payloads: list) -> list:
        """A large put's fields are views of the unit's object (``UnitHost.put_stored``); each distinct image
        becomes an object of this unit's, stored as it lies there (no second copy), so a rank reads each distinct
        image of its share straight from it (``MMShareRuns``) and pulls no other: Ray moves whole objects between
        nodes, and with one object for all of a put's images a rank on another node pulled every image of the put
        -- its share needs only its own groups' -- and each further rank pulled the same bytes again."""
        import torch

        seen: dict[int, int] = {}
        imgs = []
        for p in payloads:
            for e in getattr(p, "encodings", ()):
                if id(e) not in seen:
                    seen[id(e)] = len(imgs)
                    imgs.append(e)
        if not imgs:
            return self.unit.put(payloads, copy=False)
        arrays = [(e.detach().contiguous().view(torch.int16) if e.dtype == torch.bfloat16 else e.detach().contiguous())
                  .numpy() for e in imgs]
        refs = [ray.put((a,)) for a in arrays]  # one object per distinct image
        with warnings.catch_warnings():  # read-only object views; nothing writes through them
            warnings.simplefilter("ignore", UserWarning)
            views = [torch.from_numpy(g[0]) for g in ray.get(refs)]
        views = [v.view(torch.bfloat16) if e.dtype == torch.bfloat16 else v for v, e in zip(views, imgs)]
        placed = [dataclasses.replace(p, encodings=tuple(views[seen[id(e)]] for e in p.encodings))
                  if getattr(p, "encodings", ()) else p for p in payloads]
        return self.unit.put(placed, copy=False, views={v.data_ptr(): (r, 0) for v, r in zip(views, refs)})

    def get(self, traj_ids: Sequence[int], fields: Sequence[str],
            serve: Collection[ImageKey] | None = None) -> UnitChunk:
        """``MMStorageUnit.get`` (``serve``: the images this unit ships for the share, the claim's choice), its
        rows packed into one of this actor's reused buffers as ``UnitHost.get`` does: one small array per
        trajectory and field (5 x 64 per share here) costs Ray far more to serialize and map than a few packed
        arrays (the multimodal raw pass took ~25 ms longer with rows: ``docs/experiments.md``)."""
        return self._packed(self._rows(lambda: self.unit.get(traj_ids, fields, serve)))

    def store_stats(self) -> StoreStats:
        return self.unit.store_stats()


# An MMStorageUnit in its own process (threaded: several ranks read at once).
MMStorageUnitActor = ray.remote(num_cpus=0, max_concurrency=8)(MMUnitHost)


@dataclass
class MMRayDataPlane(RayDataPlane):
    """``RayDataPlane`` whose clients are ``MMClient``s; picklable (pass it to producer and rank actors)."""

    def client(self, local_unit: str | None = None) -> MMClient:
        return as_mm_client(super().client(local_unit))

    def store_stats(self) -> dict[str, StoreStats]:
        return dict(zip(self.unit_actors, ray.get([a.store_stats.remote() for a in self.unit_actors.values()])))

    def live_bytes(self) -> int:
        """Encoding bytes the unit actors still hold (drops are fire-and-forget: call after they landed)."""
        return sum(s.live_bytes for s in self.store_stats().values())


def build_mm_ray(unit_nodes: Mapping[str, str], rank_nodes: tuple[str, ...], schema: TrajectorySchema = MM_SCHEMA,
                 hash_fn: HashFn = encoding_hash_fn, balance_slack: float = 0.05, equal_counts: bool = True,
                 prepare: PrepareConfig | None = None, policy=None,  # noqa: ANN001 - an AdmissionPolicy
                 dedup: bool = True, cross_unit: bool = True, read_timeout_s: float | None = 300.0,
                 controller_node: str | None = None, controller_restarts: int = 8, checksums: bool = False,
                 records_window: int | None = None) -> MMRayDataPlane:
    """``build_ray`` with ``MMStorageUnitActor``s and the ``MMController``. Ray must already be initialized.
    ``dedup`` False: units store and move every image occurrence (the plain twin); ``cross_unit`` False: dedup
    within each unit only. ``read_timeout_s``: ``RayDataPlane.read_timeout_s``; ``controller_node`` and
    ``controller_restarts``: as ``build_ray``'s (a restarted controller rebuilds its groups and content keys from
    the units' manifests, ``MMStorageUnit.manifest``; 0: a dead controller raises ``ControllerLostError``);
    ``checksums`` and ``records_window``: as ``build_mm_inprocess``'s."""
    if not ray.is_initialized():
        raise RuntimeError("build_mm_ray: call ray.init(...) first")
    check_restarts("build_mm_ray", controller_restarts)
    cfg = ControllerConfig(tuple(rank_nodes), balance_slack, equal_counts, records_window)
    ctrl_cls = MMController if cross_unit else functools.partial(MMController, cross_unit=False)
    ctrl, units, restartable = start_actors(schema, unit_nodes, cfg, MMStorageUnitActor,
                                            lambda u, node: (u, node, schema, hash_fn, dedup), ctrl_cls, policy,
                                            controller_restarts, controller_node)
    dp = MMRayDataPlane(schema, ctrl, units, prepare or PrepareConfig(), checksums=checksums,
                        read_timeout_s=read_timeout_s, restartable=restartable)
    ray.get([ctrl.stats.remote(), *(a.stats.remote() for a in units.values())])  # wait until all are up
    return dp
