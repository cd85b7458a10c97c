"""Multimodal trajectories through the on-demand data plane, with one stored and moved copy per distinct image.

This composes ``knittrans.dataplane`` (controller, storage units, client, prefetcher, both transports) with the
encoding store (``store.py``):

- **Put** (producer, before t0): a rollout engine writes each trajectory's per-trajectory fields *and* the
  ``pixel_values`` of the images it shows (``MMPayload``) to the storage unit on its node. The unit
  (``MMStorageUnit``) registers the images in its ``EncodingStore`` -- one copy per distinct content, bytes
  compared on every key hit, one reference per occurrence -- and writes the ``image_index`` field itself (the
  slot of each occurrence, in placeholder order). The n samples of a GRPO group share one copy.
- **Admit**: ``MMController`` splits a mini-batch into per-rank shares of *whole groups* (tokens balanced,
  local first, via ``assign_shares`` over groups), so each distinct image lands on one rank; if the groups
  cannot be dealt evenly it falls back to the per-trajectory split (dedup is then per rank).
- **Fetch** (trainer rank): the ordinary claim / read / pack. A unit asked for ``image_index`` answers with an
  ``MMUnitChunk``: the fields, plus each *distinct* (slot, grid) of the requested trajectories once, with
  ``image_index`` rewritten to indices into that list; the client (``MMClient``) offsets the indices of several
  units' chunks into one list and returns an ``MMShare``: fields as in text, ``images`` (an ``ImageSet`` of the
  distinct images) and ``image_ids`` (per trajectory, its images' indices: the per-sample index map the
  dedup trainer path ``gather.collate`` takes). Bytes moved = fields + distinct images' bytes.
- **Release**: when the last rank acks the mini-batch the controller releases it and the units drop its
  trajectories; ``MMStorageUnit.drop`` releases their references, and a slot is freed with its last one
  (nothing freed early: a trajectory of a later mini-batch holds its own reference).

Across units (a group's samples spread over rollout engines, as verl's agent loop places them): each unit reports
with its put records the ``ImageKey`` of every occurrence (a collision-resistant digest of the bytes, dtype,
shape and grid); the controller keeps them and, at each claim, names for every distinct key of the share the one
unit that ships it (the rank's local unit when it holds a copy, else the least loaded holder:
``MMShareLocation.image_sources``). The other units answer with the key only (``MMUnitChunk.borrowed``) and the
client resolves it, so a consumer moves each distinct encoding once however many units hold copies; each unit
still stores its own copy (it was written there). Same bytes with different grids (a blank 56x84 and 84x56
image) share a slot but are delivered as two images: the encoder's output depends on the grid.

Transports: ``build_mm_inprocess`` (here) and ``knittrans.mmdedup.plane_ray.build_mm_ray`` (units as Ray actors).

Example (in-process)::

    >>> import numpy as np, torch
    >>> from knittrans.types import MiniBatch
    >>> dp = build_mm_inprocess({"u0": "n0"}, rank_nodes=("n0",))
    >>> img = torch.randn(16, 1176)
    >>> def traj(t):
    ...     f = {"input_ids": np.arange(6), "old_logprobs": np.zeros(2, np.float32),
    ...          "advantages": np.ones(2, np.float32), "loss_mask": np.ones(2, bool)}
    ...     return MMPayload(t, f, group=0, encodings=(img,), grids=((1, 4, 4),))
    >>> dp.client("u0").put([traj(t) for t in range(4)])
    >>> _ = dp.controller.admit(MiniBatch(0, 0, (0, 1, 2, 3), (0,), 24))
    >>> share = dp.client().fetch(MiniBatch(0, 0, (0, 1, 2, 3), (0,), 24), rank=0)
    >>> len(share.images.pixels), share.image_ids[3], share.pixel_nbytes == img.numel() * 4, dp.live_bytes()
    (1, (0,), True, 0)
"""

from __future__ import annotations

import threading
import warnings
from dataclasses import dataclass, field, fields as dc_fields, replace
from typing import TYPE_CHECKING, Collection, Mapping, Sequence

import numpy as np
import torch

from knittrans.dataplane.assign import ShareItem, assign_shares
from knittrans.dataplane.buffers import aligned
from knittrans.dataplane.client import DataPlaneClient, PrepareConfig, pack_runs, pack_share
from knittrans.dataplane.columns import PutColumns
from knittrans.dataplane.controller import Controller, ControllerConfig
from knittrans.dataplane.inprocess import InProcessDataPlane
from knittrans.dataplane.recovery import ControllerJournal
from knittrans.dataplane.storage import StorageUnit, validate_payload
from knittrans.dataplane.sources import Where
from knittrans.dataplane.types import (DataPlaneError, DuplicatePutError, FieldSpec, MiniBatchKey, PackedField,
                                       PackedShare,
                                       PutRecord, SchemaMismatchError, ShareLocation, ShareRuns, TrajectoryPayload,
                                       TrajectorySchema, UnitChunk)
from knittrans.mmdedup.gather import ImageSet
from knittrans.mmdedup.keys import (EncodingInputError, HashFn, ImageKey, check_encoding, check_finite_pixels,
                                    check_grid, encoding_hash_fn)
from knittrans.mmdedup.store import EncodingRef, EncodingStore, StoreStats, same_bytes
from knittrans.types import MiniBatch

if TYPE_CHECKING:
    from knittrans.admission.base import AdmissionPolicy

IMAGE_FIELD = "image_index"
"""The unit-written field: per trajectory, one int64 per image occurrence (placeholder order). Stored: the slot in
the unit's encoding store. Delivered: the index of the image in the share's ``ImageSet``."""

MM_SCHEMA = TrajectorySchema(
    fields=(FieldSpec("input_ids", "int64"), FieldSpec("old_logprobs", "float32", finite=True),
            FieldSpec("advantages", "float32", finite=True), FieldSpec("loss_mask", "bool"),
            FieldSpec(IMAGE_FIELD, "int64")),
    token_field="input_ids", same_length=(("old_logprobs", "advantages", "loss_mask"),), response_field="old_logprobs")
"""A multimodal trajectory: the text schema's fields (prompt + response ids; response-length logprobs,
advantages, loss mask) and the image index, with the text schema's checks (finite log-probs and advantages, one row
per response token in each response field, ``num_tokens`` equal to the response length). Pixel values travel beside
it, once per distinct image."""


@dataclass(frozen=True)
class MMPayload(TrajectoryPayload):
    """What a producer writes for one multimodal trajectory: its fields (not ``image_index``: the unit writes
    it), its GRPO group, and the ``pixel_values`` ``[patches, patch_dim]`` and ``grid_thw`` of each image it shows,
    in placeholder order (the n samples of a group pass the same tensors; the unit keeps one copy)."""

    group: int = -1
    encodings: tuple[torch.Tensor, ...] = ()
    grids: tuple[tuple[int, int, int], ...] = ()


@dataclass(frozen=True)
class MMPutRecord(PutRecord):
    """A unit's ``PutRecord`` plus the trajectory's group (what lets the controller keep groups whole) and the
    content keys of its images (what lets it name one unit per distinct image of a share)."""

    group: int | None = None
    images: tuple[ImageKey, ...] | None = None
    """One key per image occurrence (placeholder order); None when this put carried no images or the unit keeps
    every occurrence apart (``dedup=False``: no cross-unit dedup either)."""
    image_where: tuple[tuple[object, int, int, int], ...] | None = None
    """Per image occurrence, where the unit keeps its bytes: (source, array of it, first byte, end byte) -- a
    one-array tuple of the stored encoding in process, the image's own object of the unit's on Ray -- so a rank
    reads each distinct image of its share straight from it (``MMShareRuns``); None when this put carried none."""


@dataclass(frozen=True)
class MMUnitChunk(UnitChunk):
    """A unit's answer to a get that includes ``image_index``: ``pixels[i]`` / ``grids[i]`` is the i-th distinct
    image of the requested trajectories (each once), and their ``image_index`` values index this list.
    ``occurrence_nbytes`` is what the same get would move with one copy per occurrence. With a ``serve`` set
    (the claim named other units for some images), an ``image_index`` value ``i >= len(pixels)`` stands for
    ``borrowed[i - len(pixels)]``: an image another unit of the share ships."""

    pixels: tuple[np.ndarray, ...] = ()
    grids: tuple[tuple[int, int, int], ...] = ()
    pixel_dtype: str = "float32"
    occurrence_nbytes: int = 0
    keys: tuple[ImageKey, ...] = ()
    """``keys[i]``: the content key of ``pixels[i]`` (empty when the unit keeps no keys, ``dedup=False``)."""
    borrowed: tuple[ImageKey, ...] = ()


@dataclass(frozen=True)
class MMShareRuns(ShareRuns):
    """A multimodal share read straight from its units' sources: ``runs`` cover ``field_names`` (the requested
    fields but ``image_index``, which the rank builds); ``images[i]`` is the (source, array, first byte, end byte)
    of the share's i-th distinct image, ``image_keys[i]`` its dtype, shape and grid; ``image_index`` the
    per-occurrence index into them, ``image_counts`` each trajectory's occurrences (share order)."""

    field_names: tuple[str, ...] = ()
    images: np.ndarray = field(default_factory=lambda: np.zeros((0, 4), np.int64))
    image_keys: tuple[ImageKey, ...] = ()
    image_index: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    image_counts: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    occurrence_nbytes: int = 0


_IMG = IMAGE_FIELD + "#"
"""Prefix of the controller's per-occurrence image locations in a trajectory's ``where`` ("image_index#<i>")."""


@dataclass(frozen=True)
class MMShareLocation(ShareLocation):
    """A claim's answer plus, per unit of the share, the distinct images (keys) that unit ships; every other image
    of its trajectories it names by key only. Empty: every unit ships each of its distinct images."""

    image_sources: tuple[tuple[str, tuple[ImageKey, ...]], ...] = ()


@dataclass(frozen=True)
class MMShare(PackedShare):
    """A rank's share with its distinct images. ``nbytes`` = fields + ``pixel_nbytes`` (pixel bytes the units
    shipped: each distinct image once when the claim named one unit per image); ``occurrence_nbytes`` = the pixel
    bytes a fetch without dedup would move."""

    images: ImageSet = field(default_factory=lambda: ImageSet((), ()))
    pixel_nbytes: int = 0
    occurrence_nbytes: int = 0

    @property
    def image_ids(self) -> dict[int, tuple[int, ...]]:
        """Per trajectory, its images' indices into ``images`` (placeholder order): ``TrainSample.image_ids``."""
        f = self.fields[IMAGE_FIELD]
        vals, cu = f.values.tolist(), f.cu_seqlens.tolist()
        return {t: tuple(vals[cu[i]:cu[i + 1]]) for i, t in enumerate(self.traj_ids)}


def _check_images(p: MMPayload) -> None:
    if len(p.encodings) != len(p.grids):
        raise EncodingInputError(f"trajectory {p.traj_id}: {len(p.encodings)} encodings but {len(p.grids)} grids")
    for i, (e, g) in enumerate(zip(p.encodings, p.grids)):
        check_encoding(e)
        check_finite_pixels(f"trajectory {p.traj_id} image {i}", e)
        check_grid(f"trajectory {p.traj_id} image {i}", g, e.shape[0])


class MMStorageUnit(StorageUnit):
    """A storage unit that also holds one ``EncodingStore``: images once per distinct content, refcounted by the
    trajectories that show them, released when the controller says those trajectories are consumed."""

    BOUNDED_GET = False  # its get also waits on the image occurrences' lock and the encoding store

    def __init__(self, unit_id: str, node: str, schema: TrajectorySchema = MM_SCHEMA,
                 hash_fn: HashFn = encoding_hash_fn, dedup: bool = True) -> None:
        """``dedup`` False: the store keeps every occurrence (``EncodingStore(dedup=False)``), so gets move one
        copy per occurrence -- the plain twin of the same unit."""
        if IMAGE_FIELD not in schema.names:
            raise SchemaMismatchError(f"MMStorageUnit needs a schema with the {IMAGE_FIELD!r} field")
        super().__init__(unit_id, node, schema)
        self.store = EncodingStore(hash_fn, dedup=dedup)
        self._occ: dict[int, tuple[tuple[EncodingRef, tuple[int, int, int]], ...]] = {}
        self._where: dict[int, tuple[object, int, int, int]] = {}  # live slot -> where its bytes lie (``image_where``)
        self._group: dict[int, int] = {}  # trajectory -> its GRPO group (re-reported by ``manifest``)
        self._occ_lock = threading.Lock()

    def put(self, payloads: Sequence[TrajectoryPayload], copy: bool = True,
            views: Mapping[int, tuple[object, int]] | None = None) -> list[PutRecord]:
        """Like ``StorageUnit.put`` (all or nothing; ``copy`` as there); an ``MMPayload`` also stores its images (one
        reference per occurrence) and writes ``image_index``. A trajectory's images come with its first put,
        exactly once; a later ``MMPayload`` without images (fields that arrive later, e.g. advantages at
        completion) is a plain field put. ``views``: the payloads' encodings are read-only views of this unit's
        own object (a Ray unit's put: ``plane_ray.MMUnitHost``), by data pointer -> (object, array); they are
        stored as they are and their slots lie there. Otherwise a new slot's bytes lie in its own stored copy."""
        with self._occ_lock:
            later = {p.traj_id for p in payloads
                     if isinstance(p, MMPayload) and not p.encodings and p.traj_id in self._occ}
        checked: list[dict[str, np.ndarray] | None] = [None] * len(payloads)
        for i, p in enumerate(payloads):  # validate everything before the store changes
            if IMAGE_FIELD in p.tensors:
                raise SchemaMismatchError(f"trajectory {p.traj_id}: {IMAGE_FIELD!r} is written by the storage unit "
                                          f"from the payload's encodings; do not put it")
            if isinstance(p, MMPayload):
                checked[i] = validate_payload(self.schema, p)
                _check_images(p)
        imaged = [p for p in payloads if isinstance(p, MMPayload) and p.traj_id not in later]
        if len({p.traj_id for p in imaged}) != len(imaged):
            raise DuplicatePutError(f"unit {self.unit_id}: images of trajectories {[p.traj_id for p in imaged]} "
                                    f"appear twice in one put (each trajectory's images are put exactly once)")
        # Idempotent puts (as for plain fields, ``StorageUnit.put``): a retry whose first reply was lost carries
        # the images this unit already holds for that trajectory -- same bytes, same grids, same order -- and
        # takes no new reference; its ``image_index`` is the stored one, so the field put below is a repeat too.
        # Different images under the same id are a real duplicate.
        with self._occ_lock:
            held = {p.traj_id: self._occ[p.traj_id] for p in imaged if p.traj_id in self._occ}
        for p in imaged:
            if p.traj_id in held and not self._same_images(held[p.traj_id], p):
                raise DuplicatePutError(f"unit {self.unit_id}: images of trajectory {p.traj_id} were already written "
                                        f"with different content or grids (each trajectory's images are put exactly "
                                        f"once; an identical retry is a no-op)")
        mm = [p for p in imaged if p.traj_id not in held]
        # one call: each shared view hashed once; views of the unit's own object are stored as they are
        flat = self.store.put([e for p in mm for e in p.encodings], copy=None if views is None else False)
        refs, at = [], 0
        for p in mm:
            refs.append(tuple(flat[at:at + len(p.encodings)]))
            at += len(p.encodings)
        index = {p.traj_id: np.fromiter((r.slot for r in rs), dtype=np.int64, count=len(rs))
                 for p, rs in zip(mm, refs)}
        index.update({t: np.fromiter((r.slot for r, _ in occ), dtype=np.int64, count=len(occ))
                      for t, occ in held.items()})
        full = [TrajectoryPayload(**{**{f.name: getattr(p, f.name) for f in dc_fields(TrajectoryPayload)},
                                     "tensors": {**p.tensors, IMAGE_FIELD: index[p.traj_id]}})
                if p.traj_id in index else p for p in payloads]
        for i, p in enumerate(payloads):  # validated above: the plain put checks only what it has not seen
            if checked[i] is not None and p.traj_id in index:
                checked[i] = {**checked[i], IMAGE_FIELD: full[i].tensors[IMAGE_FIELD]}
        try:
            records = super().put(full, checked, copy=copy)
        except Exception:
            self._release([r for rs in refs for r in rs])
            raise
        with self._occ_lock:
            raced = []
            for p, rs in zip(mm, refs):
                if p.traj_id in self._occ:  # a concurrent identical put recorded them first: ours are extra refs
                    raced += rs
                else:
                    self._occ[p.traj_id] = tuple(zip(rs, (tuple(int(x) for x in g) for g in p.grids)))
        occ_of = {**{p.traj_id: tuple(zip(rs, (tuple(int(x) for x in g) for g in p.grids)))
                     for p, rs in zip(mm, refs)}, **held}
        images: dict[int, tuple[ImageKey, ...]] = {}
        if self.store.dedup:  # content keys for the controller (strong digests: once per slot, cached)
            images = {t: tuple(self._image_key(ref, grid) for ref, grid in occ) for t, occ in occ_of.items()}
        where = {t: tuple(self._slot_where(ref, views) for ref, _ in occ) for t, occ in occ_of.items()}
        if raced:
            self._release(raced)
        groups = {p.traj_id: p.group for p in payloads if isinstance(p, MMPayload)}
        with self._occ_lock:  # kept for ``manifest``: the payload's group, else its metadata's
            for p in payloads:
                g = p.group if isinstance(p, MMPayload) and p.group >= 0 else getattr(p.meta, "group_id", None)
                if g is not None and g >= 0:
                    self._group.setdefault(p.traj_id, int(g))
        return [MMPutRecord(**{f.name: getattr(r, f.name) for f in dc_fields(r)}, group=groups.get(r.traj_id),
                            images=images.get(r.traj_id), image_where=where.get(r.traj_id)) for r in records]

    def put_columns(self, cols: PutColumns, arrays: Sequence[np.ndarray]) -> tuple[np.ndarray, ...] | None:
        """``StorageUnit.put_columns`` of a later put: fields that arrive after a trajectory's images came with its
        first put (the advantages at completion; ``MMClient`` sends an imageless put as columns), where an
        ``MMPayload`` without images and a plain payload mean the same. Its metadata's groups are kept for
        ``manifest``, as ``put`` keeps them. None -- nothing stored; the caller puts the payloads themselves -- when
        some trajectory's images are not recorded here yet (its first put: ``put`` decides what that writes) or the
        put names the field this unit writes itself."""
        if IMAGE_FIELD in cols.names:
            return None
        with self._occ_lock:
            if any(t not in self._occ for t in cols.traj_ids.tolist()):
                return None
        got = super().put_columns(cols, arrays)
        if got is not None:
            with self._occ_lock:
                for t, g in cols.groups().items():
                    self._group.setdefault(t, int(g))
        return got

    def _slot_where(self, ref: EncodingRef, views: Mapping[int, tuple[object, int]] | None
                    ) -> tuple[object, int, int, int]:
        """Where slot ``ref``'s bytes lie (``MMPutRecord.image_where``), recorded when the slot is first seen: the
        unit's object (``views``) or the stored copy itself (a one-array source)."""
        with self._occ_lock:
            got = self._where.get(ref.slot)
            if got is None:
                t = self.store.get(ref)
                at = None if views is None else views.get(t.data_ptr())
                if at is not None:
                    got = (at[0], at[1], 0, ref.nbytes)
                else:
                    got = ((t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy().reshape(-1),
                           0, 0, ref.nbytes)
                    got = ((got[0],), 0, 0, ref.nbytes)
                self._where[ref.slot] = got
            return got

    def _release(self, refs: Sequence[EncodingRef]) -> None:
        """``store.release``, forgetting where the freed slots lay."""
        self.store.release(refs)
        with self._occ_lock:
            for r in refs:
                if r.slot in self._where and self.store.refcount(r) == 0:
                    del self._where[r.slot]

    def _image_key(self, ref: EncodingRef, grid: tuple[int, int, int]) -> ImageKey:
        return ImageKey(self.store.strong_digest(ref), ref.key.dtype, ref.key.shape, grid)

    def _same_images(self, occ: tuple[tuple[EncodingRef, tuple[int, int, int]], ...], p: MMPayload) -> bool:
        """Whether ``p`` shows exactly the images (bytes, dtype, shape, grid, order) stored as ``occ``."""
        if len(occ) != len(p.encodings):
            return False
        for (ref, grid), e, g in zip(occ, p.encodings, p.grids):
            if grid != tuple(int(x) for x in g) or not same_bytes(self.store.get(ref), e.detach().contiguous()):
                return False
        return True

    def get(self, traj_ids: Sequence[int], fields: Sequence[str],
            serve: Collection[ImageKey] | None = None) -> UnitChunk:
        """``StorageUnit.get``; with ``image_index`` among ``fields``, an ``MMUnitChunk`` carrying each distinct
        image of these trajectories once (see the class doc). ``serve``: ship only the images with these keys and
        name the others by key (``MMUnitChunk.borrowed``: another unit of the share ships them); None: ship all."""
        chunk = super().get(traj_ids, fields)
        if IMAGE_FIELD not in fields:
            return chunk
        with self._occ_lock:
            occ = [self._occ.get(t, ()) for t in traj_ids]
        keyed = self.store.dedup
        index: dict[tuple[int, tuple[int, int, int]], int] = {}
        lent: dict[ImageKey, int] = {}
        pixels, grids, keys, borrowed, entries = [], [], [], [], []
        dtype, occ_bytes = "float32", 0
        for t_occ in occ:
            for ref, grid in t_occ:
                occ_bytes += ref.nbytes
                ikey = self._image_key(ref, grid) if keyed else None
                if serve is not None and ikey is not None and ikey not in serve:
                    if ikey not in lent:
                        lent[ikey] = len(borrowed)
                        borrowed.append(ikey)
                    entries.append((True, lent[ikey]))
                    continue
                key = (ref.slot, grid)
                if key not in index:
                    index[key] = len(pixels)
                    x = self.store.get(ref)
                    dtype = str(x.dtype).removeprefix("torch.")
                    pixels.append((x.view(torch.int16) if x.dtype == torch.bfloat16 else x).numpy())
                    grids.append(grid)
                    if ikey is not None:
                        keys.append(ikey)
                entries.append((False, index[key]))
        local = [len(pixels) + i if lent_ else i for lent_, i in entries]
        values = list(chunk.values)
        values[list(fields).index(IMAGE_FIELD)] = np.asarray(local, dtype=np.int64)
        base = {f.name: getattr(chunk, f.name) for f in dc_fields(chunk)}
        base["values"] = tuple(values)
        return MMUnitChunk(**base, pixels=tuple(pixels), grids=tuple(grids), pixel_dtype=dtype,
                           occurrence_nbytes=occ_bytes, keys=tuple(keys), borrowed=tuple(borrowed))

    def drop(self, traj_ids: Sequence[int], fields: Sequence[str] | None = None) -> int:
        """``StorageUnit.drop``; dropping ``image_index`` (or everything) releases the trajectories' image
        references, and a slot is freed with its last one. Returns the field bytes freed."""
        freed = super().drop(traj_ids, fields)
        if fields is None or IMAGE_FIELD in fields:
            with self._occ_lock:
                refs = [ref for t in traj_ids for ref, _ in self._occ.pop(t, ())]
                for t in traj_ids:
                    self._group.pop(t, None)
            self._release(refs)
        return freed

    def manifest(self) -> list[PutRecord]:
        """``StorageUnit.manifest`` as ``MMPutRecord``s: each trajectory's group and its images' content keys too,
        so a restarted ``MMController`` keeps groups whole and names one unit per distinct image again (the keys
        are recomputed from the stored bytes: the strong digest, cached per slot). A trajectory whose images are
        still being recorded by a concurrent put is reported without keys; the put's own register brings them."""
        records = super().manifest()
        with self._occ_lock:
            occ = {r.traj_id: self._occ.get(r.traj_id) for r in records}
            groups = {r.traj_id: self._group.get(r.traj_id) for r in records}
        out = []
        for r in records:
            o = occ[r.traj_id]
            images = tuple(self._image_key(ref, g) for ref, g in o) if o is not None and self.store.dedup else None
            out.append(MMPutRecord(**{f.name: getattr(r, f.name) for f in dc_fields(r)}, group=groups[r.traj_id],
                                   images=images))
        return out

    def clear(self) -> int:
        """Forget everything (the unit was lost, see ``StorageUnit.clear``), images included."""
        freed = super().clear()
        with self._occ_lock:
            refs = [ref for occ in self._occ.values() for ref, _ in occ]
            self._occ.clear()
            self._group.clear()
        self._release(refs)
        return freed

    def store_stats(self) -> StoreStats:
        return self.store.stats()


class MMController(Controller):
    """A ``Controller`` that keeps GRPO groups whole within a rank's share (so a rank holds every occurrence of
    an image it fetches). Groups come from ``MMPutRecord.group``; a mini-batch whose groups cannot be dealt to the
    ranks in equal counts (or with trajectories of unknown group) is split per trajectory as usual."""

    def __init__(self, schema: TrajectorySchema, unit_nodes: Mapping[str, str], config: ControllerConfig,
                 policy: "AdmissionPolicy | None" = None, cross_unit: bool = True,
                 journal: "ControllerJournal | None" = None) -> None:
        """``cross_unit`` False: claims name no image sources, so each unit ships every distinct image it holds
        (dedup within a unit only: the plain twin of the cross-unit path). ``journal``: as ``Controller``'s; the
        multimodal state (groups, content keys) is not journaled: a restart rebuilds it from the units'
        manifests (``MMStorageUnit.manifest``) and re-puts, and image sources are chosen at each claim from it."""
        self.cross_unit = cross_unit
        super().__init__(schema, unit_nodes, config, policy, journal)

    def _reset_state(self) -> None:
        super()._reset_state()
        self._group: dict[int, int] = {}
        self._images: dict[int, tuple[ImageKey, ...]] = {}  # trajectory -> its images' content keys

    def _strip_repeats_locked(self, records: Sequence[PutRecord]) -> list[PutRecord]:
        # A repeated put (a register retried across a restart) is stripped before ``_registered_locked`` sees it,
        # but still carries the group and keys of a trajectory this controller holds on that unit: note them (a
        # rebuilt controller lacks the keys of a trajectory whose put was in flight when the unit reported).
        self._registered_locked([r for r in records if (st := self._trajs.get(r.traj_id)) is not None
                                 and st.unit_id == r.unit_id])
        return super()._strip_repeats_locked(records)

    def _columns_registered_locked(self, unit_id: str, cols: PutColumns) -> None:
        self._group.update(cols.groups())  # a columnar put brings plain fields, no images: only its groups are new

    def _registered_locked(self, records: Sequence[PutRecord]) -> None:
        for r in records:  # before admission runs on them, so shares keep these groups whole
            g = getattr(r, "group", None)
            if (g is None or g < 0) and r.meta is not None:
                g = r.meta.group_id
            if g is not None and g >= 0:
                self._group[r.traj_id] = g
            imgs = getattr(r, "images", None)
            if imgs is not None:  # a later put without images (e.g. the advantages) keeps the keys
                self._images[r.traj_id] = imgs
            st, iw = self._trajs.get(r.traj_id), getattr(r, "image_where", None)
            if st is not None and iw and st.unit_id == r.unit_id and _IMG + "0" not in st.where:
                for i, (handle, col, a, b) in enumerate(iw):  # where each occurrence's bytes lie
                    st.where.update(self._sources.add(handle, r.unit_id, [(f"{_IMG}{i}", (col, a, b))]))
        self._sources.end_put()

    def _sourced_locked(self, traj_id: int, st) -> bool:  # noqa: ANN001 - a puts._TrajState
        """Every field but ``image_index`` in a source, and every image with its location and content key (what
        ``_share_runs`` needs to answer with runs rather than reads through the units)."""
        return (all(f in st.where for f in st.fields if f != IMAGE_FIELD)
                and self._located_images(traj_id, st) is not None)

    def _located_images(self, traj_id: int, st) -> tuple[ImageKey, ...] | None:  # noqa: ANN001 - a _TrajState
        """The content keys of ``traj_id``'s images when each has its key and its location, else None."""
        ks = self._images.get(traj_id)
        n = st.fields.get(IMAGE_FIELD, 0) // np.dtype(np.int64).itemsize
        if ks is None or len(ks) != n or any(f"{_IMG}{i}" not in st.where for i in range(n)):
            return None
        return ks

    def _share_runs(self, traj_ids: Sequence[int], fields: Sequence[str], rank: int) -> ShareRuns | None:
        """With ``image_index`` requested: the other fields' runs and the share's distinct images, each once (the
        copy on the rank's node when one is there, else the first holder's; without ``cross_unit`` once per unit),
        or None unless every trajectory's fields and images have locations and content keys (a ``dedup=False``
        unit's or a rebuilt controller's trajectories are then read through their units)."""
        if IMAGE_FIELD not in fields:
            return super()._share_runs(traj_ids, fields, rank)
        rest = tuple(n for n in fields if n != IMAGE_FIELD)
        rank_node = self.config.rank_nodes[rank]
        picked: dict[object, int] = {}  # distinct image -> its index in the share
        where: list[Where] = []
        at_unit: list[str] = []
        keys: list[ImageKey] = []
        index, counts, occ_bytes = [], np.zeros(len(traj_ids), np.int64), 0
        for j, t in enumerate(traj_ids):
            st = self._trajs[t]
            ks = self._located_images(t, st)
            if ks is None:
                return None
            for i, k in enumerate(ks):
                w = st.where[f"{_IMG}{i}"]
                ident = k if self.cross_unit else (st.unit_id, k)
                at = picked.get(ident)
                if at is None:
                    at = picked[ident] = len(where)
                    where.append(w)
                    at_unit.append(st.unit_id or "")
                    keys.append(k)
                elif (self.unit_nodes.get(st.unit_id or "") == rank_node
                      and self.unit_nodes.get(at_unit[at]) != rank_node):
                    where[at], at_unit[at] = w, st.unit_id or ""  # a copy on the rank's node: no network
                index.append(at)
                counts[j] += 1
                occ_bytes += w[3] - w[2]
        got = self._sources.runs_with([self._trajs[t].where for t in traj_ids], rest, where)
        if got is None:
            return None
        runs, images = got
        return MMShareRuns(runs.sources, runs.source_units, runs.runs, runs.nbytes, field_names=rest, images=images,
                           image_keys=tuple(keys), image_index=np.asarray(index, np.int64), image_counts=counts,
                           occurrence_nbytes=occ_bytes)

    def _forget_locked(self, traj_ids: Sequence[int]) -> None:
        for t in traj_ids:
            self._group.pop(t, None)
            self._images.pop(t, None)

    def claim(self, key: MiniBatchKey, rank: int, fields: Sequence[str], epoch: int | None = None) -> ShareLocation:
        """``Controller.claim``; with ``image_index`` among the fields and every trajectory's keys known, an
        ``MMShareLocation`` naming one unit per distinct image (``image_sources``)."""
        loc = super().claim(key, rank, fields, epoch)
        if IMAGE_FIELD not in loc.fields or not self.cross_unit:
            return loc
        with self._cv:
            imgs = [self._images.get(t) for t in loc.traj_ids]
        if any(i is None for i in imgs):
            return loc
        sources = image_sources(loc.unit_ids, imgs, self.config.rank_nodes[rank], self.unit_nodes)  # type: ignore[arg-type]
        return MMShareLocation(**{f.name: getattr(loc, f.name) for f in dc_fields(loc)}, image_sources=sources)

    def _assign(self, items: Sequence[ShareItem], mb: MiniBatch) -> tuple[tuple[int, ...], ...]:
        groups: dict[int, list[ShareItem]] = {}
        for it in items:
            g = self._group.get(it.traj_id)
            if g is None:
                return super()._assign(items, mb)
            groups.setdefault(g, []).append(it)
        sizes = {len(v) for v in groups.values()}
        nranks = self.num_ranks
        if self.config.equal_counts and (len(sizes) != 1 or len(groups) % nranks):
            return super()._assign(items, mb)
        order = sorted(groups)
        gitems = [ShareItem(i, sum(it.tokens for it in groups[g]), groups[g][0].node) for i, g in enumerate(order)]
        gshares = assign_shares(gitems, self.config.rank_nodes, self.config.balance_slack, self.config.equal_counts)
        owner = {it.traj_id: r for r, s in enumerate(gshares) for gi in s for it in groups[order[gi]]}
        shares: list[list[int]] = [[] for _ in range(nranks)]
        for it in items:
            shares[owner[it.traj_id]].append(it.traj_id)
        return tuple(tuple(s) for s in shares)


def image_sources(unit_ids: Sequence[str], images: Sequence[Sequence[ImageKey]], rank_node: str,
                  unit_nodes: Mapping[str, str]) -> tuple[tuple[str, tuple[ImageKey, ...]], ...]:
    """Per unit of a share, the distinct images it ships (``MMShareLocation.image_sources``): each key once, from
    the rank's local unit when that holds a copy (no network), else from the holder with the fewest bytes named so
    far (reads from several units overlap), ties to the holder with more occurrences, then the unit id.

        >>> k = ImageKey(b"d" * 16, "float32", (4, 6), (1, 2, 2))
        >>> image_sources(["u0", "u1", "u1"], [[k], [k], [k]], "n1", {"u0": "n0", "u1": "n1"})
        (('u0', ()), ('u1', (ImageKey(digest=b'dddddddddddddddd', dtype='float32', shape=(4, 6), grid=(1, 2, 2)),)))
    """
    holders: dict[ImageKey, dict[str, int]] = {}
    for u, keys in zip(unit_ids, images):
        for k in keys:
            h = holders.setdefault(k, {})
            h[u] = h.get(u, 0) + 1
    load = {u: 0 for u in dict.fromkeys(unit_ids)}
    serve: dict[str, list[ImageKey]] = {u: [] for u in load}
    for k, hs in holders.items():
        cands = [u for u in hs if unit_nodes.get(u) == rank_node] or list(hs)
        u = min(cands, key=lambda u: (load[u], -hs[u], u))
        serve[u].append(k)
        load[u] += k.nbytes
    return tuple((u, tuple(ks)) for u, ks in serve.items())


@dataclass
class MMClient(DataPlaneClient):
    """``DataPlaneClient`` whose fetches (and prefetches) that include ``image_index`` return an ``MMShare``: one
    copy of each distinct image, however many units hold it (the claim's ``image_sources``)."""

    def _columns(self, payloads: Sequence[TrajectoryPayload]) -> tuple[PutColumns, tuple[np.ndarray, ...]] | None:
        """A put whose ``MMPayload``s carry no images (fields that arrive later: a ``Producer``'s completing put)
        travels as columns; its unit takes them where every trajectory's images are recorded there already
        (``MMStorageUnit.put_columns``), else the payloads themselves are put."""
        if payloads and all(type(p) is MMPayload and not p.encodings and not p.grids
                            and (p.group < 0 or (p.meta is not None and p.meta.group_id == p.group))
                            for p in payloads):
            payloads = [TrajectoryPayload(p.traj_id, p.tensors, meta=p.meta, checksums=p.checksums)
                        for p in payloads]
        return super()._columns(payloads)

    def _pack_runs(self, loc: ShareLocation, objects: Sequence[Sequence[np.ndarray]]) -> PackedShare:
        """A share read straight from its sources (``MMShareRuns``): the fields' runs as in text, a private copy of
        each distinct image into the rank's pooled buffer (64-byte aligned), ``image_index`` from the claim."""
        runs = loc.runs
        if not isinstance(runs, MMShareRuns):
            return super()._pack_runs(loc, objects)
        share = pack_runs(replace(loc, fields=runs.field_names), objects, self.schema, self.prepare, self.pack_pool())
        pool = self.pack_pool()
        sizes = [int(b - a) for _, _, a, b in runs.images.tolist()]
        buf = pool.take(sum(aligned(n) for n in sizes)) if pool is not None else np.empty(sum(aligned(n) for n in
                                                                                             sizes), np.uint8)
        pixels, off, dst = [], 0, memoryview(buf)
        for (o, c, a, b), k in zip(runs.images.tolist(), runs.image_keys):
            # the one copy, with the GIL held as ``pack_runs`` holds it (``np.copyto`` would drop it per image)
            dst[off:off + b - a] = memoryview(objects[o][c].reshape(-1).view(np.uint8))[a:b]
            raw = buf[off:off + b - a]
            if self.checksums:
                verify_image(loc, runs.source_units[o], raw, k)
            x = torch.from_numpy(raw.view(np.int16 if k.dtype == "bfloat16" else np.dtype(k.dtype)).reshape(k.shape))
            pixels.append(x.view(torch.bfloat16) if k.dtype == "bfloat16" else x)
            off += aligned(b - a)
        cu = np.zeros(len(runs.image_counts) + 1, np.int64)
        np.cumsum(runs.image_counts, out=cu[1:])
        fields = {**share.fields, IMAGE_FIELD: PackedField(IMAGE_FIELD, torch.from_numpy(runs.image_index.copy()),
                                                           torch.from_numpy(cu.astype(np.int32)))}
        base = {fl.name: getattr(share, fl.name) for fl in dc_fields(share)}
        pix = sum(sizes)
        base.update(fields={n: fields[n] for n in loc.fields}, nbytes=loc.nbytes + pix)
        return MMShare(**base, images=ImageSet(tuple(pixels), tuple(k.grid for k in runs.image_keys)),
                       pixel_nbytes=pix, occurrence_nbytes=runs.occurrence_nbytes)

    def _unit_args(self, loc: ShareLocation) -> Mapping[str, tuple] | None:
        if not isinstance(loc, MMShareLocation) or not loc.image_sources:
            return None
        return {u: (frozenset(keys),) for u, keys in loc.image_sources}

    def _pack(self, loc: ShareLocation, chunks: Sequence[UnitChunk]) -> PackedShare:
        if IMAGE_FIELD not in loc.fields:
            return pack_share(loc, chunks, self.schema, self.prepare, self.pack_pool())
        f = loc.fields.index(IMAGE_FIELD)
        pixels, grids, occ_bytes, pix_bytes = [], [], 0, 0
        srcs: list[tuple[np.ndarray, str]] = []  # the share's distinct images (source, pixel dtype)
        at: dict[ImageKey, int] = {}  # content key -> index in the share's ImageSet
        where: list[list[int]] = []  # per chunk: its local image index -> the share's
        for ch in chunks:
            if not isinstance(ch, MMUnitChunk):
                raise SchemaMismatchError(f"unit {ch.unit_id} is not a multimodal storage unit (it returned no "
                                          f"images for {IMAGE_FIELD!r})")
            m = []
            for i, a in enumerate(ch.pixels):
                pix_bytes += int(a.nbytes)  # moved, even if another unit shipped the same content
                k = ch.keys[i] if ch.keys else None
                if self.checksums:
                    verify_image(loc, ch.unit_id, a, k)
                if k is not None and k in at:
                    m.append(at[k])
                    continue
                if k is not None:
                    at[k] = len(srcs)
                m.append(len(srcs))
                srcs.append((a, ch.pixel_dtype))
                grids.append(ch.grids[i])
            where.append(m)
            occ_bytes += ch.occurrence_nbytes
        # Private copies of the distinct images: in process a source is the unit's stored tensor, on Ray a shared
        # object-store view; either way a consumer's in-place edit must not reach what the next mini-batch reads.
        # Written into one reused buffer of the pack pool (no page faults per share), each image 64-byte aligned.
        pool = self.pack_pool()
        buf = pool.take(sum(aligned(a.nbytes) for a, _ in srcs)) if pool is not None else None
        off = 0
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            for a, dtype in srcs:
                own = (buf[off:off + a.nbytes].view(a.dtype).reshape(a.shape) if buf is not None
                       else np.empty(a.shape, dtype=a.dtype))
                np.copyto(own, a)
                off += aligned(a.nbytes)
                x = torch.from_numpy(own)
                pixels.append(x.view(torch.bfloat16) if dtype == "bfloat16" else x)
        shifted = []
        for ch, m in zip(chunks, where):
            for k in ch.borrowed:  # shipped by another unit of this share (the claim named it)
                if k not in at:
                    raise DataPlaneError(f"share {loc.key} rank {loc.rank}: unit {ch.unit_id} names image {k} as "
                                         f"shipped by another unit, but no unit shipped it")
                m.append(at[k])
            values = list(ch.values)
            values[f] = np.asarray(m, dtype=np.int64)[values[f]] if len(values[f]) else values[f]
            shifted.append(replace(ch, values=tuple(values)))
        share = pack_share(loc, shifted, self.schema, self.prepare, pool)
        base = {fl.name: getattr(share, fl.name) for fl in dc_fields(share)}
        base["nbytes"] = share.nbytes + pix_bytes
        return MMShare(**base, images=ImageSet(tuple(pixels), tuple(grids)), pixel_nbytes=pix_bytes,
                       occurrence_nbytes=occ_bytes)


def verify_image(loc: ShareLocation, unit_id: str, pixels: np.ndarray, key: ImageKey | None) -> None:
    """With checksums on, an image a unit shipped must match its content key (the unit's strong digest of the stored
    bytes, ``ImageKey``): a corrupted image raises ``CorruptPayloadError`` naming the unit and the share (the claim is
    undone by the client). Without keys (``dedup=False``) the fields' CRC-32s are the check."""
    from knittrans.dataplane.types import CorruptPayloadError
    from knittrans.mmdedup.keys import strong_digest

    if key is not None and strong_digest(torch.from_numpy(np.ascontiguousarray(pixels))) != key.digest:
        raise CorruptPayloadError(f"share {loc.key} rank {loc.rank}: image {key} from unit {unit_id} is corrupt "
                                  f"on fetch (its bytes do not match its content key); nothing was consumed, retry "
                                  f"the fetch")


def as_mm_client(client: DataPlaneClient) -> MMClient:
    """The same client (controller, units, getter, options: whatever the transport set) as an ``MMClient``."""
    return MMClient(**{f.name: getattr(client, f.name) for f in dc_fields(client) if f.init})


@dataclass
class MMInProcessDataPlane(InProcessDataPlane):
    """The embedded transport with multimodal units (``units[u].store`` is unit u's encoding store)."""

    def client(self, local_unit: str | None = None) -> MMClient:
        return as_mm_client(super().client(local_unit))

    def store_stats(self) -> dict[str, StoreStats]:
        return {u: unit.store.stats() for u, unit in self.units.items()}

    def live_bytes(self) -> int:
        """Encoding bytes the units still hold (0 once every trajectory put is consumed)."""
        return sum(s.live_bytes for s in self.store_stats().values())


def build_mm_inprocess(unit_nodes: Mapping[str, str], rank_nodes: tuple[str, ...], schema: TrajectorySchema = MM_SCHEMA,
                       hash_fn: HashFn = encoding_hash_fn, balance_slack: float = 0.05, equal_counts: bool = True,
                       prepare: PrepareConfig | None = None,
                       policy: "AdmissionPolicy | None" = None, dedup: bool = True,
                       cross_unit: bool = True, read_timeout_s: float | None = 300.0,
                       recoverable: bool = False, checksums: bool = False,
                       records_window: int | None = None) -> MMInProcessDataPlane:
    """``build_inprocess`` with ``MMStorageUnit``s and the group-keeping ``MMController`` (admitting through
    ``policy`` when given, as ``knittrans.handoff`` does). ``dedup`` False: units store and move every image
    occurrence (the plain twin); ``cross_unit`` False: dedup within each unit only (``MMController``).
    ``read_timeout_s``: ``InProcessDataPlane.read_timeout_s``; ``recoverable``: as ``build_inprocess``'s (the
    controller journals, ``restart_controller`` rebuilds it from the journal and the units' manifests);
    ``checksums``: as ``build_inprocess``'s (each field's CRC-32 checked at the unit and at the rank; each shipped
    image checked against its content key, ``MMClient``); ``records_window``: ``ControllerConfig.records_window``."""
    journal = ControllerJournal() if recoverable else None
    if journal is not None:
        journal.attach()  # the first controller: nothing to recover
    ctrl = MMController(schema, unit_nodes, ControllerConfig(tuple(rank_nodes), balance_slack, equal_counts,
                                                             records_window), policy,
                        cross_unit=cross_unit, journal=journal)
    units = {u: MMStorageUnit(u, n, schema, hash_fn, dedup) for u, n in unit_nodes.items()}
    return MMInProcessDataPlane(schema, ctrl, units, prepare or PrepareConfig(), checksums=checksums,
                                read_timeout_s=read_timeout_s, journal=journal)
