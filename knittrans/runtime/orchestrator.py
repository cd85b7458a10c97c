"""The orchestrator: runs rollout and training in one of three modes, with the project's admission policies.

- ``colocated``: one thread takes turns: load the newest weights, generate a whole batch, train its M
  mini-batches (train-batch admission). Staleness is purely algorithmic: ``j`` for the j-th mini-batch.
- disaggregated (``train_batch``, ``knittrans``, ``greedy``, ``bounded_async``): a rollout thread generates
  groups in waves while the trainer (the calling thread) steps; the admission policy (built by the
  caller's ``make_policy``, e.g. ``baselines.admission.make_policy``: one implementation, shared with the simulator) decides which completed
  groups each step consumes. Flow control and weight sync follow ``RuntimeConfig``.

Concurrency: one ``threading.Condition`` guards all shared state (dispatch queue, in-flight count, published
weights, the admission policy, the error slot); each side waits on it, and each state change notifies it. No
sleep-polling. Torch releases the GIL inside its kernels, so the two threads overlap on two cores.

Invariants checked on every run (``RunResult`` is returned only if they hold): every dispatched trajectory is
consumed by exactly one step; versions increase by one per step; no trajectory is staler than
``RuntimeConfig.staleness_bound()`` (when enforced). A failing generation wave is retried or fails the run
(``RolloutWorkerError``); a group is never dropped silently.

Faults (docs/reliability.md): a wave that dies mid-group or runs past ``generation_timeout_s`` is abandoned
and regenerated under the retry policy (its partial output never reaches admission); a trainer crash re-delivers
the mini-batch, and the ``StepLedger`` keyed by (batch, mini-batch index) applies each optimizer step once.
``RuntimeFaultPlan`` injects them.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections import deque
from typing import Callable, Protocol, Sequence

import torch

from knittrans.admission.base import AdmissionPolicy
from knittrans.admission.minibatch import KnitTransAdmission
from knittrans.constraints import BatchConstraints
from knittrans.dataplane.faults import StepLedger
from knittrans.dataplane.types import MiniBatchKey
from knittrans.runtime.config import OnRolloutError, RuntimeConfig
from knittrans.runtime.engine import GroupRequest, RolloutEngine, Sample, SamplingConfig
from knittrans.runtime.faults import (FaultLog, FaultyEngine, GenerationTimeoutError, RuntimeFaultPlan,
                                      TrainerCrashedError)
from knittrans.runtime.records import RunResult, StepRecord, TrajRecord
from knittrans.runtime.trainer import GRPOTrainer, TrainItem, group_advantages
from knittrans.types import AdmissionKind, BatchPlan, ExecutionMode, GroupSpec, MiniBatch, SyncPolicy, Trajectory


class RolloutWorkerError(RuntimeError):
    """A generation wave failed (after its retries, if any); the groups it held are named."""


class StalenessBoundError(RuntimeError):
    """A trajectory was consumed staler than flow control guarantees: a bug in flow control or sync."""


class RunInvariantError(RuntimeError):
    """A trajectory was lost or trained twice, or versions did not advance one per step."""


class RLTask(Protocol):
    """Prompts and exact rewards (``workloads.arith.ArithRLTask`` is one)."""

    def batch(self, seed: int, batch_id: int, n: int) -> Sequence: ...  # items with .prompt_ids

    def reward(self, prompt, response_ids: tuple[int, ...]) -> float: ...


PolicyFactory = Callable[[AdmissionKind, BatchConstraints], AdmissionPolicy]
"""Builds the admission policy of a run from its kind and constraints (``baselines.admission.make_policy`` builds
every kind; the core itself only knows KnitTrans's)."""


def knittrans_policy(kind: AdmissionKind, constraints: BatchConstraints) -> AdmissionPolicy:
    """The default ``PolicyFactory``: KnitTrans admission; other kinds live in ``baselines`` (pass its
    ``make_policy``)."""
    if kind is not AdmissionKind.KNITTRANS:
        raise ValueError(f"admission {kind.value!r} is a baseline: pass make_policy=baselines.admission.make_policy")
    return KnitTransAdmission(constraints)


class Orchestrator:
    """Runs one ``RuntimeConfig`` with a trainer, an engine and a task; ``make_policy`` builds its admission."""

    def __init__(self, cfg: RuntimeConfig, trainer: GRPOTrainer, engine: RolloutEngine, task: RLTask,
                 faults: RuntimeFaultPlan | None = None, make_policy: PolicyFactory = knittrans_policy) -> None:
        self.cfg = cfg
        self.trainer = trainer
        self.faults = faults or RuntimeFaultPlan()
        self.fault_log = FaultLog()
        self.engine = FaultyEngine(engine, self.faults, self.fault_log) if self.faults.engine_faults else engine
        self.task = task
        self._ledger: StepLedger = StepLedger()  # exactly-once steps across trainer restarts
        self._crashed: set[int] = set()
        self.sampling = SamplingConfig(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature)
        self.constraints = BatchConstraints(batch_size=cfg.prompts_per_batch * cfg.group_size,
                                            num_minibatches=cfg.num_minibatches,
                                            max_response_len=cfg.max_new_tokens, group_size=cfg.group_size)
        self.policy = make_policy(cfg.admission, self.constraints)
        self._cv = threading.Condition()
        self._pending: deque[GroupRequest] = deque()
        self._prompts: dict[int, object] = {}
        self._items: dict[int, TrainItem] = {}
        self._records: dict[int, TrajRecord] = {}
        self._inflight = 0  # groups dispatched and not yet consumed by a finished step
        self._generating = 0  # waves running right now
        self._published: tuple[int, dict[str, torch.Tensor]] | None = None
        self._publish_s: list[float] = []
        self._error: BaseException | None = None
        self._stop = False
        self._failures = 0
        self._t0 = 0.0
        self._plan()

    # -- set-up ------------------------------------------------------------------------------------------------

    def _plan(self) -> None:
        """All batches, in training order, with globally unique group and trajectory ids."""
        c = self.cfg
        for b in range(c.num_batches):
            prompts = self.task.batch(c.seed, b, c.prompts_per_batch)
            groups = []
            for i, p in enumerate(prompts):
                gid = b * c.prompts_per_batch + i
                self._prompts[gid] = p
                tids = tuple(gid * c.group_size + j for j in range(c.group_size))
                self._pending.append(GroupRequest(gid, b, tuple(p.prompt_ids), tids))
                groups.append(GroupSpec(gid, b, c.group_size, prompt_tokens=len(p.prompt_ids)))
            self.policy.add_batch(BatchPlan(b, tuple(groups)))

    def _now(self) -> float:
        return time.perf_counter() - self._t0

    # -- public ------------------------------------------------------------------------------------------------

    def run(self) -> RunResult:
        self._t0 = time.perf_counter()
        self._publish()
        # The engine starts from the trainer's weights whatever it was built with (a reused engine, a vLLM engine
        # loaded from a checkpoint directory): version 0 is loaded unconditionally.
        with self._cv:
            assert self._published is not None
            version, weights = self._published
        self.engine.load_weights(weights, version)
        steps: list[StepRecord] = []
        snapshots: dict[int, dict[str, torch.Tensor]] = {}
        if self.cfg.eval_every:
            snapshots[0] = self.trainer.weights()
        try:
            if self.cfg.mode is ExecutionMode.COLOCATED:
                self._run_colocated(steps, snapshots)
            else:
                worker = threading.Thread(target=self._rollout_loop, name="rollout", daemon=True)
                worker.start()
                try:
                    self._train_loop(steps, snapshots)
                finally:
                    with self._cv:
                        self._stop = True
                        self._cv.notify_all()
                    worker.join()
        finally:
            if isinstance(self.engine, FaultyEngine):
                self.engine.release()
        wall = self._now()
        result = RunResult(config=self.cfg, trajectories=sorted(self._records.values(), key=lambda r: r.traj_id),
                           steps=steps, wall_s=wall, engine=self.engine.stats, admission=self.policy.stats,
                           publish_s=self._publish_s, snapshots=snapshots, rollout_failures=self._failures,
                           faults_injected=dict(self.fault_log.injected),
                           faults_recovered=dict(self.fault_log.recovered))
        if self._ledger.version != len(steps):
            raise RunInvariantError(f"{self._ledger.version} distinct steps applied but {len(steps)} recorded")
        check_run(result)
        return result

    # -- weights -----------------------------------------------------------------------------------------------

    def _publish(self) -> None:
        t0 = time.perf_counter()
        w = self.trainer.weights()
        self._publish_s.append(time.perf_counter() - t0)
        with self._cv:
            self._published = (self.trainer.version, w)

    def _sync_due(self, mb: MiniBatch) -> bool:
        c = self.cfg
        if c.sync is SyncPolicy.EVERY_STEP:
            return True
        if c.sync is SyncPolicy.EVERY_K:
            return self.trainer.version % c.sync_every == 0
        return mb.index == c.num_minibatches - 1

    def _load_newest(self) -> None:
        """Engine side of a sync point: load the newest published weights if the engine is behind."""
        with self._cv:
            pub = self._published
        if pub is not None and pub[0] != self.engine.version:
            self.engine.load_weights(pub[1], pub[0])

    # -- rollout -----------------------------------------------------------------------------------------------

    def _generate(self, wave: list[GroupRequest]) -> list[Sample]:
        """Generate a wave under the failure policy: retry it, or raise ``RolloutWorkerError``."""
        attempts = 1 + (self.cfg.rollout_retries if self.cfg.on_rollout_error is OnRolloutError.RETRY else 0)
        for attempt in range(attempts):
            try:
                seed = self.cfg.seed * 7_919 + wave[0].group_id * 31 + attempt
                out = self._generate_within_timeout(wave, seed)
                if attempt:
                    self.fault_log.recover("regenerated_wave")
                return out
            except Exception as e:  # noqa: BLE001 - any engine failure is retried or re-raised below, never lost
                self._failures += 1
                if attempt == attempts - 1:
                    ids = [r.group_id for r in wave]
                    raise RolloutWorkerError(f"generation failed for groups {ids} (batch {wave[0].batch_id}) after "
                                             f"{attempts} attempt(s), policy {self.cfg.on_rollout_error.value}: "
                                             f"{type(e).__name__}: {e}") from e
        raise AssertionError("unreachable")

    def _generate_within_timeout(self, wave: list[GroupRequest], seed: int) -> list[Sample]:
        """One generation call; with ``generation_timeout_s`` set, a call still running after it is abandoned
        (``GenerationTimeoutError``: the retry policy regenerates the wave). An engine call cannot be pre-empted:
        the abandoned call finishes in the background and its samples are discarded."""
        timeout = self.cfg.generation_timeout_s
        if not timeout:
            return self.engine.generate(wave, self.sampling, seed=seed)
        pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="generate")
        fut = pool.submit(self.engine.generate, wave, self.sampling, seed)
        pool.shutdown(wait=False)
        try:
            return fut.result(timeout=timeout)
        except concurrent.futures.TimeoutError:
            self.fault_log.recover("straggler_abandoned")
            raise GenerationTimeoutError(f"generation of groups {[r.group_id for r in wave]} ran past "
                                         f"generation_timeout_s={timeout}; abandoned and regenerated") from None

    def _complete(self, wave: list[GroupRequest], samples: list[Sample], t_dispatch: float) -> None:
        """Score a finished wave and hand its trajectories to the admission policy (caller holds the lock)."""
        by_group: dict[int, list[Sample]] = {}
        for s in samples:
            by_group.setdefault(s.group_id, []).append(s)
        now = self._now()
        for r in wave:
            got = by_group.get(r.group_id, [])
            if sorted(s.traj_id for s in got) != sorted(r.traj_ids):
                raise RolloutWorkerError(f"group {r.group_id}: engine returned trajectories "
                                         f"{sorted(s.traj_id for s in got)}, expected {sorted(r.traj_ids)}")
            rewards = [self.task.reward(self._prompts[r.group_id], s.response_ids) for s in got]
            for it in group_advantages(got, rewards, self.trainer.cfg.adv_eps):
                s = it.sample
                self._items[s.traj_id] = it
                self._records[s.traj_id] = TrajRecord(s.traj_id, s.group_id, s.batch_id, len(s.response_ids),
                                                      it.reward, s.v_gen, t_dispatch, now)
                self.policy.on_complete(Trajectory(s.traj_id, s.group_id, s.batch_id, len(s.response_ids),
                                                   s.v_gen, len(s.prompt_ids), now))

    def _rollout_loop(self) -> None:
        c = self.cfg
        try:
            while True:
                with self._cv:
                    self._cv.wait_for(lambda: self._stop or (self._pending and self._inflight < c.budget))
                    if self._stop:
                        return
                    k = min(c.wave_groups, c.budget - self._inflight, len(self._pending))
                    wave = [self._pending.popleft() for _ in range(k)]
                    self._inflight += k
                    self._generating += 1
                self._load_newest()
                t_dispatch = self._now()
                samples = self._generate(wave)
                with self._cv:
                    self._complete(wave, samples, t_dispatch)
                    self._generating -= 1
                    self._cv.notify_all()
        except BaseException as e:  # noqa: BLE001 - handed to the trainer thread, which re-raises it
            with self._cv:
                self._error = e
                self._generating = 0
                self._cv.notify_all()

    # -- training ----------------------------------------------------------------------------------------------

    def _next_minibatches(self) -> list[MiniBatch]:
        """Wait until the admission policy commits something; raise if the rollout worker failed or the run can
        make no progress (which flow control must prevent: a loud failure, never a hang)."""
        with self._cv:
            while True:
                if self._error is not None:
                    raise self._error
                mbs = self.policy.on_trainer_ready(self._now())
                if mbs:
                    return mbs
                idle = self._generating == 0 and (not self._pending or self._inflight >= self.cfg.budget)
                if idle:
                    raise RunInvariantError(
                        f"deadlock: admission {self.cfg.admission.value!r} commits nothing with {self._inflight} groups in "
                        f"flight (budget {self.cfg.budget}) and {len(self._pending)} waiting to be dispatched")
                self._cv.wait()

    def _train_minibatch(self, mb: MiniBatch, steps: list[StepRecord],
                         snapshots: dict[int, dict[str, torch.Tensor]]) -> None:
        with self._cv:
            items = [self._items.pop(t) for t in mb.traj_ids]
        v_train = self.trainer.version
        t_start = self._now()
        recs = [self._records[t] for t in mb.traj_ids]
        for r in recs:
            if r.step >= 0:
                raise RunInvariantError(f"trajectory {r.traj_id} trained twice (steps {r.step} and {len(steps)})")
            r.v_train, r.t_train_start, r.step = v_train, t_start, len(steps)
            if self.cfg.enforce_staleness_bound and r.staleness > self.cfg.staleness_bound():
                raise StalenessBoundError(f"trajectory {r.traj_id} has staleness {r.staleness} > bound "
                                          f"{self.cfg.staleness_bound()} ({self.cfg.system}, budget {self.cfg.budget})")
        res = self._step_exactly_once(mb, items, len(steps))
        steps.append(StepRecord(step=len(steps), version=res.version, batch_id=mb.batch_id, minibatch_index=mb.index,
                                t_start=t_start, t_end=self._now(), step_s=res.step_s, tokens=res.tokens,
                                mean_reward=sum(i.reward for i in items) / len(items),
                                mean_staleness=sum(r.staleness for r in recs) / len(recs), clip_frac=res.clip_frac,
                                loss=res.loss, kl=res.kl))
        if self.cfg.eval_every and res.version % self.cfg.eval_every == 0:
            snapshots[res.version] = self.trainer.weights()
        if self.cfg.mode is not ExecutionMode.COLOCATED and self._sync_due(mb):
            self._publish()
        with self._cv:
            self._inflight -= len(mb.group_ids)
            self._cv.notify_all()

    def _step_exactly_once(self, mb: MiniBatch, items: list[TrainItem], step: int):  # noqa: ANN202 - StepResult
        """The optimizer step of ``mb`` through the ledger. An injected crash restarts the trainer and re-delivers
        the mini-batch (its items are kept until the step is recorded); the ledger, saved with the weights and
        optimizer state in every step's checkpoint, skips a step that was applied before the crash."""
        key = MiniBatchKey(mb.batch_id, mb.index)

        def apply():  # noqa: ANN202
            if self.faults.crashes_before(step) and step not in self._crashed:
                self._crashed.add(step)
                self.fault_log.inject("trainer_crash")
                raise TrainerCrashedError(f"trainer crashed during step {step} ({key}), before its update")
            return self.trainer.step(items)

        while True:
            try:
                res, fresh = self._ledger.apply(key, apply)
                if fresh and self.faults.crashes_after(step) and step not in self._crashed:
                    self._crashed.add(step)
                    self.fault_log.inject("trainer_crash")
                    raise TrainerCrashedError(f"trainer crashed after the update of step {step} ({key})")
                return res
            except TrainerCrashedError:
                self.fault_log.recover("trainer_restart")  # restart from the checkpoint; re-deliver mb

    def _train_loop(self, steps: list[StepRecord], snapshots: dict[int, dict[str, torch.Tensor]]) -> None:
        while len(steps) < self.cfg.total_steps:
            for mb in self._next_minibatches():
                self._train_minibatch(mb, steps, snapshots)

    def _run_colocated(self, steps: list[StepRecord], snapshots: dict[int, dict[str, torch.Tensor]]) -> None:
        c = self.cfg
        for _ in range(c.num_batches):
            self._publish()
            self._load_newest()
            batch = [self._pending.popleft() for _ in range(c.prompts_per_batch)]
            self._inflight += len(batch)
            for i in range(0, len(batch), c.wave_groups):
                wave = batch[i:i + c.wave_groups]
                t_dispatch = self._now()
                samples = self._generate(wave)
                with self._cv:
                    self._complete(wave, samples, t_dispatch)
            mbs = self.policy.on_trainer_ready(self._now())
            if len(mbs) != c.num_minibatches:
                raise RunInvariantError(f"colocated: admission committed {len(mbs)} mini-batches for a complete "
                                        f"batch, expected {c.num_minibatches}")
            for mb in mbs:
                self._train_minibatch(mb, steps, snapshots)


def check_run(run: RunResult) -> None:
    """Raise ``RunInvariantError`` unless every trajectory was consumed exactly once and versions rose one per
    step."""
    c = run.config
    expected = c.num_batches * c.prompts_per_batch * c.group_size
    ids = [t.traj_id for t in run.trajectories]
    if len(ids) != expected or len(set(ids)) != expected:
        raise RunInvariantError(f"{len(set(ids))} distinct trajectories recorded, expected {expected} (lost)")
    untrained = [t.traj_id for t in run.trajectories if t.step < 0]
    if untrained:
        raise RunInvariantError(f"{len(untrained)} trajectories never trained, e.g. {untrained[:5]}")
    per_step: dict[int, int] = {}
    for t in run.trajectories:
        per_step[t.step] = per_step.get(t.step, 0) + 1
    if sum(per_step.values()) != expected:
        raise RunInvariantError("a trajectory was trained twice")
    versions = [s.version for s in run.steps]
    if versions != list(range(1, len(run.steps) + 1)):
        raise RunInvariantError(f"versions must rise by one per step, got {versions[:10]}...")
