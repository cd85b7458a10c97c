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
import threading
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Iterable, Iterator, Mapping, Protocol, Sequence

import numpy as np

from knittrans.admission.base import AdmissionPolicy
from knittrans.admission.minibatch import KnitTransAdmission
from knittrans.constraints import BatchConstraints
from knittrans.dataplane.client import DataPlaneClient, PrepareConfig
from knittrans.dataplane.feed import ACK_DELAY_S
from knittrans.dataplane.controller import ControllerStats, HandoffRecord
from knittrans.dataplane.prefetch import PrefetchConfig, Prefetcher
from knittrans.dataplane.storage import UnitStats
from knittrans.dataplane.types import (TEXT_SCHEMA, DataPlaneClosedError, FieldNotProducedError, PackedShare,
                                       TrajectoryPayload, TrajectorySchema)
from knittrans.staleness import StalenessStats
from knittrans.types import BatchPlan, Trajectory, require_int, require_real

if TYPE_CHECKING:
    import torch

    from knittrans.dataplane.faults import FaultPlan


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
    records_window: int | None = 65_536
    """``records()`` keeps the released records of the last this many trained trajectories (64 B each in columns,
    at most twice that before a trim: <= 8 MiB at the default), so the controller's memory is flat however long the
    run; ``staleness()`` stays exact over every trained trajectory (it is kept as a histogram of staleness values).
    None: keep every record (memory grows 64 B per trajectory: what a run that checks every record wants, e.g. the
    runtime's invariant checks); 0: keep none (``records()`` lists only the unreleased ones)."""
    faults: "FaultPlan | None" = None
    """Fault injection for tests and the reliability table (``knittrans.dataplane.faults.FaultPlan``: units that die,
    corrupt or stall); None (the default): no wrapper exists at all. Text handoffs only."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "transport", Transport(self.transport))
        if not isinstance(self.constraints, BatchConstraints):
            raise TypeError(f"HandoffConfig.constraints must be a BatchConstraints, got {self.constraints!r}")
        if not self.units or len({u for u, _ in self.units}) != len(self.units):
            raise ValueError(f"HandoffConfig.units must name at least one unit, each once: {self.units}")
        if not self.rank_nodes:
            raise ValueError("HandoffConfig.rank_nodes must list at least one trainer rank")
        for name in ("multimodal", "dedup", "checksums"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"HandoffConfig.{name} must be a bool, got {getattr(self, name)!r}")
        require_int("HandoffConfig", "prefetch_depth", self.prefetch_depth, 1)
        require_real("HandoffConfig", "balance_slack", self.balance_slack, 0.0)
        require_real("HandoffConfig", "admit_timeout_s", self.admit_timeout_s, 0.0, strict=True, optional=True)
        require_int("HandoffConfig", "records_window", self.records_window, 0, optional=True)
        t = self.read_timeout_s
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0 or t == float("inf")):
            raise ValueError(f"HandoffConfig.read_timeout_s must be a finite number of seconds > 0, or None (no "
                             f"deadline), got {t!r}")
        if self.faults is not None:
            from knittrans.dataplane.faults import FaultPlan

            if not isinstance(self.faults, FaultPlan):
                raise TypeError(f"HandoffConfig.faults must be a FaultPlan or None, got {type(self.faults).__name__}")
            if self.multimodal:
                raise ValueError("HandoffConfig.faults: fault injection is for text handoffs (multimodal units take "
                                 "no FaultPlan)")

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


def check_fields(schema: TrajectorySchema, fields: object) -> tuple[str, ...] | None:
    """A consumer's ``fields`` as a tuple of distinct schema field names (None: every field), or ``TypeError`` /
    ``FieldNotProducedError`` naming the argument: a bare string is refused (``"input_ids"`` would otherwise be read
    as the fields ``'i', 'n', ...``), and so are an empty list, a duplicate and a name outside the schema.

        >>> check_fields(TEXT_SCHEMA, ["input_ids"])
        ('input_ids',)
        >>> check_fields(TEXT_SCHEMA, "input_ids")
        Traceback (most recent call last):
        ...
        TypeError: consumer fields must be a sequence of field names, e.g. ('input_ids',), got the str 'input_ids'
    """
    if fields is None:
        return None
    if isinstance(fields, (str, bytes, Mapping)) or not isinstance(fields, Iterable):
        raise TypeError(f"consumer fields must be a sequence of field names, e.g. ('input_ids',), got the "
                        f"{type(fields).__name__} {fields!r}")
    names = tuple(fields)
    odd = [n for n in names if not isinstance(n, str)]
    if odd:
        raise TypeError(f"consumer fields must be field names (str), got {odd[:4]} in {list(names)}")
    if not names or len(set(names)) != len(names):
        raise FieldNotProducedError(f"consumer fields must name at least one field, each once (None: every field), "
                                    f"got {list(names)}")
    unknown = [n for n in names if n not in schema.names]
    if unknown:
        raise FieldNotProducedError(f"consumer fields {unknown} are not in the schema (fields: {list(schema.names)})")
    return names


def _build_plane(cfg: HandoffConfig, policy: AdmissionPolicy) -> DataPlane:
    units, ranks, schema = dict(cfg.units), tuple(cfg.rank_nodes), cfg.resolved_schema
    common = dict(balance_slack=cfg.balance_slack, prepare=cfg.prepare, policy=policy,
                  read_timeout_s=cfg.read_timeout_s, checksums=cfg.checksums, records_window=cfg.records_window)
    if cfg.transport is Transport.INPROCESS:
        if cfg.multimodal:
            from knittrans.mmdedup.plane import build_mm_inprocess

            return build_mm_inprocess(units, ranks, schema, dedup=cfg.dedup, **common)
        from knittrans.dataplane.inprocess import build_inprocess

        return build_inprocess(schema, units, ranks, faults=cfg.faults, **common)
    if cfg.multimodal:
        from knittrans.mmdedup.plane_ray import build_mm_ray

        return build_mm_ray(units, ranks, schema, dedup=cfg.dedup, controller_node=cfg.controller_node, **common)
    from knittrans.dataplane.ray_transport import build_ray

    return build_ray(schema, units, ranks, faults=cfg.faults, controller_node=cfg.controller_node, **common)


@dataclass
class Producer:
    """A rollout worker's handle: ``put`` writes to ``unit`` (its node's) and completes the trajectories. Picklable
    on the Ray transport (pass it to a rollout actor)."""

    plane: DataPlane
    unit: str
    multimodal: bool
    closed: threading.Event | None = None
    """Set by ``Handoff.close`` (this process's producers only: a pickled producer learns of the close from the
    plane itself, whose controller refuses puts once closed)."""

    def __post_init__(self) -> None:
        self._client: DataPlaneClient | None = None

    def __getstate__(self) -> dict:
        return {"plane": self.plane, "unit": self.unit, "multimodal": self.multimodal, "closed": None}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._client = None

    def put(self, rollouts: Sequence[Rollout]) -> None:
        """Store ``rollouts`` and hand them to admission; all or nothing per call (a rejected call changes
        nothing and names the offending trajectory and field). A put after ``Handoff.close`` raises
        ``DataPlaneClosedError`` (never accepted and dropped). A re-put of trajectories lost with a storage unit
        (``Handoff.missing``) is accepted as it was first put, metadata included."""
        if isinstance(rollouts, Rollout) or not isinstance(rollouts, Iterable):
            raise TypeError(f"Producer.put takes a sequence of Rollout messages, got {type(rollouts).__name__}")
        rollouts = list(rollouts)
        if self.closed is not None and self.closed.is_set():
            raise DataPlaneClosedError(f"the handoff is closed: put of {len(rollouts)} rollouts to unit "
                                       f"{self.unit!r} refused")
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
        # Every argument is checked here, where it is given, not at the first ``next()``.
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank < 0:
            raise ValueError(f"Consumer.rank must be an int >= 0, got {self.rank!r}")
        self.fields = check_fields(self.plane.schema, self.fields)
        require_int("Consumer", "depth", self.depth, 1)
        require_real("Consumer", "admit_timeout_s", self.admit_timeout_s, 0.0, strict=True, optional=True)
        require_int("Consumer", "start_seq", self.start_seq, 0)
        require_int("Consumer", "count", self.count, 0, optional=True)
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
            # delayed acks (``feed.ACK_DELAY_S``): the consumer sends what is queued at the end of its stream, on
            # ``flush`` and ``close``, so nothing waits on the delay but the controller's view of the step
            self._client.ack_delay_s = ACK_DELAY_S
        return self._client

    def __iter__(self) -> Iterator[PackedShare]:
        """The shares, in admission order. A storage unit that dies under a read does not end the iteration: the
        share is read again once its producers re-put the lost trajectories (``Handoff.missing`` names them;
        ``PrefetchConfig.wait_for_reput``), within ``admit_timeout_s`` when set."""
        return iter(self._prefetch(read_limit=None))

    def _prefetch(self, read_limit: int | None) -> Prefetcher:
        """This consumer's prefetcher, built on first use (``read_limit``: its reads' bound then, ``steps``)."""
        if self._prefetcher is None:
            self._prefetcher = Prefetcher(self.client, self.rank, self.fields,
                                          PrefetchConfig(depth=self.depth, admit_timeout_s=self.admit_timeout_s,
                                                         ack_on_fetch=False, ack_on_next=False),
                                          start_seq=self.start_seq, count=self.count, read_limit=read_limit)
        return self._prefetcher

    def steps(self, count: int) -> Iterator[PackedShare]:
        """The next ``count`` shares (fewer if the stream ends), reading nothing past them: the prefetcher reads
        ahead within these ``count`` only, while the rank's claims keep arriving ahead of it (metadata, no bytes).
        For a trainer that runs a known number of steps and then does something else (evaluation, a checkpoint)
        without holding shares in memory meanwhile; the next ``steps`` call starts on bytes, its first locations
        already here. A consumer iterated plainly (``iter``) before reads ahead without bound."""
        require_int("Consumer.steps", "count", count, 0)
        pf = self._prefetch(read_limit=self.start_seq)  # a new one reads nothing until allowed
        pf.allow_reads(pf.next_seq + count)
        for _ in range(count):
            try:
                yield pf.next()
            except StopIteration:
                return

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
    def events(self) -> Sequence:
        """The prefetcher's per-share timings (``knittrans.dataplane.prefetch.PrefetchEvent``), the last
        ``prefetch.EVENTS_KEPT`` of them."""
        return () if self._prefetcher is None else self._prefetcher.events

    def flush(self, timeout: float | None = 60.0) -> None:
        """Wait until this rank's acks reached the controller (they are delayed and batched, off the trainer's
        critical path: on Ray, and in process, ``DataPlaneClient.ack_delay_s``); re-raises the first ack that
        failed."""
        if self._client is not None:
            self._client.flush_acks(timeout)

    def close(self) -> None:
        """Stop prefetching (shares claimed and not handed out are given back) and send the queued acks
        (re-raises one that failed)."""
        self._closed = True
        if self._prefetcher is not None:
            self._prefetcher.close()
        if self._client is not None:
            self._client.close()

    @property
    def closed(self) -> bool:
        return getattr(self, "_closed", False)


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
        self._closed = threading.Event()

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
        return Producer(self.plane, unit, self.config.multimodal, self._closed)

    def put(self, rollouts: Sequence[Rollout], unit: str | None = None) -> None:
        self.producer(unit).put(rollouts)

    def consumer(self, rank: int = 0, fields: Sequence[str] | None = None, start_seq: int = 0,
                 count: int | None = None) -> Consumer:
        """Trainer rank ``rank``'s iterator (``fields``: a sequence of schema field names, default every one) over
        the ``count`` shares from the ``start_seq``-th admitted mini-batch on (None: to the end of the stream). Each
        argument is checked here (``TypeError``/``ValueError`` naming it).

        Recovery (docs/reliability.md): a unit that dies under the consumer needs nothing from the trainer (the
        consumer waits for the re-put, ``Consumer.__iter__``); a trainer rank that restarts calls
        ``recover_rank(rank)`` and builds its consumer from the seq it returns."""
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < len(self.config.rank_nodes):
            raise ValueError(f"rank {rank!r} out of range: the handoff has {len(self.config.rank_nodes)} ranks")
        c = Consumer(self.plane, rank, check_fields(self.config.resolved_schema, fields), self.config.prefetch_depth,
                     self.config.admit_timeout_s, start_seq, count)
        self._consumers = [k for k in self._consumers if not k.closed] + [c]  # closed ones hold nothing to flush
        return c

    # -- recovery (docs/reliability.md) ------------------------------------------------------------------------

    def missing(self) -> tuple[int, ...]:
        """Trajectories lost with a storage unit and not re-put yet: their producers put them again (any live unit;
        ``Producer.put`` accepts the same rollouts), and every consumer waiting on them goes on."""
        return self._controller.missing()

    def recover_rank(self, rank: int) -> int:
        """Trainer rank ``rank`` crashed and restarts: what it claimed and did not ack returns to the pool, its old
        incarnation is fenced off, and the returned seq is where its new consumer starts
        (``consumer(rank, start_seq=...)``)."""
        return self._controller.recover_rank(rank)

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
        """The admitted trajectories' records: ``v_gen``, ``v_train`` (its mini-batch's step), completion and
        admission times (seconds since the handoff started), by id -- every unreleased one, and of the released ones
        the last ``HandoffConfig.records_window`` (default 65,536; None: all), so that a long run's controller memory
        stays flat. ``staleness()`` does not depend on the window."""
        self._flush_consumers()
        return self._controller.records()

    def staleness(self, released_only: bool = True) -> StalenessStats:
        """Staleness ``v_train - v_gen`` over every trajectory trained so far, exact whatever ``records_window`` is
        (the controller keeps a histogram of it); with ``released_only`` False, the admitted unreleased ones too."""
        self._flush_consumers()
        counts = dict(self._controller.staleness_counts())
        if not released_only:
            for r in self._controller.records():
                if not r.released:
                    counts[r.staleness] = counts.get(r.staleness, 0) + 1
        return StalenessStats.of_counts(tuple(counts.items()))

    def stats(self) -> tuple[ControllerStats, list[UnitStats]]:
        """The controller's and the units' counters (the acks of this process's consumers sent first)."""
        self._flush_consumers()
        return self.plane.controller_stats(), self.plane.unit_stats()

    def wait_drained(self, timeout: float | None = None) -> int:
        """Block until every unit confirmed dropping every released mini-batch (the acks of this process's
        consumers sent first: a share acked here counts, however long its ack would have waited to be batched)."""
        self._flush_consumers()
        return self.plane.wait_drained(timeout)

    # -- lifecycle ---------------------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop this process's consumers and the data plane (waiters wake with ``DataPlaneClosedError``; a later
        ``put`` raises it). Idempotent."""
        if self._closed.is_set():
            return
        self._closed.set()
        try:
            for c in self._consumers:
                c.close()
        finally:
            self.plane.close()

    def __enter__(self) -> "Handoff":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
