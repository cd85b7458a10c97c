"""Fault injection for the real runtime: a rollout worker that dies mid-group, a straggling engine, a trainer
that crashes and restarts. Semantics and the recovery policy of each are in docs/reliability.md.

A ``RuntimeFaultPlan`` is handed to the ``Orchestrator`` (default: none, and then nothing here runs). Engine
faults wrap the engine in a ``FaultyEngine``; trainer crashes fire inside the orchestrator's step, whose
``StepLedger`` (keyed by (batch, mini-batch index)) keeps each optimizer step exactly once across a restart.

    >>> plan = RuntimeFaultPlan(kill_worker_groups=(3,), slow_groups=(5,), crash_steps=(2,))
    >>> plan.engine_faults, plan.crashes_before(2), plan.crashes_after(2)
    (True, True, False)
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import torch

from knittrans.runtime.engine import EngineStats, GroupRequest, RolloutEngine, Sample, SamplingConfig


class WorkerDiedError(RuntimeError):
    """An injected rollout-worker death: the wave's partial output is gone with the worker."""


class GenerationTimeoutError(RuntimeError):
    """A generation wave ran past ``RuntimeConfig.generation_timeout_s`` and was abandoned (it is regenerated)."""


class TrainerCrashedError(RuntimeError):
    """An injected trainer crash (the orchestrator restarts the trainer and re-delivers the mini-batch)."""


@dataclass(frozen=True)
class RuntimeFaultPlan:
    """Which runtime faults fire. Each fires once (the first time its trigger is reached)."""

    kill_worker_groups: tuple[int, ...] = ()
    """The first wave holding one of these groups dies after generating (mid-group: its samples are lost)."""
    slow_groups: tuple[int, ...] = ()
    """The first wave holding one of these groups straggles for ``slow_s`` before generating."""
    slow_s: float = 60.0
    """How long an injected straggler stalls (a ``generation_timeout_s`` below it abandons the wave)."""
    crash_steps: tuple[int, ...] = ()
    """0-based optimizer steps during which the trainer crashes."""
    crash_after_update: bool = False
    """False: the crash comes before the optimizer update (the step must run after the restart); True: after the
    update and its checkpoint, before the step is reported (the re-delivered mini-batch must not step again)."""

    @property
    def engine_faults(self) -> bool:
        return bool(self.kill_worker_groups or self.slow_groups)

    def crashes_before(self, step: int) -> bool:
        return step in self.crash_steps and not self.crash_after_update

    def crashes_after(self, step: int) -> bool:
        return step in self.crash_steps and self.crash_after_update


@dataclass
class FaultLog:
    """What fired and what recovered (the reliability table counts these)."""

    injected: dict[str, int] = field(default_factory=dict)
    recovered: dict[str, int] = field(default_factory=dict)

    def inject(self, kind: str) -> None:
        self.injected[kind] = self.injected.get(kind, 0) + 1

    def recover(self, kind: str) -> None:
        self.recovered[kind] = self.recovered.get(kind, 0) + 1


class FaultyEngine:
    """A ``RolloutEngine`` that fires a plan's engine faults, then behaves like the engine it wraps."""

    def __init__(self, inner: RolloutEngine, plan: RuntimeFaultPlan, log: FaultLog) -> None:
        self.inner = inner
        self.plan = plan
        self.log = log
        self._pending_kill = set(plan.kill_worker_groups)
        self._pending_slow = set(plan.slow_groups)
        self._lock = threading.Lock()
        self._released = threading.Event()  # set on release(): abandoned stragglers return at once

    @property
    def version(self) -> int:
        return self.inner.version

    @property
    def stats(self) -> EngineStats:
        return self.inner.stats

    def generate(self, requests: Sequence[GroupRequest], sampling: SamplingConfig, seed: int) -> list[Sample]:
        gids = {r.group_id for r in requests}
        with self._lock:
            slow = gids & self._pending_slow
            kill = gids & self._pending_kill
            self._pending_slow -= slow
            self._pending_kill -= kill
        if slow:
            self.log.inject("straggler")
            if self._released.wait(self.plan.slow_s):
                raise GenerationTimeoutError(f"straggling wave of groups {sorted(gids)} abandoned")
        out = self.inner.generate(requests, sampling, seed)
        if kill:
            self.log.inject("worker_death")
            raise WorkerDiedError(f"rollout worker died mid-group while generating groups {sorted(kill)} "
                                  f"({len(out)} samples lost with it)")
        return out

    def load_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        self.inner.load_weights(state_dict, version)

    def release(self) -> None:
        """End every injected stall (the run is over, or the wave was abandoned)."""
        self._released.set()
