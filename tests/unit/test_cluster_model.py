"""The cluster transfer model (``knittrans.sim.cluster_model``): fair sharing, the replay of a task graph, the link
fit, and the systems' graphs built from traces. Pure Python: no Ray."""

from __future__ import annotations

import dataclasses

import pytest

from knittrans.dataplane.trace import CpuEvent, FlowEvent
from knittrans.sim.cluster_model import (LinkModel, Task, central_graph, fair_rates, fit_link, knittrans_graph,
                                         makespan, predict_pass, simulate, verl_wg_graph)

GB = 10**9


def test_flows_into_one_node_share_its_ingress_and_disjoint_flows_do_not():
    link = LinkModel(1e9)
    into = [Task("a", src="x", dst="d", nbytes=1), Task("b", src="y", dst="d", nbytes=1)]
    apart = [Task("a", src="x", dst="d", nbytes=1), Task("b", src="y", dst="e", nbytes=1)]
    assert fair_rates(into, link) == pytest.approx([0.5e9, 0.5e9])
    assert fair_rates(apart, link) == pytest.approx([1e9, 1e9])


def test_host_cap_binds_every_flow_of_one_machine_together():
    assert fair_rates([Task("a", src="x", dst="d", nbytes=1), Task("b", src="y", dst="e", nbytes=1)],
                      LinkModel(1e9, host_Bps=1.2e9)) == pytest.approx([0.6e9, 0.6e9])


def test_max_min_fairness_gives_a_flow_what_a_bottlenecked_neighbour_leaves():
    # a and b leave x; b also enters d with c: d's ingress halves b and c; a takes the rest of x's egress
    flows = [Task("a", src="x", dst="e", nbytes=1), Task("b", src="x", dst="d", nbytes=1),
             Task("c", src="y", dst="d", nbytes=1)]
    assert fair_rates(flows, LinkModel(1e9)) == pytest.approx([0.5e9, 0.5e9, 0.5e9])
    flows[2] = Task("c", src="y", dst="d", nbytes=1)
    flows.append(Task("d2", src="z", dst="d", nbytes=1))
    assert fair_rates(flows, LinkModel(9e8)) == pytest.approx([6e8, 3e8, 3e8, 3e8])


def test_replay_runs_latency_then_bytes_and_frees_bandwidth_when_a_flow_ends():
    link = LinkModel(1e9, latency_s=0.1)
    done = simulate([Task("small", src="x", dst="d", nbytes=GB // 2), Task("big", src="y", dst="d", nbytes=GB),
                     Task("cpu", ("small", "big"), cpu_s=0.25)], link)
    # both at 0.5 GB/s until small ends (0.1 + 1.0 s), then big alone at 1 GB/s for its last 0.5 GB
    assert done["small"][1] == pytest.approx(1.1)
    assert done["big"][1] == pytest.approx(1.6)
    assert done["cpu"] == pytest.approx((1.6, 1.85))


def test_replay_rejects_unknown_dependencies_and_duplicate_names():
    with pytest.raises(ValueError, match="unknown"):
        simulate([Task("a", ("nope",), cpu_s=1.0)], LinkModel(1e9))
    with pytest.raises(ValueError, match="unique"):
        simulate([Task("a"), Task("a")], LinkModel(1e9))
    with pytest.raises(ValueError, match="bandwidth"):
        LinkModel(0.0)


def _calibration(link: LinkModel) -> list[FlowEvent]:
    """Synthetic calibration rounds that a link behaves exactly like ``link``."""
    out, i = [], 0
    for nb in (4 << 20, 16 << 20, 48 << 20):
        for s, d in (("a", "b"), ("d", "c")):
            t = link.latency_s + nb / link.bandwidth_Bps
            out.append(FlowEvent("calibration", s, d, nb, 10.0 * i, 10.0 * i + t, f"single/{i}"))
            i += 1
    for kind, pairs in (("in", [("a", "d"), ("b", "d")]), ("disjoint", [("a", "b"), ("c", "d")])):
        tasks = [Task(f"f{j}", src=s, dst=d, nbytes=32 << 20) for j, (s, d) in enumerate(pairs)]
        ends = simulate(tasks, link)
        out += [FlowEvent("calibration", s, d, 32 << 20, 10.0 * i, 10.0 * i + ends[f"f{j}"][1], f"{kind}/{i}")
                for j, (s, d) in enumerate(pairs)]
        i += 1
    return out


def test_fit_link_recovers_the_link_that_made_the_calibration():
    truth = LinkModel(5e8, latency_s=0.02, host_Bps=6e8)
    fit = fit_link(_calibration(truth))
    assert fit.link.bandwidth_Bps == pytest.approx(5e8, rel=1e-6)
    assert fit.link.latency_s == pytest.approx(0.02, rel=1e-6)
    assert fit.link.host_Bps == pytest.approx(6e8, rel=1e-3)
    assert fit.single_rel_err < 1e-6 and fit.concurrent_rel_err < 1e-3


def test_fit_link_leaves_out_a_host_cap_that_does_not_bind():
    fit = fit_link(_calibration(LinkModel(5e8, latency_s=0.01)))
    assert fit.link.host_Bps is None


def test_one_slow_calibration_repeat_does_not_decide_the_link():
    """``fit_link_repeats``: three repeats, one of them at half the bandwidth (another job's burst): the pass's link
    is the median repeat's, not the slow one's nor a blend of the three."""
    import dataclasses

    from knittrans.sim.cluster_model import fit_link_repeats

    def tagged(link: LinkModel, rep: int) -> list[FlowEvent]:
        return [dataclasses.replace(e, key=e.key.replace("/", f"/r{rep}/", 1)) for e in _calibration(link)]
    reps = tagged(LinkModel(5e8, 0.01), 0) + tagged(LinkModel(2.5e8, 0.01), 1) + tagged(LinkModel(5.2e8, 0.01), 2)
    assert fit_link_repeats(reps).link.bandwidth_Bps == pytest.approx(5e8, rel=1e-6)
    assert fit_link_repeats(_calibration(LinkModel(4e8, 0.01))).link.bandwidth_Bps == pytest.approx(4e8, rel=1e-6)


def test_fit_link_needs_two_sizes():
    one = [FlowEvent("calibration", "a", "b", 100, 0.0, 1.0, "single/0"),
           FlowEvent("calibration", "a", "b", 100, 2.0, 3.0, "single/1")]
    with pytest.raises(ValueError, match="two sizes"):
        fit_link(one)


def central_trace(t0: float = 100.0) -> list:
    """A centralized raw pass: two gathers of 0.1 GB, 0.05 s unpickle, 0.2 s build, two ranks' 1 GB chunks."""
    ev = [FlowEvent("gather", "u0", "drv", GB // 10, t0, t0 + 0.3), FlowEvent("gather", "u1", "drv", GB // 10, t0,
                                                                                  t0 + 0.3),
          CpuEvent("deser", "drv", t0 + 0.3, t0 + 0.35), CpuEvent("build", "drv", t0 + 0.35, t0 + 0.55)]
    for r in range(2):
        ev += [CpuEvent("ser", "drv", t0 + 0.55 + 0.1 * r, t0 + 0.65 + 0.1 * r, f"r{r}"),
               FlowEvent("scatter", "drv", f"rk{r}", GB, t0 + 0.65 + 0.1 * r, t0 + 2.0, f"r{r}"),
               CpuEvent("tail", f"rk{r}", t0 + 2.0, t0 + 2.01, f"r{r}")]
    return ev


def test_central_graph_is_gather_build_then_serialized_scatter():
    link = LinkModel(1e9)
    t = makespan(central_graph(central_trace(), 100.0), link)
    # gather 0.2 GB into the driver: 0.2 s; cpu 0.05 + 0.2; ser r0 0.1; then r0's 1 GB alone for 0.1 s, both
    # share the driver's egress until r0 ends (r0 0.9 GB left at 0.5 GB/s ... ): total bytes 2 GB leave one NIC
    assert t == pytest.approx(0.2 + 0.25 + 0.1 + 2.0 + 0.01, rel=1e-6)


def verl_wg_trace(t0: float = 100.0) -> list:
    """verl's own step: gather and build as ``central_trace``'s, then three dispatches, each a conversion (3 ms)
    and verl's dispatch function (every rank's chunk put at once: 20 ms), 0.1 GB pulled by each rank, its work
    (20 ms), the two forward ones followed by the results' return (5 ms) and the union (1 ms)."""
    ev = central_trace(t0)[:4]
    for d in range(3):
        ev += [CpuEvent("convert", "drv", t0, t0 + 0.003, f"d{d}"), CpuEvent("ser", "drv", t0, t0 + 0.02, f"d{d}")]
        for r in range(2):  # the recorded times do not matter, only durations and bytes
            k = f"d{d}/r{r}"
            ev += [FlowEvent("scatter", "drv", f"rk{r}", GB // 10, t0, t0, k),
                   CpuEvent("tail", f"rk{r}", t0, t0 + 0.02, k)]
        if d < 2:
            ev += [CpuEvent("ret", "drv", t0, t0 + 0.005, f"d{d}"), CpuEvent("union", "drv", t0, t0 + 0.001, f"d{d}")]
    return ev


def test_verl_wg_graph_puts_every_chunk_at_once_then_each_forward_waits_for_its_results():
    tasks = verl_wg_graph(verl_wg_trace(), 100.0)
    assert sum(t.nbytes for t in tasks if t.is_flow) == 2 * GB // 10 + 6 * GB // 10
    # gather 0.2 s, deser + build 0.25; per dispatch: convert 0.003 + put 0.02, both ranks' 0.1 GB through the
    # driver's egress at once (0.2 s), their work 0.02; a forward one then 0.005 + 0.001 before the next one
    forward, update = 0.023 + 0.2 + 0.02 + 0.006, 0.023 + 0.2 + 0.02
    assert makespan(tasks, LinkModel(1e9)) == pytest.approx(0.45 + 2 * forward + update, rel=1e-6)
    no_ret = [e for e in verl_wg_trace() if getattr(e, "label", "") not in ("ret", "union")]  # dispatches overlap
    assert makespan(verl_wg_graph(no_ret, 100.0), LinkModel(1e9)) < 0.45 + 2 * forward + update - 0.01


def knittrans_trace(t0: float = 100.0) -> list:
    """Two ranks, two shares each, each read from two units (50 MB each), with claim / source / deser / pack."""
    ev = []
    for r in range(2):
        t = t0 - 0.5  # the prefetcher was waiting before t0: its first claim counts from t0
        for s in range(2):
            key = f"r{r}/s{s}"
            ev += [CpuEvent("claim", f"rk{r}", t, t0 + 0.01 + s, key),
                   CpuEvent("source", f"rk{r}", t0 + 0.01 + s, t0 + 0.03 + s, key),
                   FlowEvent("read", "u0", f"rk{r}", 50 * 10**6, t0 + 0.03 + s, t0 + 0.2 + s, key),
                   FlowEvent("read", "u1", f"rk{r}", 50 * 10**6, t0 + 0.03 + s, t0 + 0.2 + s, key),
                   CpuEvent("deser", f"rk{r}", t0 + 0.2 + s, t0 + 0.21 + s, key),
                   CpuEvent("pack", f"rk{r}", t0 + 0.21 + s, t0 + 0.25 + s, key)]
            t = t0 + 0.26 + s  # 0.01 s hand-over gap before the next claim
    return ev


def test_knittrans_graph_chains_each_ranks_shares_and_shares_unit_links_between_ranks():
    link = LinkModel(1e9)
    tasks = knittrans_graph(knittrans_trace(), 100.0)
    # per share: claim 0.01 (from t0), source 0.02, 4 flows of 50 MB: each unit serves 2 ranks and each rank reads
    # 2 units -> 0.5 GB/s each -> 0.1 s, deser 0.01, pack 0.04; second share: gap 0.01 + claim (0.01 + 1 - 0.26)
    first = 0.01 + 0.02 + 0.1 + 0.01 + 0.04
    second = 0.01 + (1.01 - 0.26) + 0.02 + 0.1 + 0.01 + 0.04
    assert makespan(tasks, link) == pytest.approx(first + second, rel=1e-6)
    p = predict_pass("knittrans", knittrans_trace(), 100.0, measured_s=first + second, link=link)
    assert p.rel_err == pytest.approx(0.0, abs=1e-9) and p.flow_bytes == 8 * 50 * 10**6


def test_a_ranks_turn_between_shares_is_on_its_path_and_the_projection_counts_it():
    """The rank takes share k+1 only after its turn on share k (step, ack): a turn longer than the slack before the
    next share is packed lengthens the pass by the difference; the last share's turn is not part of the pass; a
    trace without turns predicts as before, and the projection's raw pass counts the measured turn."""
    link = LinkModel(1e9)
    base = makespan(knittrans_graph(knittrans_trace(), 100.0), link)
    first = 0.01 + 0.02 + 0.1 + 0.01 + 0.04  # share 0 of each rank is held here; share 1 is packed at `base`
    slack = base - first
    turns = [CpuEvent("turn", f"rk{r}", 0.0, d, f"r{r}/s{s}") for r in range(2) for s, d in ((0, slack + 0.3),
                                                                                             (1, 5.0))]
    assert makespan(knittrans_graph(knittrans_trace() + turns, 100.0), link) == pytest.approx(base + 0.3, rel=1e-6)
    short = [CpuEvent("turn", f"rk{r}", 0.0, slack / 2, f"r{r}/s0") for r in range(2)]
    assert makespan(knittrans_graph(knittrans_trace() + short, 100.0), link) == pytest.approx(base, rel=1e-6)

    from types import SimpleNamespace

    from knittrans.sim.cluster_projection import PaperSetting, PhaseCosts, StepBalance, project
    bal = StepBalance(1e-6, 1e-6)

    def costs(events: list) -> PhaseCosts:
        return PhaseCosts.from_trace([SimpleNamespace(graph="central", events=central_trace(), pixel_bytes=0),
                                      SimpleNamespace(graph="knittrans", events=events, pixel_bytes=0)], 1e10)

    def raw(events: list) -> float:
        return project(PaperSetting(12.5e9, 8, 8), costs(events), link, bal).knittrans_raw_s

    without = raw(knittrans_trace())
    read = (without - 15 * costs(knittrans_trace()).fixed_s["knittrans/gap"]) / 16  # M = 16 shares, gaps between
    long = [CpuEvent("turn", f"rk{r}", 0.0, 10.0, f"r{r}/s0") for r in range(2)]  # far past a share's read
    assert raw(knittrans_trace() + long) == pytest.approx(read + 15 * 10.0, rel=1e-6)
    assert raw(knittrans_trace() + short) == pytest.approx(without, rel=1e-6)  # shorter than read + gap


def concurrent_trace(t0: float = 100.0) -> list:
    """One rank whose prefetcher runs two fetches at once: both claims start before either share is packed."""
    ev = []
    for s in range(2):
        key = f"r0/s{s}"
        ev += [CpuEvent("claim", "rk0", t0 - 0.5, t0 + 0.01, key),
               CpuEvent("source", "rk0", t0 + 0.01, t0 + 0.03, key),
               FlowEvent("read", "u0", "rk0", 50 * 10**6, t0 + 0.03, t0 + 0.2, key),
               CpuEvent("deser", "rk0", t0 + 0.2 + 0.05 * s, t0 + 0.21 + 0.05 * s, key),
               CpuEvent("pack", "rk0", t0 + 0.21 + 0.05 * s, t0 + 0.25 + 0.05 * s, key)]
    return ev


def test_concurrent_fetches_overlap_their_reads_and_take_turns_on_the_ranks_interpreter():
    link = LinkModel(1e9)
    tasks = knittrans_graph(concurrent_trace(), 100.0)
    # both claims from t0 (no pack had ended), both reads share unit 0's link: 100 MB at 1 GB/s; then the two
    # unpickles + packs one after the other in the rank's process (0.05 each)
    assert makespan(tasks, link) == pytest.approx(0.01 + 0.02 + 0.1 + 2 * 0.05, rel=1e-6)
    # and the projection's phase costs have no hand-over gap to measure: it counts none (no KeyError)
    from knittrans.sim.cluster_projection import PhaseCosts
    from types import SimpleNamespace
    costs = PhaseCosts.from_trace([SimpleNamespace(graph="knittrans", events=concurrent_trace(), pixel_bytes=0)],
                                  copy_Bps=1e10)
    assert "knittrans/gap" not in costs.fixed_s and costs.cpu("knittrans/pack") >= 0


def test_a_slower_link_predicts_a_slower_pass():
    fast, slow = LinkModel(1e9), LinkModel(1e8)
    for kind, ev in (("central", central_trace()), ("knittrans", knittrans_trace())):
        assert (predict_pass(kind, ev, 100.0, 1.0, slow).predicted_s
                > predict_pass(kind, ev, 100.0, 1.0, fast).predicted_s)
    with pytest.raises(ValueError, match="unknown system kind"):
        predict_pass("nope", central_trace(), 100.0, 1.0, fast)


def _object_calibration(link: LinkModel, k: int = 8, small: int = 64 << 10) -> list[FlowEvent]:
    """Calibration as ``bench.cluster.calibrate`` records it since session 38: small single pulls (the intercept),
    large ones, and ``k`` small objects pulled at once (one event per object), each made by ``link`` exactly."""
    out, i = [], 0
    for nb in (small, 4 << 20, 16 << 20, 48 << 20):
        for s, d in (("a", "b"), ("d", "c")):
            t = makespan([Task("f", src=s, dst=d, nbytes=nb)], link)
            out.append(FlowEvent("calibration", s, d, nb, 10.0 * i, 10.0 * i + t, f"single/{i}"))
            i += 1
    t = makespan([Task(f"o{j}", src="a", dst="b", nbytes=small) for j in range(k)], link)
    out += [FlowEvent("calibration", "a", "b", small, 10.0 * i, 10.0 * i + t, f"objects/{i}") for _ in range(k)]
    return out


def test_objects_pulled_together_queue_for_their_work_where_latency_overlaps():
    """``LinkModel.object_s``: eight small objects pulled at once take their latency once and their work eight times
    (what a share's small field objects beside its image cost, session 38); with no object work they take one
    latency, as before."""
    small = 1000
    eight = [Task(f"o{j}", src="a", dst="b", nbytes=small) for j in range(8)]
    work = LinkModel(1e9, latency_s=0.002, object_s=0.001)
    assert makespan(eight, work) == pytest.approx(0.002 + 8 * (0.001 + small / 1e9), rel=1e-6)
    assert makespan(eight[:1], work) == pytest.approx(0.002 + 0.001 + small / 1e9, rel=1e-6)
    assert makespan(eight, LinkModel(1e9, latency_s=0.003)) == pytest.approx(0.003 + 8 * small / 1e9, rel=1e-6)
    with pytest.raises(ValueError):
        LinkModel(1e9, object_s=-1.0)


def test_fit_link_splits_the_intercept_into_latency_and_object_work():
    truth = LinkModel(8e8, latency_s=0.0015, object_s=0.0008)
    fit = fit_link(_object_calibration(truth), host_cap=False).link
    assert fit.bandwidth_Bps == pytest.approx(8e8, rel=1e-3)
    assert fit.latency_s == pytest.approx(0.0015, rel=1e-2)
    assert fit.object_s == pytest.approx(0.0008, rel=1e-2)


def test_the_intercept_is_the_small_pulls_not_a_least_squares_intercept_of_noisy_large_ones():
    """A noisy 48 MiB pull (another job's burst) moved the least-squares intercept of 4-48 MiB pulls by milliseconds
    (0-8 ms against 2-4.5 ms small pulls, session 38); with small pulls in the calibration the intercept is theirs."""
    truth = LinkModel(1e9, latency_s=0.003)
    cal = _object_calibration(truth)
    cal = [dataclasses.replace(e, t_end=e.t_start + 1.6 * (e.t_end - e.t_start)) if e.nbytes == 48 << 20 and
           e.src == "a" else e for e in cal]
    fit = fit_link(cal, host_cap=False).link
    assert fit.latency_s + fit.object_s == pytest.approx(0.003, rel=1e-3)
    assert fit.bandwidth_Bps == pytest.approx(1e9, rel=0.05)
