"""Property tests of admission: no dead end, constraints hold, exactly once, and agreement with brute force.

The brute force here is written independently of ``knittrans.admission.feasibility``: it enumerates every
partition of a small set of units into k labeled-by-first-use bins (restricted growth strings), so it is obviously
correct and obviously slow. Instances are kept to <= 8 units and M <= 3 wherever it is used.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import assume, given, settings
from hypothesis import strategies as st

from baselines.admission import GreedyStreamingAdmission, TrainBatchAdmission
from knittrans.admission import KnitTransAdmission, Unit, Verdict, check_plan, solve
from knittrans.constraints import BatchConstraints, ConstraintError
from knittrans.types import BatchPlan, GroupSpec, MiniBatch, Trajectory

# -- brute force ------------------------------------------------------------------------------------------------


def bf_bin_ok(bin_units, c: BatchConstraints) -> bool:
    """(size, tokens) pairs form one valid mini-batch: size allowed (incl. DP and whole-group steps), tokens in
    budget. Written from the constraint definitions, not from allowed_sizes()."""
    size = sum(s for s, _ in bin_units)
    tokens = sum(t for _, t in bin_units)
    lo = max(1, c.batch_size // c.num_minibatches - c.size_slack)
    hi = c.batch_size // c.num_minibatches + c.size_slack + (1 if c.batch_size % c.num_minibatches else 0)
    if not (lo <= size <= hi) or size % c.dp_size:
        return False
    if c.whole_groups and c.group_size is not None and size % c.group_size:
        return False
    return c.token_budget is None or tokens <= c.token_budget


def bf_partitions(units: list, k: int):
    """Every partition of ``units`` into exactly k non-empty bins (each partition once)."""
    n = len(units)
    if k == 0:
        if n == 0:
            yield []
        return
    if n < k:
        return
    assign = [0] * n

    def rec(i: int, used: int):
        if n - i < k - used:
            return
        if i == n:
            if used == k:
                bins = [[] for _ in range(k)]
                for u, a in zip(units, assign):
                    bins[a].append(u)
                yield bins
            return
        for b in range(min(used + 1, k)):
            assign[i] = b
            yield from rec(i + 1, max(used, b + 1))

    yield from rec(0, 0)


def bf_feasible(units: list, k: int, c: BatchConstraints) -> bool:
    """Units are (size, tokens) pairs; can they be split into exactly k valid mini-batches?"""
    return any(all(bf_bin_ok(b, c) for b in bins) for bins in bf_partitions(units, k))


def bf_subsets(items: list):
    n = len(items)
    for mask in range(1, 1 << n):
        yield [items[i] for i in range(n) if mask >> i & 1], [items[i] for i in range(n) if not mask >> i & 1]


# -- instances -------------------------------------------------------------------------------------------------


@dataclass
class Instance:
    c: BatchConstraints
    plans: list[BatchPlan]
    trajs: list[Trajectory]  # in completion order


@st.composite
def instances(draw, max_groups: int = 5, max_batches: int = 1, uniform_ok: bool = True, max_units: int | None = None,
              max_m: int = 3, max_size: int = 4, slacks=(0, 0, 1, 2)):
    whole = draw(st.booleans())
    uniform = uniform_ok and draw(st.booleans())
    m = draw(st.integers(1, max_m))
    slack = draw(st.sampled_from(slacks))
    dp = draw(st.sampled_from([1, 1, 2]))
    L = draw(st.integers(1, 8))
    if uniform:
        n = draw(st.integers(1, 3))
        p = draw(st.integers(1, max_groups))
        sizes = [n] * p
    else:
        n = None
        sizes = draw(st.lists(st.integers(1, max_size), min_size=1, max_size=max_groups))
    total = sum(sizes)
    if max_units is not None:
        assume((len(sizes) if whole else total) <= max_units)
    batch_size = total if slack == 0 else max(1, total + draw(st.integers(-slack, slack)))
    budget = None
    if draw(st.booleans()):
        budget = draw(st.integers(L, 6 * L))
    try:
        c = BatchConstraints(batch_size=batch_size, num_minibatches=m, max_response_len=L, group_size=n,
                             whole_groups=whole, size_slack=slack, token_budget=budget, dp_size=dp)
    except ConstraintError:
        assume(False)
    nb = draw(st.integers(1, max_batches))
    plans, trajs, gid, tid = [], [], 0, 0
    for b in range(nb):
        groups = []
        for s in sizes:
            groups.append(GroupSpec(gid, b, s))
            for _ in range(s):
                trajs.append(Trajectory(tid, gid, b, draw(st.integers(1, L)), v_gen=0))
                tid += 1
            gid += 1
        plan = BatchPlan(b, tuple(groups))
        try:
            check_plan(c, plan)
        except ConstraintError:
            assume(False)
        plans.append(plan)
    order = draw(st.permutations(range(len(trajs))))
    return Instance(c, plans, [trajs[i] for i in order])


def drive(policy, inst: Instance, on_decision=None) -> list[MiniBatch]:
    """Feed completions in order; after each (and at the end) ask the trainer-ready hook until it is empty."""
    for plan in inst.plans:
        policy.add_batch(plan)
    out: list[MiniBatch] = []

    def ask():
        while True:
            if on_decision is not None:
                on_decision("before")
            got = policy.on_trainer_ready(now=0.0)
            if on_decision is not None:
                on_decision(got)
            out.extend(got)
            if not got:
                return

    for t in inst.trajs:
        policy.on_complete(t)
        ask()
    ask()
    return out


def check_valid_and_exactly_once(inst: Instance, mbs: list[MiniBatch]) -> None:
    c = inst.c
    by_id = {t.traj_id: t for t in inst.trajs}
    seen: list[int] = [i for mb in mbs for i in mb.traj_ids]
    assert sorted(seen) == sorted(by_id), "a trajectory was lost or consumed twice"
    for plan in inst.plans:
        got = [mb for mb in mbs if mb.batch_id == plan.batch_id]
        assert [mb.index for mb in got] == list(range(c.num_minibatches)), "batch did not finish in exactly M"
        gsize = {g.group_id: g.size for g in plan.groups}
        for mb in got:
            trajs = [by_id[i] for i in mb.traj_ids]
            assert all(t.batch_id == plan.batch_id for t in trajs)
            assert mb.violations == ()
            assert bf_bin_ok([(1, t.num_tokens) for t in trajs], c), f"invalid mini-batch {mb}"
            assert mb.num_tokens == sum(t.num_tokens for t in trajs)
            if c.whole_groups:
                for g in set(t.group_id for t in trajs):
                    assert sum(t.group_id == g for t in trajs) == gsize[g], f"group {g} split across mini-batches"
    # batch b's mini-batches all come before batch b+1's
    bids = [mb.batch_id for mb in mbs]
    assert bids == sorted(bids)


# -- (a)-(c): KnitTrans never dead-ends, never breaks a constraint, consumes exactly once -----------------------


@settings(max_examples=250)
@given(instances(max_groups=6, max_batches=2))
def test_knittrans_never_reaches_a_dead_end_and_keeps_every_constraint(inst):
    mbs = drive(KnitTransAdmission(inst.c), inst)
    check_valid_and_exactly_once(inst, mbs)


@settings(max_examples=200)
@given(instances(max_groups=8, max_batches=1, max_m=5, max_size=5, slacks=(1, 2, 3), uniform_ok=False))
def test_knittrans_never_reaches_a_dead_end_without_exhaustive_search(inst):
    """The liveness guarantee must not rest on the exhaustive subset enumeration (large instances skip it)."""
    mbs = drive(KnitTransAdmission(inst.c, exhaustive_max=0), inst)
    check_valid_and_exactly_once(inst, mbs)


# -- (d): KnitTrans admits exactly when brute force says a robustly safe mini-batch exists ----------------------


class Shadow:
    """The test's own view of the current batch: ready units (exact tokens) and pending units (upper bounds)."""

    def __init__(self, inst: Instance):
        self.c = inst.c
        self.plan = inst.plans[0]
        self.arrived: dict[int, list[Trajectory]] = {g.group_id: [] for g in self.plan.groups}
        self.consumed: set[int] = set()
        self.committed = 0

    def complete(self, t: Trajectory):
        self.arrived[t.group_id].append(t)

    def units(self):
        """(ready, pending): (key, size, tokens) triples; pending tokens are the robust upper bound."""
        L = self.c.max_response_len
        ready, pending = [], []
        for g in self.plan.groups:
            arr = self.arrived[g.group_id]
            if self.c.whole_groups:
                if g.group_id in self.consumed:
                    continue
                tok = sum(t.num_tokens for t in arr) + (g.size - len(arr)) * L
                (ready if len(arr) == g.size else pending).append((("g", g.group_id), g.size, tok))
            else:
                ready += [(("t", t.traj_id), 1, t.num_tokens) for t in arr if t.traj_id not in self.consumed]
                pending += [(("p", g.group_id, i), 1, L) for i in range(g.size - len(arr))]
        return ready, pending

    def safe_choices(self):
        k = self.c.num_minibatches - self.committed
        ready, pending = self.units()
        out = []
        for chosen, rest in bf_subsets(ready):
            if not bf_bin_ok([(s, t) for _, s, t in chosen], self.c):
                continue
            if bf_feasible([(s, t) for _, s, t in rest + pending], k - 1, self.c):
                out.append(frozenset(key for key, _, _ in chosen))
        return out

    def keys_of(self, mb: MiniBatch):
        if self.c.whole_groups:
            return frozenset(("g", g) for g in mb.group_ids)
        return frozenset(("t", i) for i in mb.traj_ids)

    def consume(self, mb: MiniBatch):
        self.consumed |= set(mb.group_ids if self.c.whole_groups else mb.traj_ids)
        self.committed += 1


@settings(max_examples=200)
@given(instances(max_groups=6, max_batches=1, max_units=8))
def test_knittrans_admits_iff_brute_force_finds_a_robustly_safe_minibatch(inst):
    policy = KnitTransAdmission(inst.c)
    shadow = Shadow(inst)
    policy.add_batch(inst.plans[0])
    state = {}

    def on_decision(got):
        if got == "before":
            done = shadow.committed == inst.c.num_minibatches
            state["safe"] = [] if done else shadow.safe_choices()
            return
        if not got:
            assert state["safe"] == [], f"KnitTrans waited although {state['safe'][0]} was safe to admit"
            return
        (mb,) = got
        assert shadow.keys_of(mb) in state["safe"], f"KnitTrans admitted {mb}, which brute force says is unsafe"
        shadow.consume(mb)

    for t in inst.trajs:
        policy.on_complete(t)
        shadow.complete(t)
        while True:
            on_decision("before")
            got = policy.on_trainer_ready(0.0)
            on_decision(got)
            if not got:
                break
    assert shadow.committed == inst.c.num_minibatches


# -- (e): feasibility.solve agrees with brute force --------------------------------------------------------------


@st.composite
def solve_instances(draw):
    L = draw(st.integers(1, 8))
    m = draw(st.integers(1, 4))
    slack = draw(st.sampled_from([0, 1, 2, 3]))
    dp = draw(st.sampled_from([1, 1, 2, 3]))
    whole = draw(st.booleans())
    n = draw(st.sampled_from([None, None, 1, 2]))
    bs = draw(st.integers(1, 16))
    budget = draw(st.one_of(st.none(), st.integers(L, 5 * L)))
    try:
        c = BatchConstraints(batch_size=bs, num_minibatches=m, max_response_len=L, group_size=n, whole_groups=whole,
                             size_slack=slack, token_budget=budget, dp_size=dp)
    except ConstraintError:
        assume(False)
    usize = st.integers(1, 4) if n is None else st.just(n)
    raw = draw(st.lists(st.tuples(usize, st.integers(1, 4 * L)), min_size=0, max_size=8))
    units = [Unit(i, s, min(t, s * L), draw(st.booleans()), i) for i, (s, t) in enumerate(raw)]
    k = draw(st.integers(0, 3))
    return c, units, k


@settings(max_examples=300)
@given(solve_instances(), st.sampled_from([5, 20_000]))
def test_solve_agrees_with_brute_force_and_its_witness_is_a_valid_partition(inst, node_limit):
    c, units, k = inst
    sol = solve(units, k, c, node_limit=node_limit, want_witness=True)
    truth = bf_feasible([(u.size, u.tokens) for u in units], k, c)
    if sol.verdict is Verdict.FEASIBLE:
        assert truth, "solve claims FEASIBLE for an infeasible instance (unsound)"
    if sol.exact:
        assert sol.verdict is (Verdict.FEASIBLE if truth else Verdict.INFEASIBLE)
    else:
        assert sol.verdict is not Verdict.INFEASIBLE, "an inexact answer may never claim INFEASIBLE"
    if sol.bins is not None:
        assert len(sol.bins) == k
        assert sorted(u.key for b in sol.bins for u in b) == sorted(u.key for u in units)
        for b in sol.bins:
            assert bf_bin_ok([(u.size, u.tokens) for u in b], c), f"witness bin {b} is invalid"


# -- check_plan accepts exactly the robustly splittable plans ---------------------------------------------------


@settings(max_examples=200)
@given(st.data())
def test_accepted_plans_are_splittable_for_every_outcome_of_lengths(data):
    """Whatever the constructor and check_plan accept, brute force can split with every response at
    max_response_len: the promise that makes "no dead end" possible at all."""
    inst = data.draw(instances(max_groups=6, max_batches=1, max_units=8))
    c, plan = inst.c, inst.plans[0]
    L = c.max_response_len
    units = ([(g.size, g.size * L) for g in plan.groups] if c.whole_groups
             else [(1, L)] * plan.num_trajectories)
    assert bf_feasible(units, c.num_minibatches, c)


# -- (f): baselines consume exactly once; greedy's violations are never silent ----------------------------------


@settings(max_examples=200)
@given(instances(max_groups=6, max_batches=2))
def test_train_batch_consumes_exactly_once_within_constraints(inst):
    mbs = drive(TrainBatchAdmission(inst.c), inst)
    check_valid_and_exactly_once(inst, mbs)


@settings(max_examples=250)
@given(instances(max_groups=6, max_batches=2))
def test_greedy_consumes_exactly_once_and_never_breaks_a_constraint_silently(inst):
    policy = GreedyStreamingAdmission(inst.c)
    mbs = drive(policy, inst)
    c = inst.c
    by_id = {t.traj_id: t for t in inst.trajs}
    assert sorted(i for mb in mbs for i in mb.traj_ids) == sorted(by_id)
    broken = 0
    for plan in inst.plans:
        got = [mb for mb in mbs if mb.batch_id == plan.batch_id]
        assert [mb.index for mb in got] == list(range(c.num_minibatches))
        gsize = {g.group_id: g.size for g in plan.groups}
        for mb in got:
            trajs = [by_id[i] for i in mb.traj_ids]
            valid = bool(trajs) and bf_bin_ok([(1, t.num_tokens) for t in trajs], c)
            if c.whole_groups:
                valid = valid and all(sum(t.group_id == g for t in trajs) == gsize[g] for g in mb.group_ids)
            if not valid:
                broken += 1
                assert mb.violations, f"mini-batch {mb} breaks a constraint without recording it"
            else:
                assert mb.violations == (), f"valid mini-batch {mb} reports violations"
    assert policy.stats.violations == broken
    assert (policy.stats.dead_ends > 0) == (broken > 0)
