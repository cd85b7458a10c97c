"""K repeated, interleaved passes: within pass p every system runs once (steady pass, then raw pass), in an order
rotated by p so that no system always runs first or last; timing claims are then decided on the median over the
passes of a within-pass ratio (the systems of one pass share the machine's state), reported with [min, max].

    >>> class Sys:
    ...     def __init__(self, name): self.name, self.seen = name, []
    ...     def run_steady(self, batches, ipt):
    ...         self.seen.append(list(batches)); return PassResult(PassKind.STEADY)
    ...     def run_raw(self, batch): self.seen.append(batch); return PassResult(PassKind.RAW)
    ...     def close(self): pass
    >>> a, b = Sys("a"), Sys("b")
    >>> recs = interleaved_passes([a, b], passes=2, make_batch=lambda uid, slot: (uid, slot), num_batches=2,
    ...                           iters_per_token=0.0, warmup=False)
    >>> [(r.pass_index, r.system) for r in recs]
    [(0, 'a'), (0, 'b'), (1, 'b'), (1, 'a')]
    >>> a.seen
    [[(0, 0), (1, 1)], (2, 2), [(9, 0), (10, 1)], (11, 2)]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from knittrans.bench.loop import median_raw
from knittrans.bench.types import PassData, PassKind, PassResult, TransferSystem


@dataclass(frozen=True)
class PassRecord:
    """One system's share of one pass: its steady and raw results (None where that pass kind was not run)."""

    pass_index: int
    system: str
    steady: PassResult | None
    raw: PassResult | None


def interleaved_passes(systems: Sequence[TransferSystem], passes: int, make_batch: Callable[[int, int], PassData],
                       num_batches: int, iters_per_token: float | Mapping[str, float], raw: bool = True,
                       steady: bool = True, warmup: bool = True, raw_repeats: int = 1,
                       progress: Callable[[str], None] | None = None,
                       settle: Callable[[], object] | None = None,
                       repeat_below_s: float | None = None) -> list[PassRecord]:
    """Run ``passes`` interleaved passes (see the module docstring). ``make_batch(uid, slot)``: a batch under
    fresh ids (``uid`` runs over every batch of the run) whose content depends on ``slot`` only (its position in
    the system's pass: 0..N-1 steady, N raw), so every system of a pass moves the same content at the same slot.
    ``iters_per_token`` may differ per system name (each system charged its own measured training step).
    ``warmup``: before pass 0 every system moves one batch unrecorded (a raw pass): the first touch of fresh
    memory -- the driver's dense batch, object-store pages, a new handoff's actors -- is not charged to whichever
    system happens to run first. ``raw_repeats``: raw passes per system per pass (the median of their times
    counts: ``loop.median_raw``), each over a fresh batch of the same content. ``repeat_below_s``: a system whose
    first raw pass of a pass took at least this long runs no more in that pass (one sample of a window of seconds is
    not at the mercy of the millisecond noise the repeats average out; verl's 3-10 s raw passes would add minutes).
    ``settle``: called before every timed pass of every system, outside its window (``RaySession.settle``: the
    processes' heaps collected and frozen), so that no system's pass pays for the garbage another system left."""
    if passes < 1 or not systems:
        raise ValueError(f"interleaved_passes needs passes >= 1 and at least one system, got {passes}, {systems}")
    out: list[PassRecord] = []
    counter = 0

    def fresh(slots: range) -> list[PassData]:
        nonlocal counter
        batches = [make_batch(counter + i, slot) for i, slot in enumerate(slots)]
        counter += len(slots)
        return batches

    def timed(run: Callable[[], PassResult]) -> PassResult:
        if settle is not None:
            settle()
        return run()

    if warmup:
        for s in systems:
            if progress is not None:
                progress(f"warm-up {s.name}")
            s.run_raw(fresh(range(num_batches, num_batches + 1))[0])
    for p in range(passes):
        order = list(systems[p % len(systems):]) + list(systems[:p % len(systems)])
        for s in order:
            ipt = iters_per_token[s.name] if isinstance(iters_per_token, Mapping) else iters_per_token
            if progress is not None:
                progress(f"pass {p + 1}/{passes} {s.name}")
            st = timed(lambda: s.run_steady(fresh(range(num_batches)), ipt)) if steady else None
            rw = None
            if raw:
                raws: list[PassResult] = []
                while len(raws) < raw_repeats and (not raws or repeat_below_s is None
                                                   or raws[0].raw_s < repeat_below_s):
                    raws.append(timed(lambda: s.run_raw(fresh(range(num_batches, num_batches + 1))[0])))
                rw = median_raw(raws)
            for r, kind in ((st, PassKind.STEADY), (rw, PassKind.RAW)):
                if r is not None and r.kind is not kind:
                    raise TypeError(f"{s.name} returned a {r.kind.value} result for a {kind.value} pass")
            out.append(PassRecord(p, s.name, st, rw))
    return out
