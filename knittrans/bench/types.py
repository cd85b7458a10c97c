"""The transfer benchmark's vocabulary: one pass's data, what a rank records per step, what a system returns.

A **pass** trains ``N`` consecutive batches (the steady state of an RL loop) or moves one batch without compute
(the raw pass). Every system -- KnitTrans on either transport, the verl-style centralized driver, TransferQueue --
implements ``TransferSystem`` over the same ``PassData``, the same trainer ranks and the same emulated compute, so
a table changes one thing between its rows: the system.

Time origin: ``t0[b]`` is the moment every trajectory of batch b is complete. Fields a rollout engine streams while
it generates (``input_ids``, ``old_logprobs``, ``loss_mask``, a multimodal prompt's images) are written before t0
by every system; what only exists at completion (``COMPLETION_FIELDS``: the GRPO advantages, which need the whole
group's rewards) arrives at t0 with the trajectory's admission metadata.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum
from typing import Mapping, Protocol, Sequence

import numpy as np

from knittrans.dataplane.types import TrajectoryPayload
from knittrans.handoff import Rollout
from knittrans.types import BatchPlan, MiniBatch

COMPLETION_FIELDS = ("advantages",)
"""Fields that exist only once the trajectory's group is complete (advantages need every sample's reward)."""


def streamed_payload(r: Rollout, multimodal: bool) -> TrajectoryPayload:
    """What a rollout engine writes while it generates, before its trajectory completes: every field but the
    completion fields, and a multimodal prompt's images."""
    fields = {k: v for k, v in r.tensors.items() if k not in COMPLETION_FIELDS}
    if not multimodal:
        return TrajectoryPayload(r.traj.traj_id, fields)
    from knittrans.mmdedup.plane import MMPayload

    return MMPayload(r.traj.traj_id, fields, group=r.traj.group_id, encodings=r.images, grids=r.grids)


@dataclass(frozen=True)
class ClusterPlacement:
    """Where the pieces run on a multi-node Ray cluster, as Ray node ids (``knittrans.bench.cluster``): the
    driver (the centralized driver gathers, builds and scatters there), one rollout node per storage unit /
    producer, one node per trainer rank, and the controller (default: the driver's node). Every byte between two
    of them crosses Ray's object transfer."""

    driver_node: str
    unit_nodes: tuple[str, ...]
    rank_nodes: tuple[str, ...]
    controller_node: str | None = None

    def __post_init__(self) -> None:
        if not self.unit_nodes or not self.rank_nodes:
            raise ValueError(f"ClusterPlacement needs at least one unit node and one rank node, got {self}")

    @property
    def controller(self) -> str:
        return self.controller_node or self.driver_node


@dataclass(frozen=True)
class BenchLayout:
    """Where the pieces sit and how the rollout clock runs, shared by every system of a table."""

    num_ranks: int = 2
    """Trainer (data-parallel) ranks."""
    num_units: int = 2
    """Storage units, one per rollout node; rank r and producer u sit on node ``r % num_units`` / ``u``."""
    lead_steps: int = 1
    """Batch b+1 completes when rank 0 starts step ``M - lead_steps`` of batch b (1: during its last step)."""
    warmup_batches: int = 1
    """Leading batches of a steady pass left out of its exposed numbers (the trainer starts idle)."""
    prefetch_depth: int = 2
    """Shares a KnitTrans rank prepares ahead (``HandoffConfig``'s default)."""
    placement: ClusterPlacement | None = None
    """A multi-node cluster: units, ranks, controller and driver pinned to these Ray nodes (units on their own
    rollout nodes, ranks on their own trainer nodes). None: logical node labels on one Ray node (unit u on
    ``node{u}``, rank r on ``node{r % num_units}``)."""

    def __post_init__(self) -> None:
        for name in ("num_ranks", "num_units", "lead_steps", "prefetch_depth"):
            if getattr(self, name) < 1:
                raise ValueError(f"BenchLayout.{name} must be >= 1, got {getattr(self, name)}")
        if self.warmup_batches < 0:
            raise ValueError(f"BenchLayout.warmup_batches must be >= 0, got {self.warmup_batches}")
        p = self.placement
        if p is not None and (len(p.unit_nodes) != self.num_units or len(p.rank_nodes) != self.num_ranks):
            raise ValueError(f"BenchLayout.placement places {len(p.unit_nodes)} units and {len(p.rank_nodes)} ranks; "
                             f"the layout has num_units={self.num_units}, num_ranks={self.num_ranks}")

    def check(self, num_batches: int, num_minibatches: int) -> None:
        """A steady pass must keep at least one measured batch, and the lead must fall inside a batch."""
        if num_batches <= self.warmup_batches:
            raise ValueError(f"num_batches ({num_batches}) must exceed warmup_batches ({self.warmup_batches})")
        if not 1 <= self.lead_steps <= num_minibatches:
            raise ValueError(f"lead_steps must be in [1, num_minibatches={num_minibatches}], got {self.lead_steps}")

    @property
    def unit_nodes(self) -> dict[str, str]:
        if self.placement is not None:
            return {f"unit{u}": n for u, n in enumerate(self.placement.unit_nodes)}
        return {f"unit{u}": f"node{u}" for u in range(self.num_units)}

    @property
    def rank_nodes(self) -> tuple[str, ...]:
        if self.placement is not None:
            return self.placement.rank_nodes
        return tuple(f"node{r % self.num_units}" for r in range(self.num_ranks))

    def unit(self, producer: int) -> str:
        return f"unit{producer % self.num_units}"


@dataclass(frozen=True)
class PassData:
    """One training batch under fresh ids (data is consumed exactly once): what the producers hand over
    (``rollouts``, each with its admission metadata), the batch plan, and what the centralized driver needs (the
    train-batch split into whole-group mini-batches, the prompt batch, and per group its images)."""

    batch_id: int
    plan: BatchPlan
    rollouts: tuple[Rollout, ...]
    producer_of: Mapping[int, int]
    """Trajectory -> the rollout engine (producer) that generated it; it writes to ``layout.unit(producer)``."""
    minibatches: tuple[MiniBatch, ...]
    """Train-batch admission's split: M mini-batches of whole groups in group order."""
    prompts: tuple[np.ndarray, ...]
    """Prompt ids per group index (what verl's driver holds from its dataloader)."""
    prompt_of: Mapping[int, int]
    """Trajectory -> its group's index in ``prompts``."""
    group_size: int
    max_response_len: int
    images: Mapping[int, tuple[np.ndarray, ...]] = field(default_factory=dict)
    """Multimodal: group index -> its prompt's pixel_values (one array per image; empty for text)."""
    grids: Mapping[int, tuple[tuple[int, int, int], ...]] = field(default_factory=dict)

    @property
    def multimodal(self) -> bool:
        return bool(self.images)

    @property
    def num_minibatches(self) -> int:
        return len(self.minibatches)

    @property
    def tokens(self) -> dict[int, int]:
        """Trajectory -> prompt + response tokens (its ``input_ids`` length)."""
        return {r.traj.traj_id: int(r.tensors["input_ids"].shape[0]) for r in self.rollouts}

    def payloads(self) -> list[TrajectoryPayload]:
        """The token fields of every trajectory (what rollout workers return to verl's driver)."""
        return [TrajectoryPayload(r.traj.traj_id, dict(r.tensors)) for r in self.rollouts]

    @property
    def field_nbytes(self) -> int:
        return sum(int(a.nbytes) for r in self.rollouts for a in r.tensors.values())

    @property
    def distinct_pixel_nbytes(self) -> int:
        return sum(int(a.nbytes) for ims in self.images.values() for a in ims)

    @property
    def occurrence_pixel_nbytes(self) -> int:
        """Pixel bytes with one copy per sample (what verl's repeated batch carries)."""
        return self.distinct_pixel_nbytes * self.group_size

    @property
    def nbytes(self) -> int:
        """Fields plus each distinct image once."""
        return self.field_nbytes + self.distinct_pixel_nbytes


@dataclass(frozen=True)
class Obtained:
    """What a rank got for one step: payload bytes (``pixel_nbytes`` of them pixel_values), the tokens its
    compute is charged for, and how long the get itself took (claim + read + pack; 0 for data that arrived as
    a call argument)."""

    nbytes: int
    tokens: int
    get_s: float
    pixel_nbytes: int = 0
    parts: tuple[float, ...] = ()
    """Where ``get_s`` went, (claim, read, pack, pack CPU) seconds (``client.FetchTiming``); () where not
    recorded."""


class StepSource(Protocol):
    """Where a trainer rank's step data comes from (a KnitTrans consumer, a scattered chunk, TransferQueue).
    Built by the driver, shipped to the rank (picklable), opened in the rank's process."""

    def open(self, rank: int) -> None: ...
    def obtain(self, step: int) -> Obtained: ...
    def release(self, step: int) -> None: ...
    def close(self) -> None: ...


class PassKind(str, Enum):
    STEADY = "steady"
    """``N`` consecutive batches with compute; batch b+1 completes while batch b trains."""
    RAW = "raw"
    """One batch, no compute: t0 -> every rank holds every share (with no compute to hide behind, a prefetcher
    earns no overlap credit)."""


@dataclass(frozen=True)
class PassResult:
    """One pass of one system. Steady: ``exposed[j][k]`` = the slowest rank's exposed latency of mini-batch k of
    the j-th measured batch. Raw: ``raw_s``. Bytes are per batch (the last batch of the pass)."""

    kind: PassKind
    exposed: tuple[tuple[float, ...], ...] = ()
    raw_s: float = math.nan
    get_s: tuple[float, ...] = ()
    get_nbytes: tuple[int, ...] = ()
    """Raw pass: the payload bytes of each get in ``get_s`` (same order); () where not recorded."""
    get_parts: tuple[tuple[float, ...], ...] = ()
    """Raw pass: each get's (claim, read, pack, pack CPU) seconds, same order as ``get_s``, where the system
    records them (KnitTrans: ``client.FetchTiming``); () otherwise. The profile behind a missed bandwidth goal."""
    bytes_moved: int = 0
    rank_gbps: tuple[float, ...] = ()
    """Raw pass: per rank, the bytes it received over the time from t0 (or its first ask, if later: a drain's ranks
    start after t0) to its last share, GB/s: what one rank's stream moves end to end."""
    pixel_nbytes: int = 0
    """Multimodal: pixel_values bytes delivered to the ranks per batch (KnitTrans: each distinct image once per
    share; centralized: every occurrence)."""
    live_bytes_after: int | None = None
    """KnitTrans multimodal: encoding bytes the units still held once the pass was consumed and every drop
    confirmed (0: refcounts back to zero); None where it does not apply."""
    trace: tuple = ()
    """A raw pass of a system built with ``trace=True``: its ``knittrans.dataplane.trace`` events (flows between
    nodes and the CPU work around them), node names resolved to Ray node ids; () otherwise."""
    t0: float | None = None
    """The pass's time origin (``perf_counter``), for reading ``trace``."""

    @property
    def exposed_per_batch(self) -> tuple[float, ...]:
        return tuple(sum(row) for row in self.exposed)

    @property
    def mean_exposed_s(self) -> float:
        """Exposed latency per batch (summed over its mini-batches), averaged over the measured batches."""
        per = self.exposed_per_batch
        return sum(per) / len(per) if per else math.nan

    @property
    def mean_get_s(self) -> float:
        return sum(self.get_s) / len(self.get_s) if self.get_s else math.nan

    @property
    def slowest_rank_gbps(self) -> float:
        """Raw pass: the slowest rank's bytes over its own t0 -> its last share, GB/s (NaN where not recorded)."""
        return min(self.rank_gbps) if self.rank_gbps else math.nan

    @property
    def get_gbps(self) -> float:
        """Get bandwidth of one rank's stream, GB/s (1e9 B/s): the bytes its gets delivered over the time they
        took (claim + read + pack, summed; the ranks' streams run side by side, so this is what one rank sees, the
        quantity single-thread memcpy bounds). NaN unless every get was timed (a share handed over as a call
        argument has no get: centralized ranks)."""
        if not self.get_s or len(self.get_nbytes) != len(self.get_s) or min(self.get_s) <= 0:
            return math.nan
        return sum(self.get_nbytes) / sum(self.get_s) / 1e9


class TransferSystem(Protocol):
    """One way of handing trajectories from rollout to the trainer ranks, measured pass by pass."""

    name: str

    def run_steady(self, batches: Sequence[PassData], iters_per_token: float) -> PassResult:
        """Train ``batches`` back to back with ``iters_per_token`` of emulated compute per token per step."""
        ...

    def run_raw(self, batch: PassData) -> PassResult:
        """Move one batch to the ranks without compute."""
        ...

    def close(self) -> None: ...
