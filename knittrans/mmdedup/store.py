"""Refcounted encoding store: one copy per distinct encoding, freed when the last trajectory using it is consumed.

Modelled on nano-vllm's prefix cache: a ``key -> slots`` map (a list per key, so two contents that collide on
the key get two slots), a refcount per slot, and a byte comparison on every key hit, so a hash collision can never
alias two inputs. Slot ids are never reused, so a stale ``EncodingRef`` can never reach another encoding.

The plain twin (``dedup=False``): every put gets its own slot under a unique key (no hashing, no lookup), so the
store holds -- and a fetch moves -- one copy per occurrence, exactly as a path without deduplication would. Same
API, same refcounts; benchmarks and tests run both on the same inputs.

Ownership: a trajectory is registered with the encodings it shows (``register``), taking one reference per
occurrence (a trajectory that shows the same image twice holds two); ``consume`` (the trainer has used the
trajectory) releases them; the slot is freed when its count reaches zero. Every operation validates all of its
inputs before it changes anything, so a rejected call leaves the store as it was (nothing lost, nothing freed
early).

Example::

    >>> import torch
    >>> store = EncodingStore()
    >>> img = torch.ones(4, 6)
    >>> a = store.register(0, [img]); b = store.register(1, [img.clone()])
    >>> a[0].slot == b[0].slot, store.refcount(a[0]), store.stats().live_bytes
    (True, 2, 96)
    >>> store.consume([0, 1]); len(store)
    0
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Iterable, Sequence

import torch

from knittrans.dataplane.idset import IdRanges
from knittrans.mmdedup.keys import EncodingKey, HashFn, check_encoding, content_keys, encoding_hash_fn, strong_digest


class EncodingStoreError(ValueError):
    """A request the encoding store rejects (unknown or freed slot, trajectory registered or consumed twice);
    no state was changed."""


class EncodingConflictError(EncodingStoreError):
    """A second register of a trajectory with different content (other images, bytes, order or grids) than its
    first: refused by name. An identical second register (a retried call) is a no-op instead."""


@dataclass(frozen=True, slots=True)
class EncodingRef:
    """A handle to one stored encoding: its slot (never reused), key and size in bytes."""

    slot: int
    key: EncodingKey
    nbytes: int


@dataclass(frozen=True, slots=True)
class StoreStats:
    """Counters of an ``EncodingStore``.

    ``logical_bytes`` is what the live references would occupy without dedup (one copy per occurrence);
    ``live_bytes`` is what the store holds (one copy per distinct content)."""

    puts: int
    hits: int
    collisions: int
    frees: int
    live_slots: int
    live_refs: int
    live_bytes: int
    logical_bytes: int
    peak_bytes: int


@dataclass(slots=True)
class _Slot:
    key: EncodingKey
    tensor: torch.Tensor
    refcount: int
    strong: bytes | None = None  # BLAKE2b of the bytes, computed on first ask (``strong_digest``)


class EncodingStore:
    """Content-addressed, refcounted storage of image encodings (see the module doc)."""

    def __init__(self, hash_fn: HashFn = encoding_hash_fn, copy: bool = True, dedup: bool = True) -> None:
        """``hash_fn`` computes digests (tests pass a weak one to force collisions); ``copy`` stores a private
        copy of each new encoding (off only when the caller guarantees it never mutates what it put); ``dedup``
        False stores every occurrence in its own slot (the plain twin, see the module doc)."""
        self._hash_fn = hash_fn
        self._copy = copy
        self.dedup = dedup
        self._lock = threading.Lock()
        self._by_key: dict[EncodingKey, list[int]] = {}
        self._slots: dict[int, _Slot] = {}
        self._traj: dict[int, tuple[EncodingRef, ...]] = {}
        self._consumed = IdRanges()  # consumed ids as ranges: flat memory however long the run (issue 13)
        self._next_slot = 0
        self._puts = self._hits = self._collisions = self._frees = 0
        self._live_bytes = self._peak_bytes = 0

    # -- trajectory-level API -------------------------------------------------------------------------------

    def register(self, traj_id: int, encodings: Sequence[torch.Tensor]) -> tuple[EncodingRef, ...]:
        """Store the encodings trajectory ``traj_id`` shows (in placeholder order), one reference each.

        Idempotent: registering an already registered trajectory with the same encodings (same count, order,
        dtypes, shapes and bytes) is a no-op returning the same references (a retried call whose reply was lost
        takes no second reference); different content raises ``EncodingConflictError``, and a trajectory already
        consumed cannot be registered again."""
        with self._lock:
            if traj_id in self._consumed:
                raise EncodingStoreError(f"trajectory {traj_id} is already registered (and consumed)")
            if traj_id in self._traj:
                return self._same_or_conflict_locked(traj_id, encodings)
        refs = tuple(self.put(encodings))
        with self._lock:
            if traj_id in self._traj:  # a concurrent register of the same id won the race: undo ours
                self._release_locked(refs)
                return self._same_or_conflict_locked(traj_id, encodings)
            self._traj[traj_id] = refs
        return refs

    def _same_or_conflict_locked(self, traj_id: int, encodings: Sequence[torch.Tensor]) -> tuple[EncodingRef, ...]:
        """The references of registered ``traj_id`` if ``encodings`` is exactly what it holds, else raise."""
        held = self._traj[traj_id]
        if len(held) != len(encodings):
            raise EncodingConflictError(f"trajectory {traj_id} is already registered with {len(held)} encodings; a "
                                        f"second register carries {len(encodings)} (an identical retry is a no-op)")
        for i, (r, t) in enumerate(zip(held, encodings)):
            if not isinstance(t, torch.Tensor) or not same_bytes(self._slots[r.slot].tensor, t.detach().contiguous()):
                raise EncodingConflictError(f"trajectory {traj_id} is already registered: encoding {i} of the second "
                                            f"register differs from the stored one (dtype, shape or bytes; an "
                                            f"identical retry is a no-op)")
        return held

    def refs_of(self, traj_id: int) -> tuple[EncodingRef, ...]:
        """The references trajectory ``traj_id`` holds (in placeholder order)."""
        with self._lock:
            try:
                return self._traj[traj_id]
            except KeyError:
                state = "already consumed" if traj_id in self._consumed else "not registered"
                raise EncodingStoreError(f"trajectory {traj_id} is {state}") from None

    def consume(self, traj_ids: Iterable[int]) -> None:
        """The trainer has used these trajectories: release their references (all or none)."""
        ids = list(traj_ids)
        with self._lock:
            if len(set(ids)) != len(ids):
                raise EncodingStoreError(f"consume: duplicate trajectory ids in {ids}")
            for t in ids:
                if t not in self._traj:
                    state = "already consumed" if t in self._consumed else "not registered"
                    raise EncodingStoreError(f"consume: trajectory {t} is {state}")
            refs = [r for t in ids for r in self._traj[t]]
            self._release_locked(refs)
            for t in ids:
                del self._traj[t]
            self._consumed.update(ids)

    # -- slot-level API -------------------------------------------------------------------------------------

    def put(self, encodings: Sequence[torch.Tensor], copy: bool | None = None) -> list[EncodingRef]:
        """Add one reference per tensor: an existing slot when key and bytes match, else a new slot. ``copy``
        overrides the store's for this call (False: the caller hands over read-only memory nobody writes, e.g. a
        Ray unit's own object-store views)."""
        copy = self._copy if copy is None else copy
        for t in encodings:
            check_encoding(t)
        cpu = [t.detach().contiguous() for t in encodings]
        # hashing outside the lock: it is the expensive part (the plain twin skips it: its keys are unique)
        keys = _keys_once_per_view(cpu, self._hash_fn) if self.dedup else [None] * len(cpu)
        with self._lock:
            refs = []
            for key, t in zip(keys, cpu):
                self._puts += 1
                if key is None:  # dedup off: a fresh key per occurrence, never found again
                    key = EncodingKey(self._next_slot.to_bytes(16, "little"), str(t.dtype).removeprefix("torch."),
                                      tuple(t.shape))
                slot_id = self._find_locked(key, t) if self.dedup else None
                if slot_id is None:
                    slot_id = self._next_slot
                    self._next_slot += 1
                    self._slots[slot_id] = _Slot(key, t.clone() if copy else t, 0)
                    self._by_key.setdefault(key, []).append(slot_id)
                    self._live_bytes += _nbytes(t)
                    self._peak_bytes = max(self._peak_bytes, self._live_bytes)
                else:
                    self._hits += 1
                slot = self._slots[slot_id]
                slot.refcount += 1
                refs.append(EncodingRef(slot_id, key, _nbytes(slot.tensor)))
            return refs

    def release(self, refs: Iterable[EncodingRef]) -> None:
        """Drop one reference per item (all or none); a slot is freed when its count reaches zero."""
        with self._lock:
            self._release_locked(list(refs))

    def get(self, ref: EncodingRef) -> torch.Tensor:
        """The stored encoding (read it, never write it: every trajectory that references it shares it)."""
        with self._lock:
            return self._slot_locked(ref).tensor

    def strong_digest(self, ref: EncodingRef) -> bytes:
        """The collision-resistant digest of ``ref``'s bytes (``keys.strong_digest``), computed once per slot
        (outside the lock: hashing is the expensive part; a slot's bytes never change)."""
        with self._lock:
            s = self._slot_locked(ref)
            if s.strong is not None:
                return s.strong
            t = s.tensor
        d = strong_digest(t)
        with self._lock:
            live = self._slots.get(ref.slot)
            if live is not None:
                live.strong = d
        return d

    def refcount(self, ref: EncodingRef) -> int:
        """References held on ``ref``'s slot (0 once it is freed)."""
        with self._lock:
            s = self._slots.get(ref.slot)
            return 0 if s is None else s.refcount

    def __len__(self) -> int:
        with self._lock:
            return len(self._slots)

    def stats(self) -> StoreStats:
        with self._lock:
            refs = sum(s.refcount for s in self._slots.values())
            logical = sum(s.refcount * _nbytes(s.tensor) for s in self._slots.values())
            return StoreStats(self._puts, self._hits, self._collisions, self._frees, len(self._slots), refs,
                              self._live_bytes, logical, self._peak_bytes)

    # -- internals (lock held) ------------------------------------------------------------------------------

    def _find_locked(self, key: EncodingKey, t: torch.Tensor) -> int | None:
        """The slot holding exactly ``t``'s content, comparing bytes on every key hit (never trust the hash)."""
        for slot_id in self._by_key.get(key, ()):
            if same_bytes(self._slots[slot_id].tensor, t):
                return slot_id
            self._collisions += 1
        return None

    def _slot_locked(self, ref: EncodingRef) -> _Slot:
        s = self._slots.get(ref.slot)
        if s is None:
            raise EncodingStoreError(f"encoding slot {ref.slot} ({ref.key}) is not live: freed or never stored")
        if s.key != ref.key:
            raise EncodingStoreError(f"encoding slot {ref.slot} holds {s.key}, not {ref.key}: a foreign ref")
        return s

    def _release_locked(self, refs: Sequence[EncodingRef]) -> None:
        need: dict[int, int] = {}
        for r in refs:
            self._slot_locked(r)
            need[r.slot] = need.get(r.slot, 0) + 1
        for slot_id, k in need.items():
            if self._slots[slot_id].refcount < k:
                raise EncodingStoreError(f"release of {k} references on slot {slot_id}, which holds only "
                                         f"{self._slots[slot_id].refcount}")
        for slot_id, k in need.items():
            s = self._slots[slot_id]
            s.refcount -= k
            if s.refcount == 0:
                self._live_bytes -= _nbytes(s.tensor)
                self._frees += 1
                chain = self._by_key[s.key]
                chain.remove(slot_id)
                if not chain:
                    del self._by_key[s.key]
                del self._slots[slot_id]


def _keys_once_per_view(tensors: Sequence[torch.Tensor], hash_fn: HashFn) -> list[EncodingKey]:
    """``content_keys`` with each memory view hashed once: a GRPO group's n samples usually pass the very same
    tensor (one view, hence the same bytes), which needs one digest, not n."""
    first: dict[tuple, int] = {}
    unique: list[torch.Tensor] = []
    where = []
    for t in tensors:
        view = (t.data_ptr(), t.dtype, tuple(t.shape), t.stride())
        if view not in first:
            first[view] = len(unique)
            unique.append(t)
        where.append(first[view])
    keys = content_keys(unique, hash_fn)
    return [keys[i] for i in where]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (not ``==``, which calls NaN unequal to itself and -0.0 equal to 0.0)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
