"""The transfer tables' measures: pure functions of the logged trial rows (``repro.spec.transfer``), each a median
over passes of a within-pass quantity with its [min, max] and a note naming what the denominator was."""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Sequence

import numpy as np

from repro.spec.core import Measured, Trial, median_range, not_measured

FLOOR_S = 1e-4
"""Exposed latencies below 0.1 ms are below what the harness resolves (clock reads, a signal round trip)."""
TINY_S = 0.02
"""A denominator under 20 ms per batch is called tiny in the claim's note: a few ms of noise move the ratio."""
CEILING_SYSTEM = "engine-ceiling"
"""The engine's own ceiling for KnitTrans's read path (``knittrans.bench.ceiling``)."""
INPROC_CEILING_SYSTEM = "inproc-ceiling"
"""The same in process: knittrans-inproc's ranks as threads copying the same shares, nothing else beside them."""


def _num(x: float | None) -> float | None:
    return None if x is None or not math.isfinite(float(x)) else float(x)


def _pairs(rows: Sequence[Trial], num: str, den: str, field: str) -> list[tuple[float, float]]:
    """(numerator system's value, denominator system's value) per pass where both were measured."""
    by = {(r.pass_index, r.system): _num(getattr(r, field)) for r in rows}
    passes = sorted({r.pass_index for r in rows})
    return [(by[(p, num)], by[(p, den)]) for p in passes
            if by.get((p, num)) is not None and by.get((p, den)) is not None]


def _rate_pairs(rows: Sequence[Trial], num: str, den: str, field: str) -> list[tuple[float, float]]:
    """``_pairs`` of a rate (GB/s) where the denominator's is non-zero."""
    return [(a, b) for a, b in _pairs(rows, num, den, field) if b]


def ratio(num: str, den: str, field: str) -> Callable[[Sequence[Trial]], Measured]:
    """Median over passes of ``num``'s ``field`` / ``den``'s, with [min, max] and the denominator's size."""

    def measure(rows: Sequence[Trial]) -> Measured:
        pairs = _pairs(rows, num, den, field)  # type: ignore[arg-type]
        if not pairs:
            return not_measured(f"no pass measured both {num} and {den} ({field})")
        d = float(np.median([b for _, b in pairs]))
        note = f"{den} median {d * 1e3:.3g} ms per {'get' if field == 'get_s' else 'batch'}"
        if d < TINY_S:
            note += f" (tiny denominator: under {TINY_S * 1e3:.0f} ms a few ms of noise move the ratio a lot)"
        return median_range([a / max(b, FLOOR_S) for a, b in pairs], note)
    return measure


def rate_ratio(num: str, den: str, field: str) -> Callable[[Sequence[Trial]], Measured]:
    """Median over passes of ``num``'s rate ``field`` (GB/s) / ``den``'s in the same pass, [min, max]; the note
    names both medians."""

    def measure(rows: Sequence[Trial]) -> Measured:
        pairs = _rate_pairs(rows, num, den, field)
        if not pairs:
            return not_measured(f"no pass measured both {num} and {den} ({field})")
        return median_range([a / b for a, b in pairs],
                            f"{num} median {float(np.median([a for a, _ in pairs])):.3g} GB/s, {den} "
                            f"{float(np.median([b for _, b in pairs])):.3g} GB/s")
    return measure


def bytes_ratio(num: str, den: str) -> Callable[[Sequence[Trial]], Measured]:
    def measure(rows: Sequence[Trial]) -> Measured:
        pairs = _pairs(rows, num, den, "bytes_moved")  # type: ignore[arg-type]
        return median_range([a / b for a, b in pairs if b > 0]) if pairs else not_measured(f"no {num}/{den} pass")
    return measure


def pixel_ratio_over_n(rows: Sequence[Trial]) -> Measured:
    """(centralized pixel bytes / knittrans-ray pixel bytes) / n per pass; the value farthest from 1 decides."""
    mm = [r for r in rows if getattr(r, "group_size", None) is not None]  # multimodal rows (MMTransferTrial)
    by = {(r.pass_index, r.system): r for r in mm}
    vals = []
    for p in sorted({r.pass_index for r in mm}):
        c, k = by.get((p, "centralized")), by.get((p, "knittrans-ray"))
        if c is not None and k is not None and k.pixel_bytes > 0:
            vals.append(c.pixel_bytes / k.pixel_bytes / k.group_size)
    if not vals:
        return not_measured("no pass measured both centralized and knittrans-ray pixel bytes")
    worst = max(vals, key=lambda v: abs(v - 1.0))
    return Measured(worst, min(vals), max(vals), len(vals), "min-max",
                    f"n={mm[0].group_size}; per pass: {', '.join(f'{v:.4g}' for v in vals)}")


def live_bytes_after(rows: Sequence[Trial]) -> Measured:
    vals = [r.live_bytes_after for r in rows if getattr(r, "live_bytes_after", None) is not None]
    if not vals:
        return not_measured("no KnitTrans pass recorded what its units held")
    return Measured(float(max(vals)), float(min(vals)), float(max(vals)), len(vals), "min-max",
                    "the most any KnitTrans pass left behind")


def memcpy_fraction(system: str, field: str) -> Callable[[Sequence[Trial]], Measured]:
    """Per pass, ``system``'s ``field`` (GB/s) / the run's single-thread memcpy GB/s; median over passes,
    [min, max]. The note gives both medians in GB/s."""

    def measure(rows: Sequence[Trial]) -> Measured:
        mine = [r for r in rows if getattr(r, "system", None) == system and _num(getattr(r, field, None))
                and getattr(r, "memcpy_gbps", 0) > 0]
        if not mine:
            return not_measured(f"no raw pass of {system} measured {field}")
        gb = float(np.median([getattr(r, field) for r in mine]))
        mc = float(np.median([r.memcpy_gbps for r in mine]))  # type: ignore[attr-defined]
        prof = get_profile(mine, system) if field == "get_gbps" else ""
        return median_range([getattr(r, field) / r.memcpy_gbps for r in mine],  # type: ignore[attr-defined]
                            f"{system} median {gb:.3g} GB/s, memcpy {mc:.3g} GB/s" + (f"; {prof}" if prof else ""))
    return measure


def ceiling_fraction(system: str, ceiling: str = CEILING_SYSTEM) -> Callable[[Sequence[Trial]], Measured]:
    """Per pass, ``system``'s get bandwidth / the ceiling's in the same pass (``engine-ceiling``: refs handed over,
    one ``ray.get``, one pack of the same objects; ``inproc-ceiling``: the same in process); median, [min, max]; the
    note names the ceiling's median and ``system``'s get profile."""

    def measure(rows: Sequence[Trial]) -> Measured:
        pairs = _rate_pairs(rows, system, ceiling, "get_gbps")
        if not pairs:
            return not_measured(f"no pass measured both {system}'s and {ceiling}'s get bandwidth")
        prof, med = get_profile(rows, system), float(np.median([b for _, b in pairs]))
        return median_range([a / b for a, b in pairs],
                            f"{ceiling} median {med:.3g} GB/s" + (f"; {prof}" if prof else ""))
    return measure


def get_profile(rows: Sequence[Trial], system: str) -> str:
    """Where ``system``'s gets spent their time, from the same passes' rows (medians over passes of each part's
    share of the gets' summed time): the profile a missed bandwidth goal is read against. "" where no row
    recorded the parts."""
    mine = [r for r in rows if getattr(r, "system", None) == system and all(
        _num(getattr(r, f, None)) is not None for f in ("claim_s", "read_s", "pack_s"))]
    shares = [(r.claim_s, r.read_s, r.pack_s) for r in mine  # type: ignore[attr-defined]
              if r.claim_s + r.read_s + r.pack_s > 0]  # type: ignore[attr-defined]
    if not shares:
        return ""
    med = [float(np.median([p[i] / sum(p) for p in shares])) for i in range(3)]
    out = (f"{system}'s gets (profile, same passes): claim {med[0]:.0%}, unit reads {med[1]:.0%}, "
           f"pack {med[2]:.0%} of their time")
    # The pack alone: its bytes over its own time (what the gets would reach with free claims and reads), and how
    # much of that time the packing thread was on a CPU (the rest: waiting for a core or the GIL).
    alone = [r.get_gbps * (r.claim_s + r.read_s + r.pack_s) / r.pack_s / r.memcpy_gbps  # type: ignore[attr-defined]
             for r in mine if _num(getattr(r, "get_gbps", None)) is not None  # type: ignore[attr-defined]
             and r.pack_s > 0]  # type: ignore[attr-defined]
    on_cpu = [r.pack_cpu_s / r.pack_s for r in mine  # type: ignore[attr-defined]
              if _num(getattr(r, "pack_cpu_s", None)) is not None and r.pack_s > 0]  # type: ignore[attr-defined]
    if alone:
        out += f"; the pack alone moves {float(np.median(alone)):.2g} of memcpy"
        if on_cpu:
            out += f", on a CPU {float(np.median(on_cpu)):.0%} of its time (the rest waiting for a core or the GIL)"
    return out


def tq_get_ratio(system: str) -> Callable[[Sequence[Trial]], Measured]:
    """TransferQueue's mean get latency / ``system``'s, per pass, with ``system``'s get profile in the note."""

    def measure(rows: Sequence[Trial]) -> Measured:
        if not any(r.system == "transferqueue" for r in rows):  # type: ignore[attr-defined]
            return not_measured("TransferQueue is not installed (pip install transferqueue): not run")
        m = ratio("transferqueue", system, "get_s")(rows)
        prof = get_profile(rows, system)
        return dataclasses.replace(m, note=f"{m.note}; {prof}" if m.note and prof else m.note or prof)
    return measure


get_latency_ratio = tq_get_ratio("knittrans-ray")


def exposed_ms(system: str) -> Callable[[Sequence[Trial]], Measured]:
    """``system``'s exposed transfer latency per batch in ms, median over passes, [min, max]."""

    def measure(rows: Sequence[Trial]) -> Measured:
        vals = [r.exposed_s * 1e3 for r in rows if getattr(r, "system", None) == system  # type: ignore[attr-defined]
                and _num(getattr(r, "exposed_s", None)) is not None]
        return median_range(vals, f"{system}, summed over a batch's M mini-batches")
    return measure


def exposed_fraction(system: str) -> Callable[[Sequence[Trial]], Measured]:
    """``system``'s exposed latency per batch over the batch's emulated training (M x one step), per pass."""

    def measure(rows: Sequence[Trial]) -> Measured:
        mine = [r for r in rows if getattr(r, "system", None) == system and _num(getattr(r, "exposed_s", None))
                is not None and getattr(r, "compute_s", None) and getattr(r, "num_minibatches", None)]
        if not mine:
            return not_measured(f"no steady pass of {system} logged its step (compute_s, num_minibatches)")
        r0 = mine[0]
        return median_range([r.exposed_s / (r.num_minibatches * r.compute_s) for r in mine],  # type: ignore
                            f"{system}: exposed per batch / (M={r0.num_minibatches} x {r0.compute_s:g} s emulated "
                            "step)")
    return measure
