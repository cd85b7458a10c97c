"""Reused pack buffers: where a rank's packed share is written, so that a share costs one copy and no page faults.

Why: a share packed into freshly allocated memory pays the kernel's first-touch cost (a page fault and a zeroed page
per 4 KiB, or per 2 MiB with transparent huge pages) on top of the copy itself; on this kind of machine that halves
the pack's bandwidth. A rank packs shares of about the same size over and over, so it keeps a few buffers and writes
each share into one of them.

Safety (a share still in use is never overwritten): a buffer is handed out again only when nothing but the pool
references it. Every array and tensor carved from it -- ``np.ndarray`` views (numpy points a view's ``base`` at the
buffer) and ``torch.from_numpy`` tensors with their views (they keep the numpy array alive) -- holds a reference, so
its CPython reference count is above the pool's own until the last of them is gone. The baseline count is measured
on a probe buffer when the pool is built (not hard-coded), and the check and the hand-out happen under one lock.
A pool whose buffers are all in use allocates a fresh one (never waits, never shares); it keeps at most
``max_buffers`` (the rest are ordinary allocations, freed with their share).

Pageable memory only. Shares a GPU will read are packed into page-locked memory from torch's caching host
allocator instead (``pack_share``): that allocator also recycles its blocks, and it knows when an asynchronous
host-to-device copy still reads one (it records the copy's stream), which a refcount cannot see.

    >>> pool = BufferPool(max_buffers=2)
    >>> a = pool.take(1000)
    >>> b = pool.take(1000)         # ``a`` is still referenced: another buffer
    >>> a.base is b.base
    False
    >>> del a
    >>> pool.take(800).base is b.base, pool.num_buffers
    (False, 2)
"""

from __future__ import annotations

import sys
import threading
from typing import Sequence

import numpy as np

ALIGN = 64
"""Byte alignment of every carved field (a cache line; numpy and torch need at most 16)."""
_GRAIN = 2 << 20  # buffer sizes are rounded up to 2 MiB (a transparent huge page), with 1/8 headroom


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


class BufferPool:
    """A few reusable byte buffers (see the module docstring). Thread-safe; pickles as an empty pool (buffers
    never travel: a client shipped to a rank actor builds its own)."""

    def __init__(self, max_buffers: int = 8) -> None:
        if max_buffers < 0:
            raise ValueError(f"BufferPool.max_buffers must be >= 0, got {max_buffers}")
        self.max_buffers = max_buffers
        self._bufs: list[np.ndarray] = []
        self._used: list[int] = []  # per buffer, when it was last handed out (a counter)
        self._clock = 0
        self._lock = threading.Lock()
        self._bufs.append(np.empty(1, dtype=np.uint8))
        self._free_refs = self._refs(0)  # the count of a buffer only the pool holds, measured, not assumed
        self._bufs.clear()
        self.allocations = 0  # buffers allocated so far (a steady stream of equal shares stops allocating)

    def __reduce__(self):  # noqa: ANN204
        return (BufferPool, (self.max_buffers,))

    def _refs(self, i: int) -> int:
        return sys.getrefcount(self._bufs[i])

    def _alloc(self, nbytes: int) -> np.ndarray:
        self.allocations += 1
        return np.empty(nbytes, dtype=np.uint8)

    @property
    def num_buffers(self) -> int:
        return len(self._bufs)

    def take(self, nbytes: int) -> np.ndarray:
        """A writable ``uint8`` array of ``nbytes`` bytes that nothing else references (a view of a pooled buffer,
        or a fresh allocation when every pooled one is in use). Its contents are undefined."""
        if nbytes < 0:
            raise ValueError(f"BufferPool.take: nbytes must be >= 0, got {nbytes}")
        with self._lock:
            best, spare = -1, -1
            self._clock += 1
            for i in range(len(self._bufs)):
                if self._refs(i) != self._free_refs:
                    continue  # a share carved from it is still alive
                if self._bufs[i].nbytes >= nbytes and (best < 0 or self._used[i] > self._used[best]):
                    best = i  # of the free ones that fit, the most recently used: its lines are likeliest cached
                elif self._bufs[i].nbytes < nbytes and spare < 0:
                    spare = i
            if best >= 0:
                self._used[best] = self._clock
                return self._bufs[best][:nbytes]
            size = -(-(nbytes + nbytes // 8) // _GRAIN) * _GRAIN
            if spare >= 0:  # a free buffer too small for this share: replace it rather than grow the pool
                self._bufs[spare] = self._alloc(size)
                self._used[spare] = self._clock
                return self._bufs[spare][:nbytes]
            if len(self._bufs) < self.max_buffers:
                self._bufs.append(self._alloc(size))
                self._used.append(self._clock)
                return self._bufs[-1][:nbytes]
        return self._alloc(nbytes)  # every pooled buffer is in use: an ordinary allocation, freed with its share


_POOL: list[BufferPool] = []
_POOL_LOCK = threading.Lock()


def process_pool(max_buffers: int) -> BufferPool:
    """This process's pack pool, shared by every client in it: a rank's consumer is often rebuilt (a new pass, a
    recovered rank) while the process and its share sizes stay, so the buffers outlive any one client.
    Thread-safe; ``max_buffers`` only grows (the largest any client asked for). It holds at most ``max_buffers``
    buffers of about one share each, for the life of the process."""
    with _POOL_LOCK:
        if not _POOL:
            _POOL.append(BufferPool(max_buffers))
        _POOL[0].max_buffers = max(_POOL[0].max_buffers, max_buffers)
        return _POOL[0]


def copy_rows(rows: Sequence[np.ndarray], out: np.ndarray, ragged: bool) -> None:
    """Write ``rows`` back to back into ``out`` (ragged: concatenated along the first axis; fixed: stacked), the
    GIL held throughout. Hand-written because ``np.concatenate`` releases the GIL around every row's copy (any row
    past 500 elements) and re-acquires it after: beside threads running Python (a trainer's step, producers' puts
    in process) each re-acquisition waits out a switch interval (5 ms), and 256 rows took 0.83 s instead of 1.7 ms
    with two busy threads (0.008 s this way).

    Each row is one ``memoryview`` slice assignment: CPython's ``memcpy`` with the GIL held, ~0.5 us of overhead
    per row (a libc ``memcpy`` through ctypes cost ~4 us per row, mostly ``ndarray.ctypes.data``: with 16 KB rows
    that was 2-3x the copy itself). Any row that is not C-contiguous, of another dtype or shape, a dtype without a
    buffer format (datetime, object) or a size mismatch falls back to numpy for the whole field (which raises the
    shape error, if any)."""
    dt, tail = out.dtype, out.shape[1:]
    if (not (out.flags.c_contiguous and out.flags.writeable and out.nbytes) or dt.hasobject
            or sum(r.nbytes for r in rows) != out.nbytes):
        _numpy_rows(rows, out, ragged)
        return
    try:
        off = 0
        if out.ndim == 1 and ragged:
            # 1-D rows into a 1-D output: element slices. The assignment itself checks each row's format (dtype)
            # and shape and copies strided rows correctly, so nothing is checked per row here.
            dst = memoryview(out)
            for r in rows:
                n = r.shape[0]
                dst[off:off + n] = r
                off += n
            return
        dst = memoryview(out).cast("B")  # a byte cast forgets the dtype: each row's dtype and shape are checked
        for r in rows:
            if (r.dtype is not dt and r.dtype != dt) or (r.shape[1:] if ragged else r.shape) != tail:
                raise ValueError("not a plain row")
            n = r.nbytes
            if n:
                dst[off:off + n] = memoryview(r).cast("B")  # TypeError unless the row is C-contiguous
            off += n
    except (ValueError, TypeError, NotImplementedError, IndexError):
        _numpy_rows(rows, out, ragged)  # rewrites the whole field: a partial fast copy leaves nothing behind


def _numpy_rows(rows: Sequence[np.ndarray], out: np.ndarray, ragged: bool) -> None:
    (np.concatenate if ragged else np.stack)(rows, out=out)  # type: ignore[operator]
