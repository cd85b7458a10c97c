"""Hold off a VM's free page reporting while the tables run: a cost of the VM, not of the systems measured.

A KVM guest with virtio-balloon free page reporting (this project's Firecracker machines: ``page_reporting``'s
``min_free_ms`` is 0) hands pages back to the host as soon as they are free; memory allocated again after that
faults in at the host as well, and zeroing it is 4-10x slower: filling 256 MB freed 2 s earlier took 119-352 ms
against 32 ms for memory freed < 0.1 s earlier (docs/experiments.md, session 43). Which pass of which system lands
on reported memory is chance -- the centralized multimodal baseline, which allocates ~250 MB afresh per pass, had
4-7x slow passes that decided ``mm_transfer_latency_ratio``'s median -- so the tables would measure the VM.
Raising ``min_free_ms`` for the run keeps memory freed and reused within that time from being reported: the
allocation cost every system pays on bare metal. Where the parameter is absent (bare metal, other kernels) or cannot
be written, nothing changes and the run says so.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator

MIN_FREE_MS = Path("/sys/module/page_reporting/parameters/min_free_ms")
HOLD_MS = 60_000
"""How long a page must stay free before the guest reports it, during the run (the largest value that kernel
accepts; a table's passes reuse what they free within seconds)."""


@contextlib.contextmanager
def page_reporting_held(hold_ms: int = HOLD_MS, param: Path = MIN_FREE_MS) -> Iterator[str]:
    """Raise ``param`` to ``hold_ms`` for the block, restore it after; yields one line on what was done."""
    try:
        old = param.read_text().strip()
        if old == str(hold_ms):  # held already (another run): that run restores it, not this one
            yield f"free page reporting held already: {param.name} {old}"
            return
        param.write_text(str(hold_ms))
    except OSError as e:
        yield f"free page reporting not held ({param}: {e.strerror or type(e).__name__})"
        return
    try:
        yield f"free page reporting held: {param.name} {old} -> {hold_ms} for the run"
    finally:
        try:
            param.write_text(old)
        except OSError:
            pass
