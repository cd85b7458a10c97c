"""Dedup-aware encoding plane: one ``EncodingStore`` per storage unit, and a fetch that moves each distinct
encoding of a rank's share once.

Where encodings live: a producer (rollout engine) registers each trajectory's image encodings with the store of
its local unit, as it writes the trajectory's other fields to the same unit (``knittrans.dataplane``). The n
samples of a GRPO group share the prompt's images, so the unit holds one copy per distinct image (bytes compared
on every key hit, see ``store.py``).

Fetch: a rank gathers the content key (``keys.ImageKey``: a collision-resistant digest of the bytes, dtype, shape
and grid) of every image occurrence of its share, in the share's order, reads each distinct key once (from the
first unit that holds it), and returns an ``ImageSet`` of distinct images plus, per trajectory, the indices into
it (``TrainSample.image_ids``), which is all the dedup trainer path (``gather.py``) needs. Within a unit the store
compares bytes on every key hit; across units (a group split across engines, as verl's agent loop places it) the
strong digest stands in for the comparison, so a copy on a second unit is not moved again.

Consumption: ``consume`` releases the trajectories' references after the trainer step that used them; a slot is
freed with its last reference (nothing freed early: a later mini-batch's trajectory still holds its own).

Example::

    >>> import torch
    >>> plane = EncodingPlane(["u0"])
    >>> img = torch.randn(16, 1176)
    >>> for t in range(4):
    ...     _ = plane.register("u0", t, [img], [(1, 4, 4)])
    >>> f = plane.fetch([0, 1, 2, 3])
    >>> len(f.images.pixels), f.image_ids[3], f.nbytes == img.numel() * 4
    (1, (0,), True)
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

import torch

from knittrans.mmdedup.gather import ImageSet
from knittrans.mmdedup.keys import (EncodingInputError, HashFn, ImageKey, check_finite_pixels, check_grid,
                                    encoding_hash_fn)
from knittrans.mmdedup.store import EncodingConflictError, EncodingRef, EncodingStore, EncodingStoreError, StoreStats


@dataclass(frozen=True, slots=True)
class ImageOccurrence:
    """One image a trajectory shows: which unit's store holds it, the reference, and its grid (t, h, w)."""

    unit_id: str
    ref: EncodingRef
    grid_thw: tuple[int, int, int]


@dataclass(frozen=True)
class DistinctFetch:
    """What a dedup-aware fetch hands the trainer: distinct images, per-trajectory indices into them (placeholder
    order), and the accounting. ``nbytes`` = bytes moved = the distinct images' bytes; ``occurrence_nbytes`` =
    what a fetch without dedup would move."""

    traj_ids: tuple[int, ...]
    images: ImageSet
    image_ids: Mapping[int, tuple[int, ...]]
    nbytes: int
    occurrence_nbytes: int
    num_occurrences: int


class EncodingPlane:
    """Per-unit encoding stores plus the metadata of which images each trajectory shows."""

    def __init__(self, unit_ids: Iterable[str], hash_fn: HashFn = encoding_hash_fn, copy: bool = True) -> None:
        self.stores: dict[str, EncodingStore] = {u: EncodingStore(hash_fn, copy) for u in unit_ids}
        if not self.stores:
            raise ValueError("EncodingPlane needs at least one unit")
        self._lock = threading.Lock()
        self._occ: dict[int, tuple[ImageOccurrence, ...]] = {}
        self._unit_of: dict[int, str] = {}  # trajectory -> the unit whose store holds its references

    def register(self, unit_id: str, traj_id: int, encodings: Sequence[torch.Tensor],
                 grids: Sequence[tuple[int, int, int]]) -> tuple[ImageOccurrence, ...]:
        """Store trajectory ``traj_id``'s image encodings (placeholder order) in ``unit_id``'s store. Idempotent: a
        second register with identical content (unit, grids, encoding bytes, order) returns the same occurrences
        and takes no second reference; a conflicting one raises ``EncodingConflictError``."""
        if unit_id not in self.stores:
            raise EncodingStoreError(f"unknown unit {unit_id!r} (units: {sorted(self.stores)})")
        if len(encodings) != len(grids):
            raise EncodingInputError(f"trajectory {traj_id}: {len(encodings)} encodings but {len(grids)} grids")
        for i, (e, g) in enumerate(zip(encodings, grids)):
            if not isinstance(e, torch.Tensor):
                raise EncodingInputError(f"trajectory {traj_id} image {i}: pixel values must be a torch.Tensor, "
                                         f"got {type(e).__name__}")
            check_grid(f"trajectory {traj_id} image {i}", g, e.shape[0])
            check_finite_pixels(f"trajectory {traj_id} image {i}", e)
        grids = [tuple(int(x) for x in g) for g in grids]
        with self._lock:
            if traj_id in self._occ:  # a second register: a no-op if identical (a retry), else refused by name
                held = self._occ[traj_id]
                if self._unit_of[traj_id] != unit_id or [o.grid_thw for o in held] != grids:
                    raise EncodingConflictError(
                        f"trajectory {traj_id} already has images registered on unit {self._unit_of[traj_id]!r} "
                        f"with grids {[o.grid_thw for o in held]}; a second register on {unit_id!r} with grids "
                        f"{grids} conflicts (an identical retry is a no-op)")
        refs = self.stores[unit_id].register(traj_id, encodings)  # identical: the same refs; else a conflict
        occ = tuple(ImageOccurrence(unit_id, r, g) for r, g in zip(refs, grids))
        with self._lock:
            self._occ.setdefault(traj_id, occ)
            self._unit_of.setdefault(traj_id, unit_id)
            return self._occ[traj_id]

    def occurrences(self, traj_id: int) -> tuple[ImageOccurrence, ...]:
        with self._lock:
            try:
                return self._occ[traj_id]
            except KeyError:
                raise EncodingStoreError(f"trajectory {traj_id} has no registered images (never registered, or "
                                         f"already consumed)") from None

    def fetch(self, traj_ids: Sequence[int], copy: bool = True) -> DistinctFetch:
        """Each distinct (unit, slot, grid) of these trajectories' images, read once. ``copy`` (the default)
        materialises a private copy per distinct image, so a consumer's in-place edit cannot change what the next
        mini-batch receives; False hands out the stored tensors (only for a caller that never writes them)."""
        occ = {t: self.occurrences(t) for t in traj_ids}  # raises before anything is read
        index: dict[ImageKey, int] = {}
        order: list[ImageOccurrence] = []
        image_ids: dict[int, tuple[int, ...]] = {}
        occ_bytes = n_occ = 0
        for t in traj_ids:
            ids = []
            for o in occ[t]:
                # the grid is part of the key: identical bytes shown as 56x84 and as 84x56 are two images to the
                # encoder (M-RoPE positions differ), so each keeps its own grid
                k = ImageKey(self.stores[o.unit_id].strong_digest(o.ref), o.ref.key.dtype, o.ref.key.shape,
                             o.grid_thw)
                if k not in index:
                    index[k] = len(order)
                    order.append(o)
                ids.append(index[k])
                occ_bytes += o.ref.nbytes
                n_occ += 1
            image_ids[t] = tuple(ids)
        pixels = []
        for o in order:
            x = self.stores[o.unit_id].get(o.ref)
            pixels.append(x.clone() if copy else x)
        nbytes = sum(o.ref.nbytes for o in order)
        return DistinctFetch(tuple(traj_ids), ImageSet(tuple(pixels), tuple(o.grid_thw for o in order)), image_ids,
                             nbytes, occ_bytes, n_occ)

    def consume(self, traj_ids: Sequence[int]) -> None:
        """Release the trajectories' references (all or none); their last reference frees a slot."""
        ids = list(traj_ids)
        with self._lock:
            if len(set(ids)) != len(ids):
                raise EncodingStoreError(f"consume: duplicate trajectory ids in {ids}")
            missing = [t for t in ids if t not in self._occ]
            if missing:
                raise EncodingStoreError(f"consume: trajectories {missing} have no registered images (never "
                                         f"registered, or already consumed)")
            by_unit: dict[str, list[int]] = {}
            for t in ids:
                by_unit.setdefault(self._unit_of[t], []).append(t)
            for u, ts in by_unit.items():  # each store validated all its ids above: these cannot fail midway
                self.stores[u].consume(ts)
            for t in ids:
                del self._occ[t], self._unit_of[t]

    def stats(self) -> dict[str, StoreStats]:
        """Per-unit store counters."""
        return {u: s.stats() for u, s in self.stores.items()}

    def live_bytes(self) -> int:
        return sum(s.live_bytes for s in self.stats().values())
