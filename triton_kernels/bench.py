"""Measurement helpers shared by ``repro.kernels`` and ``tests/bench``: inputs, a memcpy of a given byte count, and
timing in repeated, interleaved passes.

How a fraction of memcpy is measured
------------------------------------
Each timed point (a ``Case``) knows its op's ``Traffic`` (bytes read + written, counted by the kernel package).
In every pass, for every case and each of its calls in turn, a memcpy that moves the same total (copies
``traffic.memcpy_bytes`` between two buffers touched beforehand) is timed, then the call. The fraction of memcpy of
that pass is ``memcpy seconds / op seconds`` (= op GB/s / memcpy GB/s, same bytes). The memcpy right before each
call also leaves every call the same cache state (its inputs evicted as far as the bytes reach), so a variant is not
helped by the one before it having read the same inputs. A claim takes the median over passes and
reports [min, max]: load on a shared machine hits the op and the memcpy of the same pass alike, and one slow pass
cannot decide. On CPU the memcpy is the faster (in that pass) of torch's ``copy_`` (intra-op threads) and numpy's
single-threaded ``copyto``: on a busy machine a threaded copy can wait at its barrier, which would flatter
everything measured against it.

Example::

    >>> import torch
    >>> from triton_kernels.traffic import Traffic
    >>> mc = Memcpy(1 << 16, torch.device("cpu"))
    >>> buf = torch.zeros(1 << 12)
    >>> times = interleaved_passes([Case("zero", Traffic(0, buf.numel() * 4), {"": buf.zero_})], mc, passes=3)
    >>> len(times), times[0].op.wall > 0 and times[0].memcpy.wall > 0
    (3, True)
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass
from typing import Callable, Mapping, NamedTuple, Sequence

import numpy as np
import torch

from .traffic import Traffic

IMAGE_BYTES = 448 * 448 * 3 * 4
"""One 448x448 RGB image in fp32."""
SGLANG_SHAPE = (3312, 1176)
"""The fp32 pixel-value tensor SGLang hashes per image."""
SPEC_BANDWIDTH = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.039e12, "L40S": 0.864e12, "A10": 0.6e12}
"""Spec memory bandwidth (bytes/s) of GPUs we know, by a substring of their name."""


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def spec_bandwidth(device: torch.device) -> float | None:
    """The spec memory bandwidth (bytes/s) of a known GPU, None otherwise (CPUs included)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((bw for key, bw in SPEC_BANDWIDTH.items() if key in name), None)


def hash_inputs(n_tensors: int, gen: torch.Generator, device: torch.device,
                tensor_bytes: int = IMAGE_BYTES) -> tuple[torch.Tensor, torch.Tensor]:
    """``n_tensors`` random tensors of ``tensor_bytes`` bytes each as one uint8 buffer and its byte offsets."""
    buf = torch.randint(0, 256, (n_tensors * tensor_bytes,), dtype=torch.uint8, generator=gen).to(device)
    return buf, (torch.arange(n_tensors + 1, dtype=torch.int64) * tensor_bytes).to(device)


class PackInputs(NamedTuple):
    fields: dict[str, torch.Tensor]
    seq_offsets: torch.Tensor
    plan: object  # a batched_pack.PackPlan


def pack_inputs(total_tokens: int, gen: torch.Generator, device: torch.device, num_ranks: int = 4,
                row_len: int = 8192) -> PackInputs:
    """Ragged RL fields of ``total_tokens`` tokens (lengths uniform in 64..4096: int64 ids, fp32 old log-probs and
    advantages, bool loss mask) and a Karmarkar-Karp plan on ``num_ranks`` ranks with ``row_len``-token rows."""
    from .batched_pack import plan_microbatches

    lengths: list[int] = []
    total = 0
    while total < total_tokens:
        lengths.append(int(torch.randint(64, 4097, (1,), generator=gen)))
        total += lengths[-1]
    lengths[-1] -= total - total_tokens
    off = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(torch.tensor(lengths), 0)])
    t = int(off[-1])
    fields = {"input_ids": torch.randint(0, 150000, (t,), generator=gen),
              "old_logprobs": torch.randn(t, generator=gen), "advantages": torch.randn(t, generator=gen),
              "loss_mask": torch.rand(t, generator=gen) > 0.2}
    plan = plan_microbatches(lengths, num_ranks=num_ranks, max_tokens_per_microbatch=row_len, method="kk").pack
    return PackInputs({k: v.to(device) for k, v in fields.items()}, off.to(device), plan)


class Memcpy:
    """A source and a destination of ``capacity`` bytes, both written once up front (no first-touch page faults
    in a timed copy); ``calls(n)`` are the ways to copy their first ``n`` bytes on this device."""

    def __init__(self, capacity: int, device: torch.device) -> None:
        self.device = device
        self.src = torch.ones(max(1, capacity), dtype=torch.uint8, device=device)
        self.dst = torch.zeros_like(self.src)

    def calls(self, nbytes: int) -> dict[str, Callable[[], object]]:
        if nbytes > self.src.numel():
            raise ValueError(f"memcpy of {nbytes} bytes asked of buffers of {self.src.numel()}")
        s, d = self.src[:nbytes], self.dst[:nbytes]
        out: dict[str, Callable[[], object]] = {"torch": lambda: d.copy_(s)}
        if self.device.type == "cpu":
            sn, dn = s.numpy(), d.numpy()
            out["numpy"] = lambda: np.copyto(dn, sn)
        return out


@dataclass(frozen=True)
class Case:
    """One timed point: a name, the op's traffic (what its memcpy moves) and its calls by variant name
    (e.g. ``{"fresh": ..., "reused": ...}`` for the pack; ``{"": ...}`` for a single call)."""

    name: str
    traffic: Traffic
    calls: Mapping[str, Callable[[], object]]


class Seconds(NamedTuple):
    wall: float
    """perf_counter seconds, the device synchronized after the call."""
    cpu: float
    """CPU seconds of this process (user + system, every thread) during the call."""


@dataclass(frozen=True)
class PassTime:
    """One call of one case in one pass, beside the memcpy of the same bytes timed right before it (on CPU the
    faster, by CPU time, of torch's and numpy's copy there)."""

    case: str
    variant: str
    pass_index: int
    op: Seconds
    memcpy: Seconds


def _seconds(fn: Callable[[], object], device: torch.device) -> Seconds:
    c0, t0 = time.process_time(), time.perf_counter()
    fn()
    sync(device)
    t1 = time.perf_counter()
    return Seconds(t1 - t0, time.process_time() - c0)


def interleaved_passes(cases: Sequence[Case], memcpy: Memcpy, passes: int, warmup: int = 1,
                       threads: int | None = None) -> list[PassTime]:
    """Time every case's calls once per pass, each right after a memcpy of its case's bytes, for ``passes`` passes
    (after ``warmup`` untimed rounds: first-touch faults, allocator and oneDNN caches). Python's garbage collector
    is paused while timing, as ``timeit`` does. ``threads``: torch's intra-op threads while timing (None: as set).

    Both clocks are recorded. On a shared CPU the process's CPU time is the robust one: a call longer than the
    scheduler's time slice is preempted by other tenants' work and its wall time grows with their load, a short
    memcpy's much less, so wall-time ratios there measure the load, not the code. With ``threads=1`` every
    contender runs on one core and CPU time counts no spinning at a thread barrier."""
    if passes < 1:
        raise ValueError(f"passes must be >= 1, got {passes}")
    device = memcpy.device
    copies = {c.name: memcpy.calls(c.traffic.memcpy_bytes) for c in cases}
    before = torch.get_num_threads()
    was_enabled = gc.isenabled()
    out = []
    try:
        if threads is not None:
            torch.set_num_threads(threads)
        for _ in range(warmup):
            for c in cases:
                for fn in [*copies[c.name].values(), *c.calls.values()]:
                    fn()
        sync(device)
        gc.disable()
        for p in range(passes):
            for c in cases:
                for v, fn in c.calls.items():
                    m = min((_seconds(copy, device) for copy in copies[c.name].values()), key=lambda s: s.cpu)
                    out.append(PassTime(c.name, v, p, _seconds(fn, device), m))
    finally:
        if was_enabled:
            gc.enable()
        torch.set_num_threads(before)
    return out


def pack_copy_floor(fields: Mapping[str, torch.Tensor], seq_offsets: torch.Tensor, plan,
                    out) -> Callable[[], None]:
    """A profile of the CPU pack: only its copies. Builds every output's pieces once (``slices.slice_copies``), as
    the pack does per call, and returns a call that runs just the concatenations into ``out`` (a ``PackedBatch``
    from ``batched_pack(fields, seq_offsets, plan)``). Timed beside the pack, its fraction of memcpy is what the
    slice design can reach with no bookkeeping at all; the difference is validation, planning the pieces and
    building the views."""
    from .batched_pack.slices import _as_int, slice_copies

    copies = slice_copies(seq_offsets, plan)
    jobs = []
    for name, v in fields.items():
        src = _as_int(v).numpy()[copies.first:copies.end]
        pad = np.zeros(copies.max_pad, dtype=src.dtype)
        views = [*map(src.__getitem__, copies.seq_slices), *map(pad.__getitem__, copies.pad_slices)]
        jobs.append(([views[i] for i in copies.order], _as_int(out.fields[name]).view(-1).numpy()))
    ramp, zeros = np.arange(copies.max_len, dtype=np.int64), np.zeros(copies.max_pad, dtype=np.int64)
    views = [*map(ramp.__getitem__, copies.ramp_slices), *map(zeros.__getitem__, copies.pad_slices)]
    jobs.append(([views[i] for i in copies.order], out.position_ids.view(-1).numpy()))

    def copies_only() -> None:
        for pieces, dst in jobs:
            np.concatenate(pieces, out=dst)

    return copies_only
