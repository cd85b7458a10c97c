"""Load through the data plane: concurrent producers and consumers, in process (threads) and on Ray (actors),
with exact accounting, storage freed after consumption and unit occupancy bounded by the producers' window."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from workloads.reliability_faults import count, units_empty


@dataclass
class LoadConfig:
    """One load run."""

    load_trajectories: int = 100_000
    """Trajectories pushed through the data plane."""
    load_minibatch: int = 1000
    """Trajectories per admitted mini-batch."""
    producers: int = 2
    ranks: int = 2
    window: int = 4
    """Producer flow control: mini-batch k is put only once k - window are released (bounds unit memory)."""
    load_checksums: bool = True
    """Checksum every put and verify every fetch (what catches corrupted messages)."""


def _load_payload(t: int):  # noqa: ANN202
    from knittrans.dataplane import TrajectoryPayload

    n = 4 + t % 13
    return TrajectoryPayload(t, {"ids": np.arange(t, t + n, dtype=np.int64),
                                 "lp": np.full(n, -1.0, dtype=np.float32)})


def load_schema():  # noqa: ANN201
    from knittrans.dataplane import FieldSpec, TrajectorySchema

    return TrajectorySchema((FieldSpec("ids", "int64"), FieldSpec("lp", "float32", finite=True)), token_field="ids")


@dataclass
class LoadResult:
    transport: str
    trajectories: int
    delivered: int
    lost: int
    duplicated: int
    wall_s: float
    throughput: float
    peak_unit_trajectories: int
    bound_trajectories: int
    final_unit_bytes: int
    producers: int
    ranks: int
    held_max: int = -1
    """Most trajectories with live controller metadata at any admission after warm-up (compaction bounds it by
    the producers' window; before compaction it was every trajectory ever put)."""
    rss_growth_b_per_traj: float = float("nan")
    """Process RSS growth from warm-up (10% of the mini-batches) to the end, per trajectory put after warm-up
    (in-process only: controller, units, producers and consumers all live in this process)."""
    peak_rss_growth_mb: float = float("nan")
    """Peak RSS of this process over the run minus its RSS at the start (MiB)."""


def rss_bytes() -> int:
    """Resident set size of this process now (Linux /proc; 0 elsewhere)."""
    import os

    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def peak_rss_bytes() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def _guarded(fn: Callable[[], None], errors: list[BaseException]) -> Callable[[], None]:
    """``fn`` for a worker thread: an error is appended to ``errors`` (the driver re-raises it) instead of dying with
    the thread."""
    def run() -> None:
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - re-raised by the driver
            errors.append(e)
    return run


def _plan(n: int, mb: int) -> list[tuple[int, ...]]:
    return [tuple(range(k * mb, min(n, (k + 1) * mb))) for k in range(-(-n // mb))]


def _produce(client, controller, p: int, producers: int, mbs, window: int, chunk: int = 250,  # noqa: ANN001
             on_put: Callable[[int], None] | None = None) -> None:
    """Producer ``p`` puts its part (t % producers == p) of each mini-batch, waiting for k - window releases."""
    for k, ids in enumerate(mbs):
        if k >= window:
            controller.wait_released(k - window + 1, timeout=300)
        mine = [t for t in ids if t % producers == p]
        for i in range(0, len(mine), chunk):
            client.put([_load_payload(t) for t in mine[i:i + chunk]])
        if on_put is not None:
            on_put(k)


def load_inprocess(cfg: LoadConfig) -> LoadResult:
    """Producer threads, an admitting driver, consumer threads with prefetchers: exact accounting in process."""
    from knittrans.dataplane import Prefetcher, PrefetchConfig, build_inprocess
    from knittrans.types import MiniBatch

    units = {f"u{p}": f"n{p}" for p in range(cfg.producers)}
    dp = build_inprocess(load_schema(), units, tuple(f"n{r % cfg.producers}" for r in range(cfg.ranks)),
                         checksums=cfg.load_checksums)
    mbs = _plan(cfg.load_trajectories, cfg.load_minibatch)
    put_done = [[threading.Event() for _ in mbs] for _ in range(cfg.producers)]
    # per-rank delivery counts, preallocated: the accounting itself must not grow with the run (RSS is measured)
    delivered = [np.zeros(cfg.load_trajectories, np.uint8) for _ in range(cfg.ranks)]
    errors: list[BaseException] = []

    def guard(fn):  # noqa: ANN001, ANN202
        return _guarded(fn, errors)

    def consume(r: int) -> None:
        for share in Prefetcher(dp.client(), r, None, PrefetchConfig(depth=1, admit_timeout_s=300), count=len(mbs)):
            delivered[r][np.asarray(share.traj_ids, dtype=np.int64)] += 1

    threads = [threading.Thread(target=guard(lambda p=p: _produce(dp.client(f"u{p}"), dp.controller, p,
                                                                  cfg.producers, mbs, cfg.window,
                                                                  on_put=lambda k, p=p: put_done[p][k].set())))
               for p in range(cfg.producers)]
    threads += [threading.Thread(target=guard(lambda r=r: consume(r))) for r in range(cfg.ranks)]
    rss0 = rss_bytes()
    t0 = time.perf_counter()
    for th in threads:
        th.start()
    peak = 0
    held = 0
    warm = max(1, len(mbs) // 10)
    rss_warm = 0
    for k, ids in enumerate(mbs):
        for p in range(cfg.producers):
            while not put_done[p][k].wait(1.0):
                if errors:
                    raise errors[0]
        dp.controller.admit(MiniBatch(0, k, ids, (k,), 0))
        peak = max(peak, sum(u.stats().num_trajectories for u in dp.units.values()))
        if k == warm:
            rss_warm = rss_bytes()
        if k >= warm:
            held = max(held, dp.controller.stats().held)
    for th in threads:
        th.join(timeout=600)
    wall = time.perf_counter() - t0
    if errors:
        raise errors[0]
    rss_end = rss_bytes()
    total = sum(d.astype(np.int64) for d in delivered)
    lost, dup = int((total == 0).sum()), int(np.clip(total - 1, 0, None).sum())
    final = sum(u.stats().nbytes for u in dp.units.values())
    dp.close()
    after = sum(len(ids) for ids in mbs[warm:])
    return LoadResult("inprocess", cfg.load_trajectories, int(total.sum()), lost, dup, wall,
                      cfg.load_trajectories / wall, peak, (cfg.window + 2) * cfg.load_minibatch, final, cfg.producers,
                      cfg.ranks, held, (rss_end - rss_warm) / max(1, after), (peak_rss_bytes() - rss0) / 2**20)


def load_ray(cfg: LoadConfig) -> LoadResult:
    """The same load with producer and consumer actors, storage-unit actors and a controller actor."""
    import ray

    from knittrans.dataplane.ray_transport import build_ray
    from knittrans.types import MiniBatch

    units = {f"u{p}": f"n{p}" for p in range(cfg.producers)}
    dp = build_ray(load_schema(), units, tuple(f"n{r % cfg.producers}" for r in range(cfg.ranks)),
                   checksums=cfg.load_checksums)
    mbs = _plan(cfg.load_trajectories, cfg.load_minibatch)
    producer_cls, consumer_cls = _actors()
    producers = [producer_cls.remote(dp, f"u{p}") for p in range(cfg.producers)]
    consumers = [consumer_cls.remote(dp, r) for r in range(cfg.ranks)]
    ray.get([a.ready.remote() for a in producers + consumers])
    t0 = time.perf_counter()
    runs = [c.consume.remote(len(mbs)) for c in consumers]
    refs = [[a.put_minibatch.remote(p, cfg.producers, k, mbs[k], cfg.window) for k in range(len(mbs))]
            for p, a in enumerate(producers)]
    driver = dp.client()
    peak = held = 0
    for k, ids in enumerate(mbs):
        ray.get([refs[p][k] for p in range(cfg.producers)])
        driver.admit(MiniBatch(0, k, ids, (k,), 0))
        if k % 10 == 0:
            peak = max(peak, sum(s.num_trajectories for s in dp.unit_stats()))
            if k >= len(mbs) // 10:
                held = max(held, dp.controller_stats().held)
    results = ray.get(runs, timeout=600)
    wall = time.perf_counter() - t0
    flat = [t for ids in results for t in ids]
    lost, dup = count(flat, set(range(cfg.load_trajectories)))
    units_empty(dp)
    final = sum(s.nbytes for s in dp.unit_stats())
    for a in producers + consumers:
        ray.kill(a)
    dp.close()
    return LoadResult("ray", cfg.load_trajectories, len(flat), lost, dup, wall, cfg.load_trajectories / wall, peak,
                      (cfg.window + 2) * cfg.load_minibatch, final, cfg.producers, cfg.ranks, held)


def _ray_actors():  # noqa: ANN202 - defined lazily so importing this module never needs Ray
    import ray

    @ray.remote(num_cpus=0)
    class _LoadProducer:
        def __init__(self, dp, unit: str) -> None:  # noqa: ANN001
            self.client = dp.client(unit)

        def ready(self) -> bool:
            return True

        def put_minibatch(self, p: int, producers: int, k: int, ids, window: int) -> int:  # noqa: ANN001
            if k >= window:
                self.client.controller.wait_released(k - window + 1, timeout=300)
            mine = [t for t in ids if t % producers == p]
            for i in range(0, len(mine), 250):
                self.client.put([_load_payload(t) for t in mine[i:i + 250]])
            return len(mine)

    @ray.remote(num_cpus=0)
    class _LoadConsumer:
        def __init__(self, dp, rank: int) -> None:  # noqa: ANN001
            self.client = dp.client()
            self.rank = rank

        def ready(self) -> bool:
            return True

        def consume(self, count: int) -> list[int]:
            from knittrans.dataplane import Prefetcher, PrefetchConfig

            out: list[int] = []
            for share in Prefetcher(self.client, self.rank, None, PrefetchConfig(depth=1, admit_timeout_s=300),
                                    count=count):
                out.extend(share.traj_ids)
            return out

    return _LoadProducer, _LoadConsumer


_ACTORS: tuple | None = None


def _actors() -> tuple:
    global _ACTORS
    if _ACTORS is None:
        _ACTORS = _ray_actors()
    return _ACTORS


def ray_init() -> None:
    import os

    import ray

    # Authentication: Ray's own default (token auth for local clusters from Ray 2.59; docs/dataplane.md,
    # multi-node). The Makefile's throw-away offline cluster disables it explicitly; this never forces it off.
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if not ray.is_initialized():
        ray.init(address="local", include_dashboard=False, num_cpus=4, log_to_driver=False, configure_logging=False)




# -- load through the Handoff (issue 29): the admission policy, records and the consumers' acks included -----------


@dataclass
class HandoffLoadConfig:
    """One load through ``knittrans.Handoff``: GRPO batches of ``prompts`` x ``group_size`` admitted by KnitTrans's
    policy in ``num_minibatches`` mini-batches, ``producers`` rollout threads (one unit each), ``ranks`` consumers."""

    trajectories: int = 1_000_000
    prompts: int = 32
    group_size: int = 8
    num_minibatches: int = 4
    max_response_len: int = 8
    producers: int = 2
    ranks: int = 2
    window: int = 2
    """Batches announced ahead of the trainer: batch b is announced (and put) once batch b - window is trained."""
    checksums: bool = True
    records_window: int | None = 65_536
    """``HandoffConfig.records_window`` (the default): what keeps the controller flat."""


@dataclass
class HandoffLoadResult:
    transport: str
    trajectories: int
    lost: int
    duplicated: int
    wall_s: float
    throughput: float
    version: int
    final_unit_bytes: int
    records_kept: int
    staleness_mean: float
    held_max: int
    """Most trajectories with live controller metadata after warm-up."""
    bound_trajectories: int
    """What the announcement window lets be in flight: (window + 1) batches."""
    ledger_batches_max: int = -1
    """Most batches the admission ledger held after warm-up (in process; finished batches are forgotten)."""
    rss_growth_b_per_traj: float = float("nan")
    """Process RSS growth (``/proc/self/statm``) from warm-up (10% of the batches) to the end, per trajectory put after
    warm-up: controller, policy, units, producers and consumers all live in this process."""
    peak_rss_growth_mb: float = float("nan")


def _handoff_rollout(t: int, g: int, b: int, v_gen: int):  # noqa: ANN202 - a Rollout; tensors: a function of the id
    from knittrans.handoff import Rollout
    from knittrans.types import Trajectory

    n = 1 + t % 8
    return Rollout(Trajectory(t, g, b, n, v_gen=v_gen),
                   {"input_ids": np.arange(t, t + n + 4, dtype=np.int64), "old_logprobs": np.full(n, -1.0, np.float32),
                    "advantages": np.ones(n, np.float32), "loss_mask": np.ones(n, bool)})


def load_handoff(cfg: HandoffLoadConfig, transport: str = "inprocess") -> HandoffLoadResult:
    """Producer threads put rollouts through ``Handoff.producer``; the controller's policy admits; consumer threads
    iterate ``Handoff.consumer`` and ack; the driver announces each batch once the one ``window`` before it is
    trained. Exact accounting (preallocated delivery counts), units empty at the end, and, in process, RSS growth."""
    from knittrans.handoff import Handoff, HandoffConfig, Transport
    from knittrans.types import BatchPlan, GroupSpec

    B = cfg.prompts * cfg.group_size
    batches = -(-cfg.trajectories // B)
    n = batches * B
    units = tuple((f"u{p}", f"n{p}") for p in range(cfg.producers))
    h = Handoff(HandoffConfig.grpo(cfg.prompts, cfg.group_size, cfg.num_minibatches, cfg.max_response_len,
                                   transport=Transport(transport), units=units,
                                   rank_nodes=tuple(f"n{r % cfg.producers}" for r in range(cfg.ranks)),
                                   checksums=cfg.checksums, records_window=cfg.records_window, admit_timeout_s=300.0))
    announced = [threading.Event() for _ in range(batches)]
    delivered = [np.zeros(n, np.uint8) for _ in range(cfg.ranks)]
    errors: list[BaseException] = []

    def guard(fn):  # noqa: ANN001, ANN202
        return _guarded(fn, errors)

    def produce(p: int) -> None:
        producer = h.producer(f"u{p}")
        for b in range(batches):
            while not announced[b].wait(1.0):
                if errors:
                    return
            groups = [g for g in range(b * cfg.prompts, (b + 1) * cfg.prompts) if g % cfg.producers == p]
            v_gen = max(0, (b - cfg.window) * cfg.num_minibatches)  # the version trained when b was announced
            for i in range(0, len(groups), 8):  # 8 groups per put call
                producer.put([_handoff_rollout(g * cfg.group_size + j, g, b, v_gen) for g in groups[i:i + 8]
                              for j in range(cfg.group_size)])

    def consume(r: int) -> None:
        consumer = h.consumer(r, count=batches * cfg.num_minibatches)
        for share in consumer:
            delivered[r][np.asarray(share.traj_ids, dtype=np.int64)] += 1
            consumer.ack(share)
        consumer.close()

    threads = [threading.Thread(target=guard(lambda p=p: produce(p)), daemon=True) for p in range(cfg.producers)]
    threads += [threading.Thread(target=guard(lambda r=r: consume(r)), daemon=True) for r in range(cfg.ranks)]
    local = transport == "inprocess"
    rss0 = rss_bytes()
    t0 = time.perf_counter()
    for th in threads:
        th.start()
    warm = max(1, batches // 10)
    rss_warm, held, ledger_max = 0, 0, -1
    M = cfg.num_minibatches
    try:
        for b in range(batches):
            if b >= cfg.window:
                h.wait_version((b - cfg.window) * M, timeout=300)
            if errors:
                raise errors[0]
            h.add_batch(BatchPlan(b, tuple(GroupSpec(g, b, cfg.group_size)
                                           for g in range(b * cfg.prompts, (b + 1) * cfg.prompts))))
            announced[b].set()
            if b == warm:
                rss_warm = rss_bytes()
            if b >= warm and b % 16 == 0:
                held = max(held, h.stats()[0].held)
                if local:
                    ledger_max = max(ledger_max, len(h.plane.controller.policy.ledger.batches))
        h.seal()
        for th in threads:
            th.join(timeout=600)
        if errors:
            raise errors[0]
        wall = time.perf_counter() - t0
        version = h.wait_version(batches * M, timeout=120)
        rss_end = rss_bytes()
        h.wait_drained(timeout=60)
        units_empty(h.plane, timeout=0.0 if local else 10.0)
        final = sum(s.nbytes for s in h.stats()[1])
        kept, stale = len(h.records()), h.staleness().mean
    finally:
        h.close()
    total = sum(d.astype(np.int64) for d in delivered)
    lost, dup = int((total == 0).sum()), int(np.clip(total - 1, 0, None).sum())
    after = (batches - warm) * B
    return HandoffLoadResult(transport, n, lost, dup, wall, n / wall, version, final, kept, stale, held,
                             (cfg.window + 1) * B, ledger_max,
                             (rss_end - rss_warm) / max(1, after) if local else float("nan"),
                             (peak_rss_bytes() - rss0) / 2**20 if local else float("nan"))
