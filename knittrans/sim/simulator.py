"""A discrete-event model of a disaggregated RL system: rollout engines, weight sync, flow control, trainer.

Model (every knob in ``knittrans.sim.config``):

- **Rollout.** E engines with C slots each run continuous batching: every decode step emits one token for every
  active sequence and takes ``tpot * (1 + load_alpha * active / C)`` seconds. A group's n samples start together
  on one engine (as ``SamplingParams(n=...)`` does), once it has n free slots; groups start in data-loader order.
  Between events the active set is constant, so each engine runs on a virtual token clock and the next completion
  time is computed in closed form: the cost is per trajectory, not per token.
- **Flow control.** Whether the next group may be dispatched: an in-flight budget in groups (dispatched and not
  yet consumed by the trainer; a consumed group frees its place when its step ends or when it starts,
  ``BudgetRelease``), AReaL's capacity rule, or unbounded.
- **Trainer.** One optimizer step per mini-batch, ``step_overhead + per_token * tokens`` seconds. When idle it asks
  the admission policy for mini-batches (after every step and whenever a trajectory completes).
- **Weight sync.** Every step, every k steps or every batch; both sides pause for ``cost`` seconds; in-flight
  requests continue (keeping their oldest version as ``v_gen``) or are aborted and regenerated.
- **Colocated mode.** Generation and training take turns on shared resources: batch b is generated with the
  weights after batch b-1, then trained, with a switch cost per batch.

Deterministic given the workload (which is generated from a seed): ties are broken by event sequence numbers.
Records per trajectory ``v_gen``, ``v_train`` and timestamps; per engine and trainer, busy and idle time.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from knittrans.admission.base import AdmissionPolicy, AdmissionStats
from knittrans.sim.config import BudgetRelease, FlowKind, SimConfig
from knittrans.types import ExecutionMode, InflightPolicy, MiniBatch, SyncPolicy, Trajectory, WorkloadBatch


class SimDeadlock(RuntimeError):
    """No event is left but trajectories remain unconsumed (e.g. a budget below one batch with train-batch
    admission, which must see the whole batch before it trains)."""


@dataclass
class TrajRecords:
    """Per-trajectory arrays, indexed by trajectory id (ids are 0..N-1 in data-loader order)."""

    batch: np.ndarray
    group: np.ndarray
    length: np.ndarray
    t_dispatch: np.ndarray
    t_start: np.ndarray
    t_complete: np.ndarray
    t_group_complete: np.ndarray
    t_consumed: np.ndarray  # start of the step that consumes it
    v_gen: np.ndarray
    v_train: np.ndarray
    step: np.ndarray  # global index of the consuming step
    mb_index: np.ndarray  # j: index of the consuming mini-batch within its batch

    @classmethod
    def empty(cls, n: int) -> "TrajRecords":
        f = lambda: np.full(n, np.nan)  # noqa: E731
        i = lambda: np.full(n, -1, dtype=np.int64)  # noqa: E731
        return cls(i(), i(), i(), f(), f(), f(), f(), f(), i(), i(), i(), i())

    @property
    def staleness(self) -> np.ndarray:
        return self.v_train - self.v_gen


@dataclass
class StepRecord:
    start: float
    end: float
    batch_id: int
    index: int
    size: int
    tokens: int
    violations: int


@dataclass
class SimResult:
    records: TrajRecords
    steps: list[StepRecord]
    syncs: list[tuple[float, float]]
    total_time: float
    engine_busy: np.ndarray  # seconds each engine had at least one active sequence (not paused)
    engine_slot_seconds: np.ndarray  # integral of active sequences over time, per engine
    wasted_tokens: int  # tokens generated then discarded (aborted at a sync)
    policy: str
    policy_stats: AdmissionStats
    num_minibatches: int
    timeline: list[tuple[float, int, int]] = field(default_factory=list)  # (t, engine, active)


class _Engine:
    __slots__ = ("idx", "heap", "tau", "last", "paused", "epoch", "busy", "slot_seconds", "slow")

    def __init__(self, idx: int) -> None:
        self.idx = idx
        # (virtual finish time, trajectory id); changed in place only (Simulator.heaps holds the same list)
        self.heap: list[tuple[float, int]] = []
        self.tau = 0.0  # tokens decoded per active sequence since start (virtual clock)
        self.last = 0.0
        self.paused = False
        self.epoch = 0
        self.busy = 0.0
        self.slot_seconds = 0.0
        self.slow = 1.0  # decode-step multiplier (interference from a trainer sharing the hardware)

    def advance(self, now: float, step_time: list[float]) -> None:
        """Run the virtual clock up to ``now``; ``step_time[n]`` is the decode-step time with n active sequences."""
        dt = now - self.last
        if dt > 0 and self.heap and not self.paused:
            n = len(self.heap)
            self.tau += dt / (step_time[n] * self.slow)
            self.busy += dt
            self.slot_seconds += dt * n
        self.last = now


_ENGINE, _TRAINER_DONE, _SYNC_DONE = 0, 1, 2


class Simulator:
    """Runs one admission policy over a list of workload batches. ``run()`` returns a ``SimResult``."""

    def __init__(self, cfg: SimConfig, policy: AdmissionPolicy, batches: Sequence[WorkloadBatch]) -> None:
        self.cfg = cfg
        self.policy = policy
        self.batches = list(batches)
        self.M = policy.constraints.num_minibatches
        self.B = policy.constraints.batch_size
        # flatten groups in data-loader order; trajectory ids are global
        self.groups: list[tuple[int, int, np.ndarray, range]] = []  # (batch idx, group id, lengths, traj ids)
        tid = 0
        for bi, wb in enumerate(self.batches):
            for g in wb.plan.groups:
                lens = np.asarray(wb.lengths[g.group_id], dtype=np.int64)
                if len(lens) != g.size:
                    raise ValueError(f"group {g.group_id}: {len(lens)} lengths for declared size {g.size}")
                self.groups.append((bi, g.group_id, lens, range(tid, tid + g.size)))
                tid += g.size
        self.N = tid
        self.rec = TrajRecords.empty(self.N)
        self.prompt_tokens = {g.group_id: g.prompt_tokens for wb in self.batches for g in wb.plan.groups}
        # per group: (group id, batch id, prompt tokens), as the policy's Trajectory needs them
        self.group_meta = [(gid, self.batches[bi].plan.batch_id, self.prompt_tokens[gid])
                           for bi, gid, _, _ in self.groups]
        sizes = [len(ids) for _, _, _, ids in self.groups]
        self.rec.batch[:] = np.repeat(np.array([m[1] for m in self.group_meta], dtype=np.int64), sizes)
        self.rec.group[:] = np.repeat(np.array([m[0] for m in self.group_meta], dtype=np.int64), sizes)
        if self.groups:
            self.rec.length[:] = np.concatenate([lens for _, _, lens, _ in self.groups])
        # Plain Python lists for the hot loops (numpy scalar reads and writes cost far more than list ones):
        self.traj_group: list[int] = np.repeat(np.arange(len(self.groups)), sizes).tolist()  # index into groups
        self.traj_length: list[int] = self.rec.length.tolist()  # response length
        self.traj_length_f: list[float] = self.rec.length.astype(np.float64).tolist()  # the same, as floats
        self.engines = [_Engine(i) for i in range(cfg.engine.num_engines)]
        self.heaps = [e.heap for e in self.engines]  # engine i's active sequences, for counting them fast
        self.traj_engine = np.full(self.N, -1, dtype=np.int64)
        # cfg.engine.step_time(n) for every possible active count (an engine never holds more than its slots)
        self.step_time = [cfg.engine.step_time(n) for n in range(cfg.engine.slots + 1)]
        self._colocated = cfg.mode is ExecutionMode.COLOCATED
        self._record_timeline = cfg.record_timeline

    # -- event plumbing -----------------------------------------------------------------------------------------

    def _push(self, t: float, kind: int, payload: int, epoch: int = 0) -> None:
        heapq.heappush(self.events, (t, next(self.seq), kind, payload, epoch))

    def _schedule_engine(self, e: _Engine) -> None:
        e.epoch += 1
        heap = e.heap
        if e.paused or not heap:
            return
        left = heap[0][0] - e.tau
        if not left > 0.0:  # max(0.0, left), inlined
            left = 0.0
        t = self.now + left * self.step_time[len(heap)] * e.slow
        heapq.heappush(self.events, (t, next(self.seq), _ENGINE, e.idx, e.epoch))

    def _note_timeline(self, e: _Engine) -> None:
        if self._record_timeline:
            self.timeline.append((self.now, e.idx, len(e.heap)))

    # -- main loop ----------------------------------------------------------------------------------------------

    def run(self) -> SimResult:
        self.now = 0.0
        self.events: list = []
        self.seq = itertools.count()
        self.version = 0
        self.engine_version = 0
        self.next_group = 0
        self.batches_added = 0
        self.inflight_groups = 0
        self.submitted = 0
        self.group_left = [len(g[3]) for g in self.groups]  # trajectories still generating, per group
        self.group_unconsumed = [len(g[3]) for g in self.groups]
        self.consumed = 0
        self.trainer_busy = False
        self.syncing = False
        self.train_queue: list[MiniBatch] = []
        self.steps: list[StepRecord] = []
        self.syncs: list[tuple[float, float]] = []
        self.timeline: list[tuple[float, int, int]] = []
        self.wasted = 0
        self.batches_trained = 0
        # v_gen and t_complete live in lists during the run (read and written per trajectory); _flush_records
        # copies them into self.rec
        self.v_gen: list[int] = self.rec.v_gen.tolist()
        self.t_complete: list[float] = self.rec.t_complete.tolist()
        try:
            self._loop()
        finally:
            self._flush_records()
        if self.consumed < self.N:
            raise SimDeadlock(
                f"{self.policy.name}: {self.N - self.consumed} of {self.N} trajectories never consumed at "
                f"t={self.now:.1f}s; groups dispatched {self.next_group}/{len(self.groups)}, in flight "
                f"{self.inflight_groups}, flow={self.cfg.flow}. Train-batch admission needs a budget of at "
                f"least one batch of groups.")
        for e in self.engines:
            e.advance(self.now, self.step_time)
        return SimResult(self.rec, self.steps, self.syncs, self.now,
                         np.array([e.busy for e in self.engines]), np.array([e.slot_seconds for e in self.engines]),
                         self.wasted, self.policy.name, self.policy.stats, self.M, self.timeline)

    def _loop(self) -> None:
        self._dispatch()
        self._trainer_poll()
        events, engines, pop = self.events, self.engines, heapq.heappop
        max_events, N = self.cfg.max_events, self.N
        handled = 0
        while events and self.consumed < N:
            t, _, kind, payload, epoch = pop(events)
            handled += 1
            if handled > max_events:
                raise RuntimeError(f"simulation exceeded max_events={max_events}")
            if kind == _ENGINE:
                e = engines[payload]
                if epoch != e.epoch:
                    continue  # stale: the engine's active set changed after this was scheduled
                self.now = t
                self._on_engine(e)
            elif kind == _TRAINER_DONE:
                self.now = t
                self._on_step_done(payload)
            else:
                self.now = t
                self._on_sync_done()

    def _flush_records(self) -> None:
        """Copy the per-trajectory state kept in lists during the run into ``self.rec``."""
        self.rec.v_gen[:] = self.v_gen
        self.rec.t_complete[:] = self.t_complete

    # -- rollout ------------------------------------------------------------------------------------------------

    def _flow_allows(self, size: int, batch_idx: int) -> bool:
        if self._colocated:
            return batch_idx == self.batches_trained and not self.trainer_busy and not self.syncing
        f = self.cfg.flow
        if f.kind is FlowKind.GROUPS:
            return self.inflight_groups < f.budget_groups
        if f.kind is FlowKind.AREAL:
            return self.submitted + size <= (f.eta + self.version // self.M + 1) * self.B
        return True

    def _dispatch(self) -> None:
        if self.cfg.engine.wave_groups:
            self._dispatch_waves()
            return
        slots, groups, heaps, rec, push = self.cfg.engine.slots, self.groups, self.heaps, self.rec, heapq.heappush
        while self.next_group < len(groups):
            bi, gid, lens, ids = groups[self.next_group]
            n = len(ids)
            if n > slots:
                raise ValueError(f"group {gid} has {n} samples but an engine has only {slots} slots")
            # head-of-line: groups start in data-loader order, each on the engine with the most free slots (the
            # lowest index among ties). All three checks are side-effect free: the cheap one, which usually blocks,
            # goes first.
            active = list(map(len, heaps))
            least = min(active)
            if slots - least < n:
                return
            e = self.engines[active.index(least)]
            if e.paused or not self._flow_allows(n, bi):
                return
            while self.batches_added <= bi:
                self.policy.add_batch(self.batches[self.batches_added].plan)
                self.batches_added += 1
            now = self.now
            e.advance(now, self.step_time)
            tau, heap = e.tau, e.heap
            a, b = ids.start, ids.stop  # a group's ids are contiguous
            for tid, length in zip(ids, self.traj_length_f[a:b]):
                push(heap, (tau + length, tid))
            rec.t_dispatch[a:b] = now
            rec.t_start[a:b] = now
            self.v_gen[a:b] = [self.engine_version] * n
            self.traj_engine[a:b] = e.idx
            self.next_group += 1
            self.inflight_groups += 1
            self.submitted += n
            self._note_timeline(e)
            self._schedule_engine(e)

    def _dispatch_waves(self) -> None:
        """Static batching: each idle engine takes up to ``wave_groups`` groups; the wave ends with its longest
        sequence, and all its sequences complete then."""
        eng_cfg = self.cfg.engine
        for e in self.engines:
            if e.heap or e.paused:
                continue
            wave = []
            while self.next_group < len(self.groups) and len(wave) < eng_cfg.wave_groups:
                bi, gid, lens, ids = self.groups[self.next_group]
                if sum(len(w[3]) for w in wave) + len(ids) > eng_cfg.slots:
                    raise ValueError(f"a wave of {eng_cfg.wave_groups} groups needs more than {eng_cfg.slots} slots")
                if not self._flow_allows(len(ids), bi):
                    break
                while self.batches_added <= bi:
                    self.policy.add_batch(self.batches[self.batches_added].plan)
                    self.batches_added += 1
                wave.append(self.groups[self.next_group])
                self.next_group += 1
                self.inflight_groups += 1
                self.submitted += len(ids)
            if not wave:
                return
            e.advance(self.now, self.step_time)
            longest = max(int(lens.max()) for _, _, lens, _ in wave)
            for _, _, lens, ids in wave:
                for tid in ids:
                    heapq.heappush(e.heap, (e.tau + float(longest), tid))
                a, b = ids.start, ids.stop
                self.rec.t_dispatch[a:b] = self.now
                self.rec.t_start[a:b] = self.now
                self.v_gen[a:b] = [self.engine_version] * len(ids)
                self.traj_engine[a:b] = e.idx
            self._note_timeline(e)
            self._schedule_engine(e)

    def _on_engine(self, e: _Engine) -> None:
        e.advance(self.now, self.step_time)
        heap = e.heap
        if heap[0][0] > e.tau:  # the event fires exactly at the first finish (no float drift)
            e.tau = heap[0][0]
        limit = e.tau + 1e-9
        done = []
        while heap and heap[0][0] <= limit:
            done.append(heapq.heappop(heap)[1])
        self._complete(done)
        if self._record_timeline:
            self._note_timeline(e)
        self._schedule_engine(e)
        self._dispatch()
        if not (self.trainer_busy or self.syncing):  # _trainer_poll's own guard, saving a call per event
            self._trainer_poll()

    def _complete(self, tids: list[int]) -> None:
        """Record the completion of ``tids`` (in this order) and hand each to the policy."""
        now, t_complete, v_gen, length = self.now, self.t_complete, self.v_gen, self.traj_length
        traj_group, group_left, groups, meta = self.traj_group, self.group_left, self.groups, self.group_meta
        on_complete = self.policy.on_complete
        for tid in tids:
            t_complete[tid] = now
            gi = traj_group[tid]
            group_left[gi] -= 1
            if group_left[gi] == 0:
                ids = groups[gi][3]
                self.rec.t_group_complete[ids.start:ids.stop] = now
            gid, batch_id, prompt_tokens = meta[gi]
            on_complete(Trajectory(traj_id=tid, group_id=gid, batch_id=batch_id, num_tokens=length[tid],
                                   v_gen=v_gen[tid], prompt_tokens=prompt_tokens, t_complete=now))

    # -- trainer ------------------------------------------------------------------------------------------------

    def _trainer_poll(self) -> None:
        if self.trainer_busy or self.syncing:
            return
        if not self.train_queue:
            self.train_queue.extend(self.policy.on_trainer_ready(self.now))
        if not self.train_queue:
            return
        mb = self.train_queue.pop(0)
        ids = np.fromiter(mb.traj_ids, dtype=np.int64, count=len(mb.traj_ids))
        if np.any(self.rec.v_train[ids] >= 0):
            raise AssertionError(f"mini-batch {mb.batch_id}/{mb.index} holds an already consumed trajectory")
        self.rec.v_train[ids] = self.version
        self.rec.t_consumed[ids] = self.now
        self.rec.step[ids] = len(self.steps)
        self.rec.mb_index[ids] = mb.index
        dur = self.cfg.trainer.step_time(mb.num_tokens)
        if self.cfg.trainer.interference and any(e.heap and not e.paused for e in self.engines):
            dur *= 1.0 + self.cfg.trainer.interference
        self._set_engine_slowdown(1.0 + self.cfg.engine.interference)
        self.steps.append(StepRecord(self.now, self.now + dur, mb.batch_id, mb.index, mb.size, mb.num_tokens,
                                     len(mb.violations)))
        self.trainer_busy = True
        self._current = mb
        self._push(self.now + dur, _TRAINER_DONE, len(self.steps) - 1)
        if self.cfg.flow.release is BudgetRelease.STEP_START:
            self._release(mb)
            self._dispatch()  # the freed budget lets rollout start new groups while this step computes

    def _release(self, mb: MiniBatch) -> None:
        """Free the budget of every group whose last trajectory ``mb`` consumes (``FlowConfig.release`` says when
        this runs: at the start or at the end of the consuming step)."""
        traj_group, unconsumed = self.traj_group, self.group_unconsumed
        for tid in mb.traj_ids:
            gi = traj_group[tid]
            unconsumed[gi] -= 1
            if unconsumed[gi] == 0:
                self.inflight_groups -= 1

    def _set_engine_slowdown(self, slow: float) -> None:
        if not self.cfg.engine.interference:
            return
        for e in self.engines:
            e.advance(self.now, self.step_time)  # progress so far at the old rate
            e.slow = slow
            self._schedule_engine(e)

    def _on_step_done(self, step_idx: int) -> None:
        mb = self._current
        self.trainer_busy = False
        self._set_engine_slowdown(1.0)
        self.version += 1
        if self.cfg.flow.release is BudgetRelease.STEP_END:
            self._release(mb)
        self.consumed += len(mb.traj_ids)
        last_of_batch = mb.index == self.M - 1
        if last_of_batch:
            self.batches_trained += 1
        s = self.cfg.sync
        if self.cfg.mode is ExecutionMode.COLOCATED:
            do_sync, cost = last_of_batch, self.cfg.colocated_switch_cost
        else:
            do_sync = (s.policy is SyncPolicy.EVERY_STEP
                       or (s.policy is SyncPolicy.EVERY_K and self.version % s.k == 0)
                       or (s.policy is SyncPolicy.EVERY_BATCH and last_of_batch))
            cost = s.cost
        if do_sync:
            self._start_sync(cost)
        else:
            self._dispatch()
            self._trainer_poll()

    # -- weight sync --------------------------------------------------------------------------------------------

    def _start_sync(self, cost: float) -> None:
        self.syncing = True
        for e in self.engines:
            e.advance(self.now, self.step_time)
            e.paused = True
            e.epoch += 1  # drop scheduled completions while paused
        self.syncs.append((self.now, self.now + cost))
        self._push(self.now + cost, _SYNC_DONE, 0)

    def _on_sync_done(self) -> None:
        self.syncing = False
        self.engine_version = self.version
        abort = self.cfg.sync.inflight is InflightPolicy.ABORT and self.cfg.mode is ExecutionMode.DISAGGREGATED
        for e in self.engines:
            e.paused = False
            e.last = self.now
            if abort and e.heap:
                restarted = []
                for fin, tid in e.heap:
                    length = float(self.traj_length[tid])
                    self.wasted += int(round(length - (fin - e.tau)))
                    restarted.append((e.tau + length, tid))
                    self.v_gen[tid] = self.engine_version
                self.rec.t_start[[tid for _, tid in restarted]] = self.now
                heapq.heapify(restarted)
                e.heap[:] = restarted
            self._schedule_engine(e)
        self._dispatch()
        self._trainer_poll()


def simulate(cfg: SimConfig, policy: AdmissionPolicy, batches: Sequence[WorkloadBatch]) -> SimResult:
    """Run one simulation (see ``Simulator``)."""
    return Simulator(cfg, policy, batches).run()
