"""Property tests of admission: no dead end, constraints hold, exactly once, and agreement with brute force.

The brute force here is written independently of ``knittrans.admission.feasibility``: it enumerates every
partition of a small set of units into k labeled-by-first-use bins (restricted growth strings), so it is obviously
correct and obviously slow. Instances are kept to <= 8 units and M <= 3 wherever it is used. For up to 24 groups,
(d') enumerates multisets of interchangeable units instead (same size and tokens), still without any of the
implementation's arithmetic.
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
              max_m: int = 3, max_size: int = 4, slacks=(0, 0, 1, 2), whole_groups: bool | None = None,
              max_len: int = 8, min_groups: int = 1):
    whole = draw(st.booleans()) if whole_groups is None else whole_groups
    uniform = uniform_ok and draw(st.booleans())
    m = draw(st.integers(1, max_m))
    slack = draw(st.sampled_from(slacks))
    dp = draw(st.sampled_from([1, 1, 2]))
    L = draw(st.integers(1, max_len))
    if uniform:
        n = draw(st.integers(1, 3))
        p = draw(st.integers(min_groups, max_groups))
        sizes = [n] * p
    else:
        n = None
        sizes = draw(st.lists(st.integers(1, max_size), min_size=min_groups, max_size=max_groups))
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


# -- the ledger's running sums equal a recount -------------------------------------------------------------------


def assert_ledger_equals_recount(ledger, c: BatchConstraints, oracle) -> None:
    """Every incremental field of every batch in the ledger, recounted from its groups and the definitions."""
    L = c.max_response_len
    hi = c.max_minibatch_size
    for b in ledger.batches.values():
        ready_keys, ready_sizes, pend_sizes, pend_tokens, reach = [], {}, {}, 0, 1
        for g in b.plan.groups:
            st = b.groups[g.group_id]
            assert st.tokens == sum(t.num_tokens for t in st.arrived)
            missing = g.size - len(st.arrived)
            if c.whole_groups:
                if missing == 0 and not st.consumed:
                    ready_keys.append(g.group_id)
                    ready_sizes[g.size] = ready_sizes.get(g.size, 0) + 1
                    reach |= reach << g.size
                if missing:
                    pend_sizes[g.size] = pend_sizes.get(g.size, 0) + 1
                    pend_tokens += oracle(g.group_id) if oracle else st.tokens + missing * L
            else:
                for t in st.arrived:
                    if t.traj_id not in b.consumed_traj:
                        ready_keys.append(t.traj_id)
                        ready_sizes[1] = ready_sizes.get(1, 0) + 1
                        reach |= reach << 1
                if missing:
                    pend_sizes[1] = pend_sizes.get(1, 0) + missing
                    pend_tokens += (oracle(g.group_id) - st.tokens) if oracle else missing * L
        assert sorted(b.ready_units) == sorted(ready_keys)
        assert {s: n for s, n in b.ready_sizes.items() if n} == ready_sizes
        assert {s: n for s, n in b.pending_sizes.items() if n} == pend_sizes
        assert b.pending_tokens == pend_tokens
        assert b.ready_reach == reach & ((2 << hi) - 1)
        ready, pending = ledger.units(b)
        assert b.ready_size == sum(u.size for u in ready) and b.ready_tokens == sum(u.tokens for u in ready)
        assert b.pending_size == sum(u.size for u in pending) and b.pending_tokens == sum(u.tokens for u in pending)
        assert b.remaining_size == b.plan.num_trajectories - len(b.consumed_traj)


@settings(max_examples=200)
@given(instances(max_groups=6, max_batches=2), st.booleans())
def test_the_ledgers_running_sums_equal_a_recount(inst, clairvoyant):
    """The ledger keeps ready and pending units incrementally (no rebuild per decision); after every arrival and
    every commit each running sum, count, token bound and subset-sum bitset equals a recount from the groups."""
    totals: dict[int, int] = {}
    for t in inst.trajs:
        totals[t.group_id] = totals.get(t.group_id, 0) + t.num_tokens
    oracle = totals.__getitem__ if clairvoyant else None
    policy = KnitTransAdmission(inst.c, oracle_tokens=oracle)
    for plan in inst.plans:
        policy.add_batch(plan)
    assert_ledger_equals_recount(policy.ledger, inst.c, oracle)
    for t in inst.trajs:
        policy.on_complete(t)
        assert_ledger_equals_recount(policy.ledger, inst.c, oracle)
        while policy.on_trainer_ready(0.0):
            assert_ledger_equals_recount(policy.ledger, inst.c, oracle)


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


# -- (d'): up to 24 groups: KnitTrans never misses a safe mini-batch, never commits an unsafe one -----------------

# Partitions of 24 units are far too many to list, so this brute force enumerates multisets instead: units with the
# same (size, tokens) are interchangeable (tokens dropped without a budget), a split into bins is found by choosing
# the bin that holds one unit of the first type left, over every sub-multiset that makes a valid bin, memoized. It
# prunes only on monotone facts (a bin that is already too large or over budget stays so) and on the total size.


def _ms(units, c: BatchConstraints) -> tuple:
    """Sorted ((size, tokens), count) pairs of (key, size, tokens) units."""
    counts: dict[tuple[int, int], int] = {}
    for _, size, tokens in units:
        t = (size, tokens if c.token_budget is not None else 0)
        counts[t] = counts.get(t, 0) + 1
    return tuple(sorted(counts.items(), reverse=True))


def _sub_multisets(ms: tuple, c: BatchConstraints, first_at_least_one: bool):
    """(bin, rest) for every sub-multiset ``bin`` of ``ms`` that is a valid mini-batch (containing one unit of the
    first type when asked)."""
    hi = c.batch_size // c.num_minibatches + c.size_slack + (1 if c.batch_size % c.num_minibatches else 0)
    budget = c.token_budget
    chosen = [0] * len(ms)

    def rec(i: int, size: int, tokens: int):
        if i == len(ms):
            b = [(t, n) for (t, _), n in zip(ms, chosen) if n]
            if b and bf_bin_ok([t for t, n in b for _ in range(n)], c):
                rest = tuple((t, m - n) for (t, m), n in zip(ms, chosen) if m - n)
                yield b, rest
            return
        (s, tok), m = ms[i]
        lo = 1 if (i == 0 and first_at_least_one) else 0
        for n in range(lo, m + 1):
            if size + n * s > hi or (budget is not None and tokens + n * tok > budget):
                break
            chosen[i] = n
            yield from rec(i + 1, size + n * s, tokens + n * tok)
        chosen[i] = 0

    yield from rec(0, 0, 0)


def bf_split_ms(ms: tuple, k: int, c: BatchConstraints, memo: dict) -> bool:
    """Can the multiset ``ms`` be split into exactly k valid mini-batches?"""
    key = (ms, k)
    if key not in memo:
        hi = c.batch_size // c.num_minibatches + c.size_slack + (1 if c.batch_size % c.num_minibatches else 0)
        total = sum(s * n for (s, _), n in ms)
        if k == 0 or not ms:
            memo[key] = k == 0 and not ms
        elif total > k * hi or total < k:
            memo[key] = False
        else:
            memo[key] = any(bf_split_ms(rest, k - 1, c, memo) for _, rest in _sub_multisets(ms, c, True))
    return memo[key]


def bf_safe_exists(ready, pending, k: int, c: BatchConstraints, memo: dict) -> bool:
    """Is there a mini-batch of ready units after which ready + pending still split into k - 1?"""
    whole = _ms(ready + pending, c)
    for b, _ in _sub_multisets(_ms(ready, c), c, False):
        rest = dict(whole)
        for t, n in b:
            rest[t] -= n
        if bf_split_ms(tuple(sorted(((t, n) for t, n in rest.items() if n), reverse=True)), k - 1, c, memo):
            return True
    return False


def check_no_missed_admission(inst: Instance) -> int:
    """Drive KnitTrans like the trainer does; at every decision compare with the multiset brute force. Returns the
    number of decisions checked."""
    policy = KnitTransAdmission(inst.c)
    shadow = Shadow(inst)
    policy.add_batch(inst.plans[0])
    memo: dict = {}
    checked = 0
    for t in inst.trajs:
        policy.on_complete(t)
        shadow.complete(t)
        while shadow.committed < inst.c.num_minibatches:
            k = inst.c.num_minibatches - shadow.committed
            ready, pending = shadow.units()
            got = policy.on_trainer_ready(0.0)
            checked += 1
            if not got:
                assert not bf_safe_exists(ready, pending, k, inst.c, memo), \
                    f"KnitTrans waited with {len(ready)} ready units although a safe mini-batch existed"
                break
            (mb,) = got
            keys = shadow.keys_of(mb)
            chosen = [u for u in ready if u[0] in keys]
            rest = [u for u in ready if u[0] not in keys] + pending
            assert bf_bin_ok([(s, tok) for _, s, tok in chosen], inst.c), f"invalid mini-batch {mb}"
            assert bf_split_ms(_ms(rest, inst.c), k - 1, inst.c, memo), f"KnitTrans admitted unsafe {mb}"
            shadow.consume(mb)
    assert shadow.committed == inst.c.num_minibatches
    return checked


@st.composite
def many_groups(draw, min_groups: int = 14, max_groups: int = 24):
    """One batch of 14..24 whole groups, mostly small (so a mini-batch holds many of them; some palettes mostly
    even, so odd sums are scarce and exact sizes are hard to hit), M in 2..4; about half
    with a token budget that binds (it needs size_slack >= 1: with exact sizes, a budget that fits the nominal
    mini-batch at max_response_len never binds). Completions arrive in a random order of trajectories, or group
    by group in a random order of groups (then many groups are ready while a few large ones are in flight).
    Short responses (max_response_len <= 3) keep the brute force's multisets small."""
    palette = draw(st.sampled_from([(1, 1, 2, 2, 2, 3, 4, 5), (2, 2, 4, 4, 3, 6), (2, 4, 4, 1, 3)]))
    sizes = draw(st.lists(st.sampled_from(palette), min_size=min_groups, max_size=max_groups))
    total = sum(sizes)
    m = draw(st.sampled_from([2, 2, 2, 3, 4]))
    slack = draw(st.sampled_from([0, 1, 1, 2, 3]))
    if slack == 0 and total % m:
        slack = 1
    dp = 2 if total % 2 == 0 and draw(st.integers(0, 3)) == 0 else 1
    L = draw(st.integers(1, 3))
    budget = None
    if slack and draw(st.booleans()):
        need = -(-total // m)  # the robust sizes must still hold the batch in M mini-batches
        hi = total // m + slack + (1 if total % m else 0)
        budget = draw(st.integers(need * L, max(need * L, hi * L - 1)))
    try:
        c = BatchConstraints(batch_size=total, num_minibatches=m, max_response_len=L, size_slack=slack,
                             token_budget=budget, dp_size=dp)
        plan = BatchPlan(0, tuple(GroupSpec(g, 0, s) for g, s in enumerate(sizes)))
        check_plan(c, plan)
    except ConstraintError:
        assume(False)
    groups, tid = [], 0
    for g, s in enumerate(sizes):
        groups.append([Trajectory(tid + i, g, 0, draw(st.integers(1, L)), v_gen=0) for i in range(s)])
        tid += s
    if draw(st.booleans()):
        trajs = [t for g in draw(st.permutations(range(len(groups)))) for t in groups[g]]
    else:
        flat = [t for g in groups for t in g]
        trajs = [flat[i] for i in draw(st.permutations(range(len(flat))))]
    return Instance(c, [plan], trajs)


@settings(max_examples=500)
@given(many_groups())
def test_knittrans_never_misses_a_safe_minibatch_with_up_to_24_groups(inst):
    """Zero missed safe admissions with more ready groups than any fixed enumeration bound (the old one was 12),
    token budgets included; and every mini-batch it commits is safe by brute force."""
    check_no_missed_admission(inst)


def test_knittrans_admits_the_issue_15_example():
    """B = 50, M = 2, ready sizes [4]*6 + [2]*6 + [3] in that order, in flight [6, 4, 1]: five 4s, one 2 and the 3
    make 25, and the rest (one 4, five 2s and the in-flight 11) makes 25. The old policy committed nothing."""
    sizes = [4] * 6 + [2] * 6 + [3] + [6, 4, 1]
    c = BatchConstraints(batch_size=50, num_minibatches=2, max_response_len=8)
    plan = BatchPlan(0, tuple(GroupSpec(g, 0, s) for g, s in enumerate(sizes)))
    policy = KnitTransAdmission(c)
    policy.add_batch(plan)
    tid, got = 0, []
    for g, s in enumerate(sizes[:13]):
        for _ in range(s):
            policy.on_complete(Trajectory(tid, g, 0, 1, v_gen=0))
            tid += 1
        got += policy.on_trainer_ready(0.0)
    assert len(got) == 1 and got[0].size == 25 and set(got[0].group_ids) <= set(range(13))


def timeline(policy, inst: Instance) -> list[tuple[int, int, int, tuple[int, ...]]]:
    """(arrival index, batch, index, trajectories) of every mini-batch committed, asking after every arrival."""
    for plan in inst.plans:
        policy.add_batch(plan)
    out = []
    for i, t in enumerate(inst.trajs):
        policy.on_complete(t)
        while got := policy.on_trainer_ready(0.0):
            out += [(i, mb.batch_id, mb.index, mb.traj_ids) for mb in got]
    return out


@settings(max_examples=400)
@given(st.one_of(many_groups(), instances(max_groups=6, max_batches=2)))
def test_a_skipped_decision_could_not_have_admitted(inst):
    """KnitTrans re-runs a decision only when an arrival can change its answer (a unit of the current batch became
    ready, or, after a wait caused by tokens, an in-flight bound dropped). Its plain twin decides whenever asked:
    both must commit the same mini-batches after the same arrivals."""
    fast = timeline(KnitTransAdmission(inst.c), inst)
    assert fast == timeline(KnitTransAdmission(inst.c, skip_unchanged=False), inst)


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
