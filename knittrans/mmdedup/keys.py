"""Encoding keys: 128-bit content hashes of image encodings (``pixel_values``) plus the dtype and shape.

``triton_kernels.encoding_hash`` hashes bytes only (dtype- and shape-agnostic, and not cryptographic), so a key
here is (digest, dtype, shape): two tensors with equal bytes but different shapes (a 16 x 64 and a 32 x 32 grid)
get different keys, and the store still compares bytes on every key hit (see ``store.py``).

The hash function is a parameter (``HashFn``) so tests can force collisions with a deliberately weak hash and
check that the store never aliases two inputs.

Example::

    >>> import torch
    >>> a, b = torch.zeros(4, 6), torch.zeros(6, 4)
    >>> ka, kb = content_keys([a, b])
    >>> ka.digest == kb.digest, ka == kb
    (True, False)
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

HashFn = Callable[[Sequence[torch.Tensor]], list[bytes]]
"""Maps tensors to one digest (bytes) each, from their bytes only."""


class EncodingInputError(ValueError):
    """An encoding the store or the trainer path cannot accept (wrong dtype, wrong rank, zero size)."""


@dataclass(frozen=True, slots=True)
class EncodingKey:
    """What the store looks an encoding up by. Equal keys are necessary, not sufficient, for equal content:
    the store compares the bytes on a hit."""

    digest: bytes
    dtype: str
    shape: tuple[int, ...]

    def __str__(self) -> str:
        return f"{self.digest.hex()[:12]}:{self.dtype}{list(self.shape)}"


@dataclass(frozen=True, slots=True)
class ImageKey:
    """An image occurrence's identity across storage units, as the controller knows it: a collision-resistant
    digest of the pixel bytes (``strong_digest``), their dtype and shape, and the grid the image is shown with.

    Within a unit the store never trusts a hash (it compares bytes on every key hit); two units' copies are never
    in one place, so proving them equal by comparison would mean moving one. A 128-bit BLAKE2b digest stands in
    for that comparison (collision-resistant, unlike the fast ``encoding_hash``: a forced collision of the fast
    key, as the collision tests make, leaves these keys apart). The grid is part of the key: the same bytes shown
    as 56x84 and as 84x56 are two images to the encoder (M-RoPE positions differ)."""

    digest: bytes
    dtype: str
    shape: tuple[int, ...]
    grid: tuple[int, int, int]

    @property
    def nbytes(self) -> int:
        n = _itemsize(self.dtype)
        for d in self.shape:
            n *= d
        return n

    def __str__(self) -> str:
        return f"{self.digest.hex()[:12]}:{self.dtype}{list(self.shape)}@{list(self.grid)}"


_ITEMSIZE: dict[str, int] = {}


def _itemsize(dtype: str) -> int:
    """Bytes per element of torch dtype ``dtype`` ("float32", "bfloat16", ...), asked of torch once per dtype per
    process. The controller asks per distinct image of every multimodal claim (``plane.image_sources``), on one of
    its threaded actor's threads: a torch call there drops the GIL, and with another of its threads in Python (a
    registration, an admission) each re-acquisition waits out the 5 ms switch interval."""
    size = _ITEMSIZE.get(dtype)
    if size is None:
        size = _ITEMSIZE[dtype] = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    return size


def strong_digest(t: torch.Tensor) -> bytes:
    """128-bit BLAKE2b of a tensor's bytes (``hashlib``: collision-resistant; ~1 ms per 1.2 MB image on one core,
    paid once per stored slot, never per occurrence)."""
    x = t.detach().contiguous().reshape(-1).view(torch.uint8)
    return hashlib.blake2b(x.numpy().data, digest_size=16).digest()


def encoding_hash_fn(tensors: Sequence[torch.Tensor]) -> list[bytes]:
    """The production hash: ``triton_kernels.encoding_hash`` over all tensors in one ragged call (Triton on
    CUDA, the bit-identical torch reference on CPU), 16 bytes per tensor."""
    from triton_kernels.encoding_hash import encoding_hash, key_bytes

    if not tensors:
        return []
    keys = encoding_hash(list(tensors))
    return [key_bytes(k) for k in keys.cpu()]


def check_encoding(t: torch.Tensor, allowed: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16,
                                                                       torch.float16)) -> None:
    """Raise ``EncodingInputError`` unless ``t`` is a non-empty 2-D floating ``[patches, patch_dim]`` tensor."""
    if not isinstance(t, torch.Tensor):
        raise EncodingInputError(f"an encoding must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in allowed:
        raise EncodingInputError(f"pixel values have dtype {t.dtype}; expected one of {list(allowed)} "
                                 f"(preprocess images to normalised floats, not raw uint8 pixels)")
    if t.ndim != 2 or t.shape[0] == 0 or t.shape[1] == 0:
        raise EncodingInputError(f"pixel values have shape {tuple(t.shape)}; expected a non-empty "
                                 f"[patches, patch_dim] tensor")
    if t.is_meta:
        raise EncodingInputError("pixel values are a meta-device tensor (shape only, no data)")


def check_finite_pixels(owner: str, t: torch.Tensor) -> None:
    """Training images must be finite: one NaN pixel poisons the encoder's gradients for the whole step (one pass
    over the pixels, at the put of a trajectory; the store itself compares bytes and accepts any value)."""
    if not bool(torch.isfinite(t).all()):
        bad = int((~torch.isfinite(t)).sum())
        raise EncodingInputError(f"{owner}: pixel values hold {bad} non-finite value(s) (NaN or inf)")


def check_grid(owner: str, grid: object, rows: int) -> tuple[int, int, int]:
    """``grid`` as a (t, h, w) of positive ints whose product is ``rows`` (the pixel rows of its image), or
    ``EncodingInputError`` naming ``owner``."""
    g = tuple(grid) if isinstance(grid, (tuple, list)) else ()
    if len(g) != 3 or not all(isinstance(x, int) and not isinstance(x, bool) for x in g):
        raise EncodingInputError(f"{owner}: grid_thw must be three ints (t, h, w), got {grid!r}")
    if min(g) < 1 or g[0] * g[1] * g[2] != rows:
        raise EncodingInputError(f"{owner}: grid_thw {g} does not match pixel values with {rows} rows")
    return g  # type: ignore[return-value]


def content_keys(tensors: Sequence[torch.Tensor], hash_fn: HashFn = encoding_hash_fn) -> list[EncodingKey]:
    """One key per tensor (digest of its bytes, its dtype and shape), hashed in one batch."""
    digests = hash_fn(tensors)
    if len(digests) != len(tensors):
        raise RuntimeError(f"hash function returned {len(digests)} digests for {len(tensors)} tensors")
    return [EncodingKey(bytes(d), str(t.dtype).removeprefix("torch."), tuple(t.shape))
            for d, t in zip(digests, tensors)]
