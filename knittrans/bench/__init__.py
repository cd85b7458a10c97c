"""The transfer benchmark as library code: the systems the transfer and speedup tables compare, behind one protocol.

- ``types``: ``TransferSystem`` (``run_steady`` / ``run_raw`` / ``close``), ``PassData`` (one batch under fresh
  ids), ``PassResult``, ``BenchLayout`` (ranks, units, rollout clock), ``StepSource`` (a rank's step data).
- ``loop``: the trainer rank's loop (obtain -> emulated compute -> release) and the rollout clock.
- ``knittrans_system``: ``KnitTransSystem``, the ``knittrans.Handoff`` a user imports, in-process or on Ray, text
  or multimodal.
- ``ray_ranks``: ``RankActor`` / ``SignalActor`` / ``RaySession`` (imported lazily: needs Ray).
- ``passes``: K interleaved passes over several systems.
- ``mm_train``: the speedup table's training step, baseline (every image occurrence encoded) vs dedup, on the
  share the multimodal handoff delivers.

The baselines implement the same protocol in ``baselines/`` (``centralized_system``, ``transferqueue_system``);
the measurement primitives are ``knittrans.dataplane.harness``. Tables: ``repro/transfer.py``,
``repro/speedup.py``; see docs/dataplane.md and docs/mmdedup.md.
"""

from knittrans.bench.knittrans_system import ConsumerSource, KnitTransSystem
from knittrans.bench.loop import complete_key, completion_times, finish_raw, finish_steady, rank_loop, step_key
from knittrans.bench.passes import PassRecord, interleaved_passes
from knittrans.bench.types import (COMPLETION_FIELDS, BenchLayout, ClusterPlacement, Obtained, PassData, PassKind,
                                   PassResult, StepSource, TransferSystem)

__all__ = [
    "BenchLayout", "COMPLETION_FIELDS", "ClusterPlacement", "ConsumerSource", "KnitTransSystem", "Obtained",
    "PassData", "PassKind", "PassRecord", "PassResult", "StepSource", "TransferSystem", "complete_key",
    "completion_times", "finish_raw", "finish_steady", "interleaved_passes", "rank_loop", "step_key",
]
