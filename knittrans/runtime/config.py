"""Runtime configuration: execution mode, batch shape, weight-sync semantics, flow control, failure policy.

Version semantics (DESIGN.md asks every run to state them; they are fields here, so they are in every run's
config):

- Weights reach the rollout engine at **sync points**, chosen by ``sync``: after every optimizer step, after every
  ``sync_every`` steps, or after the last mini-batch of every batch. The trainer publishes a copy of its weights
  at a sync point; the engine loads the newest published copy before its next generation wave.
- **In-flight requests continue**: a wave always finishes with the weights it started with (no mid-generation
  update), so a trajectory's ``v_gen`` is the single version that produced all of its tokens.
- Flow control is an **in-flight budget** in groups: a group counts from dispatch to rollout until the trainer has
  finished the step that consumes it.
- Every trajectory reaches the trainer through a ``knittrans.handoff.Handoff`` (``transport``: in-process or Ray):
  admission runs in its controller as trajectories are put, the trainer iterates its prefetched packed shares.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

from knittrans.handoff import Transport
from knittrans.types import AdmissionKind, ExecutionMode, SyncPolicy


class RuntimeConfigError(ValueError):
    """A runtime config that cannot run (it would deadlock, or a field is out of range)."""


class OnRolloutError(str, Enum):
    """What a failed generation wave does: retry its groups (up to ``rollout_retries`` times), or fail the run."""

    RETRY = "retry"
    FAIL = "fail"




@dataclass(frozen=True)
class RuntimeConfig:
    """One real run: execution mode, batch constraints, sync and flow control."""

    mode: ExecutionMode = ExecutionMode.DISAGGREGATED
    """``colocated`` (generate a whole batch, then train its M mini-batches, taking turns) or ``disaggregated``
    (rollout and trainer concurrently, in separate threads or processes)."""
    admission: AdmissionKind = AdmissionKind.KNITTRANS
    """The admission policy of a disaggregated run (the caller builds it: ``baselines.admission.make_policy``).
    Colocated runs always admit whole batches: their admission is ``train_batch`` whatever is set here."""
    num_batches: int = 4
    """Training batches; the run takes num_batches * num_minibatches optimizer steps."""
    prompts_per_batch: int = 16
    """P: groups (prompts) per batch."""
    group_size: int = 4
    """n: samples per prompt."""
    num_minibatches: int = 4
    """M: optimizer steps per batch."""
    max_new_tokens: int = 5
    """Response cap in tokens, EOS included (max_response_len)."""
    temperature: float = 1.0
    """Sampling temperature."""
    sync: SyncPolicy = SyncPolicy.EVERY_STEP
    """When weights reach the engine (ignored by ``colocated``, which always generates with the newest weights)."""
    sync_every: int = 1
    """k for ``every_k``."""
    inflight_groups: int = 0
    """In-flight budget in groups (dispatched and not yet consumed by a finished step); 0 means one batch (P)."""
    wave_groups: int = 4
    """Groups per generation call: the engine's granularity. Weights change only between waves."""
    rollout_retries: int = 1
    """Extra attempts for a failed wave when ``on_rollout_error`` is ``retry``."""
    on_rollout_error: OnRolloutError = OnRolloutError.RETRY
    """A wave that raises is retried, or fails the run; a group is never dropped silently."""
    generation_timeout_s: float = 0.0
    """Straggler policy: a generation wave still running after this many seconds is abandoned and regenerated
    (it counts as a failed attempt under ``on_rollout_error``); 0 waits forever. See docs/reliability.md."""
    enforce_staleness_bound: bool = True
    """Fail loudly if a trajectory is staler than ``staleness_bound()`` (a flow-control bug, not a tuning knob)."""
    eval_every: int = 0
    """Snapshot the trainer's weights every this many steps for offline evaluation (0: none)."""
    seed: int = 0
    """Prompt stream and sampling seed."""
    adv_eps: float = 1e-6
    """Added to a group's reward std in its advantages (a group of identical rewards gets zero advantage, not
    NaN)."""
    transport: Transport = Transport.INPROCESS
    """The handoff's transport: ``inprocess`` (controller and storage unit are objects of this process) or ``ray``
    (they are Ray actors; ``ray.init`` must have run). The same path either way."""
    multimodal: bool = False
    """A multimodal task: the handoff stores each request's images once per distinct content (``MM_SCHEMA``) and
    the learner steps on ``MMShare``s. Text tasks leave it False (a rollout carrying images is then rejected)."""
    prefetch_depth: int = 2
    """Shares the trainer's consumer prepares ahead of the step that computes (``HandoffConfig.prefetch_depth``)."""

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "mode", ExecutionMode(self.mode))
            object.__setattr__(self, "admission", AdmissionKind(self.admission))
        except ValueError as e:
            raise RuntimeConfigError(f"RuntimeConfig: {e} (modes: {[m.value for m in ExecutionMode]}, admission "
                                     f"kinds: {[a.value for a in AdmissionKind]})") from None
        if self.mode is ExecutionMode.COLOCATED:
            object.__setattr__(self, "admission", AdmissionKind.TRAIN_BATCH)
        if self.admission is AdmissionKind.CLAIRVOYANT:
            raise RuntimeConfigError("RuntimeConfig.admission=clairvoyant needs every response's length in advance: "
                                     "the simulator's bound, not a real run")
        try:
            object.__setattr__(self, "transport", Transport(self.transport))
        except ValueError:
            raise RuntimeConfigError(f"RuntimeConfig.transport must be one of {[t.value for t in Transport]}, got "
                                     f"{self.transport!r}") from None
        if not self.adv_eps > 0:
            raise RuntimeConfigError(f"RuntimeConfig.adv_eps must be > 0, got {self.adv_eps}")
        for name in ("num_batches", "prompts_per_batch", "group_size", "num_minibatches", "max_new_tokens",
                     "sync_every", "wave_groups", "prefetch_depth"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise RuntimeConfigError(f"RuntimeConfig.{name} must be an int >= 1, got {v!r}")
        if self.prompts_per_batch % self.num_minibatches:
            raise RuntimeConfigError(f"RuntimeConfig: prompts_per_batch={self.prompts_per_batch} must be a multiple "
                                     f"of num_minibatches={self.num_minibatches} (whole groups per mini-batch)")
        if not self.generation_timeout_s >= 0:
            raise RuntimeConfigError(f"RuntimeConfig.generation_timeout_s must be >= 0, got {self.generation_timeout_s}")
        if self.inflight_groups < 0 or self.rollout_retries < 0 or self.eval_every < 0:
            raise RuntimeConfigError("RuntimeConfig: inflight_groups, rollout_retries and eval_every must be >= 0")
        object.__setattr__(self, "sync", SyncPolicy(self.sync))
        object.__setattr__(self, "on_rollout_error", OnRolloutError(self.on_rollout_error))
        need = self.prompts_per_batch if self.admission.whole_batch else self.groups_per_minibatch
        if self.budget < need:
            raise RuntimeConfigError(
                f"RuntimeConfig: inflight_groups={self.budget} would deadlock admission {self.admission.value!r}: it "
                f"commits nothing "
                f"until {need} groups have completed, so the budget must be >= {need}")

    @property
    def budget(self) -> int:
        """The in-flight budget in groups."""
        return self.inflight_groups or self.prompts_per_batch

    @property
    def groups_per_minibatch(self) -> int:
        return self.prompts_per_batch // self.num_minibatches

    @property
    def total_steps(self) -> int:
        return self.num_batches * self.num_minibatches

    @property
    def sync_lag(self) -> int:
        """Most steps the engine's weights can trail the trainer's published version at a wave start."""
        if self.mode is ExecutionMode.COLOCATED or self.sync is SyncPolicy.EVERY_STEP:
            return 0
        if self.sync is SyncPolicy.EVERY_K:
            return self.sync_every - 1
        return self.num_minibatches - 1

    def staleness_bound(self) -> int:
        """An upper bound on any trajectory's staleness that flow control guarantees.

        A group starts generating (with weights at most ``sync_lag`` behind the trainer) only while fewer than
        ``budget`` groups are in flight, and each step consumes ``groups_per_minibatch`` of them, so at most
        ``ceil(budget / groups_per_minibatch)`` steps run between its start and the step that consumes it.
        Colocated: ``M - 1`` (the j-th mini-batch of a batch is j steps stale)."""
        if self.mode is ExecutionMode.COLOCATED:
            return self.num_minibatches - 1
        return math.ceil(self.budget / self.groups_per_minibatch) + self.sync_lag

    @property
    def system(self) -> str:
        """The name of this run's system in tables: ``colocated``, or the admission kind of a disaggregated run."""
        return "colocated" if self.mode is ExecutionMode.COLOCATED else self.admission.value

    @classmethod
    def for_system(cls, system: str, **kw) -> "RuntimeConfig":
        """``colocated`` or an admission kind (``knittrans``, ``train_batch`` ...), as tables name systems."""
        if system == "colocated":
            return cls(mode=ExecutionMode.COLOCATED, admission=AdmissionKind.TRAIN_BATCH, **kw)
        return cls(mode=ExecutionMode.DISAGGREGATED, admission=AdmissionKind(system), **kw)
