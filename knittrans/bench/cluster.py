"""A multi-node Ray cluster on one machine, and calibration transfers between its nodes.

``LocalCluster`` starts several raylets with Ray's own cluster utilities (``ray.cluster_utils.Cluster``): each a
Ray node with its own object store and a custom resource ``node_<i>``, so an object read on another node than the
one that holds it crosses Ray's object transfer (the object manager's chunked push over gRPC, here on loopback)
exactly as between machines. Node 0 (the head) is the driver's; ``placement(U, R)`` puts the controller there too,
rollout units / producers on nodes 1..U and trainer ranks on nodes U+1..U+R, one per node, so every byte between
rollout, driver and trainer crosses a node boundary.

``calibrate`` moves objects of known sizes between nodes, alone and two at a time (two into one node, two out of
one node, two disjoint pairs), and records each pull as a ``knittrans.dataplane.trace.FlowEvent`` (key
``"<kind>/<round>"``): what ``knittrans.sim.cluster_model.fit_link`` fits the link model to.

    >>> # with LocalCluster(num_nodes=5) as c:
    >>> #     layout = BenchLayout(num_ranks=2, num_units=2, placement=c.placement(2, 2))
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import numpy as np
import ray

from knittrans.bench.ray_ranks import pinned
from knittrans.bench.types import ClusterPlacement
from knittrans.dataplane.trace import FlowEvent


@dataclass
class LocalCluster:
    """``num_nodes`` raylets on this machine (node 0: the head, the driver's), Ray connected to them."""

    num_nodes: int
    object_store_mib: int = 300
    """Each node's object store (its own shared-memory segment)."""
    cpus_per_node: int = 1
    node_ids: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.num_nodes < 2:
            raise ValueError(f"LocalCluster needs at least 2 nodes (a driver and one more), got {self.num_nodes}")
        if self.object_store_mib < 80:
            raise ValueError(f"LocalCluster.object_store_mib must be >= 80 (Ray's minimum), got "
                             f"{self.object_store_mib}")

    def __enter__(self) -> "LocalCluster":
        from ray.cluster_utils import Cluster

        if ray.is_initialized():
            raise RuntimeError("LocalCluster: Ray is already initialized in this process; shut it down first")
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        store = self.object_store_mib << 20
        self._cluster = Cluster(initialize_head=True, connect=False, head_node_args=dict(
            num_cpus=self.cpus_per_node, object_store_memory=store, resources={"node_0": 1},
            include_dashboard=False))
        try:
            nodes = [self._cluster.head_node]
            for i in range(1, self.num_nodes):
                nodes.append(self._cluster.add_node(num_cpus=self.cpus_per_node, object_store_memory=store,
                                                    resources={f"node_{i}": 1}))
            self._cluster.wait_for_nodes()
            ray.init(address=self._cluster.address, log_to_driver=False, configure_logging=False)
        except BaseException:
            self._cluster.shutdown()
            raise
        self.node_ids = [n.node_id for n in nodes]
        if ray.get_runtime_context().get_node_id() != self.node_ids[0]:
            raise RuntimeError("LocalCluster: the driver did not connect to the head node")
        return self

    def warm_stores(self, fraction: float = 0.8) -> int:
        """Write once through ``fraction`` of every node's object store (an object made on each node, then freed):
        the first pulls into a raylet's fresh store pay its page faults, which put each run's first calibration at
        0.55-0.8 of the later passes' bandwidth (the centralized baseline, whose flows are ~75% of its predicted time,
        then predicted +27-53% on that pass, sessions 33-35), RaySession.warm_object_store's reason on one raylet.
        Returns the bytes written per node."""
        nbytes = int(fraction * (self.object_store_mib << 20))
        probes = [Probe.options(**pinned(n)).remote() for n in self.node_ids]
        ray.get([p.make.remote(nbytes) for p in probes], timeout=300)
        for p in probes:
            ray.kill(p)
        return nbytes

    def placement(self, num_units: int, num_ranks: int) -> ClusterPlacement:
        """Driver and controller on node 0, unit u on node 1 + u, rank r on node 1 + U + r."""
        need = 1 + num_units + num_ranks
        if need > self.num_nodes:
            raise ValueError(f"{num_units} units and {num_ranks} ranks on their own nodes need {need} nodes, "
                             f"the cluster has {self.num_nodes}")
        ids = self.node_ids
        return ClusterPlacement(ids[0], tuple(ids[1:1 + num_units]), tuple(ids[1 + num_units:need]))

    def __exit__(self, *exc: object) -> None:
        ray.shutdown()
        self._cluster.shutdown()


@ray.remote(num_cpus=0)
class Probe:
    """One per node: holds arrays (created in its node's object store) and pulls others' (timed)."""

    def __init__(self) -> None:
        self.held: list[ray.ObjectRef] = []

    def node(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def make(self, nbytes: int, count: int = 1) -> list:
        """``count`` fresh arrays of ``nbytes`` put in this node's object store, their refs (the probe owns them and
        keeps them until ``drop``). ``ray.put``, not a return value: a return under Ray's inline limit (100 KiB) travels
        inside the task's reply to the caller and never enters an object store, so a "pull" of it took 0.03 ms
        where a stored 64 KiB object takes 2.4-6 ms to pull across raylets (as a unit's field objects do), and the
        fitted per-flow latency came out near zero (session 38, docs/experiments.md)."""
        refs = [ray.put(np.full(nbytes, 7, dtype=np.uint8)) for _ in range(count)]
        self.held.extend(refs)
        return refs

    def drop(self) -> None:
        """Forget every array this probe made (their objects are freed once no pull holds them)."""
        self.held.clear()

    def pull(self, refs: list) -> tuple[float, float]:
        """(start, end) of making ``refs`` local to this node (no unpickle)."""
        t = time.perf_counter()
        ray.wait(refs, num_returns=len(refs), fetch_local=True, timeout=120)
        return t, time.perf_counter()


def calibrate(node_ids: list[str], sizes: tuple[int, ...] = (4 << 20, 16 << 20, 48 << 20), repeats: int = 2,
              concurrent_bytes: int = 32 << 20, objects: int = 8, objects_bytes: int = 64 << 10,
              warmup: bool = True) -> list[FlowEvent]:
    """Calibration pulls between the first three non-driver nodes (a, b, c) and the driver's (d = node 0): single
    flows a->b, d->c, b->d of each size ``repeats`` times (key "single/<i>"); ``objects`` objects of
    ``objects_bytes`` pulled a->b at once (key "objects/<i>", one event per object: the work per object,
    ``cluster_model.LinkModel.object_s``); then two at once: a->d and b->d
    (key "in/<i>"), d->b and d->c ("out/<i>"), a->b and c->d ("disjoint/<i>"), ``concurrent_bytes`` each. With
    ``repeats`` > 1 the keys name the repeat ("single/r<k>/<i>"): the fit takes the median repeat's link
    (``cluster_model.fit_link_repeats``). ``warmup``: one more repeat first, not recorded: with the probes just
    started, the first repeat's bandwidth was the lowest of three in 6 of 6 passes (0.27-0.83 of the others'),
    which made the median repeat the slower of the other two (session 38)."""
    if len(node_ids) < 4:
        raise ValueError(f"calibrate needs a driver node and three more, got {len(node_ids)} nodes")
    d, a, b, c = node_ids[:4]
    probes = {n: Probe.options(**pinned(n)).remote() for n in (d, a, b, c)}
    ray.get([p.node.remote() for p in probes.values()])
    out: list[FlowEvent] = []
    i = 0

    def round_(kind: str, pairs: list[tuple[str, str]], nbytes: int, count: int = 1) -> None:
        nonlocal i
        tag = f"{kind}/r{rep}" if repeats > 1 else kind
        refs = ray.get([probes[s].make.remote(nbytes, count) for s, _ in pairs], timeout=120)  # at their sources
        times = ray.get([probes[t].pull.remote(r) for (_, t), r in zip(pairs, refs)], timeout=300)
        if rep >= 0:
            out.extend(FlowEvent("calibration", s, t, nbytes, t0, t1, f"{tag}/{i}") for (s, t), (t0, t1)
                       in zip(pairs, times) for _ in range(count))
            i += 1
        del refs
        ray.get([probes[s].drop.remote() for s in {s for s, _ in pairs}])

    for rep in range(-1 if warmup else 0, repeats):  # rep -1: the warm-up, not recorded
        for nbytes in sizes:
            for pair in ((a, b), (d, c), (b, d)):
                round_("single", [pair], nbytes)
        round_("objects", [(a, b)], objects_bytes, objects)
        round_("in", [(a, d), (b, d)], concurrent_bytes)
        round_("out", [(d, b), (d, c)], concurrent_bytes)
        round_("disjoint", [(a, b), (c, d)], concurrent_bytes)
    for p in probes.values():
        ray.kill(p)
    return out
