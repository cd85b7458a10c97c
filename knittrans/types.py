"""Typed messages of the handoff: trajectories, groups, batch plans, mini-batches, versions.

Definitions used everywhere in this project (DESIGN.md, "Definitions"); they are written here once:

- **Policy version** ``v``: the number of optimizer steps the trainer has applied. One mini-batch = one step.
- **Generation version** ``v_gen(t)``: the version loaded in the rollout engine when trajectory ``t`` started
  generating (with in-flight weight updates, the oldest version that produced any of its tokens).
- **Training version** ``v_train(t)``: the trainer's version at the step that consumes ``t``.
- **Staleness** ``s(t) = v_train(t) - v_gen(t)``, in optimizer steps.

Every message validates itself on construction and raises ``ValueError`` naming the field and the value, so a
malformed message is rejected before it can touch any state.

Example::

    >>> g = GroupSpec(group_id=0, batch_id=0, size=2)
    >>> plan = BatchPlan(batch_id=0, groups=(g,))
    >>> plan.num_trajectories
    2
    >>> Trajectory(traj_id=7, group_id=0, batch_id=0, num_tokens=0, v_gen=0)
    Traceback (most recent call last):
    ...
    ValueError: Trajectory.num_tokens must be >= 1 (an empty or negative-length response), got 0
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from enum import Enum, EnumMeta
from functools import cached_property
from typing import TYPE_CHECKING, Mapping, NewType

if TYPE_CHECKING:  # numpy only annotates WorkloadBatch; this module stays import-light
    import numpy as np

PolicyVersion = NewType("PolicyVersion", int)
TrajId = int
GroupId = int
BatchId = int


# -- the shared vocabulary: one set of enums for the runtime, the simulator, the handoff and the Hydra configs ------


class ValueNamedEnum(EnumMeta):
    """``Kind["value"]`` finds a member by its value as well as by its name. OmegaConf (2.3) converts a string
    into an enum-typed field with ``Kind[string]``, i.e. by *name* only, so without this a Hydra override had to
    say ``system.inflight=ABORT`` while every log, row and doc says ``abort``.

    >>> InflightPolicy["abort"] is InflightPolicy["ABORT"] is InflightPolicy.ABORT
    True
    """

    def __getitem__(cls, name):
        try:
            return super().__getitem__(name)
        except KeyError:
            try:
                return cls(name)
            except ValueError:
                raise KeyError(name) from None



class ExecutionMode(str, Enum, metaclass=ValueNamedEnum):
    """Where rollout and training run."""

    COLOCATED = "colocated"
    """Synchronously on shared resources: generate a whole batch, then train its M mini-batches (the reference
    whose staleness is purely algorithmic)."""
    DISAGGREGATED = "disaggregated"
    """On separate resources, concurrently; an admission policy decides what each step consumes."""


class AdmissionKind(str, Enum, metaclass=ValueNamedEnum):
    """Which admission policy a run uses (``baselines.admission.make_policy`` builds one by kind)."""

    KNITTRANS = "knittrans"
    """Mini-batch admission with a feasibility proof for the rest of the batch (``knittrans.admission``)."""
    TRAIN_BATCH = "train_batch"
    """Admit a batch once all of it has completed, as its M mini-batches (verl and most async stacks)."""
    GREEDY = "greedy"
    """Stream the first locally valid mini-batch, with no look-ahead (can dead-end; counted)."""
    BOUNDED_ASYNC = "bounded_async"
    """AReaL-style: a batch is whatever whole groups complete first."""
    CLAIRVOYANT = "clairvoyant"
    """KnitTrans admission told every response's true length in advance (an upper bound, simulator only)."""

    @property
    def whole_batch(self) -> bool:
        """Commits nothing before a whole batch has completed (its in-flight budget must hold a batch)."""
        return self in (AdmissionKind.TRAIN_BATCH, AdmissionKind.BOUNDED_ASYNC)


class SyncPolicy(str, Enum, metaclass=ValueNamedEnum):
    """When the trainer's weights reach the rollout engines."""

    EVERY_STEP = "every_step"
    EVERY_K = "every_k"
    """After every ``k`` optimizer steps."""
    EVERY_BATCH = "every_batch"
    """After the last mini-batch of every batch."""


class InflightPolicy(str, Enum, metaclass=ValueNamedEnum):
    """What a weight sync does to requests in flight."""

    CONTINUE = "continue"
    """They finish with the new weights; ``v_gen`` stays the oldest version that produced any of their tokens."""
    ABORT = "abort"
    """They restart from scratch with the new weights; their tokens are wasted."""


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def require_int(owner: str, name: str, value: object, minimum: int, optional: bool = False) -> None:
    """``value`` is an int >= ``minimum`` (not a bool, not a float such as 2.5), or None when ``optional``; else
    ``TypeError`` / ``ValueError`` naming ``owner.name``. For config fields and call arguments, checked where they
    are given (construction, the call) rather than where they are first used.

        >>> require_int("HandoffConfig", "prefetch_depth", 2.5, 1)
        Traceback (most recent call last):
        ...
        TypeError: HandoffConfig.prefetch_depth must be an int, got float 2.5
    """
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{owner}.{name} must be an int{' or None' if optional else ''}, got "
                        f"{type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{owner}.{name} must be >= {minimum}{' or None' if optional else ''}, got {value}")


def require_real(owner: str, name: str, value: object, minimum: float = 0.0, strict: bool = False,
                 optional: bool = False) -> None:
    """``value`` is a finite real number >= ``minimum`` (> when ``strict``), or None when ``optional``; else
    ``TypeError`` / ``ValueError`` naming ``owner.name`` (NaN and inf are refused: a slack or a timeout of inf is a
    typo, and None already says "no limit").

        >>> require_real("HandoffConfig", "admit_timeout_s", -5, strict=True, optional=True)
        Traceback (most recent call last):
        ...
        ValueError: HandoffConfig.admit_timeout_s must be a finite number > 0.0 or None, got -5
    """
    if value is None and optional:
        return
    what = f"a finite number {'>' if strict else '>='} {minimum}{' or None' if optional else ''}"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{owner}.{name} must be {what}, got {type(value).__name__} {value!r}")
    if not math.isfinite(value) or value < minimum or (strict and value == minimum):
        raise ValueError(f"{owner}.{name} must be {what}, got {value!r}")


def _int_field(owner: str, name: str, value: object, minimum: int) -> None:
    # bool is an int subclass; a True where a count belongs is a bug, not a 1.
    _require(isinstance(value, int) and not isinstance(value, bool),
             f"{owner}.{name} must be an int, got {type(value).__name__} {value!r}")
    _require(value >= minimum, f"{owner}.{name} must be >= {minimum}, got {value}")


@dataclass(frozen=True, slots=True)
class Trajectory:
    """One completed response (a sample of a group), as the admission layer sees it.

    ``num_tokens`` is the response length in tokens (what token budgets and trainer step time count);
    ``prompt_tokens`` the prompt length. ``v_gen`` is the generation version defined above.
    """

    traj_id: TrajId
    group_id: GroupId
    batch_id: BatchId
    num_tokens: int
    v_gen: int
    prompt_tokens: int = 0
    t_complete: float = 0.0

    def __post_init__(self) -> None:
        # Fast path (this runs once per trajectory in every simulation): all ints, all in range.
        if (type(self.traj_id) is int and type(self.group_id) is int and type(self.batch_id) is int
                and type(self.num_tokens) is int and type(self.v_gen) is int and type(self.prompt_tokens) is int
                and self.traj_id >= 0 and self.group_id >= 0 and self.batch_id >= 0 and self.num_tokens >= 1
                and self.v_gen >= 0 and self.prompt_tokens >= 0):
            return
        _int_field("Trajectory", "traj_id", self.traj_id, 0)
        _int_field("Trajectory", "group_id", self.group_id, 0)
        _int_field("Trajectory", "batch_id", self.batch_id, 0)
        _require(isinstance(self.num_tokens, int) and not isinstance(self.num_tokens, bool),
                 f"Trajectory.num_tokens must be an int, got {type(self.num_tokens).__name__}")
        _require(self.num_tokens >= 1,
                 f"Trajectory.num_tokens must be >= 1 (an empty or negative-length response), got {self.num_tokens}")
        _int_field("Trajectory", "v_gen", self.v_gen, 0)
        _int_field("Trajectory", "prompt_tokens", self.prompt_tokens, 0)


@dataclass(frozen=True, slots=True)
class GroupSpec:
    """A prompt dispatched with ``size`` samples (its GRPO group). Sizes may differ across groups (filtered or
    truncated groups, agentic rollouts with a variable number of trajectories); a group's size is declared when
    it is dispatched, and no more than ``size`` trajectories may arrive for it."""

    group_id: GroupId
    batch_id: BatchId
    size: int
    prompt_tokens: int = 0

    def __post_init__(self) -> None:
        _int_field("GroupSpec", "group_id", self.group_id, 0)
        _int_field("GroupSpec", "batch_id", self.batch_id, 0)
        _int_field("GroupSpec", "size", self.size, 1)
        _int_field("GroupSpec", "prompt_tokens", self.prompt_tokens, 0)


@dataclass(frozen=True)
class BatchPlan:
    """The groups that make up training batch ``batch_id`` (the data loader's prompts for that batch)."""

    batch_id: BatchId
    groups: tuple[GroupSpec, ...]

    def __post_init__(self) -> None:
        _int_field("BatchPlan", "batch_id", self.batch_id, 0)
        _require(len(self.groups) > 0, f"BatchPlan {self.batch_id} has no groups")
        seen: set[int] = set()
        for g in self.groups:
            _require(isinstance(g, GroupSpec), f"BatchPlan.groups must hold GroupSpec, got {type(g).__name__}")
            _require(g.batch_id == self.batch_id,
                     f"group {g.group_id} declares batch_id {g.batch_id} but is in BatchPlan {self.batch_id}")
            _require(g.group_id not in seen, f"BatchPlan {self.batch_id}: duplicate group_id {g.group_id}")
            seen.add(g.group_id)

    @cached_property
    def num_trajectories(self) -> int:
        # cached: admission reads it on every decision, and summing P groups each time made a batch O(P^2)
        return sum(g.size for g in self.groups)


@dataclass(frozen=True)
class MiniBatch:
    """One optimizer step's worth of trajectories: the ``index``-th of its batch's M mini-batches.

    ``violations`` is empty for every policy that keeps the batch constraints; the greedy baseline, which has no
    feasibility check, records here each constraint it had to break at a dead end."""

    batch_id: BatchId
    index: int
    traj_ids: tuple[TrajId, ...]
    group_ids: tuple[GroupId, ...]
    num_tokens: int
    violations: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        for name in ("batch_id", "index"):
            v = getattr(self, name)
            if not isinstance(v, numbers.Integral) or isinstance(v, bool) or v < 0:
                raise ValueError(f"MiniBatch.{name} must be an int >= 0, got {v!r}")
        if not self.traj_ids:
            raise ValueError(f"MiniBatch {self.batch_id}/{self.index}: traj_ids is empty (an optimizer step with no "
                             f"data); a mini-batch holds at least one trajectory")

    @property
    def size(self) -> int:
        return len(self.traj_ids)


@dataclass(frozen=True)
class WorkloadBatch:
    """One training batch of a workload: its plan and the true response length of each trajectory, by group
    (what the simulator replays; ``workloads.text.generate_batches`` draws them)."""

    plan: BatchPlan
    lengths: Mapping[int, "np.ndarray"]

    def group_tokens(self, group_id: int) -> int:
        return int(self.lengths[group_id].sum())
