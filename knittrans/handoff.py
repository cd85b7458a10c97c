"""The handoff: the whole rollout-to-trainer path as one object a user imports into an RL stack.

``Handoff`` composes the three mechanisms behind one typed config (``HandoffConfig``):

- **rollout side**: ``producer(unit).put(rollouts)`` writes each finished trajectory's tensors to the storage
  unit on the producer's node (multimodal: its images, stored once per distinct content);
- **admission**: the controller runs the admission policy (KnitTrans's by default) as trajectories complete and
  admits each mini-batch the moment it is safe, split into per-rank shares (local first, tokens balanced);
- **trainer side**: ``consumer(rank)`` iterates that rank's shares of admitted mini-batches in order, prefetched
  (mini-batch k+1 is claimed, read and packed while k computes) and packed into ready-to-use tensors (varlen
  ``cu_seqlens`` layout; multimodal: the distinct images plus the per-sample index map); ``ack(share)`` after
  the optimizer step, so a rank that crashes before it gets the share again (nothing lost by default);
- **versions**: the ``seq``-th admitted mini-batch is trained at policy version ``seq`` (``share.seq`` is its
  ``v_train``); ``version`` counts steps every rank acknowledged; ``records()`` has every trajectory's ``v_gen``,
  ``v_train`` and times, and ``staleness()`` their statistics.

Transports: in-process (the default: controller and units are objects of this process, zero-copy) and Ray
(controller and units are actors; ``producer``/``consumer`` handles pickle into other processes or nodes) --
the same API. Example (runs as written; a GRPO step would replace the comment)::

    >>> import numpy as np
    >>> from knittrans.handoff import Handoff, HandoffConfig, Rollout
    >>> from knittrans.types import BatchPlan, GroupSpec, Trajectory
    >>> h = Handoff(HandoffConfig.grpo(prompts_per_batch=2, group_size=2, num_minibatches=2, max_response_len=8))
    >>> h.add_batch(BatchPlan(0, (GroupSpec(0, 0, 2), GroupSpec(1, 0, 2))))
    >>> h.seal()                                   # no more batches: the consumer's iteration ends after this one
    >>> def rollout(t: int) -> Rollout:            # prompt of 3 tokens, response of 2, behaviour log-probs ...
    ...     return Rollout(Trajectory(traj_id=t, group_id=t // 2, batch_id=0, num_tokens=2, v_gen=0),
    ...                    {"input_ids": np.arange(5), "old_logprobs": np.full(2, -1.0, np.float32),
    ...                     "advantages": np.ones(2, np.float32), "loss_mask": np.ones(2, bool)})
    >>> h.producer().put([rollout(t) for t in range(4)])
    >>> trainer = h.consumer(rank=0)
    >>> for share in trainer:                      # loss = grpo_loss(share["input_ids"], ...); step()
    ...     trainer.ack(share)                     # after the optimizer step
    ...     print(share.seq, share.traj_ids, share["input_ids"].shape[0])
    0 (0, 1) 10
    1 (2, 3) 10
    >>> h.version, h.staleness().mean
    (2, 0.5)
    >>> h.close()
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Iterator, Mapping, Protocol, Sequence

import numpy as np

from knittrans.admission.base import AdmissionPolicy
from knittrans.admission.minibatch import KnitTransAdmission
from knittrans.constraints import BatchConstraints
from knittrans.dataplane.client import DataPlaneClient, PrepareConfig
from knittrans.dataplane.controller import ControllerStats, HandoffRecord
from knittrans.dataplane.prefetch import PrefetchConfig, Prefetcher
from knittrans.dataplane.storage import UnitStats
from knittrans.dataplane.types import TEXT_SCHEMA, PackedShare, TrajectoryPayload, TrajectorySchema
from knittrans.staleness import StalenessStats
from knittrans.types import BatchPlan, Trajectory

if TYPE_CHECKING:
    import torch


class Transport(str, Enum):
    """How the handoff's controller, units and clients talk."""

    INPROCESS = "inprocess"
    """Controller and units are objects of this process; producers and ranks are threads (zero-copy)."""
    RAY = "ray"
    """Controller and units are Ray actors (pinned to their node when the node is a Ray node id); handles pickle
    into producer and trainer processes. ``ray.init`` must have run."""


class DataPlane(Protocol):
    """What both transports provide (``InProcessDataPlane``, ``RayDataPlane`` and their multimodal variants)."""

    schema: TrajectorySchema

    def client(self, local_unit: str | None = None) -> DataPlaneClient: ...
    def unit_stats(self) -> list[UnitStats]: ...
    def controller_stats(self) -> ControllerStats: ...
    def wait_drained(self, timeout: float | None = None) -> int: ...
    def close(self) -> None: ...


@dataclass(frozen=True)
class HandoffConfig:
    """Everything a handoff is built from."""

    constraints: BatchConstraints
    """The batch constraints (B, M, whole groups, token budget ...) admission keeps."""
    transport: Transport = Transport.INPROCESS
    """In-process or Ray; the API is the same."""
    units: tuple[tuple[str, str], ...] = (("u0", "n0"),)
    """Storage units as (unit id, node): one per rollout node; producers put to the unit on their node."""
    rank_nodes: tuple[str, ...] = ("n0",)
    """Node of each trainer rank (``len`` = data-parallel ranks); a rank reads units on its node locally."""
    multimodal: bool = False
    """Multimodal trajectories: images stored and moved once per distinct content; shares carry the distinct
    images and the per-sample index map (``knittrans.mmdedup``)."""
    dedup: bool = True
    """Multimodal only: store and move each distinct image once. False is the plain twin (every occurrence
    stored and moved: what the same plane costs without deduplication)."""
    schema: TrajectorySchema | None = None
    """Per-trajectory fields; None: ``TEXT_SCHEMA`` (``MM_SCHEMA`` when multimodal)."""
    prefetch_depth: int = 2
    """Shares a rank prepares ahead of its trainer."""
    checksums: bool = False
    """A CRC-32 per field travels with each put and is verified on fetch (corruption is caught, not trained)."""
    prepare: PrepareConfig = field(default_factory=PrepareConfig)
    """Casts and pinning of fetched shares."""
    admit_timeout_s: float | None = None
    """A consumer waiting this long for its next mini-batch raises ``TimeoutError`` (None: until closed/sealed)."""
    balance_slack: float = 0.05
    """Share assignment: locality yields once a rank exceeds ``(1 + slack)`` x its ideal tokens."""
    read_timeout_s: float | None = 300.0
    """Deadline of a rank's reads of one share from its storage units, on both transports: a unit hung in ``get``
    raises ``ReadTimeoutError`` (the claim is undone, a retry gets the share) instead of blocking the trainer.
    None: no deadline (in process, reads then run on the rank's own thread)."""
    controller_node: str | None = None
    """Ray transport: the node of the controller actor (a Ray node id pins it there; None: Ray places it)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "transport", Transport(self.transport))
        if not isinstance(self.constraints, BatchConstraints):
            raise TypeError(f"HandoffConfig.constraints must be a BatchConstraints, got {self.constraints!r}")
        if not self.units or len({u for u, _ in self.units}) != len(self.units):
            raise ValueError(f"HandoffConfig.units must name at least one unit, each once: {self.units}")
        if not self.rank_nodes:
            raise ValueError("HandoffConfig.rank_nodes must list at least one trainer rank")
        if self.prefetch_depth < 1:
            raise ValueError(f"HandoffConfig.prefetch_depth must be >= 1, got {self.prefetch_depth}")
        t = self.read_timeout_s
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0 or t == float("inf")):
            raise ValueError(f"HandoffConfig.read_timeout_s must be a finite number of seconds > 0, or None (no "
                             f"deadline), got {t!r}")

    @classmethod
    def grpo(cls, prompts_per_batch: int, group_size: int, num_minibatches: int, max_response_len: int,
             **kw) -> "HandoffConfig":
        """GRPO batches of ``prompts_per_batch`` groups of ``group_size`` samples, whole groups per mini-batch."""
        ck = {k: kw.pop(k) for k in ("size_slack", "whole_groups", "token_budget", "dp_size") if k in kw}
        return cls(BatchConstraints(batch_size=prompts_per_batch * group_size, num_minibatches=num_minibatches,
                                    max_response_len=max_response_len, group_size=group_size, **ck), **kw)

    @property
    def resolved_schema(self) -> TrajectorySchema:
        if self.schema is not None:
            return self.schema
        if self.multimodal:
            from knittrans.mmdedup.plane import MM_SCHEMA

            return MM_SCHEMA
        return TEXT_SCHEMA


@dataclass(frozen=True)
class Rollout:
    """One finished trajectory as a rollout worker hands it over: its admission metadata and its tensors
    (numpy arrays or CPU tensors, per the schema). Multimodal: ``images`` are the ``pixel_values`` of each image it
    shows, in placeholder order, with their ``grid_thw`` (a group's samples pass the same tensors)."""

    traj: Trajectory
    tensors: Mapping[str, "np.ndarray | torch.Tensor"]
    images: tuple["torch.Tensor", ...] = ()
    grids: tuple[tuple[int, int, int], ...] = ()


def _build_plane(cfg: HandoffConfig, policy: AdmissionPolicy) -> DataPlane:
    units, ranks, schema = dict(cfg.units), tuple(cfg.rank_nodes), cfg.resolved_schema
    common = dict(balance_slack=cfg.balance_slack, prepare=cfg.prepare, policy=policy,
                  read_timeout_s=cfg.read_timeout_s)
    if cfg.transport is Transport.INPROCESS:
        if cfg.multimodal:
            from knittrans.mmdedup.plane import build_mm_inprocess

            return build_mm_inprocess(units, ranks, schema, dedup=cfg.dedup, **common)
        from knittrans.dataplane.inprocess import build_inprocess

        return build_inprocess(schema, units, ranks, checksums=cfg.checksums, **common)
    if cfg.multimodal:
        from knittrans.mmdedup.plane_ray import build_mm_ray

        return build_mm_ray(units, ranks, schema, dedup=cfg.dedup, controller_node=cfg.controller_node, **common)
    from knittrans.dataplane.ray_transport import build_ray

    return build_ray(schema, units, ranks, checksums=cfg.checksums, controller_node=cfg.controller_node, **common)


@dataclass
class Producer:
    """A rollout worker's handle: ``put`` writes to ``unit`` (its node's) and completes the trajectories. Picklable
    on the Ray transport (pass it to a rollout actor)."""

    plane: DataPlane
    unit: str
    multimodal: bool

    def __post_init__(self) -> None:
        self._client: DataPlaneClient | None = None

    def __getstate__(self) -> dict:
        return {"plane": self.plane, "unit": self.unit, "multimodal": self.multimodal}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._client = None

    def put(self, rollouts: Sequence[Rollout]) -> None:
        """Store ``rollouts`` and hand them to admission; all or nothing per call (a rejected call changes
        nothing and names the offending trajectory and field)."""
        if self._client is None:
            self._client = self.plane.client(self.unit)
        payloads = [self._payload(r) for r in rollouts]
        self._client.put(payloads)

    def _payload(self, r: Rollout) -> TrajectoryPayload:
        if not isinstance(r, Rollout):
            raise TypeError(f"put takes Rollout messages, got {type(r).__name__}")
        if not self.multimodal:
            if r.images:
                raise ValueError(f"trajectory {r.traj.traj_id} carries images but the handoff is text-only "
                                 f"(HandoffConfig.multimodal=False)")
            return TrajectoryPayload(r.traj.traj_id, dict(r.tensors), meta=r.traj)
        from knittrans.mmdedup.plane import MMPayload

        return MMPayload(r.traj.traj_id, dict(r.tensors), meta=r.traj, group=r.traj.group_id,
                         encodings=tuple(r.images), grids=tuple(tuple(g) for g in r.grids))


@dataclass
class Consumer:
    """Trainer rank ``rank``'s iterator over its shares of admitted mini-batches, in admission order, prefetched;
    ``ack(share)`` after each optimizer step. The iteration ends when the handoff is sealed and its last
    mini-batch was handed out, or when it is closed. Picklable on the Ray transport (the prefetch thread starts
    in the process that iterates). ``count``: stop after that many shares (None: at the end of the stream)."""

    plane: DataPlane
    rank: int
    fields: tuple[str, ...] | None = None
    depth: int = 2
    admit_timeout_s: float | None = None
    start_seq: int = 0
    count: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank < 0:
            raise ValueError(f"Consumer.rank must be an int >= 0, got {self.rank!r}")
        self._client: DataPlaneClient | None = None
        self._prefetcher: Prefetcher | None = None

    def __getstate__(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._client = None
        self._prefetcher = None

    @property
    def client(self) -> DataPlaneClient:
        if self._client is None:
            self._client = self.plane.client()
        return self._client

    def __iter__(self) -> Iterator[PackedShare]:
        if self._prefetcher is None:
            self._prefetcher = Prefetcher(self.client, self.rank, self.fields,
                                          PrefetchConfig(depth=self.depth, admit_timeout_s=self.admit_timeout_s,
                                                         ack_on_fetch=False, ack_on_next=False),
                                          start_seq=self.start_seq,
                                          count=self.count)
        return iter(self._prefetcher)

    def take(self, count: int) -> list[PackedShare]:
        """The next ``count`` shares (fewer if the stream ends), without acking them."""
        out: list[PackedShare] = []
        it = iter(self)
        for _ in range(count):
            try:
                out.append(next(it))
            except StopIteration:
                break
        return out

    def ack(self, share: PackedShare) -> None:
        """This rank has stepped on ``share``: once every rank acked a mini-batch it is released (the version
        advances) and its units drop it."""
        self.client.ack(share)

    @property
    def events(self) -> list:
        """The prefetcher's per-share timings (``knittrans.dataplane.prefetch.PrefetchEvent``)."""
        return [] if self._prefetcher is None else self._prefetcher.events

    def flush(self, timeout: float | None = 60.0) -> None:
        """Wait until this rank's acks reached the controller (on Ray they are sent asynchronously, off the
        trainer's critical path); re-raises the first ack that failed."""
        if self._client is not None:
            self._client.flush_acks(timeout)

    def close(self) -> None:
        """Stop prefetching (shares claimed and not handed out are given back) and send the queued acks
        (re-raises one that failed)."""
        if self._prefetcher is not None:
            self._prefetcher.close()
        if self._client is not None:
            self._client.close()


class Handoff:
    """The rollout-to-trainer handoff (see the module docstring). ``policy``: the admission policy (default
    KnitTrans's, built from ``config.constraints``); baselines (train-batch, greedy ...) pass theirs."""

    def __init__(self, config: HandoffConfig, policy: AdmissionPolicy | None = None) -> None:
        self.config = config
        policy = policy if policy is not None else KnitTransAdmission(config.constraints)
        if policy.constraints != config.constraints:
            raise ValueError(f"the admission policy was built for {policy.constraints}, the handoff for "
                             f"{config.constraints}")
        self.policy_name = policy.name
        self.plane: DataPlane = _build_plane(config, policy)
        self._controller = self.plane.controller
        self._consumers: list[Consumer] = []

    # -- batches -------------------------------------------------------------------------------------------------

    def add_batch(self, plan: BatchPlan) -> None:
        """Announce a training batch (its groups, before any of their trajectories is put)."""
        self._controller.add_batch(plan)

    def seal(self) -> None:
        """No batch will follow the ones announced: consumers stop after the last mini-batch."""
        self._controller.seal()

    # -- rollout and trainer sides -----------------------------------------------------------------------------

    def producer(self, unit: str | None = None) -> Producer:
        """A rollout worker's handle on ``unit`` (default: the first unit)."""
        unit = unit or self.config.units[0][0]
        if unit not in dict(self.config.units):
            raise ValueError(f"unknown storage unit {unit!r}; units: {[u for u, _ in self.config.units]}")
        return Producer(self.plane, unit, self.config.multimodal)

    def put(self, rollouts: Sequence[Rollout], unit: str | None = None) -> None:
        self.producer(unit).put(rollouts)

    def consumer(self, rank: int = 0, fields: Sequence[str] | None = None, start_seq: int = 0,
                 count: int | None = None) -> Consumer:
        """Trainer rank ``rank``'s iterator (``fields``: default every schema field) over the ``count`` shares
        from the ``start_seq``-th admitted mini-batch on (None: to the end of the stream)."""
        if not 0 <= rank < len(self.config.rank_nodes):
            raise ValueError(f"rank {rank} out of range: the handoff has {len(self.config.rank_nodes)} ranks")
        if count is not None and count < 0:
            raise ValueError(f"consumer count must be >= 0 or None, got {count}")
        c = Consumer(self.plane, rank, None if fields is None else tuple(fields), self.config.prefetch_depth,
                     self.config.admit_timeout_s, start_seq, count)
        self._consumers.append(c)
        return c

    # -- versions and records ----------------------------------------------------------------------------------

    @property
    def version(self) -> int:
        """Optimizer steps every rank has acknowledged (the acks of this process's consumers sent first)."""
        self._flush_consumers()
        return self._controller.version

    def wait_version(self, version: int, timeout: float | None = None) -> int:
        self._flush_consumers()
        return self._controller.wait_version(version, timeout)

    def _flush_consumers(self) -> None:
        for c in self._consumers:
            c.flush()

    def records(self) -> list[HandoffRecord]:
        """Every admitted trajectory: ``v_gen``, ``v_train`` (its mini-batch's step), completion and admission
        times (seconds since the handoff started)."""
        self._flush_consumers()
        return self._controller.records()

    def staleness(self, released_only: bool = True) -> StalenessStats:
        """Staleness ``v_train - v_gen`` over the trajectories trained so far (all admitted ones if not
        ``released_only``)."""
        return StalenessStats.of(np.array([r.staleness for r in self.records() if r.released or not released_only]))

    def stats(self) -> tuple[ControllerStats, list[UnitStats]]:
        return self.plane.controller_stats(), self.plane.unit_stats()

    def wait_drained(self, timeout: float | None = None) -> int:
        """Block until every unit confirmed dropping every released mini-batch."""
        return self.plane.wait_drained(timeout)

    # -- lifecycle ---------------------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop this process's consumers and the data plane (waiters wake with ``DataPlaneClosedError``)."""
        try:
            for c in self._consumers:
                c.close()
        finally:
            self.plane.close()

    def __enter__(self) -> "Handoff":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
