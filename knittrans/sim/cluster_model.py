"""A trace-driven cluster transfer model: flows between nodes at a modelled bandwidth, everything else measured.

What is modelled: the **flows** (one object pulled from one node to another). Each node has a NIC of
``bandwidth_Bps`` per direction (egress and ingress separately); concurrent flows share every link they cross
max-min fairly (progressive filling: the standard model of TCP-like fair sharing); each flow pays a fixed
``latency_s`` (request, object lookup, first chunk) before its bytes move. On one machine the raylets' "NICs" are
loopback copies on shared cores, so the validation adds ``host_Bps``: one cap on the sum of all flows' rates (the
machine's copy capacity); a projection to separate machines leaves it out (None).

What is measured, never modelled: every CPU phase -- the driver's unpickle and build, the serialization of a
chunk into an object store, a unit's get and its serialization ("source"), a rank's unpickle and packing, a
controller claim -- is a ``CpuEvent`` of the recorded trace (``knittrans.dataplane.trace``) and enters the model as
its measured duration, in the order the system runs it (``central_graph``, ``verl_wg_graph``, ``knittrans_graph``).
The model then predicts each system's raw transfer time (t0 -> every rank holds every share) by replaying that
task graph with the flows' durations computed instead of read. The link parameters come from calibration
transfers of the same run (``fit_link``), never from the systems' own flows.

    >>> link = LinkModel(bandwidth_Bps=1e9, latency_s=0.0)
    >>> done = simulate([Task("a", src="n1", dst="n0", nbytes=10**9), Task("b", src="n2", dst="n0", nbytes=10**9),
    ...                  Task("c", cpu_s=0.5, deps=("a", "b"))], link)
    >>> round(done["a"][1], 3), round(done["c"][1], 3)   # two flows share n0's ingress: 2 s, then 0.5 s of CPU
    (2.0, 2.5)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from knittrans.dataplane.trace import CpuEvent, FlowEvent, TraceEvent


@dataclass(frozen=True)
class LinkModel:
    """The network: per-node NIC bandwidth per direction, per-flow latency, and (one machine only) a host cap."""

    bandwidth_Bps: float
    """Bytes per second a node sends (and, separately, receives)."""
    latency_s: float = 0.0
    """Fixed cost of one flow before its bytes move."""
    host_Bps: float | None = None
    """Cap on the sum of every flow's rate (raylets sharing one machine's cores); None: separate machines."""
    object_s: float = 0.0
    """Work per object pulled (the pull's request, the chunk's framing, the store's create and seal at both ends),
    as time at ``bandwidth_Bps``: a flow moves ``object_s * bandwidth_Bps`` more bytes through every resource it
    crosses, so objects pulled together queue for it where ``latency_s`` (a delay) would overlap. Eight 64 KiB
    objects pulled at once took 3.7x one (session 38): a share's small field objects beside its image object."""

    def __post_init__(self) -> None:
        if (not self.bandwidth_Bps > 0 or self.latency_s < 0 or self.object_s < 0
                or (self.host_Bps is not None and not self.host_Bps > 0)):
            raise ValueError(f"LinkModel needs bandwidth > 0, latency >= 0, object work >= 0 and host cap > 0 or "
                             f"None, got {self}")

    def flow_bytes(self, nbytes: int) -> float:
        """What a flow of ``nbytes`` moves through the links: its bytes and its object's work."""
        return nbytes + self.object_s * self.bandwidth_Bps


@dataclass(frozen=True)
class Task:
    """A node of the replayed graph: CPU work of a measured duration (``cpu_s``) or a flow of ``nbytes`` from
    ``src`` to ``dst`` (when ``src`` is set). Starts when every task in ``deps`` has ended (and not before
    ``not_before``)."""

    name: str
    deps: tuple[str, ...] = ()
    cpu_s: float = 0.0
    src: str | None = None
    dst: str | None = None
    nbytes: int = 0
    not_before: float = 0.0

    @property
    def is_flow(self) -> bool:
        return self.src is not None


def fair_rates(flows: Sequence[Task], link: LinkModel) -> list[float]:
    """Max-min fair rates of concurrent flows (progressive filling over every node's egress and ingress and the
    host cap): repeatedly the most contended resource fixes the rate of the flows through it."""
    caps: dict[tuple, float] = {}
    users: dict[tuple, list[int]] = {}
    for i, f in enumerate(flows):
        res = [("out", f.src), ("in", f.dst)] + ([("host",)] if link.host_Bps is not None else [])
        for r in res:
            caps.setdefault(r, link.host_Bps if r == ("host",) else link.bandwidth_Bps)
            users.setdefault(r, []).append(i)
    rate: dict[int, float] = {}
    while len(rate) < len(flows):
        share = {r: caps[r] / sum(1 for i in us if i not in rate) for r, us in users.items()
                 if any(i not in rate for i in us)}
        r_min = min(share, key=share.get)
        s = share[r_min]
        for i in users[r_min]:
            if i in rate:
                continue
            rate[i] = s
            for r, us in users.items():
                if i in us:
                    caps[r] -= s
    return [rate[i] for i in range(len(flows))]


def simulate(tasks: Sequence[Task], link: LinkModel) -> dict[str, tuple[float, float]]:
    """Replay ``tasks``: (start, end) of each. CPU tasks take their measured time (concurrent CPU tasks do not
    slow each other: their durations were measured under the run's real contention); a flow waits its latency,
    then moves its bytes (and its object's work, ``LinkModel.object_s``) at its fair rate, recomputed whenever a
    flow starts or ends; a flow within one node is free (zero-copy)."""
    by = {t.name: t for t in tasks}
    if len(by) != len(tasks):
        raise ValueError("task names must be unique")
    missing = {d for t in tasks for d in t.deps} - set(by)
    if missing:
        raise ValueError(f"tasks depend on unknown tasks {sorted(missing)}")
    start: dict[str, float] = {}
    end: dict[str, float] = {}
    cpu_end: dict[str, float] = {}          # running CPU task / flow in its latency phase -> when it ends
    moving: dict[str, float] = {}           # flow moving bytes -> bytes left
    now = 0.0
    while len(end) < len(tasks):
        for t in tasks:
            if t.name not in start and all(d in end for d in t.deps):
                s = max(now, t.not_before, max((end[d] for d in t.deps), default=0.0))
                if s > now:
                    continue
                start[t.name] = now
                if t.is_flow and t.src != t.dst and t.nbytes > 0:
                    cpu_end[t.name] = now + link.latency_s  # then its bytes move
                else:
                    cpu_end[t.name] = now + (t.cpu_s if not t.is_flow else 0.0)
        flows = [by[n] for n in moving]
        rates = fair_rates(flows, link) if flows else []
        finish = {n: now + left / r for (n, left), r in zip(moving.items(), rates)}
        nxt = [v for v in cpu_end.values()] + list(finish.values())
        nxt += [max(t.not_before, max((end[d] for d in t.deps), default=0.0)) for t in tasks
                if t.name not in start and all(d in end for d in t.deps)]
        if not nxt:
            raise ValueError(f"the task graph cannot finish: {sorted(set(by) - set(end))} wait on each other")
        t_next = max(min(nxt), now)
        for (n, left), r in zip(list(moving.items()), rates):
            moving[n] = left - r * (t_next - now)
        now = t_next
        for n, te in list(cpu_end.items()):
            if te <= now + 1e-12:
                del cpu_end[n]
                t = by[n]
                if t.is_flow and t.src != t.dst and t.nbytes > 0:
                    moving[n] = link.flow_bytes(t.nbytes)
                else:
                    end[n] = now
        # by finish time, not bytes left: a flow far faster than the clock's resolution still ends
        for n in [n for n in moving if finish.get(n, math.inf) <= now + 1e-12
                  or moving[n] <= 1e-9 * max(1.0, link.flow_bytes(by[n].nbytes))]:
            del moving[n]
            end[n] = now
    return {n: (start[n], end[n]) for n in end}


def makespan(tasks: Sequence[Task], link: LinkModel) -> float:
    return max(e for _, e in simulate(tasks, link).values()) if tasks else 0.0


# -- fitting the link from calibration flows ------------------------------------------------------------------------


@dataclass(frozen=True)
class LinkFit:
    """``fit_link``'s answer: the model and how well it explains the calibration flows themselves."""

    link: LinkModel
    single_rel_err: float
    """Median relative error of the fitted model on the single-flow calibration transfers."""
    concurrent_rel_err: float
    """Median relative error on the concurrent calibration rounds (NaN when there were none)."""


def _rounds(events: Sequence[FlowEvent]) -> dict[str, list[FlowEvent]]:
    """Calibration flows by round (``key`` = "<kind>/<round>": the flows of a round started together)."""
    out: dict[str, list[FlowEvent]] = {}
    for e in events:
        out.setdefault(e.key, []).append(e)
    return out


SMALL_FLOW_BYTES = 1 << 20
"""Single calibration pulls up to this size measure the intercept (``fit_link``): 64 KiB moves in ~0.06 ms at the
fitted bandwidths, against a 2-4.5 ms pull."""


def fit_link(calibration: Sequence[FlowEvent], host_cap: bool = True) -> LinkFit:
    """``t = intercept + bytes / bandwidth`` over the single-flow rounds (key "single/..."): the intercept the median
    of the pulls up to ``SMALL_FLOW_BYTES``, the bandwidth the median of the larger pulls' bytes over their time past
    it (least squares over every size where the calibration has no small pulls, as the recorded fixtures); the
    intercept split into the object's work (``LinkModel.object_s``: the median over the rounds of several small
    objects pulled at once from one node into another, key "objects/...", of their time past one object's, per extra
    object) and the latency (the rest; no split without such rounds); then, with
    ``host_cap``, the host cap that best explains the concurrent rounds (median relative error of their replayed
    makespans), chosen among no cap and each round's aggregate rate (sum of bytes / (its makespan - latency))
    below twice the NIC bandwidth (the most two flows move without a cap)."""
    rounds = _rounds(calibration)
    single = [fs[0] for k, fs in rounds.items() if k.startswith("single/")]
    if len(single) < 2 or len({e.nbytes for e in single}) < 2:
        raise ValueError("fit_link needs single-flow calibration rounds of at least two sizes")
    x = np.array([e.nbytes for e in single], dtype=float)
    y = np.array([e.t_end - e.t_start for e in single])
    small = x <= SMALL_FLOW_BYTES
    if small.any() and not small.all():
        # the intercept where it is measured (pulls too small for their bytes to count), the bandwidth from the large
        # pulls past it: a least-squares intercept of 4-48 MiB pulls swung 0-8 ms around the 2-4.5 ms small pulls
        lat = float(np.median(y[small]))
        for _ in range(3):  # the small pulls' own bytes, at the bandwidth of the previous round
            bw = float(np.median(x[~small] / np.maximum(y[~small] - lat, 1e-9)))
            lat = max(0.0, float(np.median(y[small] - x[small] / bw)))
    else:
        slope, lat = np.polyfit(x, y, 1)
        if slope <= 0:
            raise ValueError(f"calibration flows do not take longer with more bytes (slope {slope}): not a link")
        bw, lat = 1.0 / float(slope), max(0.0, float(lat))
    # a single flow's intercept is its latency plus its object's work; objects pulled at once tell them apart:
    # k objects of s bytes take intercept + ((k - 1) * object work + k * s / bw)
    objs = [fs for k, fs in rounds.items() if k.startswith("objects/") and len(fs) > 1]
    work = [(_round_meas(fs) - lat) / (len(fs) - 1) - sum(f.nbytes for f in fs) / ((len(fs) - 1) * bw)
            for fs in objs]
    obj = min(lat, max(0.0, float(np.median(work)))) if work else 0.0
    link = LinkModel(bw, lat - obj, object_s=obj)
    conc = [fs for k, fs in rounds.items() if not k.startswith(("single/", "objects/")) and len(fs) > 1]
    if host_cap and conc:  # candidates: no cap, and each round's aggregate rate; keep the best explanation
        cands = [link] + [LinkModel(bw, link.latency_s, c, obj) for c in
                          (sum(link.flow_bytes(f.nbytes) for f in fs) / max(1e-9, _round_meas(fs) - link.latency_s)
                           for fs in conc)
                          if c < 2 * bw]
        link = min(cands, key=lambda m: float(np.median([abs(_round_pred(fs, m) - _round_meas(fs))
                                                          / _round_meas(fs) for fs in conc])))
    s_err = float(np.median([abs(link.latency_s + link.flow_bytes(e.nbytes) / link.bandwidth_Bps - (e.t_end - e.t_start))
                             / (e.t_end - e.t_start) for e in single]))
    c_err = [abs(_round_pred(fs, link) - _round_meas(fs)) / _round_meas(fs) for fs in conc]
    return LinkFit(link, s_err, float(np.median(c_err)) if c_err else math.nan)


def fit_link_repeats(calibration: Sequence[FlowEvent], host_cap: bool = True) -> LinkFit:
    """``fit_link`` per calibration repeat (keys "<kind>/r<k>/<i>", ``bench.cluster.calibrate``), and the fit of
    the repeat whose bandwidth is the median (the lower one of an even count): one slow or fast repeat -- another
    job's burst on a shared machine -- no longer decides the pass's link. A calibration without repeat tags (one
    repeat; the recorded fixtures) is one fit."""
    reps: dict[str, list[FlowEvent]] = {}
    for e in calibration:
        parts = e.key.split("/")
        reps.setdefault(parts[1] if len(parts) == 3 else "", []).append(e)
    fits = sorted((fit_link(evs, host_cap) for evs in reps.values()), key=lambda f: f.link.bandwidth_Bps)
    return fits[(len(fits) - 1) // 2]


def _round_meas(fs: Sequence[FlowEvent]) -> float:
    return max(f.t_end for f in fs) - min(f.t_start for f in fs)


def _round_pred(fs: Sequence[FlowEvent], link: LinkModel) -> float:
    return makespan([Task(f"f{i}", src=f.src, dst=f.dst, nbytes=f.nbytes) for i, f in enumerate(fs)], link)


# -- the systems' task graphs from their traces ----------------------------------------------------------------------


def _dur(e: CpuEvent) -> float:
    return max(0.0, e.t_end - e.t_start)


def central_graph(events: Sequence[TraceEvent], t0: float) -> list[Task]:
    """The centralized driver's raw pass (``baselines.centralized_system``): every rollout worker's output pulled
    to the driver at once (flows "gather"), the unpickle ("deser") and build ("build"), then per rank in order the
    serialization of its chunk ("ser", on the driver: one after another) and its pull to the rank ("scatter"),
    then the rank's tail ("tail"). Every CpuEvent's measured duration; every flow's bytes."""
    cpu = {(e.label, e.key): e for e in events if isinstance(e, CpuEvent)}
    flows = [e for e in events if isinstance(e, FlowEvent)]
    gathers = [f for f in flows if f.label == "gather"]
    tasks = [Task(f"gather{i}", src=f.src, dst=f.dst, nbytes=f.nbytes) for i, f in enumerate(gathers)]
    g = tuple(t.name for t in tasks)
    tasks += [Task("deser", g, _dur(cpu[("deser", "")])), Task("build", ("deser",), _dur(cpu[("build", "")]))]
    prev = "build"
    for f in sorted((f for f in flows if f.label == "scatter"), key=lambda f: f.key):
        r = f.key
        tasks += [Task(f"ser:{r}", (prev,), _dur(cpu[("ser", r)])),
                  Task(f"scatter:{r}", (f"ser:{r}",), src=f.src, dst=f.dst, nbytes=f.nbytes),
                  Task(f"tail:{r}", (f"scatter:{r}",), _dur(cpu[("tail", r)]))]
        prev = f"ser:{r}"
    return tasks


def _gather_build(cpu: Mapping[tuple[str, str], CpuEvent], flows: Sequence[FlowEvent]) -> list[Task]:
    """The verl drivers' start: every rollout output pulled to the driver at once ("gather" flows), the unpickle
    ("deser") and the build ("build"), the last task named "build"."""
    gathers = [f for f in flows if f.label == "gather"]
    tasks = [Task(f"gather{i}", src=f.src, dst=f.dst, nbytes=f.nbytes) for i, f in enumerate(gathers)]
    return tasks + [Task("deser", tuple(t.name for t in tasks), _dur(cpu[("deser", "")])),
                    Task("build", ("deser",), _dur(cpu[("build", "")]))]


def verl_wg_graph(events: Sequence[TraceEvent], t0: float) -> list[Task]:
    """verl's own step's raw pass (``baselines.verl_system``: verl's DataProto and single controller): the gather,
    unpickle ("deser") and build as ``central_graph``'s, then three dispatches in order (keys "d<i>": old log-prob,
    reference, update). Per dispatch the driver converts the batch to a TensorDict ("convert") and runs verl's
    dispatch function ("ser": every rank's chunk consolidated and put at once); then each rank pulls its chunk
    ("scatter", key "d<i>/r<rank>", all ranks at once) and works on it ("tail"); after a forward dispatch the
    driver waits for every rank, then the results' return ("ret") and the union ("union"), all measured, before
    the next conversion. Every CpuEvent's measured duration; every flow's bytes."""
    cpu = {(e.label, e.key): e for e in events if isinstance(e, CpuEvent)}
    flows = [e for e in events if isinstance(e, FlowEvent)]
    tasks = _gather_build(cpu, flows)
    prev = "build"
    for d in sorted(key for label, key in cpu if label == "ser"):
        tasks += [Task(f"convert:{d}", (prev,), _dur(cpu[("convert", d)])),
                  Task(f"ser:{d}", (f"convert:{d}",), _dur(cpu[("ser", d)]))]
        tails = []
        for f in sorted((f for f in flows if f.label == "scatter" and f.key.split("/")[0] == d), key=lambda f: f.key):
            tasks += [Task(f"scatter:{f.key}", (f"ser:{d}",), src=f.src, dst=f.dst, nbytes=f.nbytes),
                      Task(f"tail:{f.key}", (f"scatter:{f.key}",), _dur(cpu[("tail", f.key)]))]
            tails.append(f"tail:{f.key}")
        if ("ret", d) in cpu:  # a forward dispatch: the driver waits for its results before the next one
            tasks += [Task(f"ret:{d}", (f"ser:{d}", *tails), _dur(cpu[("ret", d)])),
                      Task(f"union:{d}", (f"ret:{d}",), _dur(cpu[("union", d)]))]
            prev = f"union:{d}"
        else:
            prev = f"ser:{d}"
    return tasks


def knittrans_graph(events: Sequence[TraceEvent], t0: float) -> list[Task]:
    """KnitTrans's raw pass: each rank's prefetcher fetches its shares (keys "r<rank>/s<seq>"): the claim
    ("claim": waits for the admission at t0, then the controller's answer), the request to every unit holding
    part of the share and the units' work and serialization ("source"), one pull per unit ("read" flows,
    concurrent with every other flow), the unpickle ("deser") and packing ("pack"). A claim waits for the rank's
    latest share whose packing had ended when the claim started, plus the measured gap (the hand-over); a claim
    that started before any of the rank's packs ended starts when it was asked for (t0 at the earliest). So one fetch after another (a prefetcher with
    one worker) chains every share, and the prefetcher's ``depth`` concurrent fetches (since 3f775ac) overlap
    their claims and reads as they did. A rank's unpickling and packing run in its one process, so they take turns
    there (in the order they ran). The rank takes its shares in order: share k is held once it is packed and once
    the rank's turn after share k-1 ended ("turn": from taking share k-1 to asking for share k, its step and its
    ack: a round trip to the controller and the units' drops); the pass ends when every rank holds its last share.
    A trace without turns (recorded before they were) holds each share when it is packed. Ranks run in parallel.
    A share whose sources the rank had mapped already (``client.SourceCache``, since session 35) has no lookup, pull
    or unpickle: its pack follows its claim."""
    cpu: dict[tuple[str, str], CpuEvent] = {(e.label, e.key): e for e in events if isinstance(e, CpuEvent)}
    reads: dict[str, list[FlowEvent]] = {}
    for e in events:
        if isinstance(e, FlowEvent) and e.label == "read":
            reads.setdefault(e.key, []).append(e)
    by_rank: dict[str, list[str]] = {}
    for (label, key) in cpu:
        if label == "claim":
            by_rank.setdefault(key.split("/")[0], []).append(key)
    tasks: list[Task] = []
    for rank, keys in by_rank.items():
        keys.sort(key=lambda k: cpu[("claim", k)].t_start)
        # one process per rank: its shares' unpickle and packing take turns on its interpreter, in the order they ran
        turns = sorted((k for k in keys if ("deser", k) in cpu), key=lambda k: cpu[("deser", k)].t_start)
        before = {k: f"pack:{turns[i - 1]}" for i, k in enumerate(turns) if i > 0}
        for key in keys:
            claim = cpu[("claim", key)]
            done = [k for k in keys if ("pack", k) in cpu and cpu[("pack", k)].t_end <= claim.t_start]
            last = max(done, key=lambda k: cpu[("pack", k)].t_end, default=None)
            prev = (f"pack:{last}",) if last is not None else ()
            # the hand-over after the rank's last packed share, or (its first fetches) the rank's own start: a rank
            # actor that begins iterating after t0 asks late, and its share cannot arrive before it asks
            gap = max(0.0, claim.t_start - (cpu[("pack", last)].t_end if last is not None else t0))
            claim_s = claim.t_end - max(claim.t_start, t0)
            source = cpu.get(("source", key))
            tasks += [Task(f"gap:{key}", prev, gap), Task(f"claim:{key}", (f"gap:{key}",), max(0.0, claim_s)),
                      Task(f"source:{key}", (f"claim:{key}",), 0.0 if source is None else _dur(source))]
            fl = [Task(f"read:{key}:{i}", (f"source:{key}",), src=f.src, dst=f.dst, nbytes=f.nbytes)
                  for i, f in enumerate(reads.get(key, []))]
            tasks += fl
            after = tuple(t.name for t in fl) or (f"source:{key}",)
            deser, pack = cpu.get(("deser", key)), cpu[("pack", key)]
            tasks += [Task(f"deser:{key}", after + ((before[key],) if key in before else ()),
                           0.0 if deser is None else _dur(deser)),
                      # from the unpickle's end: the wait for the rank's interpreter before packing is its cost too
                      Task(f"pack:{key}", (f"deser:{key}",),
                           max(0.0, pack.t_end - (pack.t_start if deser is None else deser.t_end)))]
        order = sorted(keys, key=lambda k: int(k.rsplit("/s", 1)[1]))  # the order the rank takes its shares
        for i, key in enumerate(order):
            prev = order[i - 1] if i else None
            turn = (f"turn:{prev}",) if prev is not None and ("turn", prev) in cpu else ()
            tasks.append(Task(f"held:{key}", (f"pack:{key}",) + turn))
            if i + 1 < len(order) and ("turn", key) in cpu:
                tasks.append(Task(f"turn:{key}", (f"held:{key}",), _dur(cpu[("turn", key)])))
    return tasks


GRAPHS = {"central": central_graph, "verl_wg": verl_wg_graph, "knittrans": knittrans_graph}
"""Task graph per system kind: "verl_wg" is verl's own code (``baselines.verl_system``). ("verl", the graph of our
re-implementation of verl's multimodal step, went with it in session 33.)"""


@dataclass(frozen=True)
class Prediction:
    """One recorded raw pass against the model's replay of it."""

    system: str
    measured_s: float
    predicted_s: float
    flow_bytes: int
    cpu_s: float
    """Sum of the pass's measured CPU phases (all of them, for context)."""
    no_network_s: float = 0.0
    """The same replay with free flows (infinite bandwidth, no latency): what the measured CPU phases alone
    explain; ``1 - no_network_s / predicted_s`` is the share of the prediction the link model carries."""

    @property
    def rel_err(self) -> float:
        return (self.predicted_s - self.measured_s) / self.measured_s


def predict_pass(kind: str, events: Sequence[TraceEvent], t0: float, measured_s: float, link: LinkModel,
                 system: str = "") -> Prediction:
    """``kind``: "central" or "knittrans" (which graph); ``measured_s``: the pass's measured raw time."""
    if kind not in GRAPHS:
        raise ValueError(f"unknown system kind {kind!r}; choose from {sorted(GRAPHS)}")
    tasks = GRAPHS[kind](events, t0)
    return Prediction(system or kind, measured_s, makespan(tasks, link),
                      sum(t.nbytes for t in tasks if t.is_flow), sum(t.cpu_s for t in tasks if not t.is_flow),
                      makespan(tasks, LinkModel(1e30)))


def cpu_phase_totals(events: Sequence[TraceEvent]) -> Mapping[str, float]:
    """Measured seconds per CPU phase label (context for a trace)."""
    out: dict[str, float] = {}
    for e in events:
        if isinstance(e, CpuEvent):
            out[e.label] = out.get(e.label, 0.0) + _dur(e)
    return out
