"""The controller: metadata only (where each field lives, what is produced, admitted and consumed).

Why metadata only: in a single-controller design every byte crosses the controller (gather, repeat, split,
scatter), so the controller's memory bandwidth bounds the whole handoff. Here the controller answers "which
unit holds the trajectories of rank r's share" in a few hundred bytes and the bytes flow unit -> rank.

State machine of one (mini-batch, rank, field): not admitted -> admitted -> claimed (exactly once) -> acked.
When every rank has acked every produced field of an admitted mini-batch, its trajectories are released and the
units may drop them. All state lives under one lock; ``next_admitted`` waits on a condition variable (no
polling), which is how a prefetcher learns of the next mini-batch the moment it is admitted, and never before.

Every method validates its whole request before it changes anything. The production side -- ``register`` (a put's
records) and ``register_columns`` (a columnar put, ``columns``) -- is ``puts.PutRegistry``, mixed in.

Admission (``knittrans.handoff``): given an ``AdmissionPolicy``, the controller is also where admission runs. A
batch is announced with ``add_batch``; each put that carries a trajectory's ``meta`` completes it and hands it to
the policy, and every mini-batch the policy then commits is admitted at once, in order -- so mini-batches are
decided as trajectories complete, next to the metadata they need, on every transport. ``seal`` says no more
batches will come: a wait for a mini-batch beyond the last announced one then ends (``EndOfStream``) instead of
blocking. Versions: mini-batches are trained one optimizer step each, in admission order, so the ``seq``-th
admitted mini-batch is trained at policy version ``seq`` (``v_train``), and ``version`` counts released ones.

Faults (``knittrans.dataplane.faults``, docs/reliability.md): ``lose_unit`` marks every trajectory the unit held
that is still needed as *missing* (its metadata -- token count, admission -- is kept; its fields are gone); a claim
touching a missing trajectory raises ``DataLostError`` (``claim_next`` waits for the re-put instead), so a share
is never handed out partially. A re-put (to any live unit) restores it. ``unclaim`` returns a claimed, unacked
(rank, field) to the pool (a read that failed), and ``recover_rank`` does so for everything a crashed rank held
(at-least-once delivery; the trainer's ``StepLedger`` makes the step exactly once).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Mapping, Sequence

from knittrans.dataplane.assign import ShareItem, assign_shares
from knittrans.dataplane.idset import IdRanges
from knittrans.dataplane.puts import PutRegistry, _TrajState
from knittrans.dataplane.records import HandoffRecord, RecordLog
from knittrans.dataplane.recovery import ControllerJournal, JournalState, Released, rebuild
from knittrans.dataplane.sources import SourceTable
from knittrans.dataplane.types import (CLOCK_DOMAIN, AdmissionStateError, AdmittedMiniBatch, AlreadyConsumedError,
                                       DataLostError, DataPlaneClosedError, DataPlaneError, EndOfStream, FencedError,
                                       FieldNotProducedError, MiniBatchKey, Polled, PutRecord, ShareLocation,
                                       ShareRuns, TrajectorySchema, UnknownMiniBatchError)
from knittrans.dataplane.types import ControllerStats  # noqa: F401 - re-exported: the controller's counts
from knittrans.types import BatchPlan, MiniBatch, require_int, require_real

if TYPE_CHECKING:  # the admission package is only needed when a policy is passed in
    from knittrans.admission.base import AdmissionPolicy


@dataclass(frozen=True)
class ControllerConfig:
    """How the controller splits admitted mini-batches into shares."""

    rank_nodes: tuple[str, ...]
    """Node of each trainer rank, by rank (``len`` = number of ranks); ranks on a unit's node read it locally."""
    balance_slack: float = 0.05
    """Locality yields once a rank would exceed ``(1 + slack) * ideal`` tokens (see ``assign``)."""
    equal_counts: bool = True
    """Give every rank the same number of trajectories (+-1): DP ranks step on equal sample counts."""
    records_window: int | None = None
    """``records()`` keeps the released records of the last this many trained trajectories that carried metadata
    (64 B each, in columns: ``records.RecordLog``); None: all of them; 0: none (only unreleased ones are
    reported). With a window controller memory is flat however long the run (released trajectories and
    mini-batches are compacted either way)."""

    def __post_init__(self) -> None:
        if not self.rank_nodes:
            raise ValueError("ControllerConfig.rank_nodes must name at least one rank's node")
        # checked here, not at the first admission (where a bad slack used to fail the controller for good)
        require_real("ControllerConfig", "balance_slack", self.balance_slack, 0.0)
        require_int("ControllerConfig", "records_window", self.records_window, 0, optional=True)


@dataclass
class _MiniBatchState:
    admitted: AdmittedMiniBatch
    claimed: set[tuple[int, str]] = field(default_factory=set)  # (rank, field)
    acked: set[tuple[int, str]] = field(default_factory=set)
    released: bool = False
    t_admit: float = 0.0  # seconds since the controller started
    restored: bool = False  # rebuilt after a controller restart: its claims were not journaled (see ``ack``)
    claimers: dict[int, int] = field(default_factory=dict)
    """rank -> the incarnation (``rank_epoch``) whose fenced claim holds the rank's share: a retry of that claim by
    the same incarnation (its reply was lost) gets the same share again (``claim``)."""


class _PollWait:
    """A waiting ``Controller.poll`` or ``claim_many`` (``retired_since`` False) and its answer, once given."""

    __slots__ = ("seq", "rank", "fields", "limit", "epoch", "retired_since", "t_wait", "event", "result")

    def __init__(self, seq: int, rank: int, fields: tuple[str, ...], limit: int, epoch: int | None,
                 retired_since: "tuple[str, int] | None | bool") -> None:
        _check_seq(seq)
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise AdmissionStateError(f"claim_many: limit must be an int >= 1, got {limit!r}")
        self.seq, self.rank, self.fields, self.limit, self.epoch = seq, rank, fields, limit, epoch
        self.retired_since, self.t_wait = retired_since, time.perf_counter()
        self.event = threading.Event()
        self.result: Polled | None = None


def _check_seq(seq: object) -> None:
    if not isinstance(seq, int) or isinstance(seq, bool) or seq < 0:  # -1 would read the last mini-batch
        raise AdmissionStateError(f"seq must be an int >= 0 (an admission order), got {seq!r}")


class _WakingCondition(threading.Condition):
    """The controller's lock: ``notify_all`` also serves the waiting polls (``serve``, lock held), which wait on
    events: a poll wakes with its answer, or to raise, never only to check again -- a poll woken to check takes the
    lock, and behind an admission (which holds it for milliseconds) its answer, given in place meanwhile, waits too."""

    def __init__(self, serve: Callable[[], None]) -> None:
        super().__init__()
        self._serve = serve

    def notify_all(self) -> None:
        super().notify_all()
        self._serve()


class Controller(PutRegistry):
    """Metadata of one data plane. ``unit_nodes`` maps each storage unit id to its node. ``journal``: where the
    controller writes what only it knows, before it answers, so that a restarted controller can be rebuilt from
    the journal and the units (``restore``, ``knittrans.dataplane.recovery``); None: not recoverable."""

    def __init__(self, schema: TrajectorySchema, unit_nodes: Mapping[str, str], config: ControllerConfig,
                 policy: "AdmissionPolicy | None" = None, journal: ControllerJournal | None = None) -> None:
        if not unit_nodes:
            raise ValueError("Controller needs at least one storage unit")
        self.policy = policy
        self.schema = schema
        self.unit_nodes = dict(unit_nodes)
        self.config = config
        self._journal = journal
        self._shown_upto: int | None = None  # None: every admission is visible at once (``show_durable_only``)
        # A restart rebuilds the policy by replaying its inputs into a fresh copy of it (taken before any input).
        self._pristine = copy.deepcopy(policy) if journal is not None and policy is not None else None
        self._polls: list[_PollWait] = []  # long polls waiting (``poll``), answered in place when they can be
        self._cv = _WakingCondition(self._serve_polls_locked)
        self._durable: Callable[[], None] | None = None  # ``show_durable_only``'s in-lock flush, if the host has one
        self._reset_state()

    def _reset_state(self) -> None:
        """Every piece of volatile state, empty (what a controller process starts with)."""
        self._groups: dict[int, tuple[int, int]] = {}  # announced group -> (batch, declared size)
        self._arrived: dict[int, int] = {}  # group -> completed trajectories
        self._planned = 0  # mini-batches announced (M per batch)
        self._completed = 0
        self._sealed = False
        self._failure: BaseException | None = None  # an admission failure: every waiter re-raises it
        self._t0 = time.perf_counter()
        self._trajs: dict[int, _TrajState] = {}
        self._sources = SourceTable()  # where the rows' bytes lie (``knittrans.dataplane.sources``)
        self._mbs: dict[MiniBatchKey, _MiniBatchState] = {}
        self._log: list[MiniBatchKey] = []
        self._claims = 0
        self._released = 0
        self._missing: set[int] = set()
        self._units_lost = 0
        self._discarded = 0
        self._epochs: dict[int, int] = {}  # rank -> incarnation (recover_rank bumps it)
        # Compaction (bounded memory): a released mini-batch's trajectories leave ``_trajs`` and the mini-batch
        # leaves ``_mbs``; what stays is their ids as ranges, the released keys (one per step), and the records of
        # the last ``records_window`` trajectories that carried metadata (``RecordLog``).
        self._released_ids = IdRanges()
        self._released_keys: set[MiniBatchKey] = set()
        self._consumed_after_loss: set[int] = set()  # released while missing: a late re-put is not needed
        self._records = RecordLog(self.config.records_window)
        self._closed = False
        # Per announced batch (with a policy), until all its trajectories are released: its plan, size and how many
        # are released; then the batch's groups leave ``_groups``/``_arrived`` and its policy inputs the journal.
        self._plans: dict[int, BatchPlan] = {}
        self._batch_size: dict[int, int] = {}
        self._released_in_batch: dict[int, int] = {}
        self._restarts = 0
        self._skip_base = 0  # mini-batches skipped in batches a replay no longer sees (``_planned_now``)
        self._skip_journaled = 0

    @property
    def num_ranks(self) -> int:
        return len(self.config.rank_nodes)

    # -- admission (with a policy) ---------------------------------------------------------------------------

    def add_batch(self, plan: BatchPlan) -> None:
        """Announce training batch ``plan`` to the admission policy (batches train in the order announced)."""
        with self._cv:
            if self.policy is None:
                raise AdmissionStateError("add_batch needs a controller built with an admission policy")
            if self._plans.get(getattr(plan, "batch_id", None)) == plan:
                return  # a retried announcement (its reply was lost, e.g. across a controller restart): a no-op
            if self._closed or self._sealed:
                raise DataPlaneClosedError("the handoff is closed or sealed: no more batches")
            self.policy.add_batch(plan)  # validates the plan (AdmissionError) before anything changes
            self._note_batch_locked(plan)
            self._planned += self.policy.constraints.num_minibatches
            if self._journal is not None:
                self._journal.batch(plan, self._planned)
            self._admit_ready_locked()

    def _note_batch_locked(self, plan: BatchPlan) -> None:
        """Record an announced batch's groups (lock held; also the replay of a restart)."""
        for g in plan.groups:
            self._groups[g.group_id] = (plan.batch_id, g.size)
        self._plans[plan.batch_id] = plan
        self._batch_size[plan.batch_id] = sum(g.size for g in plan.groups)

    def seal(self) -> None:
        """No batch will be announced after this one: waits beyond the last mini-batch end (``EndOfStream``)."""
        with self._cv:
            self._sealed = True
            if self._journal is not None:
                self._journal.seal()
            self._cv.notify_all()

    def _admit_ready_locked(self) -> None:
        """Admit every mini-batch the policy commits now (it is asked until it commits nothing). A policy that
        fails (a batch it cannot split) fails the handoff: every waiter re-raises the error."""
        assert self.policy is not None
        before = len(self._log)
        try:
            while mbs := self.policy.on_trainer_ready(time.perf_counter() - self._t0):
                for mb in mbs:
                    self._admit_locked(mb)
            skipped = self._skip_base + getattr(self.policy.stats, "skipped_minibatches", 0)
            if self._journal is not None and skipped != self._skip_journaled:
                self._journal.count("skipped", skipped)
                self._skip_journaled = skipped
            if len(self._log) > before:
                self._admitted_durable_locked()
        except Exception as e:  # noqa: BLE001 - stored for every waiter, then re-raised to this caller
            self._failure = e
            self._cv.notify_all()
            raise

    # -- admission -------------------------------------------------------------------------------------------

    def admit(self, mb: MiniBatch) -> AdmittedMiniBatch:
        """Admit a mini-batch (the admission policy committed it) and split it into per-rank shares."""
        with self._cv:
            if self.policy is not None:
                raise AdmissionStateError("this controller admits through its own policy; admit() is for a "
                                          "controller without one")
            st = self._mbs.get(MiniBatchKey(mb.batch_id, mb.index)) if isinstance(mb, MiniBatch) else None
            if st is not None and st.admitted.traj_ids == tuple(mb.traj_ids):
                return st.admitted  # a retried admission (its reply was lost): the same decision, not a second one
            return self._admit_locked(mb)

    def _admit_locked(self, mb: MiniBatch) -> AdmittedMiniBatch:
        """Validate and admit ``mb`` (lock held)."""
        if not isinstance(mb, MiniBatch):
            raise AdmissionStateError(f"admit takes a MiniBatch, got {type(mb).__name__}")
        key = MiniBatchKey(mb.batch_id, mb.index)
        if self._closed:
            raise DataPlaneClosedError("controller is closed")
        if key in self._mbs:
            raise AdmissionStateError(f"mini-batch {key} was already admitted")
        if len(set(mb.traj_ids)) != len(mb.traj_ids):
            raise AdmissionStateError(f"mini-batch {key} lists a trajectory twice: {mb.traj_ids}")
        items = []
        for t in mb.traj_ids:
            st = self._trajs.get(t)
            if st is None and t in self._released_ids:
                raise AdmissionStateError(f"mini-batch {key}: trajectory {t} was already trained and released")
            if st is None or st.num_tokens is None:
                raise AdmissionStateError(f"mini-batch {key}: trajectory {t} was never put (its token field "
                                          f"{self.schema.token_field!r} is unknown)")
            if st.admitted_in is not None:
                raise AdmissionStateError(f"mini-batch {key}: trajectory {t} is already in {st.admitted_in}")
            items.append(ShareItem(t, st.num_tokens, self.unit_nodes.get(st.unit_id or "", "")))  # missing: no node
        shares = self._assign(items, mb)
        tokens = tuple(sum(self._trajs[t].num_tokens or 0 for t in s) for s in shares)
        local = sum(1 for r, s in enumerate(shares) for t in s
                    if self.unit_nodes.get(self._trajs[t].unit_id or "") == self.config.rank_nodes[r])
        adm = AdmittedMiniBatch(key=key, seq=len(self._log), traj_ids=tuple(mb.traj_ids), shares=shares,
                                share_tokens=tokens, local_fraction=local / max(1, len(items)),
                                group_ids=tuple(mb.group_ids))
        for t in mb.traj_ids:
            self._trajs[t].admitted_in = key
        self._mbs[key] = _MiniBatchState(adm, t_admit=time.perf_counter() - self._t0)
        self._log.append(key)
        if self._journal is not None:  # the shares are decided once: a restart restores them, never re-assigns
            self._journal.admit(adm, self._mbs[key].t_admit)
        self._cv.notify_all()
        return adm

    def _share_runs(self, traj_ids: Sequence[int], fields: Sequence[str], rank: int) -> ShareRuns | None:
        """Hook: a claimed share's runs (lock held; ``MMController`` adds the distinct images)."""
        return self._sources.runs([self._trajs[t].where for t in traj_ids], fields)

    def _assign(self, items: Sequence[ShareItem], mb: MiniBatch) -> tuple[tuple[int, ...], ...]:
        """Split an admitted mini-batch into per-rank shares (lock held). A subclass may refine it, e.g.
        ``knittrans.mmdedup.plane.MMController`` keeps GRPO groups whole."""
        return assign_shares(items, self.config.rank_nodes, self.config.balance_slack, self.config.equal_counts)

    def show_durable_only(self, flush: Callable[[], None] | None = None) -> None:
        """From now on an admission is visible to waiters (``next_admitted``, the feeds' polls) only once its host
        says it is durable (``show``: every answer follows the flush of what it reports). ``flush``: the host's
        journal flush, called under this lock by the call whose registration admitted (``_admit_ready_locked``),
        which then shows the admission and answers the waiting polls in place (``_serve_polls_locked``) instead of
        leaving them to its host's flush after the call and to whichever call takes the lock next."""
        with self._cv:
            self._shown_upto = len(self._log)
            self._durable = flush

    def admitted_count(self) -> int:
        """Mini-batches admitted so far (visible or not)."""
        with self._cv:
            return len(self._log)

    def show(self, count: int) -> None:
        """The first ``count`` admissions are durable: wake whoever waits for them (``show_durable_only``)."""
        with self._cv:
            self._show_locked(count)

    def _show_locked(self, count: int) -> None:
        if self._shown_upto is not None and count > self._shown_upto:
            self._shown_upto = min(count, len(self._log))
            self._cv.notify_all()

    def _admitted_durable_locked(self) -> None:
        """A call admitted (lock held): with a host flush (``show_durable_only``), write and show it now."""
        if self._durable is None or self._shown_upto is None:
            return
        count = len(self._log)  # every admission counted is queued in the journal already (``_admit_locked``)
        try:
            self._durable()
        except Exception:  # noqa: BLE001 - nothing shown; the host's flush after the call raises it to the caller
            return
        self._show_locked(count)

    def _shown(self) -> int:
        """Admissions visible to waiters (lock held)."""
        return len(self._log) if self._shown_upto is None else self._shown_upto

    def next_admitted(self, seq: int, timeout: float | None = None) -> AdmittedMiniBatch:
        """The ``seq``-th admitted mini-batch, waiting until it is admitted. Raises ``TimeoutError`` after
        ``timeout`` seconds, ``DataPlaneClosedError`` if the controller closes first."""
        _check_seq(seq)
        with self._cv:
            got: list[AdmittedMiniBatch | None] = []
            if not self._cv.wait_for(lambda: got.append(self._admitted_now_locked(seq)) or got[-1] is not None,
                                     timeout):
                raise TimeoutError(f"no mini-batch #{seq} admitted within {timeout} s")
            return got[-1]

    def _admitted_now_locked(self, seq: int) -> AdmittedMiniBatch | None:
        """The shown ``seq``-th mini-batch (lock held); None: not yet; raises past a release, failure, end, close."""
        if self._shown() > seq:
            key = self._log[seq]
            self._raise_released(key, f"#{seq} ")
            return self._mbs[key].admitted
        if self._failure is not None:
            raise self._failure
        if self._ended(seq):
            raise EndOfStream(f"the stream is sealed after {self._planned_now()} mini-batches: there is no #{seq}")
        if self._closed:
            raise DataPlaneClosedError(f"controller closed before mini-batch #{seq} was admitted")
        return None

    def _ended(self, seq: int) -> bool:
        return self._sealed and self.policy is not None and seq >= self._planned_now()

    def _planned_now(self) -> int:
        """Mini-batches the announced batches will have: M each, less what a policy skipped when it ended a used-up
        batch short (the greedy baseline; ``AdmissionStats.skipped_minibatches``)."""
        assert self.policy is not None
        return self._planned - self._skip_base - getattr(self.policy.stats, "skipped_minibatches", 0)

    def admitted(self, key: MiniBatchKey) -> AdmittedMiniBatch:
        with self._cv:
            st = self._mbs.get(key)
            if st is None:
                self._raise_released(key)
                raise UnknownMiniBatchError(f"mini-batch {key} was never admitted")
            return st.admitted

    # -- consumption -----------------------------------------------------------------------------------------

    def claim(self, key: MiniBatchKey, rank: int, fields: Sequence[str], epoch: int | None = None) -> ShareLocation:
        """Hand rank ``rank`` the locations of its share's ``fields``, exactly once per (mini-batch, rank,
        field). ``epoch``: the claimer's incarnation (``rank_epoch``); a superseded one raises ``FencedError``.

        Retries: a fenced claim (``epoch`` given) retried by the same incarnation before its ack -- its reply was lost
        -- gets the same share again (idempotent: nothing more is claimed, and the incarnation decides it never got
        the first reply). A second claim without an epoch, by another incarnation, or after the ack raises
        ``AlreadyConsumedError`` (exactly-once delivery)."""
        with self._cv:
            self._check_epoch(rank, epoch, f"claim of {key}")
            st = self._mbs.get(key)
            if st is None:
                self._raise_released(key)
                raise UnknownMiniBatchError(f"mini-batch {key} was never admitted (admitted: "
                                            f"{sorted((k.batch_id, k.index) for k in self._mbs)[-8:]} ...)")
            self._check_rank(rank)
            if not fields or len(set(fields)) != len(fields):
                raise FieldNotProducedError(f"fetch of {key} rank {rank}: fields must be non-empty and distinct, "
                                            f"got {list(fields)}")
            for name in fields:
                self.schema.get(name)  # raises FieldNotProducedError for a field outside the schema
            traj_ids = st.admitted.shares[rank]
            lost = [t for t in traj_ids if self._trajs[t].unit_id is None]
            if lost:
                raise DataLostError(f"fetch of {key} rank {rank}: trajectories {lost[:8]} were on a lost unit and "
                                    f"are not re-put yet; nothing was claimed (a share is never handed out partially)")
            nbytes = 0
            for t in traj_ids:
                produced = self._trajs[t].fields
                for name in fields:
                    if name not in produced:
                        raise FieldNotProducedError(f"fetch of {key} rank {rank}: field {name!r} of trajectory {t} "
                                                    f"was never produced")
                    nbytes += produced[name]
            done = [name for name in fields if (rank, name) in st.claimed]
            if done and not self._retried_claim(st, rank, fields, epoch):
                raise AlreadyConsumedError(f"rank {rank} already fetched {done} of mini-batch {key} (exactly-once "
                                           f"delivery; only the incarnation that claimed it, passing its epoch, may "
                                           f"retry a claim whose reply was lost, before its ack)")
            if not done:
                st.claimed.update((rank, name) for name in fields)
                self._claims += 1
                if epoch is None:
                    st.claimers.pop(rank, None)
                else:
                    st.claimers[rank] = epoch
            sums: tuple[tuple[int | None, ...], ...] = ()
            if any(self._trajs[t].checksums for t in traj_ids):
                sums = tuple(tuple(self._trajs[t].checksums.get(name) for t in traj_ids) for name in fields)
            return ShareLocation(key=key, rank=rank, traj_ids=traj_ids,
                                 unit_ids=tuple(self._trajs[t].unit_id or "" for t in traj_ids),
                                 fields=tuple(fields), nbytes=nbytes, checksums=sums, seq=st.admitted.seq,
                                 group_ids=st.admitted.group_ids,
                                 epoch=-1 if epoch is None else epoch, runs=self._share_runs(traj_ids, fields, rank),
                                 admitted_at=math.nan if st.restored else self._t0 + st.t_admit, clock=CLOCK_DOMAIN)

    @staticmethod
    def _retried_claim(st: _MiniBatchState, rank: int, fields: Sequence[str], epoch: int | None) -> bool:
        """Whether a claim of ``fields`` repeats the fenced claim of the same incarnation, none of it acked yet (a
        retry after a lost reply: ``claim`` answers it with the same share). The epoch itself was checked against
        the rank's current one before (``_check_epoch``)."""
        return (epoch is not None and st.claimers.get(rank) == epoch
                and all((rank, n) in st.claimed and (rank, n) not in st.acked for n in fields))

    def claim_next(self, seq: int, rank: int, fields: Sequence[str], timeout: float | None = None,
                   epoch: int | None = None) -> ShareLocation:
        """Wait for the ``seq``-th admitted mini-batch, then claim rank ``rank``'s share of it (one round trip
        for a prefetcher on a remote controller). ``TimeoutError`` if it is not admitted in time; nothing is
        claimed then."""
        return self.claim_many(seq, rank, fields, 1, timeout, epoch)[0]

    def claim_many(self, seq: int, rank: int, fields: Sequence[str], limit: int, timeout: float | None = None,
                   epoch: int | None = None) -> tuple[ShareLocation, ...]:
        """Wait for the ``seq``-th admitted mini-batch and the re-put of its share's lost trajectories, then claim rank
        ``rank``'s shares of it and of every later one shown, at most ``limit`` (``_poll_now_locked``). ``TimeoutError``
        (nothing claimed) if that takes longer than ``timeout``."""
        wait = _PollWait(seq, rank, tuple(fields), limit, epoch, False)
        with self._cv:
            got: list[Polled | None] = []
            if not self._cv.wait_for(lambda: got.append(self._poll_now_locked(wait)) or got[-1] is not None, timeout):
                raise TimeoutError(f"mini-batch #{seq} rank {rank}: not admitted (or lost rows re-put) in {timeout} s")
            return got[-1].locs

    def poll(self, seq: int, rank: int, fields: Sequence[str], limit: int, timeout: float | None = None,
             epoch: int | None = None, retired_since: tuple[str, int] | None = None) -> Polled:
        """A remote rank's long poll (``feed.ShareFeed``): ``claim_many`` fenced by ``epoch``, where ``epoch`` None
        is the rank's incarnation as this call arrives (``rank_epoch``: a consumer learns its incarnation from its
        first poll instead of a round trip of its own; one that started before a ``recover_rank`` is still fenced
        off, since the epoch is taken before the wait). A poll that finds nothing admitted within ``timeout``
        returns no shares (with the epoch) instead of raising: timing out is a long poll's normal answer. Every
        answer carries the sources retired since the poller's cursor ``retired_since`` (``SourceTable``): what the
        reader may let go of. The call that shows its mini-batch answers a waiting poll in place, under that call's
        lock (``_serve_polls_locked``), as does every other change (``notify_all``): a poll wakes with its answer, to
        raise, or at its timeout."""
        wait = _PollWait(seq, rank, tuple(fields), limit, epoch, retired_since)
        deadline = None if timeout is None else wait.t_wait + timeout
        with self._cv:
            self._check_rank(rank)
            wait.epoch = self._epochs.get(rank, 0) if epoch is None else epoch
        while True:
            with self._cv:
                polled = wait.result or self._poll_now_locked(wait)
                if polled is not None or (deadline is not None and time.perf_counter() >= deadline):
                    return polled or Polled(wait.epoch, (), self._sources.retired_since(retired_since))
                wait.event.clear()
                self._polls.append(wait)
            wait.event.wait(None if deadline is None else max(0.0, deadline - time.perf_counter()))
            if wait.result is not None:  # answered in place: no lock to take
                return wait.result
            with self._cv:
                if wait in self._polls:
                    self._polls.remove(wait)

    def _poll_now_locked(self, wait: "_PollWait") -> Polled | None:
        """``wait``'s shares if they can be claimed now (lock held; a share is never handed out in part); None: wait.
        The first claim raises what ``claim`` raises; a later share that cannot be claimed ends the list."""
        self._check_rank(wait.rank)
        adm = self._admitted_now_locked(wait.seq)
        if adm is None or (not self._closed and self._missing.intersection(adm.shares[wait.rank])):
            return None
        first = self.claim(adm.key, wait.rank, wait.fields, wait.epoch)
        out = [dataclasses.replace(first, waited_s=time.perf_counter() - wait.t_wait)]
        for s in range(wait.seq + 1, wait.seq + wait.limit):
            st = self._mbs.get(self._log[s]) if s < self._shown() else None
            if st is None or self._missing.intersection(st.admitted.shares[wait.rank]):
                break
            try:
                out.append(self.claim(st.admitted.key, wait.rank, wait.fields, wait.epoch))
            except DataPlaneError:
                break  # claimed already, or not produced yet: the rank's next poll asks for it
        retired = self._sources.retired_since(wait.retired_since) if wait.retired_since is not False else None
        return Polled(wait.epoch if wait.epoch is not None else -1, tuple(out), retired)

    def _serve_polls_locked(self) -> None:
        """Answer every waiting poll that can be answered now (lock held); one that would raise is woken to raise."""
        for wait in list(self._polls):
            try:
                wait.result = self._poll_now_locked(wait)
            except Exception:  # noqa: BLE001 - re-raised by the poll's own check
                wait.result = None
            else:
                if wait.result is None:
                    continue  # not yet: it keeps waiting
            self._polls.remove(wait)
            wait.event.set()

    def ack(self, key: MiniBatchKey, rank: int, fields: Sequence[str],
            epoch: int | None = None) -> tuple[tuple[str, tuple[int, ...]], ...]:
        """Rank ``rank`` holds its ``fields``. Returns ``(unit_id, traj_ids)`` pairs the units may now drop:
        non-empty exactly once, when the last rank acks the last produced field of the mini-batch. A superseded
        ``epoch`` (a zombie of a recovered rank) raises ``FencedError``."""
        with self._cv:
            self._check_epoch(rank, epoch, f"ack of {key}")
            st = self._mbs.get(key)
            if st is None:
                if key in self._released_keys:
                    return ()  # a repeated ack of a released (compacted) mini-batch: nothing more to do
                raise UnknownMiniBatchError(f"ack for mini-batch {key}, which was never admitted")
            missing = [n for n in fields if (rank, n) not in st.claimed]
            if missing and not st.restored:  # restored: claims before the restart were not journaled
                raise AdmissionStateError(f"ack of {missing} for {key} rank {rank} without a claim")
            st.acked.update((rank, n) for n in fields)
            if self._journal is not None:  # before the answer: the rank will not ack again
                self._journal.ack(key, rank, tuple(fields))
            if st.released:
                return ()
            if self._missing:
                for t in st.admitted.shares[rank]:
                    if t in self._missing and all((rank, n) in st.acked for n in self._trajs[t].fields):
                        self._missing.discard(t)  # read before its unit died: consumed, nothing to re-put
                if self._missing.intersection(st.admitted.traj_ids):
                    return ()  # a rank still needs a re-put: not every rank can have consumed it
            if any((r, n) not in st.acked for r in range(self.num_ranks) for n in self._produced(st, r)):
                return ()
            st.released = True
            self._released += 1
            self._missing.difference_update(st.admitted.traj_ids)
            self._cv.notify_all()
            by_unit: dict[str, list[int]] = {}
            for t in st.admitted.traj_ids:
                u = self._trajs[t].unit_id
                if u is not None:  # None: consumed after its unit was lost; nothing left to drop
                    by_unit.setdefault(u, []).append(t)
            released = self._compact_locked(st)
            if self._journal is not None:
                self._journal.ack(key, rank, (), released)
            return tuple((u, tuple(ts)) for u, ts in sorted(by_unit.items()))

    def _compact_locked(self, st: _MiniBatchState) -> Released:
        """Forget a released mini-batch's per-trajectory state (lock held; see ``_reset_state``), and the groups of
        every batch it finishes (all their trajectories released); returns what the journal records of it."""
        adm = st.admitted
        rows = []
        touched: set[int] = set()
        for t in adm.traj_ids:
            ts = self._trajs.pop(t)
            self._sources.release(ts.where)
            if ts.unit_id is None:
                self._consumed_after_loss.add(t)
            if ts.meta is not None:  # a row even with records_window 0: the staleness histogram counts it
                m = ts.meta
                rows.append((t, m.group_id, m.batch_id, m.num_tokens, m.v_gen, adm.seq, ts.t_complete, st.t_admit))
            if ts.meta is not None:
                b = ts.meta.batch_id
                self._released_in_batch[b] = self._released_in_batch.get(b, 0) + 1
                touched.add(b)
        self._records.extend(rows)
        done = tuple(sorted(b for b in touched if b in self._plans
                            and self._released_in_batch[b] >= self._batch_size[b]))
        for b in done:  # bounded memory: a finished batch's groups are never needed again
            for g in self._plans.pop(b).groups:
                self._groups.pop(g.group_id, None)
                self._arrived.pop(g.group_id, None)
            del self._batch_size[b], self._released_in_batch[b]
        self._released_ids.update(adm.traj_ids)
        self._forget_locked(adm.traj_ids)
        del self._mbs[adm.key]
        self._released_keys.add(adm.key)
        return Released(adm.key, adm.traj_ids, tuple(rows), done, self.config.records_window)

    def _forget_locked(self, traj_ids: Sequence[int]) -> None:
        """Hook: these trajectories were released and compacted (a subclass drops its own per-trajectory state)."""

    def _raise_released(self, key: MiniBatchKey, seq: str = "") -> None:
        if key in self._released_keys:
            raise AlreadyConsumedError(f"mini-batch {seq}{key} was released: every rank consumed it (exactly-once "
                                       f"delivery)")

    # -- faults and recovery (docs/reliability.md) -----------------------------------------------------------

    def lose_unit(self, unit_id: str) -> tuple[int, ...]:
        """Unit ``unit_id`` is gone with everything it held. Every trajectory on it that is not yet released
        becomes missing (metadata kept, fields forgotten) until a producer re-puts it; returns their ids.
        Idempotent (a second report of the same loss finds nothing more)."""
        with self._cv:
            if unit_id not in self.unit_nodes:
                raise AdmissionStateError(f"lose_unit: unknown unit {unit_id!r}")
            lost = []
            done: dict[MiniBatchKey, set[int]] = {}  # per admitted mini-batch: trajectories their rank consumed
            for t, st in self._trajs.items():
                if st.unit_id != unit_id:
                    continue
                if st.admitted_in is not None:
                    mb = self._mbs[st.admitted_in]
                    if mb.released:
                        continue  # consumed and dropped already: nothing lost
                    if st.admitted_in not in done:
                        done[st.admitted_in] = {x for r, share in enumerate(mb.admitted.shares)
                                                if all((r, n) in mb.acked for n in self._produced(mb, r))
                                                for x in share}
                    if t in done[st.admitted_in]:
                        continue  # its rank holds it already
                st.unit_id = None  # fields stay recorded (what was produced) until the re-put replaces them
                self._sources.release(st.where)  # its bytes went with the unit
                lost.append(t)
            if lost:
                self._units_lost += 1
                if self._journal is not None:
                    self._journal.count("units_lost", self._units_lost)
            self._missing.update(lost)
            self._cv.notify_all()
            return tuple(lost)

    def discard(self, traj_ids: Sequence[int]) -> tuple[tuple[str, tuple[int, ...]], ...]:
        """Forget orphaned trajectories (their producer died mid-group; nothing will complete them): metadata
        gone, so the same ids may be regenerated and put again. Returns ``(unit_id, traj_ids)`` pairs the units
        must drop. All or nothing: a trajectory already admitted (it will be trained) or already handed to the
        admission policy (completed) raises ``AdmissionStateError``; unknown ids are ignored (idempotent)."""
        with self._cv:
            ids = list(dict.fromkeys(traj_ids))
            for t in ids:
                if not isinstance(t, int) or isinstance(t, bool):
                    raise AdmissionStateError(f"discard: trajectory ids are ints, got {t!r}")
                st = self._trajs.get(t)
                if st is None and t in self._released_ids:
                    raise AdmissionStateError(f"discard: trajectory {t} was trained and released; only orphans "
                                              f"(never admitted) can be discarded")
                if st is None:
                    continue
                if st.admitted_in is not None:
                    raise AdmissionStateError(f"discard: trajectory {t} is admitted in {st.admitted_in} and will be "
                                              f"trained; only orphans (never admitted) can be discarded")
                if st.meta is not None and self.policy is not None:
                    raise AdmissionStateError(f"discard: trajectory {t} completed and was handed to the admission "
                                              f"policy; only orphans (no completing put) can be discarded")
            by_unit: dict[str, list[int]] = {}
            for t in ids:
                st = self._trajs.pop(t, None)
                if st is None:
                    continue
                self._sources.release(st.where)
                self._missing.discard(t)
                self._discarded += 1
                if st.unit_id is not None:
                    by_unit.setdefault(st.unit_id, []).append(t)
            if self._journal is not None:
                self._journal.count("discarded", self._discarded)
            self._cv.notify_all()
            return tuple((u, tuple(ts)) for u, ts in sorted(by_unit.items()))

    def missing(self) -> tuple[int, ...]:
        """Trajectories lost with a unit and not re-put yet (what producers must re-put)."""
        with self._cv:
            return tuple(sorted(self._missing))

    def unreleased(self, traj_ids: Sequence[int]) -> tuple[int, ...]:
        """Those of ``traj_ids`` still needed (not yet consumed by every rank and released): what a producer
        that keeps trajectories until they are acknowledged must still keep."""
        with self._cv:
            out = []
            for t in traj_ids:
                st = self._trajs.get(t)
                if st is None and t in self._released_ids:
                    continue  # released and compacted
                if st is None or st.admitted_in is None or not self._mbs[st.admitted_in].released:
                    out.append(t)
            return tuple(out)

    def untracked(self, traj_ids: Sequence[int]) -> tuple[int, ...]:
        """Those of ``traj_ids`` this controller has no record of (never registered, discarded, or -- after a
        restart -- lost with a unit before admission, so no unit reported them): what a producer that keeps its
        trajectories until they are released must put again (``ProducerBuffer.reput_missing``)."""
        with self._cv:
            return tuple(t for t in traj_ids if t not in self._trajs and t not in self._released_ids)

    def unclaim(self, key: MiniBatchKey, rank: int, fields: Sequence[str]) -> None:
        """Undo a claim whose delivery failed (unit lost, payload corrupt): the (rank, field)s that were claimed
        and not acked may be claimed again. Acked ones stay consumed."""
        with self._cv:
            st = self._mbs.get(key)
            if st is None:
                if key in self._released_keys:
                    return  # every rank consumed it: nothing to return to the pool
                raise UnknownMiniBatchError(f"unclaim of mini-batch {key}, which was never admitted")
            st.claimed.difference_update((rank, n) for n in fields if (rank, n) not in st.acked)
            if not any(r == rank and (r, n) not in st.acked for r, n in st.claimed):
                st.claimers.pop(rank, None)  # nothing of it is held: a later claim is a new one
            self._cv.notify_all()

    def recover_rank(self, rank: int) -> int:
        """A trainer rank crashed and restarts: return everything it claimed and did not ack to the pool, and
        return the admission sequence number it must resume from (its first mini-batch not fully acked)."""
        with self._cv:
            self._check_rank(rank)
            self._epochs[rank] = self._epochs.get(rank, 0) + 1  # fences off the old incarnation's claims and acks
            if self._journal is not None:
                self._journal.epoch(rank, self._epochs[rank])
            resume = len(self._log)
            for seq, key in enumerate(self._log):
                st = self._mbs.get(key)
                if st is None:  # released and compacted
                    continue
                st.claimed = {(r, n) for r, n in st.claimed if r != rank or (r, n) in st.acked}
                st.claimers.pop(rank, None)
                produced = self._produced(st, rank)
                if resume == len(self._log) and not st.released and any((rank, n) not in st.acked for n in produced):
                    resume = seq
            self._cv.notify_all()
            return resume

    def rank_epoch(self, rank: int) -> int:
        """Rank ``rank``'s current incarnation: 0 at start, +1 at every ``recover_rank``. A consumer reads it once
        when it starts and passes it with every claim and ack (fencing, see ``FencedError``)."""
        with self._cv:
            self._check_rank(rank)
            return self._epochs.get(rank, 0)

    def _check_epoch(self, rank: int, epoch: int | None, what: str) -> None:
        if epoch is not None and epoch != self._epochs.get(rank, 0):
            raise FencedError(f"{what} by rank {rank} incarnation {epoch}: recover_rank superseded it (now "
                              f"{self._epochs.get(rank, 0)}); a zombie of a crashed rank may not claim or ack")

    def _check_rank(self, rank: object) -> None:
        if not isinstance(rank, int) or isinstance(rank, bool):  # True would read rank 1's share
            raise AdmissionStateError(f"rank must be an int, got {rank!r}")
        if not 0 <= rank < self.num_ranks:
            raise AdmissionStateError(f"rank {rank} out of range: this data plane has {self.num_ranks} ranks")

    def _produced(self, st: _MiniBatchState, rank: int) -> set[str]:
        share = st.admitted.shares[rank]
        return set.intersection(*(set(self._trajs[t].fields) for t in share)) if share else set()

    def wait_released(self, count: int, timeout: float | None = None) -> int:
        """Wait until at least ``count`` mini-batches are released (flow control for producers); returns the
        number released. ``TimeoutError`` after ``timeout`` seconds."""
        with self._cv:
            if not self._cv.wait_for(lambda: self._closed or self._released >= count, timeout):
                raise TimeoutError(f"fewer than {count} mini-batches released within {timeout} s")
            if self._released < count:
                raise DataPlaneClosedError(f"controller closed with {self._released} < {count} released")
            return self._released

    # -- restart (knittrans.dataplane.recovery) --------------------------------------------------------------

    def restore(self, state: JournalState, manifests: Mapping[str, Sequence[PutRecord]]
                ) -> dict[str, list[int]]:
        """Rebuild this controller after a restart from its journal's ``state`` and the ``manifests`` of the live
        units (a unit absent is lost: its unreleased trajectories become missing). Everything volatile is
        discarded first, as in a new process. Returns ``unit -> trajectory ids`` the units must drop (released
        before the restart, or a second copy). ``RecoveryError`` if the replayed policy disagrees with the
        journal."""
        if self._journal is None:
            raise AdmissionStateError("restore needs a controller built with a journal")
        with self._cv:
            self._reset_state()
            if self._pristine is not None:
                self.policy = copy.deepcopy(self._pristine)
            drops = rebuild(self, state, manifests).drops
            if self._shown_upto is not None:  # replayed from the journal: durable
                self._shown_upto = len(self._log)
            self._cv.notify_all()
            return drops

    # -- lifecycle -------------------------------------------------------------------------------------------

    def close(self) -> None:
        """Wake every waiter with ``DataPlaneClosedError``; later admissions are refused."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()

    def stats(self) -> ControllerStats:
        with self._cv:
            return ControllerStats(len(self._trajs) + len(self._released_ids), len(self._log), self._claims,
                                   self._released, len(self._missing), self._units_lost, self._completed,
                                   self._planned, held=len(self._trajs), held_minibatches=len(self._mbs),
                                   released_id_ranges=len(self._released_ids.ranges),
                                   discarded=self._discarded, restarts=self._restarts,
                                   held_groups=len(self._groups))

    # -- versions and records --------------------------------------------------------------------------------

    @property
    def version(self) -> int:
        """Optimizer steps completed: mini-batches every rank has acknowledged (released), in admission order."""
        with self._cv:
            return self._released

    def wait_version(self, version: int, timeout: float | None = None) -> int:
        """Wait until ``version`` steps are complete (a rollout worker that syncs weights every k steps waits
        here); returns the version. ``TimeoutError`` after ``timeout`` s; an admission failure re-raises."""
        with self._cv:
            ok = self._cv.wait_for(lambda: self._closed or self._failure is not None or self._released >= version,
                                   timeout=timeout)
            if self._released >= version:
                return self._released
            if self._failure is not None:
                raise self._failure
            if self._closed:
                raise DataPlaneClosedError(f"controller closed at version {self._released} < {version}")
            assert not ok
            raise TimeoutError(f"version {version} not reached within {timeout} s (at {self._released})")

    def staleness_counts(self) -> tuple[tuple[int, int], ...]:
        """(staleness, trajectories) over every released trajectory that carried metadata, however small
        ``records_window`` is (``RecordLog.counts``), by staleness."""
        with self._cv:
            return tuple(sorted(self._records.counts.items()))

    def records(self) -> list[HandoffRecord]:
        """Every admitted trajectory that carried metadata (of the released ones, the last ``records_window``),
        with ``v_gen``, ``v_train`` and its times, by id."""
        with self._cv:
            out = self._records.rows()
            for t, st in self._trajs.items():
                if st.meta is None or st.admitted_in is None:
                    continue
                mb = self._mbs[st.admitted_in]
                m = st.meta
                out.append(HandoffRecord(t, m.group_id, m.batch_id, m.num_tokens, m.v_gen, mb.admitted.seq,
                                         st.t_complete, mb.t_admit, mb.released))
            return sorted(out, key=lambda r: r.traj_id)
