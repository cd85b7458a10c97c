"""Keep the cyclic garbage collector's full passes off the handoff's critical path.

An actor process of the data plane (a storage unit, the controller, its journal) or a trainer rank imports numpy,
torch and Ray: ~200k long-lived Python objects before it serves its first call. CPython's full (generation-2)
collection walks every tracked object, and a burst of allocations -- a put of a few hundred trajectories, a
share's unpickling -- triggers one: on a loaded 2-core machine these took 150-490 ms each, landing in the middle
of a completing put or a journal flush (the multimodal raw pass went from ~0.13 s to ~0.3 s in about one pass in
three; ``docs/experiments.md``, session 22). ``freeze_startup_heap`` moves everything alive at the end of an actor's
constructor into the permanent generation (``gc.freeze``), so later full passes walk only what the process
allocated since: the data it holds, which reference counting frees anyway. This is what long-running Python
servers do after start-up (vLLM's engine after its warm-up, Instagram's pre-fork servers); collection itself is
not disabled, so cycles created later are still found.
"""

from __future__ import annotations

import gc


def freeze_startup_heap() -> int:
    """Collect once, then exempt every object alive now from later collections. Returns how many objects were
    frozen (``gc.get_freeze_count``). Idempotent; call it at the end of a long-lived process's set-up."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
