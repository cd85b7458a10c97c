"""The orchestrator: runs rollout and training through the handoff, in one of three modes.

Every trajectory takes the same path (``knittrans.handoff.Handoff``, built from ``RuntimeConfig``): the rollout
side scores a generated wave, turns each sample and its group-normalized advantage (and its request's images)
into a ``Rollout`` and ``put``s it; admission runs in the handoff's controller as trajectories complete (the
policy is built by the caller's ``make_policy``, e.g. ``baselines.admission.make_policy``: one implementation,
shared with the simulator); the trainer iterates ``consumer(0)``'s prefetched packed shares, runs one
``Learner.step`` per share and acks it after the step. Modes:

- ``colocated``: one thread takes turns: load the newest weights, generate a whole batch and put it, then train
  its M mini-batches (train-batch admission). Staleness is purely algorithmic: ``j`` for the j-th mini-batch.
- disaggregated (``train_batch``, ``knittrans``, ``greedy``, ``bounded_async``): a rollout thread generates
  groups in waves while the trainer (the calling thread) steps. Flow control and weight sync follow
  ``RuntimeConfig``: a group counts against the in-flight budget from dispatch until the step that consumes it
  (``share.group_ids``) has finished.

Task, engine and learner are the contracts of ``knittrans.runtime.protocols`` (text or multimodal alike). One
trainer rank: data-parallel ranks would each need a learner replica stepping on its own ``consumer(rank)``.

Concurrency: one ``threading.Condition`` guards the orchestrator's state (dispatch queue, in-flight count,
published weights, the error slot); each side waits on it, and each change notifies it. No sleep-polling. A
rollout failure closes the handoff's data plane, which wakes the trainer's consumer; the trainer re-raises it.

Invariants checked on every run (``RunResult`` is returned only if they hold): every dispatched trajectory is
consumed by exactly one step; versions increase by one per step; the ``seq``-th share is trained at version
``seq``; the handoff's records (``v_gen``, ``v_train``) equal the orchestrator's own; no trajectory is staler than
``RuntimeConfig.staleness_bound()`` (when enforced). A failing generation wave is retried or fails the run
(``RolloutWorkerError``); a group is never dropped silently; a run that cannot progress fails, never hangs.

Faults (docs/reliability.md): a wave that dies mid-group or runs past ``generation_timeout_s`` is abandoned and
regenerated under the retry policy (its partial output never reaches the handoff); a trainer crash drops the
rank's consumer with everything it prefetched, the controller returns the rank's unacked shares
(``recover_rank``) and a new consumer gets the crashed mini-batch again; the ``StepLedger`` keyed by (batch,
mini-batch index) applies each optimizer step once. ``RuntimeFaultPlan`` injects them.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections import deque
from typing import Callable, Iterator

import torch

from knittrans.admission.base import AdmissionPolicy
from knittrans.admission.minibatch import KnitTransAdmission
from knittrans.constraints import BatchConstraints
from knittrans.dataplane.faults import StepLedger
from knittrans.dataplane.types import PackedShare
from knittrans.handoff import Consumer, Handoff, HandoffConfig, Producer, Transport
from knittrans.runtime.config import OnRolloutError, RuntimeConfig
from knittrans.runtime.engine import GroupRequest, RolloutEngine, Sample, SamplingConfig
from knittrans.runtime.faults import (FaultLog, FaultyEngine, GenerationTimeoutError, RuntimeFaultPlan,
                                      TrainerCrashedError)
from knittrans.runtime.protocols import Learner, RLTask, StepResult
from knittrans.runtime.records import RunResult, StepRecord, TrajRecord
from knittrans.runtime.rollouts import to_rollout
from knittrans.runtime.trainer import group_advantages
from knittrans.types import AdmissionKind, BatchPlan, ExecutionMode, GroupSpec, SyncPolicy


class RolloutWorkerError(RuntimeError):
    """A generation wave failed (after its retries, if any); the groups it held are named."""


class StalenessBoundError(RuntimeError):
    """A trajectory was consumed staler than flow control guarantees: a bug in flow control or sync."""


class RunInvariantError(RuntimeError):
    """A trajectory was lost or trained twice, versions did not advance one per step, or the run stalled."""


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
    """Runs one ``RuntimeConfig`` with a learner, an engine and a task; ``make_policy`` builds its admission.
    Single use: ``run()`` builds the run's handoff and closes it at the end."""

    def __init__(self, cfg: RuntimeConfig, learner: Learner, engine: RolloutEngine, task: RLTask,
                 faults: RuntimeFaultPlan | None = None, make_policy: PolicyFactory = knittrans_policy) -> None:
        self.cfg = cfg
        self.learner = learner
        self.faults = faults or RuntimeFaultPlan()
        self.fault_log = FaultLog()
        self.engine = FaultyEngine(engine, self.faults, self.fault_log) if self.faults.engine_faults else engine
        self.task = task
        self._ledger: StepLedger[StepResult] = StepLedger()  # exactly-once steps across trainer restarts
        self._crashed: set[int] = set()
        self.sampling = SamplingConfig(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature)
        self.constraints = BatchConstraints(batch_size=cfg.prompts_per_batch * cfg.group_size,
                                            num_minibatches=cfg.num_minibatches,
                                            max_response_len=cfg.max_new_tokens, group_size=cfg.group_size)
        self.policy = make_policy(cfg.admission, self.constraints)
        self.handoff: Handoff | None = None  # built by run(), with the rollout side's producer and rank 0's consumer
        self._producer: Producer | None = None
        self._consumer: Consumer | None = None
        self._shares: Iterator[PackedShare] = iter(())
        self._cv = threading.Condition()
        self._pending: deque[GroupRequest] = deque()
        self._plans: list[BatchPlan] = []
        self._prompts: dict[int, object] = {}
        self._records: dict[int, TrajRecord] = {}
        self._inflight = 0  # groups dispatched and not yet consumed by a finished step
        self._steps_done = 0  # steps whose groups were released from flow control
        self._published: tuple[int, dict[str, torch.Tensor]] | None = None
        self._publish_s: list[float] = []
        self._error: BaseException | None = None
        self._stop = False
        self._plane_closed = False
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
                images, grids = tuple(getattr(p, "images", ())), tuple(getattr(p, "grids", ()))
                self._pending.append(GroupRequest(gid, b, tuple(p.prompt_ids), tids, images, grids))
                groups.append(GroupSpec(gid, b, c.group_size, prompt_tokens=len(p.prompt_ids)))
            self._plans.append(BatchPlan(b, tuple(groups)))

    def handoff_config(self) -> HandoffConfig:
        """The run's handoff: its batch constraints, transport and prefetch depth; one storage unit, one rank."""
        c = self.cfg
        # records_window=None: check_run reads every trajectory's record
        return HandoffConfig(self.constraints, transport=Transport(c.transport), multimodal=c.multimodal,
                             prefetch_depth=c.prefetch_depth, records_window=None)

    def _now(self) -> float:
        return time.perf_counter() - self._t0

    # -- public ------------------------------------------------------------------------------------------------

    def run(self) -> RunResult:
        if self.handoff is not None:
            raise RuntimeError("Orchestrator.run: an orchestrator runs once (build a new one)")
        self._t0 = time.perf_counter()
        self.handoff = Handoff(self.handoff_config(), self.policy)
        steps: list[StepRecord] = []
        snapshots: dict[int, dict[str, torch.Tensor]] = {}
        try:
            for plan in self._plans:
                self.handoff.add_batch(plan)
            self.handoff.seal()
            self._producer = self.handoff.producer()
            self._consumer = self.handoff.consumer(0)
            self._shares = iter(self._consumer)
            self._publish()
            # The engine starts from the learner's weights whatever it was built with (a reused engine, a vLLM
            # engine loaded from a checkpoint directory): version 0 is loaded unconditionally.
            assert self._published is not None
            self.engine.load_weights(self._published[1], self._published[0])
            if self.cfg.eval_every:
                snapshots[0] = self.learner.weights()
            if self.cfg.mode is ExecutionMode.COLOCATED:
                self._run_colocated(steps, snapshots)
            else:
                self._run_disaggregated(steps, snapshots)
            # Ray acks are one-way messages: wait until the controller has them all before reading its records.
            self.handoff.wait_version(self.cfg.total_steps, timeout=120)
            records, stats = self.handoff.records(), self.handoff.staleness()
            controller = self.handoff.stats()[0]
        finally:
            if isinstance(self.engine, FaultyEngine):
                self.engine.release()
            self._close_handoff()
        wall = self._now()
        local = self.cfg.transport is Transport.INPROCESS  # on Ray the policy's counters live in the actor
        result = RunResult(config=self.cfg, trajectories=sorted(self._records.values(), key=lambda r: r.traj_id),
                           steps=steps, wall_s=wall, engine=self.engine.stats, handoff_records=records,
                           staleness_stats=stats, controller=controller,
                           admission=self.policy.stats if local else None, publish_s=self._publish_s,
                           snapshots=snapshots, rollout_failures=self._failures,
                           faults_injected=dict(self.fault_log.injected),
                           faults_recovered=dict(self.fault_log.recovered))
        if self._ledger.version != len(steps):
            raise RunInvariantError(f"{self._ledger.version} distinct steps applied but {len(steps)} recorded")
        check_run(result)
        return result

    def _run_disaggregated(self, steps: list[StepRecord], snapshots: dict[int, dict[str, torch.Tensor]]) -> None:
        worker = threading.Thread(target=self._rollout_loop, name="rollout", daemon=True)
        worker.start()
        try:
            while len(steps) < self.cfg.total_steps:
                self._train_share(self._next_share(), steps, snapshots)
        finally:
            with self._cv:
                self._stop = True
                self._cv.notify_all()
            if isinstance(self.engine, FaultyEngine):
                self.engine.release()  # an injected stall must not hold the join below
            worker.join()

    def _close_handoff(self) -> None:
        """Stop the consumer and close the data plane, once (a failing rollout thread may have closed it)."""
        if self._consumer is not None:
            self._consumer.close()
        self._close_plane()

    def _close_plane(self) -> None:
        with self._cv:
            if self._plane_closed or self.handoff is None:
                return
            self._plane_closed = True
        self.handoff.plane.close()

    def _fail(self, error: BaseException) -> None:
        """The rollout side failed: record the error for the trainer and close the data plane, which ends the
        trainer's wait for its next share (the trainer then re-raises ``error``)."""
        with self._cv:
            if self._error is None:
                self._error = error
            self._cv.notify_all()
        self._close_plane()

    # -- weights -----------------------------------------------------------------------------------------------

    def _publish(self) -> None:
        t0 = time.perf_counter()
        w = self.learner.weights()
        self._publish_s.append(time.perf_counter() - t0)
        with self._cv:
            self._published = (self.learner.version, w)

    def _sync_due(self, share: PackedShare) -> bool:
        c = self.cfg
        if c.sync is SyncPolicy.EVERY_STEP:
            return True
        if c.sync is SyncPolicy.EVERY_K:
            return self.learner.version % c.sync_every == 0
        return share.key.index == c.num_minibatches - 1

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
        """Score a finished wave and put its trajectories through the handoff (which admits them). The
        orchestrator's records are written first: the trainer may receive a share the moment the put returns."""
        by_group: dict[int, list[Sample]] = {}
        for s in samples:
            by_group.setdefault(s.group_id, []).append(s)
        now = self._now()
        records, rollouts = {}, []
        for r in wave:
            got = by_group.get(r.group_id, [])
            if sorted(s.traj_id for s in got) != sorted(r.traj_ids):
                raise RolloutWorkerError(f"group {r.group_id}: engine returned trajectories "
                                         f"{sorted(s.traj_id for s in got)}, expected {sorted(r.traj_ids)}")
            rewards = [self.task.reward(self._prompts[r.group_id], s.response_ids) for s in got]
            for it in group_advantages(got, rewards, self.cfg.adv_eps):
                s = it.sample
                records[s.traj_id] = TrajRecord(s.traj_id, s.group_id, s.batch_id, len(s.response_ids), it.reward,
                                                s.v_gen, t_dispatch, now)
                rollouts.append(to_rollout(it, r, now))
        with self._cv:
            self._records.update(records)
        assert self._producer is not None
        self._producer.put(rollouts)

    def _rollout_loop(self) -> None:
        c = self.cfg
        try:
            while True:
                with self._cv:
                    while not (self._stop or (self._pending and self._inflight < c.budget)):
                        self._check_progress_locked()
                        if not self._pending:
                            return  # every group generated, put and admitted
                        self._cv.wait()
                    if self._stop:
                        return
                    k = min(c.wave_groups, c.budget - self._inflight, len(self._pending))
                    wave = [self._pending.popleft() for _ in range(k)]
                    self._inflight += k
                self._load_newest()
                t_dispatch = self._now()
                samples = self._generate(wave)
                self._complete(wave, samples, t_dispatch)
        except BaseException as e:  # noqa: BLE001 - handed to the trainer thread, which re-raises it
            self._fail(e)

    def _check_progress_locked(self) -> None:
        """Called by the rollout thread when it cannot dispatch (lock held). Admission runs only inside its puts,
        so while it waits the admitted count is final: once every group is put, every mini-batch must be
        admitted; before that, if the trainer has finished every admitted mini-batch, nothing can ever free the
        budget or admit more. Either way the run fails loudly instead of hanging."""
        assert self.handoff is not None
        c = self.cfg
        admitted = self.handoff.plane.controller_stats().admitted
        if not self._pending and admitted < c.total_steps:
            raise RunInvariantError(f"deadlock: admission {c.admission.value!r} committed {admitted} of "
                                    f"{c.total_steps} mini-batches after every group completed")
        if self._pending and admitted == self._steps_done:
            raise RunInvariantError(f"deadlock: admission {c.admission.value!r} commits nothing with "
                                    f"{self._inflight} groups in flight (budget {c.budget}) and "
                                    f"{len(self._pending)} waiting to be dispatched ({admitted} mini-batches "
                                    f"admitted, all trained)")

    # -- training ----------------------------------------------------------------------------------------------

    def _next_share(self) -> PackedShare:
        """The next share from the handoff; re-raises a rollout failure (which ended the consumer's stream)."""
        err: BaseException | None = None
        try:
            return next(self._shares)
        except StopIteration:
            pass
        except Exception as e:  # noqa: BLE001 - a closed plane's side effect when the rollout side failed
            err = e
        with self._cv:
            if self._error is not None:
                raise self._error from err
        if err is not None:
            raise err
        raise RunInvariantError(f"the handoff's stream ended after {self._steps_done} of {self.cfg.total_steps} steps")

    def _train_share(self, share: PackedShare, steps: list[StepRecord],
                     snapshots: dict[int, dict[str, torch.Tensor]]) -> None:
        step = len(steps)
        if share.seq != step or self.learner.version != step:
            raise RunInvariantError(f"share #{share.seq} ({share.key}) handed to step {step} at learner version "
                                    f"{self.learner.version}: the seq-th share must train at version seq")
        t_start = self._now()
        with self._cv:
            recs = [self._records[t] for t in share.traj_ids]
        for r in recs:
            if r.step >= 0:
                raise RunInvariantError(f"trajectory {r.traj_id} trained twice (steps {r.step} and {step})")
            r.v_train, r.t_train_start, r.step = step, t_start, step
            if self.cfg.enforce_staleness_bound and r.staleness > self.cfg.staleness_bound():
                raise StalenessBoundError(f"trajectory {r.traj_id} has staleness {r.staleness} > bound "
                                          f"{self.cfg.staleness_bound()} ({self.cfg.system}, budget {self.cfg.budget})")
        res, share = self._step_exactly_once(share, step)
        assert self._consumer is not None
        self._consumer.ack(share)  # after the optimizer step: a crash before it gets the share again
        steps.append(StepRecord(step=step, version=res.version, batch_id=share.key.batch_id,
                                minibatch_index=share.key.index, t_start=t_start, t_end=self._now(),
                                step_s=res.step_s, tokens=res.tokens,
                                mean_reward=sum(r.reward for r in recs) / len(recs),
                                mean_staleness=sum(r.staleness for r in recs) / len(recs), clip_frac=res.clip_frac,
                                loss=res.loss, kl=res.kl, encoder_patches=res.encoder_patches,
                                occurrence_patches=res.occurrence_patches))
        if self.cfg.eval_every and res.version % self.cfg.eval_every == 0:
            snapshots[res.version] = self.learner.weights()
        if self.cfg.mode is not ExecutionMode.COLOCATED and self._sync_due(share):
            self._publish()
        with self._cv:
            self._inflight -= len(share.group_ids)
            self._steps_done += 1
            self._cv.notify_all()

    def _step_exactly_once(self, share: PackedShare, step: int) -> tuple[StepResult, PackedShare]:
        """The optimizer step of ``share`` through the ledger. An injected crash restarts the trainer rank, which
        gets the mini-batch again from the handoff (``_redeliver``); the ledger, saved with the weights and
        optimizer state in every step's checkpoint, skips a step that was applied before the crash. Returns the
        step's result and the share that was finally stepped on (the one to ack)."""
        while True:
            try:
                res, fresh = self._ledger.apply(share.key, lambda s=share: self._apply(s, step))
                if fresh and self.faults.crashes_after(step) and step not in self._crashed:
                    self._crashed.add(step)
                    self.fault_log.inject("trainer_crash")
                    raise TrainerCrashedError(f"trainer crashed after the update of step {step} ({share.key})")
                return res, share
            except TrainerCrashedError:
                self.fault_log.recover("trainer_restart")
                share = self._redeliver(share)

    def _apply(self, share: PackedShare, step: int) -> StepResult:
        if self.faults.crashes_before(step) and step not in self._crashed:
            self._crashed.add(step)
            self.fault_log.inject("trainer_crash")
            raise TrainerCrashedError(f"trainer crashed during step {step} ({share.key}), before its update")
        return self.learner.step(share)

    def _redeliver(self, share: PackedShare) -> PackedShare:
        """Restart trainer rank 0 after a crash: its consumer goes with everything it prefetched, the controller
        returns every share the rank claimed and did not ack (``recover_rank``), and a new consumer resumes at
        the first mini-batch the rank has not acked -- the crashed one, which must come back unchanged."""
        assert self.handoff is not None and self._consumer is not None
        self._consumer.close()
        self.handoff.wait_version(share.seq, timeout=60)  # earlier (one-way, on Ray) acks have all arrived
        resume = self.handoff.plane.controller.recover_rank(0)
        if resume != share.seq:
            raise RunInvariantError(f"trainer restart resumes at mini-batch #{resume}, expected #{share.seq}")
        self._consumer = self.handoff.consumer(0, start_seq=resume)
        self._shares = iter(self._consumer)
        again = self._next_share()
        if again.key != share.key or again.traj_ids != share.traj_ids:
            raise RunInvariantError(f"after a trainer restart the handoff delivered {again.key} {again.traj_ids}, "
                                    f"expected {share.key} {share.traj_ids}")
        return again

    def _run_colocated(self, steps: list[StepRecord], snapshots: dict[int, dict[str, torch.Tensor]]) -> None:
        c = self.cfg
        assert self.handoff is not None
        for b in range(c.num_batches):
            self._publish()
            self._load_newest()
            batch = [self._pending.popleft() for _ in range(c.prompts_per_batch)]
            self._inflight += len(batch)
            for i in range(0, len(batch), c.wave_groups):
                wave = batch[i:i + c.wave_groups]
                t_dispatch = self._now()
                self._complete(wave, self._generate(wave), t_dispatch)
            admitted = self.handoff.plane.controller_stats().admitted
            if admitted != (b + 1) * c.num_minibatches:
                raise RunInvariantError(f"colocated: admission committed {admitted - b * c.num_minibatches} "
                                        f"mini-batches for a complete batch, expected {c.num_minibatches}")
            for _ in range(c.num_minibatches):
                self._train_share(self._next_share(), steps, snapshots)


def check_run(run: RunResult) -> None:
    """Raise ``RunInvariantError`` unless every trajectory was consumed exactly once, versions rose one per step,
    and the handoff's records (``v_gen``, ``v_train``) agree with the orchestrator's own accounting."""
    c = run.config
    expected = c.num_batches * c.prompts_per_batch * c.group_size
    ids = [t.traj_id for t in run.trajectories]
    if len(ids) != expected or len(set(ids)) != expected:
        raise RunInvariantError(f"{len(set(ids))} distinct trajectories recorded, expected {expected} (lost)")
    untrained = [t.traj_id for t in run.trajectories if t.step < 0]
    if untrained:
        raise RunInvariantError(f"{len(untrained)} trajectories never trained, e.g. {untrained[:5]}")
    versions = [s.version for s in run.steps]
    if versions != list(range(1, len(run.steps) + 1)):
        raise RunInvariantError(f"versions must rise by one per step, got {versions[:10]}...")
    handoff = {r.traj_id: r for r in run.handoff_records}
    if len(handoff) != len(run.handoff_records) or set(handoff) != set(ids):
        raise RunInvariantError(f"the handoff recorded {len(run.handoff_records)} trajectories "
                                f"({len(handoff)} distinct), the orchestrator {expected}")
    for t in run.trajectories:
        h = handoff[t.traj_id]
        if (h.v_gen, h.v_train, h.group_id, h.batch_id) != (t.v_gen, t.v_train, t.group_id, t.batch_id) \
                or not h.released:
            raise RunInvariantError(f"trajectory {t.traj_id}: the handoff recorded v_gen={h.v_gen} v_train={h.v_train} "
                                    f"released={h.released}, the orchestrator v_gen={t.v_gen} v_train={t.v_train}")
