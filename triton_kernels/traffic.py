"""Traffic: the bytes an op must read and write, the numerator of every GB/s and fraction-of-memcpy we report.

Convention (the Triton tutorials', and a memcpy's): GB/s = (bytes read + bytes written) / seconds, where each input
byte the op needs is counted once as read and each output byte once as written, whatever an implementation does
on top (validation rereading offsets, a fill before a copy, a gather into a staging buffer). Values an op
generates rather than reads (pads, position ids) count as writes only. A memcpy that moves the same total copies
``total // 2`` bytes. Each kernel package defines its op's count next to the implementation
(``encoding_hash.hash_traffic``, ``batched_pack.pack_traffic``); the repro tables use nothing else.

Example::

    >>> t = Traffic(read=10, written=6)
    >>> t.total, t.memcpy_bytes
    (16, 8)
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Traffic:
    """Bytes an op reads and writes (see the module doc for what counts)."""

    read: int
    written: int

    def __post_init__(self) -> None:
        if self.read < 0 or self.written < 0:
            raise ValueError(f"traffic cannot be negative: read={self.read}, written={self.written}")

    @property
    def total(self) -> int:
        """Bytes read + bytes written."""
        return self.read + self.written

    @property
    def memcpy_bytes(self) -> int:
        """Size of the memcpy that moves the same total (it reads and writes that many bytes each)."""
        return self.total // 2
