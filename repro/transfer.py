"""Transfer table: exposed and raw transfer latency of the rollout-to-trainer handoff, per system, one run.

Systems, on the same trajectories (``workloads.text_data``, seeded), the same number of trainer ranks, the same
emulated compute (``knittrans.dataplane.harness``: matmuls proportional to tokens, calibrated once per run):

- ``centralized``: the verl DataProto path (``baselines.centralized``): gather on one driver, concat, repeat
  prompts, pad, balance, chunk, scatter through Ray; ranks split their chunk into mini-batches.
- ``transferqueue``: TransferQueue's KV API (``baselines.transferqueue_adapter``), when installed; each rank gets
  its share of each mini-batch when it needs it (no prefetch).
- ``knittrans-ray``: units and controller as Ray actors, ranks as Ray actors with the prefetcher.
- ``knittrans-ray-noprefetch``: the same without prefetch (what overlap buys).
- ``knittrans-inproc``: the embedded transport, ranks as threads of this process, with the prefetcher.

- ``centralized-padmax``: the same, padding to the configured maximum prompt/response lengths as verl's rollout
  does (``centralized`` pads to the batch's longest: a stronger baseline, the one the headline claim uses).

t0[b] = every trajectory of batch b complete (written to its unit / the object store / TransferQueue).

- The **exposed pass** is a steady-state RL loop: the ranks train ``num_batches`` consecutive batches of M
  mini-batches with compute; batch b+1 completes while batch b trains (when rank 0 starts step
  ``M - lead_steps`` of batch b). KnitTrans admits batch b+1 at t0[b+1] and its prefetcher may prepare
  mini-batch 0 during batch b's last step. The centralized driver does what verl's one-step-off and
  fully-async trainers do: it scatters batch b+1 only after batch b's update returns (it is blocked in it);
  with ``central_overlap="build_ahead"`` (one-step-off at best) it has already gathered, padded and balanced
  b+1 during batch b's step, with ``"serial"`` (fully-async: samples are pulled at the top of the next step)
  it does that after. Per mini-batch (b, k): the slowest rank's wait for data after it was ready, counted from
  ``max(ready, t0[b])``. The first ``warmup_batches`` batches (an idle trainer) are excluded.
- The **raw pass** is one batch without compute and without prefetch: t0 -> every rank holds its share of
  every mini-batch (no credit for overlap), and each get's latency.

Each batch uses fresh trajectory ids (data is consumed exactly once). Per system: ``repeats`` x (exposed pass,
raw pass), the exposed pass first (its unmeasured batch 0 warms every path up); the table reports medians.

Run: ``python -m repro.transfer workload=text`` (``logger=none`` to skip W&B; see conf/transfer.yaml).
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import hydra
import numpy as np
import ray
from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from baselines import transferqueue_adapter as tqa
from baselines.centralized import (CentralizedConfig, DenseBatch, balance_plan, build_dense_batch,
                                   rank_minibatches, real_tokens)
from knittrans.dataplane import (PrefetchConfig, Prefetcher, TrajectoryPayload, TrajectorySchema,
                                 build_inprocess)
from knittrans.dataplane.harness import (MiniBatchTiming, RankTrace, Signals, calibrate_iters_per_token,
                                         emulate_compute, memcpy_gbps, steady_state_exposed, summarize_exposed)
from knittrans.dataplane.ray_transport import RayDataPlane, build_ray
from knittrans.types import MiniBatch
from repro.logger import publish
from repro.results import Claim, Results
from workloads.text_data import TEXT_SCHEMA, TextDataConfig, make_text_batch
from workloads.multimodal_data import MMTransferWorkload  # issue 6: the multimodal section at the end

SYSTEMS = ("centralized", "centralized-padmax", "transferqueue", "knittrans-ray", "knittrans-ray-noprefetch",
           "knittrans-inproc")
PRIMARY = "knittrans-ray"  # the KnitTrans row the claims use: cross-process, like the baseline
BASELINE = "centralized"  # pads to the batch's longest (fewer bytes than verl); headline: the lower of it and -padmax


@dataclass
class TextWorkload:
    """The text workload's batch shape (``workloads.text_data.TextDataConfig``). Defaults: DAPO's per-trajectory
    shape (responses ~4.5k tokens on average, capped at 20480; prompts padded to 2048 by verl) at 1/8 of its
    batch (64 x 16 = 1024 trajectories, ~80 MB of fields), what a 2-core machine runs in ~3 minutes;
    ``scale=paper`` is DAPO's full batch (512 x 16 = 8192 trajectories, ~0.65 GB)."""

    num_prompts: int = 64
    """P: prompts per training batch."""
    group_size: int = 16
    """n: responses per prompt (B = P * n trajectories)."""
    prompt_len_mean: int = 256
    """Mean prompt length (tokens)."""
    response_len_median: int = 3300
    """Median response length; lognormal, long-tailed (3300 with sigma 0.8: mean ~4.4k tokens)."""
    response_len_sigma: float = 0.8
    """Lognormal sigma of response lengths."""
    max_response_len: int = 20480
    """Response length cap (verl ``data.max_response_length``; ``centralized-padmax`` pads to it)."""
    max_prompt_len: int = 2048
    """verl ``data.max_prompt_length`` (``centralized-padmax`` left-pads prompts to it)."""


@dataclass
class TransferConfig:
    """Configuration of ``python -m repro.transfer``."""

    workload: str = "text"
    """Which workload: "text" (``text`` below) or "multimodal" (``multimodal`` below; see ``run_multimodal``)."""
    text: TextWorkload = field(default_factory=TextWorkload)
    """Shape of the text workload."""
    multimodal: MMTransferWorkload = field(default_factory=MMTransferWorkload)
    """Shape of the multimodal workload (``workload=multimodal``: images through the encoding store of the data
    plane, ``knittrans.mmdedup.plane``, against ``baselines.centralized_mm``)."""
    systems: list[str] = field(default_factory=lambda: list(SYSTEMS))
    """Systems to run (subset of centralized, transferqueue, knittrans-ray, knittrans-ray-noprefetch,
    knittrans-inproc); transferqueue is skipped with a note when not installed."""
    scale: str = "default"
    """Label of the size preset (Hydra group ``scale``: ``default`` or ``paper``); recorded with the results."""
    num_minibatches: int = 4
    """M: mini-batches (optimizer steps) per training batch."""
    num_batches: int = 3
    """Consecutive training batches per exposed pass (the steady-state RL loop)."""
    warmup_batches: int = 1
    """Leading batches of each exposed pass left out of the exposed numbers (the trainer starts idle)."""
    lead_steps: int = 1
    """Batch b+1 completes when rank 0 starts step ``M - lead_steps`` of batch b (1: during its last step)."""
    central_overlap: str = "build_ahead"
    """What the centralized driver overlaps with batch b's training: "build_ahead" (gather, pad and balance
    b+1; one-step-off at best) or "serial" (nothing; fully-async). Either way the scatter waits for batch b."""
    num_ranks: int = 2
    """Trainer (data-parallel) ranks."""
    num_units: int = 2
    """KnitTrans storage units (one per logical node; rank r sits on node r mod num_units)."""
    compute_s_per_minibatch: float = 0.4
    """Calibrated emulated compute of one mini-batch on one rank at the mean share size (seconds)."""
    prefetch_depth: int = 1
    """Shares a KnitTrans rank prepares ahead."""
    repeats: int = 2
    """(exposed, raw) pass pairs per system; medians are reported (over ``repeats * (num_batches -
    warmup_batches)`` batches for exposed latency, over ``repeats`` raw passes)."""
    tq_storage_units: int = 2
    """TransferQueue SimpleStorage units."""
    ray_num_cpus: int = 8
    """Logical CPUs for the local Ray instance (TransferQueue needs >= 1 + its storage units)."""
    out_dir: str = "results/transfer-${workload}"
    """Where summary.json, table.md, config.yaml, meta.json and the plot go."""
    logger: str = "wandb"
    """"wandb" (offline unless WANDB_MODE=online) or "none"."""
    seed: int = 0
    """Seeds the workload."""


ConfigStore.instance().store(name="transfer_schema", node=TransferConfig)
# Size presets: ``python -m repro.transfer workload=text scale=paper``. ``default`` is TransferConfig's defaults.
ConfigStore.instance().store(group="scale", name="default", package="_global_", node={"scale": "default"})
ConfigStore.instance().store(group="scale", name="paper", package="_global_", node={
    "scale": "paper",
    # DAPO (Qwen2.5-32B): 512 prompts x 16 responses, 32 prompts per mini-batch, prompts <= 2k, responses <= 20k
    "text": {"num_prompts": 512, "group_size": 16, "prompt_len_mean": 256, "response_len_median": 3300,
             "response_len_sigma": 0.8, "max_response_len": 20480, "max_prompt_len": 2048},
    # multimodal (workload=multimodal): 448 x 448 images (1024 patches x 1176 fp32 = 4.8 MB each), 128 prompts x
    # n=8 x 2 images: 9.9 GB of pixel_values per batch with repetition, 1.2 GB distinct
    "multimodal": {"scale": "paper", "prompts": 128, "n": 8, "images_per_prompt": 2, "image_side": 448},
    "num_minibatches": 16,
    "num_ranks": 8,
    "num_units": 4,
    "ray_num_cpus": 16,
})


# -- the workload, fresh ids per pass -----------------------------------------------------------------------------


@dataclass(frozen=True)
class PassData:
    """One pass's trajectories: the workload's tensors under ids offset by the pass number (consumed once)."""

    batch_id: int
    payloads: tuple[TrajectoryPayload, ...]
    minibatches: tuple[MiniBatch, ...]
    prompts: tuple[np.ndarray, ...]
    prompt_of: dict[int, int]
    tokens: dict[int, int]
    group_size: int
    producer_of: dict[int, int]  # trajectory -> producer (rollout engine) index = its unit

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for p in self.payloads for a in p.tensors.values())


@dataclass(frozen=True)
class Workload:
    schema: TrajectorySchema
    make_pass: Callable[[int], PassData]
    description: str


def text_workload(cfg: TransferConfig) -> Workload:
    w = cfg.text
    base = make_text_batch(TextDataConfig(num_prompts=w.num_prompts, group_size=w.group_size,
                                          prompt_len_mean=w.prompt_len_mean,
                                          response_len_median=w.response_len_median,
                                          response_len_sigma=w.response_len_sigma,
                                          max_response_len=w.max_response_len, seed=cfg.seed))
    mbs = base.minibatches(cfg.num_minibatches)
    n = len(base.trajectories)

    def make_pass(p: int) -> PassData:
        off = p * n
        payloads = tuple(TrajectoryPayload(t.traj_id + off, t.payload().tensors) for t in base.trajectories)
        return PassData(
            batch_id=p, payloads=payloads,
            minibatches=tuple(MiniBatch(p, m.index, tuple(i + off for i in m.traj_ids), m.group_ids, m.num_tokens)
                              for m in mbs),
            prompts=base.prompts, prompt_of={t.traj_id + off: t.group_id for t in base.trajectories},
            tokens={t.traj_id + off: int(t.input_ids.shape[0]) for t in base.trajectories},
            group_size=w.group_size,
            producer_of={t.traj_id + off: t.group_id % cfg.num_units for t in base.trajectories})

    lens = np.array([t.response_len for t in base.trajectories])
    desc = (f"text: {w.num_prompts} prompts x {w.group_size} = {n} trajectories, response length median "
            f"{np.median(lens):.0f} / mean {lens.mean():.0f} / max {lens.max()} tokens, "
            f"{base.nbytes / 1e6:.1f} MB of fields")
    return Workload(TEXT_SCHEMA, make_pass, desc)


def make_workload(cfg: TransferConfig) -> Workload:
    if cfg.workload == "text":
        return text_workload(cfg)
    raise ValueError(f"workload must be 'text' (multimodal comes with its own issue), got {cfg.workload!r}")


# -- trainer ranks --------------------------------------------------------------------------------------------------

Obtain = Callable[[int], tuple[int, int, float]]  # step number within the call -> (nbytes, tokens, get seconds)
Notify = Callable[[tuple, float], None]  # (signal key, timestamp) -> None: what a rank reports at each step


def rank_loop(rank: int, num_minibatches: int, obtain: Obtain, iters_per_token: float,
              first_ask: float | None = None, num_batches: int = 1, first_batch: int = 0,
              on_step: Callable[[int, int], None] | None = None) -> RankTrace:
    """Get step i's data, then compute on it, for ``num_batches * num_minibatches`` steps (batch ``first_batch +
    i // M``, mini-batch ``i % M``). ``first_ask`` backdates the first request (a rank that was ready since then
    but received its data only as a call argument). ``on_step(batch, k)`` runs as step (batch, k) starts."""
    out = []
    for i in range(num_batches * num_minibatches):
        b, k = divmod(i, num_minibatches)
        t_ask = first_ask if (i == 0 and first_ask is not None) else time.perf_counter()
        nbytes, tokens, get_s = obtain(i)
        t_got = time.perf_counter()
        if on_step is not None:
            on_step(first_batch + b, k)
        emulate_compute(tokens, iters_per_token)
        out.append(MiniBatchTiming(k, t_ask, t_got, time.perf_counter(), get_s, nbytes, tokens, batch=first_batch + b))
    return RankTrace(rank, tuple(out))


def step_key(tag: int, batch: int, k: int) -> tuple:
    """Signal: rank 0 starts step k of batch ``batch`` of the exposed pass ``tag`` (its first batch id)."""
    return ("step", tag, batch, k)


def complete_key(tag: int, batch: int) -> tuple:
    """Signal: every trajectory of batch ``batch`` of pass ``tag`` is complete (value: t0)."""
    return ("complete", tag, batch)


def step_notifier(rank: int, tag: int, notify: Notify | None) -> Callable[[int, int], None] | None:
    """Rank 0 reports the start of each step (the rollout clock of the exposed pass runs off the trainer's)."""
    if notify is None or rank != 0:
        return None
    return lambda b, k: notify(step_key(tag, b, k), time.perf_counter())


def knittrans_obtain(client, rank: int, start_seq: int, schema: TrajectorySchema,
                     prefetcher: Prefetcher | None) -> Obtain:
    def obtain(i: int) -> tuple[int, int, float]:
        if prefetcher is not None:
            share = prefetcher.next(timeout=600)
            return share.nbytes, share.num_tokens, prefetcher.events[-1].fetch_s
        adm = client.controller.next_admitted(start_seq + i, timeout=600)
        t = time.perf_counter()
        share = client.fetch(adm.key, rank, schema.names)
        return share.nbytes, share.num_tokens, time.perf_counter() - t
    return obtain


@ray.remote(num_cpus=0, max_concurrency=64)
class SignalActor:
    """``Signals`` shared by the driver and the rank actors (threaded: waiters do not block setters)."""

    def __init__(self) -> None:
        self.signals = Signals()

    def set(self, key: tuple, value: float) -> None:
        self.signals.set(key, value)

    def wait(self, key: tuple, timeout: float | None = None) -> float:
        return self.signals.wait(key, timeout)


def ray_notify(signals: "ray.actor.ActorHandle | None") -> Notify | None:
    return None if signals is None else (lambda key, t: signals.set.remote(key, t))  # fire and forget


@ray.remote(num_cpus=0)
class RankActor:
    """A trainer rank in its own process (one torch thread, like one GPU's host thread)."""

    def __init__(self, rank: int) -> None:
        import torch

        torch.set_num_threads(1)
        self.rank = rank
        self.pf: Prefetcher | None = None
        self.last_done: float | None = None  # end of this rank's last step (when it was ready for the next)

    def ready(self) -> int:
        return self.rank

    def _done(self, trace: RankTrace) -> RankTrace:
        if trace.timings:
            self.last_done = trace.timings[-1].t_done
        return trace

    # KnitTrans ---------------------------------------------------------------------------------------------
    def kt_prepare(self, dp: RayDataPlane, start_seq: int, count: int, prefetch: bool, depth: int) -> None:
        self.client = dp.client()
        self.start_seq = start_seq
        self.pf = (Prefetcher(self.client, self.rank, dp.schema.names, PrefetchConfig(depth, 600.0),
                              start_seq=start_seq, count=count).start() if prefetch else None)

    def kt_run(self, num_minibatches: int, iters_per_token: float, num_batches: int = 1,
               signals: "ray.actor.ActorHandle | None" = None, tag: int = 0) -> RankTrace:
        obtain = knittrans_obtain(self.client, self.rank, self.start_seq, self.client.schema, self.pf)
        try:
            return self._done(rank_loop(self.rank, num_minibatches, obtain, iters_per_token, num_batches=num_batches,
                                        on_step=step_notifier(self.rank, tag, ray_notify(signals))))
        finally:
            if self.pf is not None:
                self.pf.close()

    # centralized -------------------------------------------------------------------------------------------
    def central_run(self, t0: float, chunk: DenseBatch, per_minibatch: int, iters_per_token: float,
                    batch: int = 0, signals: "ray.actor.ActorHandle | None" = None, tag: int = 0,
                    after_previous: bool = False) -> RankTrace:
        """Train one batch from its scattered chunk. ``after_previous``: this rank finished the previous batch
        and has been ready since then (steady state); otherwise it was idle since t0."""
        import torch

        t_start = time.perf_counter()
        mbs = rank_minibatches(chunk, per_minibatch)
        first_ask = self.last_done if (after_previous and self.last_done is not None) else t0

        def obtain(k: int) -> tuple[int, int, float]:
            mb = mbs[k]
            _ = {n: torch.from_numpy(np.asarray(a)) for n, a in mb.tensors.items()}  # ready-to-use tensors
            # get latency: mini-batch 0 waited from t0 through gather, build and scatter; the rest were local
            return mb.nbytes, real_tokens(mb), (t_start - max(t0, first_ask)) if k == 0 else 0.0
        return self._done(rank_loop(self.rank, len(mbs), obtain, iters_per_token, first_ask=first_ask,
                                    first_batch=batch, on_step=step_notifier(self.rank, tag, ray_notify(signals))))

    # TransferQueue -----------------------------------------------------------------------------------------
    def tq_attach(self) -> None:
        tqa.attach()

    def tq_run(self, shares: list[list[tuple[int, ...]]], schema: TrajectorySchema, partitions: list[str],
               iters_per_token: float, t0: float | None = None, signals: "ray.actor.ActorHandle | None" = None,
               tag: int = 0) -> RankTrace:
        """``shares[b][k]``: this rank's trajectory ids of mini-batch k of batch b (in ``partitions[b]``). With
        ``signals``, batch b is fetched only once the driver signals it complete; else all is complete at t0."""
        m = len(shares[0])

        def obtain(i: int) -> tuple[int, int, float]:
            b, k = divmod(i, m)
            if k == 0 and signals is not None:
                ray.get(signals.wait.remote(complete_key(tag, b), 600))
            s = tqa.get(shares[b][k], schema.names, schema, partitions[b])
            return s.nbytes, s.tokens, s.get_s
        return self._done(rank_loop(self.rank, m, obtain, iters_per_token, first_ask=t0, num_batches=len(shares),
                                    on_step=step_notifier(self.rank, tag, ray_notify(signals))))


# -- one pass per system -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PassResult:
    """One measured pass of one system."""

    exposed: tuple[tuple[float, ...], ...]  # per measured batch, per mini-batch: slowest rank (exposed pass)
    raw_s: float  # t0 -> every rank holds every share (raw pass), else nan
    get_s: tuple[float, ...]  # every (mini-batch, rank) get latency
    bytes_moved: int  # per batch


def _finish(traces: Sequence[RankTrace], t0: float, raw: bool, bytes_moved: int) -> PassResult:
    """A raw pass: one batch, t0 -> every rank holds every share."""
    gets = tuple(m.fetch_s for tr in traces for m in tr.timings)
    if raw:
        return PassResult((), max(m.t_got for tr in traces for m in tr.timings) - t0, gets, bytes_moved)
    return PassResult((tuple(summarize_exposed(traces, t0)),), float("nan"), gets, bytes_moved)


def finish_steady(traces: Sequence[RankTrace], t0: dict[int, float], warmup: int, bytes_per_batch: int) -> PassResult:
    """An exposed pass over several batches: per measured batch, per mini-batch exposed latency."""
    gets = tuple(m.fetch_s for tr in traces for m in tr.timings if m.batch >= warmup)
    return PassResult(tuple(tuple(row) for row in steady_state_exposed(traces, t0, warmup)), float("nan"), gets,
                      bytes_per_batch)


def merge_traces(per_batch: Sequence[Sequence[RankTrace]]) -> list[RankTrace]:
    """Each rank's traces of consecutive calls (one per batch) joined into one trace."""
    by_rank: dict[int, list[MiniBatchTiming]] = {}
    for traces in per_batch:
        for tr in traces:
            by_rank.setdefault(tr.rank, []).extend(tr.timings)
    return [RankTrace(r, tuple(ts)) for r, ts in sorted(by_rank.items())]


def rank_nodes(cfg: TransferConfig) -> tuple[str, ...]:
    return tuple(f"node{r % cfg.num_units}" for r in range(cfg.num_ranks))


def unit_nodes(cfg: TransferConfig) -> dict[str, str]:
    return {f"unit{u}": f"node{u}" for u in range(cfg.num_units)}


def put_by_producer(put: Callable[[str, list[TrajectoryPayload]], None], data: PassData) -> None:
    """Each rollout engine (producer) writes its trajectories to the unit on its node."""
    by_unit: dict[int, list[TrajectoryPayload]] = {}
    for p in data.payloads:
        by_unit.setdefault(data.producer_of[p.traj_id], []).append(p)
    for u, ps in sorted(by_unit.items()):
        put(f"unit{u}", ps)


def completion_times(cfg: TransferConfig, datas: Sequence[PassData], wait_step: Callable[[tuple], float],
                     complete: Callable[[int], None]) -> dict[int, float]:
    """The rollout clock of an exposed pass: batch 0 completes now; batch b >= 1 completes when rank 0 starts
    step ``M - lead_steps`` of batch b-1. ``complete(b)`` runs at t0[b] (admit it, or announce it)."""
    m, tag, t0 = len(datas[0].minibatches), datas[0].batch_id, {}
    for b in range(len(datas)):
        if b:
            wait_step(step_key(tag, b - 1, m - cfg.lead_steps))
        t0[b] = time.perf_counter()
        complete(b)
    return t0


class KnitTransRay:
    def __init__(self, cfg: TransferConfig, schema: TrajectorySchema, ranks: list, prefetch: bool,
                 signals: "ray.actor.ActorHandle") -> None:
        self.cfg, self.ranks, self.prefetch, self.signals = cfg, ranks, prefetch, signals
        self.dp = build_ray(schema, unit_nodes(cfg), rank_nodes(cfg))
        self.admitted = 0

    def run_raw(self, data: PassData) -> PassResult:
        driver = self.dp.client()
        put_by_producer(lambda u, ps: driver.put(ps, unit=u), data)
        m = len(data.minibatches)
        ray.get([r.kt_prepare.remote(self.dp, self.admitted, m, False, self.cfg.prefetch_depth) for r in self.ranks])
        runs = [r.kt_run.remote(m, 0.0) for r in self.ranks]
        t0 = time.perf_counter()
        for mb in data.minibatches:
            driver.admit(mb)
        self.admitted += m
        traces = ray.get(runs)
        return _finish(traces, t0, True, sum(x.nbytes for tr in traces for x in tr.timings))

    def run_steady(self, datas: Sequence[PassData], iters_per_token: float) -> PassResult:
        driver = self.dp.client()
        for d in datas:  # written by the producers while they generated (before t0), as for every system
            put_by_producer(lambda u, ps: driver.put(ps, unit=u), d)
        m, n, tag = len(datas[0].minibatches), len(datas), datas[0].batch_id
        ray.get([r.kt_prepare.remote(self.dp, self.admitted, n * m, self.prefetch, self.cfg.prefetch_depth)
                 for r in self.ranks])
        runs = [r.kt_run.remote(m, iters_per_token, n, self.signals, tag) for r in self.ranks]

        def admit(b: int) -> None:
            for mb in datas[b].minibatches:
                driver.admit(mb)
        t0 = completion_times(self.cfg, datas, lambda key: ray.get(self.signals.wait.remote(key, 600)), admit)
        self.admitted += n * m
        traces = ray.get(runs)
        return finish_steady(traces, t0, self.cfg.warmup_batches, datas[0].nbytes)

    def close(self) -> None:
        self.dp.close()


class KnitTransInProc:
    def __init__(self, cfg: TransferConfig, schema: TrajectorySchema) -> None:
        self.cfg = cfg
        self.dp = build_inprocess(schema, unit_nodes(cfg), rank_nodes(cfg))
        self.admitted = 0

    def _run(self, datas: Sequence[PassData], iters_per_token: float, prefetch: bool,
             signals: Signals | None) -> tuple[list[RankTrace], dict[int, float]]:
        for d in datas:
            put_by_producer(lambda u, ps: self.dp.client(u).put(ps), d)
        m, n, tag = len(datas[0].minibatches), len(datas), datas[0].batch_id
        traces: list[RankTrace | None] = [None] * self.cfg.num_ranks
        started = threading.Barrier(self.cfg.num_ranks + 1)

        def rank_thread(r: int) -> None:
            client = self.dp.client()
            pf = (Prefetcher(client, r, self.dp.schema.names, PrefetchConfig(self.cfg.prefetch_depth, 600.0),
                             start_seq=self.admitted, count=n * m).start() if prefetch else None)
            obtain = knittrans_obtain(client, r, self.admitted, self.dp.schema, pf)
            started.wait()
            try:
                traces[r] = rank_loop(r, m, obtain, iters_per_token, num_batches=n,
                                      on_step=step_notifier(r, tag, None if signals is None else signals.set))
            finally:
                if pf is not None:
                    pf.close()

        threads = [threading.Thread(target=rank_thread, args=(r,)) for r in range(self.cfg.num_ranks)]
        for th in threads:
            th.start()
        started.wait()

        def admit(b: int) -> None:
            for mb in datas[b].minibatches:
                self.dp.controller.admit(mb)
        if signals is None:
            t0 = {0: time.perf_counter()}
            admit(0)
        else:
            t0 = completion_times(self.cfg, datas, lambda key: signals.wait(key, 600), admit)
        self.admitted += n * m
        for th in threads:
            th.join()
        done = [t for t in traces if t is not None]
        if len(done) != len(traces):
            raise RuntimeError("a KnitTrans in-process rank thread failed (see its traceback above)")
        return done, t0

    def run_raw(self, data: PassData) -> PassResult:
        traces, t0 = self._run([data], 0.0, prefetch=False, signals=None)
        return _finish(traces, t0[0], True, sum(x.nbytes for tr in traces for x in tr.timings))

    def run_steady(self, datas: Sequence[PassData], iters_per_token: float) -> PassResult:
        traces, t0 = self._run(datas, iters_per_token, prefetch=True, signals=Signals())
        return finish_steady(traces, t0, self.cfg.warmup_batches, datas[0].nbytes)

    def close(self) -> None:
        self.dp.close()


@dataclass(frozen=True)
class Prepared:
    """A batch as the centralized driver scatters it: one dense chunk per rank, and the bytes it moved."""

    chunks: list[DenseBatch]
    per_minibatch: int
    bytes_moved: int  # gathered (ragged) + scattered (dense)


class Centralized:
    def __init__(self, cfg: TransferConfig, ranks: list, signals: "ray.actor.ActorHandle",
                 pad_to: str = "longest") -> None:
        if cfg.central_overlap not in ("build_ahead", "serial"):
            raise ValueError(f"central_overlap must be 'build_ahead' or 'serial', got {cfg.central_overlap!r}")
        self.cfg, self.ranks, self.signals = cfg, ranks, signals
        w = cfg.text
        self.config = CentralizedConfig(pad_to=pad_to, max_prompt_len=w.max_prompt_len,
                                        max_response_len=w.max_response_len)

    @staticmethod
    def stage(data: PassData) -> list:
        """Rollout outputs sit in the object store (each engine's return value) when the batch completes."""
        by_producer: dict[int, list[TrajectoryPayload]] = {}
        for p in data.payloads:
            by_producer.setdefault(data.producer_of[p.traj_id], []).append(p)
        return [ray.put(ps) for _, ps in sorted(by_producer.items())]

    def prepare(self, refs: list, data: PassData) -> Prepared:
        gathered = ray.get(refs)  # 1. gather on the driver
        gather_bytes = sum(int(a.nbytes) for chunk in gathered for p in chunk for a in p.tensors.values())
        plan = balance_plan(data.minibatches, data.tokens, self.cfg.num_ranks)  # 3. balance
        batch = build_dense_batch(gathered, data.prompts, data.prompt_of, data.group_size, plan,
                                  self.config)  # 2. concat, repeat, pad
        chunks = batch.chunk(self.cfg.num_ranks)  # 4. scatter (the chunks travel as call arguments)
        return Prepared(chunks, plan.per_minibatch, gather_bytes + sum(c.nbytes for c in chunks))

    def run_raw(self, data: PassData) -> PassResult:
        refs = self.stage(data)
        t0 = time.perf_counter()
        prep = self.prepare(refs, data)
        traces = ray.get([r.central_run.remote(t0, c, prep.per_minibatch, 0.0)
                          for r, c in zip(self.ranks, prep.chunks)])
        return _finish(traces, t0, True, prep.bytes_moved)

    def run_steady(self, datas: Sequence[PassData], iters_per_token: float) -> PassResult:
        """verl's driver loop across batches: batch b+1 is scattered only after batch b's update returns; with
        ``build_ahead`` its gather, pad and balance already ran while batch b trained."""
        refs = [self.stage(d) for d in datas]
        m, tag = len(datas[0].minibatches), datas[0].batch_id
        t0: dict[int, float] = {}
        finished: list[list[RankTrace]] = []
        running: list | None = None
        for b, data in enumerate(datas):
            if b:
                ray.get(self.signals.wait.remote(step_key(tag, b - 1, m - self.cfg.lead_steps), 600))
            t0[b] = time.perf_counter()
            prep = self.prepare(refs[b], data) if (b == 0 or self.cfg.central_overlap == "build_ahead") else None
            if running is not None:
                finished.append(ray.get(running))  # the driver is blocked in batch b-1's update_actor
            if prep is None:
                prep = self.prepare(refs[b], data)
            running = [r.central_run.remote(t0[b], c, prep.per_minibatch, iters_per_token, b, self.signals, tag,
                                            b > 0) for r, c in zip(self.ranks, prep.chunks)]
            bytes_per_batch = prep.bytes_moved
            del prep
        finished.append(ray.get(running))
        return finish_steady(merge_traces(finished), t0, self.cfg.warmup_batches, bytes_per_batch)

    def close(self) -> None:
        pass


class TransferQueueSystem:
    def __init__(self, cfg: TransferConfig, schema: TrajectorySchema, ranks: list,
                 signals: "ray.actor.ActorHandle") -> None:
        self.cfg, self.schema, self.ranks, self.signals = cfg, schema, ranks, signals
        tqa.start(tqa.TQConfig(num_storage_units=cfg.tq_storage_units))
        ray.get([r.tq_attach.remote() for r in ranks])

    def _shares(self, data: PassData) -> list[list[tuple[int, ...]]]:
        """Per rank, per mini-batch: the same balanced rows the centralized baseline trains on."""
        plan = balance_plan(data.minibatches, data.tokens, self.cfg.num_ranks)
        per = plan.per_minibatch
        return [[plan.rows_per_rank[r][k * per:(k + 1) * per] for k in range(len(data.minibatches))]
                for r in range(self.cfg.num_ranks)]

    def run_raw(self, data: PassData) -> PassResult:
        partition = f"pass{data.batch_id}"
        tqa.put(list(data.payloads), self.schema, partition)
        shares = self._shares(data)
        t0 = time.perf_counter()
        traces = ray.get([rk.tq_run.remote([shares[r]], self.schema, [partition], 0.0, t0)
                          for r, rk in enumerate(self.ranks)])
        tqa.clear([p.traj_id for p in data.payloads], partition)
        return _finish(traces, t0, True, sum(x.nbytes for tr in traces for x in tr.timings))

    def run_steady(self, datas: Sequence[PassData], iters_per_token: float) -> PassResult:
        partitions = [f"pass{d.batch_id}" for d in datas]
        for d, part in zip(datas, partitions):
            tqa.put(list(d.payloads), self.schema, part)
        shares = [self._shares(d) for d in datas]  # [batch][rank][k]
        tag = datas[0].batch_id
        runs = [rk.tq_run.remote([shares[b][r] for b in range(len(datas))], self.schema, partitions,
                                 iters_per_token, None, self.signals, tag) for r, rk in enumerate(self.ranks)]
        t0 = completion_times(self.cfg, datas, lambda key: ray.get(self.signals.wait.remote(key, 600)),
                              lambda b: ray.get(self.signals.set.remote(complete_key(tag, b), time.perf_counter())))
        traces = ray.get(runs)
        for d, part in zip(datas, partitions):
            tqa.clear([p.traj_id for p in d.payloads], part)
        return finish_steady(traces, t0, self.cfg.warmup_batches, datas[0].nbytes)

    def close(self) -> None:
        tqa.close()


# -- the table ---------------------------------------------------------------------------------------------------


@dataclass
class SystemSummary:
    system: str
    exposed_per_mb: list[float]  # steady state, by mini-batch position k (median over measured batches)
    exposed_total_s: float  # steady state, per batch (median over measured batches of the sum over k)
    raw_transfer_s: float
    get_latency_s: float
    bytes_moved: int
    gbps: float
    memcpy_fraction: float
    measured_batches: int = 0


def _median_cols(rows: Sequence[Sequence[float]]) -> list[float]:
    return [statistics.median(c) for c in zip(*rows)]


def summarize(system: str, exposed: list[PassResult], raw: list[PassResult], memcpy: float) -> SystemSummary:
    batches = [row for p in exposed for row in p.exposed]
    per_mb = _median_cols(batches)
    raw_s = statistics.median(p.raw_s for p in raw)
    get_s = statistics.median(statistics.mean(p.get_s) for p in raw)
    nbytes = raw[0].bytes_moved
    gbps = nbytes / raw_s / 1e9
    return SystemSummary(system, per_mb, statistics.median(sum(row) for row in batches), raw_s, get_s, nbytes,
                         gbps, gbps / memcpy, len(batches))


def _start_ray(cfg: TransferConfig) -> None:
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if not ray.is_initialized():
        ray.init(address="local", include_dashboard=False, log_to_driver=False, configure_logging=False,
                 num_cpus=max(cfg.ray_num_cpus, tqa.required_ray_cpus(cfg.tq_storage_units) + 1))


def warm_object_store(cfg: TransferConfig, probe: PassData) -> int:
    """Write once through as much of the object store as the largest system will use (the centralized baseline
    in steady state: two dense pad-to-max batches plus the staged ragged batches), capped at 80% of its
    capacity. The first write to fresh shared-memory pages pays page faults that would otherwise be charged to
    whichever system runs first (measured: ~1.7x longer exposed passes for the first system). Returns bytes."""
    w, rows = cfg.text, len(probe.payloads)
    dense = rows * ((w.max_prompt_len + w.max_response_len) * 3 * 8 + w.max_response_len * (4 + 4 + 1))
    want = 2 * dense + (cfg.num_batches + 1) * probe.nbytes
    n = int(min(want, 0.8 * ray.available_resources().get("object_store_memory", 0)))
    if n > 0:
        ref = ray.put(np.ones(n, dtype=np.uint8))
        ray.get(ref)
        del ref
    return n


def make_system(name: str, cfg: TransferConfig, schema: TrajectorySchema, ranks: list, signals):  # noqa: ANN201
    if name in ("centralized", "centralized-padmax"):
        return Centralized(cfg, ranks, signals, pad_to="max" if name == "centralized-padmax" else "longest")
    if name == "transferqueue":
        return TransferQueueSystem(cfg, schema, ranks, signals)
    if name == "knittrans-inproc":
        return KnitTransInProc(cfg, schema)
    return KnitTransRay(cfg, schema, ranks, prefetch=(name == "knittrans-ray"), signals=signals)


def check_steady(cfg: TransferConfig) -> None:
    if cfg.num_batches <= cfg.warmup_batches or cfg.warmup_batches < 0:
        raise ValueError(f"num_batches ({cfg.num_batches}) must exceed warmup_batches ({cfg.warmup_batches}) >= 0")
    if not 1 <= cfg.lead_steps <= cfg.num_minibatches:
        raise ValueError(f"lead_steps must be in [1, num_minibatches={cfg.num_minibatches}], got {cfg.lead_steps}")


def measure_systems(cfg: TransferConfig, wl: Workload, systems: Sequence[str], make: Callable[[str], object],
                    iters_per_token: float | dict[str, float], memcpy: float, first_pass: int = 0,
                    ) -> dict[str, SystemSummary]:
    """Per system: ``repeats`` x (exposed steady-state pass over ``num_batches`` fresh batches, raw pass over one),
    each batch with fresh trajectory ids. ``iters_per_token`` may differ per system (``repro.speedup`` charges
    each system its own measured training step)."""
    from tqdm import tqdm

    summaries: dict[str, SystemSummary] = {}
    bar = tqdm(total=len(systems) * 2 * cfg.repeats, desc=f"transfer-{cfg.workload}", disable=None)
    pass_no = first_pass

    def fresh(count: int) -> list[PassData]:
        nonlocal pass_no
        out = [wl.make_pass(pass_no + i) for i in range(count)]
        pass_no += count
        return out
    try:
        for name in systems:
            sysm = make(name)
            ipt = iters_per_token[name] if isinstance(iters_per_token, dict) else iters_per_token
            exposed, raw = [], []
            try:  # no separate warm-up: the first batch of an exposed pass runs every path once, unmeasured
                for p in range(cfg.repeats):
                    bar.set_postfix_str(f"{name} pass {p + 1} exposed ({cfg.num_batches} batches)")
                    exposed.append(sysm.run_steady(fresh(cfg.num_batches), ipt))
                    bar.update()
                    bar.set_postfix_str(f"{name} pass {p + 1} raw")
                    raw.append(sysm.run_raw(fresh(1)[0]))
                    bar.update()
            finally:
                sysm.close()
            summaries[name] = summarize(name, exposed, raw, memcpy)
    finally:
        bar.close()
    return summaries


def run(cfg: TransferConfig) -> Results:
    import torch

    if cfg.workload == "multimodal":  # issue 6: images deduplicated in the data plane (section at the end)
        return run_multimodal(cfg)
    unknown = [s for s in cfg.systems if s not in SYSTEMS]
    if unknown:
        raise ValueError(f"unknown systems {unknown}; choose from {list(SYSTEMS)}")
    check_steady(cfg)
    torch.set_num_threads(1)
    wl = make_workload(cfg)
    results = Results(table=f"transfer-{cfg.workload}", out_dir=cfg.out_dir)
    memcpy = memcpy_gbps()
    probe = wl.make_pass(0)
    share_tokens = sum(probe.tokens.values()) / (cfg.num_minibatches * cfg.num_ranks)
    iters_per_token = calibrate_iters_per_token(cfg.compute_s_per_minibatch, int(share_tokens))
    systems = list(cfg.systems)
    notes = []
    if "transferqueue" in systems and not tqa.transferqueue_available():
        systems.remove("transferqueue")
        notes.append("transferqueue is not installed (pip install transferqueue): its row and claim are skipped.")
    need_ray = any(s != "knittrans-inproc" for s in systems)
    if need_ray:
        _start_ray(cfg)
    ranks = [RankActor.remote(r) for r in range(cfg.num_ranks)] if need_ray else []
    signals = SignalActor.remote() if need_ray else None
    if ranks:
        ray.get([r.ready.remote() for r in ranks])
        warm_object_store(cfg, probe)
    try:
        summaries = measure_systems(cfg, wl, systems, lambda name: make_system(name, cfg, wl.schema, ranks, signals),
                                    iters_per_token, memcpy)
    finally:
        if need_ray:
            ray.shutdown()
    fill_results(results, cfg, summaries, memcpy, wl.description, iters_per_token, notes)
    return results


def fill_results(results: Results, cfg: TransferConfig, s: dict[str, SystemSummary], memcpy: float,
                 description: str, iters_per_token: float, notes: list[str]) -> None:
    m = cfg.num_minibatches
    for x in s.values():
        results.rows.append({"system": x.system, "exposed_per_mb_s": x.exposed_total_s / m,
                             "exposed_total_s": x.exposed_total_s, "exposed_mb0_s": x.exposed_per_mb[0],
                             "exposed_rest_s": sum(x.exposed_per_mb[1:]),
                             "raw_transfer_s": x.raw_transfer_s, "get_latency_s": x.get_latency_s,
                             "bytes_moved": x.bytes_moved, "gbps": x.gbps, "memcpy_fraction": x.memcpy_fraction,
                             "measured_batches": x.measured_batches,
                             **{f"exposed_mb{k}_s": v for k, v in enumerate(x.exposed_per_mb)}})
    kt = s.get(PRIMARY)

    def ratio(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None or b <= 0 else a / b

    steady = (f"steady state: median over {cfg.repeats} passes x {cfg.num_batches - cfg.warmup_batches} batches "
              f"(first {cfg.warmup_batches} of each pass excluded) of the exposed latency summed over a batch's "
              f"{m} mini-batches")
    # Headline: the stronger baseline. Pad-to-longest moves fewer bytes by construction, but on a shared 2-core
    # machine its measured exposed time can land above pad-to-max (noise, run order); so the headline divides by
    # the lower of the two measurements, never flattering KnitTrans. Each padding mode is also reported alone.
    bases = [x for x in (s.get(BASELINE), s.get("centralized-padmax")) if x is not None]
    if bases and kt:
        best = min(bases, key=lambda x: x.exposed_total_s)
        r = ratio(best.exposed_total_s, kt.exposed_total_s)
        results.claims.append(Claim("exposed_latency_ratio", paper=10.0, measured=r, unit="x",
                                    holds=r is not None and r >= 10.0,
                                    note=f"stronger baseline ({best.system}: the lower measured of "
                                         f"{', '.join(x.system for x in bases)}) / knittrans-ray, {steady}; "
                                         f"target >= 10 (KnitTrans <= 10% of baseline)"))
        best = min(bases, key=lambda x: x.raw_transfer_s)
        r = ratio(best.raw_transfer_s, kt.raw_transfer_s)
        results.claims.append(Claim("raw_transfer_ratio", paper=None, measured=r, unit="x",
                                    holds=r is not None and r > 1.0,
                                    note=f"{best.system} (the lower measured) / knittrans-ray, one batch, t0 -> "
                                         f"every rank holds every share, no prefetch and no compute; target > 1"))
    for base_name, what in ((BASELINE, "pad to the batch's longest, stronger than verl"),
                            ("centralized-padmax", "pad to the configured max, as verl does")):
        base = s.get(base_name)
        if base and kt:
            r = ratio(base.exposed_total_s, kt.exposed_total_s)
            results.claims.append(Claim(f"exposed_latency_ratio_{base_name.replace('-', '_')}", paper=None,
                                        measured=r, unit="x", holds=r is not None and r > 1.0,
                                        note=f"{base_name} ({what}) / knittrans-ray, {steady}; target > 1"))
    if "knittrans-inproc" in s and bases:
        best = min(bases, key=lambda x: x.exposed_total_s)
        r = ratio(best.exposed_total_s, s["knittrans-inproc"].exposed_total_s)
        results.claims.append(Claim("exposed_latency_ratio_inproc", paper=10.0, measured=r, unit="x",
                                    holds=r is not None and r >= 10.0,
                                    note=f"{best.system} (the lower measured) / knittrans-inproc (embedded "
                                         f"transport), {steady}; target >= 10"))
    tq = s.get("transferqueue")
    if kt:
        r = ratio(tq.get_latency_s, kt.get_latency_s) if tq else None
        results.claims.append(Claim("tq_get_latency_ratio", paper=None, measured=r, unit="x",
                                    holds=r is not None and r > 1.0,
                                    note=("transferqueue / knittrans-ray mean get latency per (mini-batch, rank); "
                                          "target > 1" if tq else "transferqueue not installed")))
    for x in s.values():
        results.claims.append(Claim(f"bytes_moved_{x.system}", paper=None, measured=float(x.bytes_moved), unit="B",
                                    holds=True, note="payload bytes per batch (reported, no target)"))
        results.claims.append(Claim(f"gbps_{x.system}", paper=None, measured=x.gbps, unit="GB/s", holds=True,
                                    note=f"bytes moved / raw transfer time; memcpy here {memcpy:.1f} GB/s"))
        results.claims.append(Claim(f"memcpy_fraction_{x.system}", paper=None, measured=x.memcpy_fraction,
                                    unit="fraction", holds=True, note="GB/s over this machine's memcpy GB/s"))
    plot(results, s)
    results.extra["memcpy_gbps"] = memcpy
    results.extra["iters_per_token"] = iters_per_token
    results.extra["scale"] = cfg.scale
    results.text = "\n\n".join([
        f"Workload (scale={cfg.scale}): {description}. M={m} mini-batches, {cfg.num_ranks} ranks, "
        f"{cfg.num_units} KnitTrans units.",
        f"Exposed latency, steady state: each exposed pass trains {cfg.num_batches} consecutive batches; batch b+1 "
        f"completes when rank 0 starts step {m - cfg.lead_steps} of batch b (lead_steps={cfg.lead_steps}); the "
        f"first {cfg.warmup_batches} batch(es) of a pass (idle trainer) are excluded; per mini-batch, the slowest "
        f"rank's wait for data after it was ready (counted from max(ready, t0 of its batch)); medians over "
        f"{cfg.repeats} passes x {cfg.num_batches - cfg.warmup_batches} batches. exposed_per_mb_s = "
        f"exposed_total_s / M. Centralized driver: central_overlap={cfg.central_overlap} (verl scatters batch b+1 "
        f"only after batch b's update returns; build_ahead: it gathered, padded and balanced b+1 during batch b, "
        f"as one-step-off can at best; serial: after, as fully-async does).",
        f"Compute emulation: {iters_per_token:.4g} 128x128 fp32 matmuls per token on one torch thread per rank "
        f"(~{cfg.compute_s_per_minibatch} s per mini-batch share), identical for every system. CPUs: "
        f"{os.cpu_count()}; memcpy {memcpy:.1f} GB/s (bytes copied once).",
        "Raw transfer: one batch, t0 -> every rank holds every share, run without compute and without prefetch "
        f"({cfg.repeats} passes, each after an exposed pass). Bytes moved (per batch): centralized counts the gather "
        "(ragged) plus the scatter (padded dense tensors incl. attention_mask and position_ids; centralized pads "
        "to the batch's longest prompt/response, centralized-padmax to max_prompt_len/max_response_len as verl's "
        "rollout does); KnitTrans and TransferQueue count the share payloads each rank receives.",
        *notes])


def plot(results: Results, s: dict[str, SystemSummary]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    names = list(s)
    m = max(len(x.exposed_per_mb) for x in s.values())
    width = 0.8 / max(1, len(names))
    for i, n in enumerate(names):
        vals = [max(v, 1e-6) * 1e3 for v in s[n].exposed_per_mb]
        ax1.bar(np.arange(m) + i * width, vals, width, label=n)
    ax1.set_yscale("log")
    ax1.set_xticks(np.arange(m) + 0.4 - width / 2, [f"mb {k}" for k in range(m)])
    ax1.set_ylabel("exposed transfer latency (ms, log)")
    ax1.set_title("steady-state exposed latency per mini-batch position")
    ax1.legend(fontsize=7)
    ax2.bar(names, [s[n].raw_transfer_s * 1e3 for n in names], color="gray")
    ax2.set_yscale("log")
    ax2.set_ylabel("raw transfer time (ms, log)")
    ax2.set_title("raw: t0 -> every rank holds every share (1 batch)")
    ax2.tick_params(axis="x", labelrotation=30, labelsize=7)
    fig.tight_layout()
    fig.savefig(results.plot_path("exposed_latency.png"), dpi=120)
    plt.close(fig)


# -- the multimodal workload (issue 6): images stored and moved once per distinct content ------------------------

MM_SYSTEMS = ("centralized", "knittrans-ray", "knittrans-ray-noprefetch", "knittrans-inproc")
"""Systems of ``workload=multimodal``: the verl path (``baselines.centralized_mm``, pad to the batch's longest) and
KnitTrans's multimodal data plane (``knittrans.mmdedup.plane``) on both transports."""


@dataclass(frozen=True)
class MMPassData(PassData):
    """A multimodal pass: ``payloads`` are ``MMPayload``s (fields + each sample's images, the group's tensors
    shared); ``images[g]`` / ``grids[g]`` are group g's images (what the centralized driver holds per prompt)."""

    images: dict[int, tuple[np.ndarray, ...]] = field(default_factory=dict)
    grids: dict[int, tuple[tuple[int, int, int], ...]] = field(default_factory=dict)

    @property
    def distinct_pixel_nbytes(self) -> int:
        return sum(int(a.nbytes) for ims in self.images.values() for a in ims)

    @property
    def occurrence_pixel_nbytes(self) -> int:
        return self.distinct_pixel_nbytes * self.group_size

    @property
    def nbytes(self) -> int:
        """Fields plus each distinct image once (what KnitTrans moves per batch)."""
        return sum(int(a.nbytes) for p in self.payloads for a in p.tensors.values()) + self.distinct_pixel_nbytes


def mm_workload(cfg: TransferConfig, vlm=None) -> Workload:  # noqa: ANN001 - a workloads.vlm.TinyVLMConfig
    """``num_batches`` distinct seeded batches (so consecutive batches of a pass show different images); pass p
    uses batch ``p mod num_batches`` under fresh ids. Mini-batches are whole groups (P / M each)."""
    from knittrans.mmdedup.plane import MM_SCHEMA, MMPayload
    from workloads.multimodal import MultimodalWorkload
    from workloads.multimodal_data import prompt_len, trajectory_fields, workload_config

    w = cfg.multimodal
    if w.prompts % cfg.num_minibatches:
        raise ValueError(f"multimodal.prompts={w.prompts} must be a multiple of num_minibatches="
                         f"{cfg.num_minibatches} (whole groups per mini-batch)")
    gen = MultimodalWorkload(workload_config(w, cfg.seed, vlm))
    pool = []
    for b in range(max(1, cfg.num_batches)):
        groups = gen.sample_batch(b)
        pool.append([(g, [trajectory_fields(s, cfg.seed) for s in g.samples]) for g in groups])
    P, n, per = w.prompts, w.n, w.prompts // cfg.num_minibatches

    def make_pass(p: int) -> MMPassData:
        groups = pool[p % len(pool)]
        payloads, prompt_of, tokens, producer, ids_of = [], {}, {}, {}, {}
        for gi, (g, fields) in enumerate(groups):
            ids_of[gi] = []
            for i, (s, f) in enumerate(zip(g.samples, fields)):
                t = p * P * n + gi * n + i
                payloads.append(MMPayload(t, f, group=p * P + gi,
                                          encodings=tuple(g.images[j].pixel_values for j in s.image_index),
                                          grids=tuple(g.images[j].grid_thw for j in s.image_index)))
                prompt_of[t], tokens[t], producer[t] = gi, int(f["input_ids"].shape[0]), gi % cfg.num_units
                ids_of[gi].append(t)
        mbs = []
        for k in range(cfg.num_minibatches):
            gs = range(k * per, (k + 1) * per)
            ids = tuple(t for gi in gs for t in ids_of[gi])
            mbs.append(MiniBatch(p, k, ids, tuple(p * P + gi for gi in gs), sum(tokens[t] for t in ids)))
        return MMPassData(
            batch_id=p, payloads=tuple(payloads), minibatches=tuple(mbs),
            prompts=tuple(g.samples[0].token_ids[:prompt_len(g.samples[0])].numpy() for g, _ in groups),
            prompt_of=prompt_of, tokens=tokens, group_size=n, producer_of=producer,
            images={gi: tuple(im.pixel_values.numpy() for im in g.images) for gi, (g, _) in enumerate(groups)},
            grids={gi: tuple(im.grid_thw for im in g.images) for gi, (g, _) in enumerate(groups)})

    probe = make_pass(0)
    desc = (f"multimodal: {P} prompts x n={n} = {P * n} trajectories, {w.images_per_prompt} image(s) per prompt "
            f"({w.image_side}px and 3/4 rectangles), {probe.distinct_pixel_nbytes / 1e6:.1f} MB of distinct "
            f"pixel_values per batch ({probe.occurrence_pixel_nbytes / 1e6:.0f} MB with one copy per sample), "
            f"{(probe.nbytes - probe.distinct_pixel_nbytes) / 1e6:.2f} MB of token fields")
    return Workload(MM_SCHEMA, make_pass, desc)


class KnitTransRayMM(KnitTransRay):
    """KnitTrans-Ray with multimodal storage-unit actors (``knittrans.mmdedup.plane_ray``)."""

    def __init__(self, cfg: TransferConfig, ranks: list, prefetch: bool, signals: "ray.actor.ActorHandle") -> None:
        from knittrans.mmdedup.plane_ray import build_mm_ray

        self.cfg, self.ranks, self.prefetch, self.signals = cfg, ranks, prefetch, signals
        self.dp = build_mm_ray(unit_nodes(cfg), rank_nodes(cfg))
        self.admitted = 0
        self.live_bytes_at_close: int | None = None

    def close(self) -> None:
        try:
            self.live_bytes_at_close = settled_live_bytes(self.dp)
        finally:
            self.dp.close()


def settled_live_bytes(dp, within_s: float = 5.0) -> int:  # noqa: ANN001 - an MMRayDataPlane
    """Encoding bytes the unit actors hold once the last releases have landed. A rank's ack and the controller's
    drops are fire-and-forget messages with no completion event to wait on, so this re-reads the units' stores
    (a few times, 50 ms apart) until they are empty or ``within_s`` has passed; a leak stays nonzero."""
    deadline = time.perf_counter() + within_s
    live = dp.live_bytes()
    while live and time.perf_counter() < deadline:
        time.sleep(0.05)
        live = dp.live_bytes()
    return live


class KnitTransInProcMM(KnitTransInProc):
    """KnitTrans in-process with multimodal units; checks after every pass that no encoding bytes are left."""

    def __init__(self, cfg: TransferConfig) -> None:
        from knittrans.mmdedup.plane import build_mm_inprocess

        self.cfg = cfg
        self.dp = build_mm_inprocess(unit_nodes(cfg), rank_nodes(cfg))
        self.admitted = 0
        self.live_bytes_at_close: int | None = None

    def _run(self, datas, iters_per_token, prefetch, signals):  # noqa: ANN001, ANN202 - as KnitTransInProc._run
        out = super()._run(datas, iters_per_token, prefetch, signals)
        if self.dp.live_bytes():
            raise RuntimeError(f"encoding stores hold {self.dp.live_bytes()} bytes after every share was consumed")
        return out

    def close(self) -> None:
        self.live_bytes_at_close = self.dp.live_bytes()
        super().close()


class CentralizedMM(Centralized):
    """The verl driver path with images (``baselines.centralized_mm``): pixel_values one copy per sample."""

    @staticmethod
    def stage(data: PassData) -> list:
        """Rollout outputs (token fields only) sit in the object store; the images are the driver's, per prompt."""
        by_producer: dict[int, list[TrajectoryPayload]] = {}
        for p in data.payloads:
            by_producer.setdefault(data.producer_of[p.traj_id], []).append(TrajectoryPayload(p.traj_id, p.tensors))
        return [ray.put(ps) for _, ps in sorted(by_producer.items())]

    def prepare(self, refs: list, data: PassData) -> Prepared:
        from baselines.centralized_mm import build_mm_dense_batch

        assert isinstance(data, MMPassData)
        gathered = ray.get(refs)  # 1. gather on the driver
        gather_bytes = sum(int(a.nbytes) for chunk in gathered for p in chunk for a in p.tensors.values())
        plan = balance_plan(data.minibatches, data.tokens, self.cfg.num_ranks)  # 3. balance
        batch = build_mm_dense_batch(gathered, data.prompts, data.prompt_of, data.group_size, plan, data.images,
                                     data.grids, self.config)  # 2. concat, repeat (pixel_values too), pad
        chunks = batch.chunk(self.cfg.num_ranks)  # 4. scatter (the chunks travel as call arguments)
        return Prepared(chunks, plan.per_minibatch, gather_bytes + sum(c.nbytes for c in chunks))


def make_mm_system(name: str, cfg: TransferConfig, ranks: list, signals):  # noqa: ANN001, ANN201
    if name == "centralized":
        return CentralizedMM(cfg, ranks, signals, pad_to="longest")
    if name == "knittrans-inproc":
        return KnitTransInProcMM(cfg)
    if name in ("knittrans-ray", "knittrans-ray-noprefetch"):
        return KnitTransRayMM(cfg, ranks, prefetch=(name == "knittrans-ray"), signals=signals)
    raise ValueError(f"unknown multimodal system {name!r}; choose from {list(MM_SYSTEMS)}")


@dataclass
class MMSession:
    """Ray, the rank actors and the signal board, started once and shared by every measurement (``repro.speedup``
    measures six sweep points in one session)."""

    cfg: TransferConfig
    ranks: list = field(default_factory=list)
    signals: "ray.actor.ActorHandle | None" = None

    def __enter__(self) -> "MMSession":
        _start_ray(self.cfg)
        self.ranks = [RankActor.remote(r) for r in range(self.cfg.num_ranks)]
        self.signals = SignalActor.remote()
        ray.get([r.ready.remote() for r in self.ranks])
        return self

    def warm(self, probe: MMPassData) -> None:
        """Write once through the object store pages the baseline will use (see ``warm_object_store``)."""
        want = (self.cfg.num_batches + 2) * (probe.occurrence_pixel_nbytes + probe.nbytes)
        n = int(min(want, 0.8 * ray.available_resources().get("object_store_memory", 0)))
        if n > 0:
            ref = ray.put(np.ones(n, dtype=np.uint8))
            ray.get(ref)
            del ref

    def measure(self, wl: Workload, systems: Sequence[str], iters_per_token: float | dict[str, float],
                memcpy: float) -> tuple[dict[str, SystemSummary], dict[str, int | None]]:
        """Summaries per system, and the encoding bytes each KnitTrans system's units held at the end (0: no leak)."""
        leaks: dict[str, int | None] = {}

        def make(name: str):  # noqa: ANN202
            sysm = make_mm_system(name, self.cfg, self.ranks, self.signals)
            if hasattr(sysm, "live_bytes_at_close"):
                made.append((name, sysm))
            return sysm
        made: list = []
        out = measure_systems(self.cfg, wl, systems, make, iters_per_token, memcpy)
        for name, sysm in made:
            leaks[name] = sysm.live_bytes_at_close
        return out, leaks

    def __exit__(self, *exc) -> None:  # noqa: ANN002
        ray.shutdown()


def run_multimodal(cfg: TransferConfig) -> Results:
    """The multimodal transfer table: the same steady-state and raw passes as text, the verl path against
    KnitTrans's multimodal data plane. See docs/mmdedup.md."""
    import torch

    unknown = [s for s in cfg.systems if s not in SYSTEMS]
    if unknown:
        raise ValueError(f"unknown systems {unknown}; choose from {list(SYSTEMS)}")
    systems = [s for s in cfg.systems if s in MM_SYSTEMS]
    check_steady(cfg)
    torch.set_num_threads(1)
    wl = mm_workload(cfg)
    probe = wl.make_pass(0)
    memcpy = memcpy_gbps()
    share_tokens = sum(probe.tokens.values()) / (cfg.num_minibatches * cfg.num_ranks)
    iters_per_token = calibrate_iters_per_token(cfg.compute_s_per_minibatch, int(share_tokens))
    with MMSession(cfg) as session:
        session.warm(probe)
        summaries, leaks = session.measure(wl, systems, iters_per_token, memcpy)
    results = Results(table=f"transfer-{cfg.workload}", out_dir=cfg.out_dir)
    fill_mm_results(results, cfg, summaries, leaks, probe, memcpy, wl.description, iters_per_token,
                    skipped=[s for s in cfg.systems if s not in MM_SYSTEMS])
    return results


def fill_mm_results(results: Results, cfg: TransferConfig, s: dict[str, SystemSummary], leaks: dict[str, int | None],
                    probe: MMPassData, memcpy: float, description: str, iters_per_token: float,
                    skipped: Sequence[str] = ()) -> None:
    m = cfg.num_minibatches
    for x in s.values():
        results.rows.append({"system": x.system, "raw_transfer_s": x.raw_transfer_s,
                             "exposed_total_s": x.exposed_total_s, "exposed_per_mb_s": x.exposed_total_s / m,
                             "exposed_mb0_s": x.exposed_per_mb[0], "exposed_rest_s": sum(x.exposed_per_mb[1:]),
                             "get_latency_s": x.get_latency_s, "bytes_moved": x.bytes_moved, "gbps": x.gbps,
                             "memcpy_fraction": x.memcpy_fraction, "measured_batches": x.measured_batches})
    base, kt = s.get("centralized"), s.get(PRIMARY)

    def ratio(a: float, b: float) -> float | None:
        return a / b if b > 0 else None

    steady = (f"steady state, median over {cfg.repeats} passes x {cfg.num_batches - cfg.warmup_batches} batches of "
              f"the exposed latency summed over a batch's {m} mini-batches; central_overlap={cfg.central_overlap}")
    if base and kt:
        r = ratio(base.raw_transfer_s, kt.raw_transfer_s)
        results.claims.append(Claim(
            "mm_transfer_latency_ratio", paper=100.0, measured=r, unit="x", holds=r is not None and r >= 50.0,
            note="raw transfer (t0 -> every rank holds every share; no compute, no prefetch, no overlap credit), "
                 "centralized (verl) / knittrans-ray; target >= 50 (two orders of magnitude, 2x margin)"))
        r = ratio(base.exposed_total_s, kt.exposed_total_s)
        results.claims.append(Claim(
            "mm_exposed_latency_ratio", paper=100.0, measured=r, unit="x", holds=r is not None and r >= 50.0,
            note=f"exposed latency, centralized (build-ahead) / knittrans-ray (prefetch), {steady}; target >= 50"))
        r = ratio(float(base.bytes_moved), float(kt.bytes_moved))
        results.claims.append(Claim(
            "mm_bytes_ratio", paper=None, measured=r, unit="x", holds=kt.bytes_moved < base.bytes_moved,
            note="bytes moved per batch, centralized (gather + scatter, pixel_values once per sample) / knittrans-ray "
                 "(fields + each distinct image once per rank share); target > 1"))
    inproc = s.get("knittrans-inproc")
    if base and inproc:
        r = ratio(base.raw_transfer_s, inproc.raw_transfer_s)
        results.claims.append(Claim("mm_transfer_latency_ratio_inproc", paper=100.0, measured=r, unit="x",
                                    holds=r is not None and r >= 50.0,
                                    note="raw transfer, centralized / knittrans-inproc (embedded transport)"))
        r = ratio(base.exposed_total_s, inproc.exposed_total_s)
        results.claims.append(Claim("mm_exposed_latency_ratio_inproc", paper=100.0, measured=r, unit="x",
                                    holds=r is not None and r >= 50.0,
                                    note=f"exposed, centralized / knittrans-inproc, {steady}"))
    for name, live in leaks.items():
        results.claims.append(Claim(f"mm_store_live_bytes_after_{name.replace('-', '_')}", paper=None,
                                    measured=None if live is None else float(live), unit="B", holds=live == 0,
                                    note="encoding bytes the units still hold after every pass was consumed; "
                                         "holds iff 0 (refcounts back to zero, nothing leaked)"))
    for x in s.values():
        results.claims.append(Claim(f"bytes_moved_{x.system}", paper=None, measured=float(x.bytes_moved), unit="B",
                                    holds=True, note="payload bytes per batch (reported, no target)"))
        results.claims.append(Claim(f"gbps_{x.system}", paper=None, measured=x.gbps, unit="GB/s", holds=True,
                                    note=f"bytes moved / raw transfer time; memcpy here {memcpy:.1f} GB/s"))
    plot(results, s)
    results.extra.update(memcpy_gbps=memcpy, iters_per_token=iters_per_token, scale=cfg.scale,
                         distinct_pixel_bytes=probe.distinct_pixel_nbytes,
                         occurrence_pixel_bytes=probe.occurrence_pixel_nbytes)
    results.text = "\n\n".join([
        f"Workload (scale={cfg.scale}): {description}. M={m} mini-batches of whole groups, {cfg.num_ranks} ranks, "
        f"{cfg.num_units} storage units (rank r and the producers of group g % {cfg.num_units} on node r / g "
        f"mod {cfg.num_units}).",
        "centralized = verl's DataProto path (baselines/centralized_mm.py): the driver gathers the rollout outputs, "
        "repeats each prompt's pixel_values for its n samples, concatenates them in the balanced row order, pads "
        "the tokens to the batch's longest, chunks per rank and scatters through the Ray object store; ranks "
        "split their chunk into mini-batches. knittrans-* = the data plane with multimodal storage units "
        "(knittrans/mmdedup/plane.py): images in each unit's refcounted encoding store once per distinct content, "
        "group-whole shares, each rank fetching its share's fields plus each distinct image once, straight from "
        "the unit actors (Ray) or by reference (in-process), with the prefetcher; refcounts return to zero as "
        "shares are consumed (mm_store_live_bytes_after_*).",
        f"Measurement: as the text table (steady state over {cfg.num_batches} batches, batch b+1 completing during "
        f"step {m - cfg.lead_steps} of batch b, first {cfg.warmup_batches} excluded; raw = one batch, t0 -> every "
        f"rank holds every share, no compute, no prefetch); {cfg.repeats} (exposed, raw) pass pairs per system; "
        f"emulated compute {iters_per_token:.4g} matmuls per token (~{cfg.compute_s_per_minibatch} s per "
        f"mini-batch share), identical for every system. CPUs: {os.cpu_count()}; memcpy {memcpy:.1f} GB/s.",
        "Why the raw ratio is not ~100x here: on one machine every hop is a memcpy through shared memory at the "
        "same few GB/s for both systems, so the ratio is roughly bytes moved (about n x the distinct pixels, twice "
        "through the driver for the baseline) plus the driver's serial build. The paper's two orders of magnitude "
        "need what this machine cannot model: the driver's NIC as the one link every byte crosses (e.g. 8 ranks "
        "x 25 GB/s of local reads vs one 12.5-25 GB/s NIC, which alone is another ~R x) and the driver's "
        "single-threaded Python build at paper scale.",
        *([f"Not run for the multimodal workload: {', '.join(skipped)} (transferqueue moves per-trajectory fields "
           f"with no dedup; padmax is the text table's variant)."] if skipped else [])])


@hydra.main(config_path="conf", config_name="transfer", version_base=None)
def main(cfg: TransferConfig) -> None:
    obj: TransferConfig = OmegaConf.to_object(cfg)
    publish(run(obj), obj.logger, f"transfer-{obj.workload}", config=cfg, seed=obj.seed)


if __name__ == "__main__":
    main()
