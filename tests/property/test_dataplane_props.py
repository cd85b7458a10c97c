"""Invariants of the data plane under random workloads and random (partly invalid) request sequences."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from knittrans.dataplane import (AlreadyConsumedError, DataPlaneError, FieldSpec, MiniBatchKey, ShareItem,
                                 TrajectoryPayload, TrajectorySchema, assign_shares, build_inprocess)
from knittrans.types import MiniBatch

SCHEMA = TrajectorySchema((FieldSpec("ids", "int64"), FieldSpec("lp", "float32"),
                           FieldSpec("score", "float32", ragged=False, tail=(2,))), token_field="ids")

items_st = st.lists(st.tuples(st.integers(1, 500), st.sampled_from(["a", "b", "c"])), min_size=1, max_size=40)


@given(items=items_st, nodes=st.lists(st.sampled_from(["a", "b", "c"]), min_size=1, max_size=5),
       slack=st.sampled_from([0.0, 0.05, 0.5]), equal=st.booleans())
def test_every_trajectory_lands_on_exactly_one_rank(items, nodes, slack, equal):
    its = [ShareItem(i, tok, node) for i, (tok, node) in enumerate(items)]
    shares = assign_shares(its, nodes, slack, equal)
    flat = [t for s in shares for t in s]
    assert sorted(flat) == list(range(len(its)))
    if equal:
        cap = -(-len(its) // len(nodes))
        assert max(len(s) for s in shares) <= cap


@given(items=items_st, nodes=st.lists(st.sampled_from(["a", "b", "c"]), min_size=1, max_size=5),
       slack=st.sampled_from([0.0, 0.05, 0.5]))
def test_no_rank_exceeds_the_balance_bound(items, nodes, slack):
    its = [ShareItem(i, tok, node) for i, (tok, node) in enumerate(items)]
    shares = assign_shares(its, nodes, slack, equal_counts=False)
    tok = {i.traj_id: i.tokens for i in its}
    ideal = sum(tok.values()) / len(nodes)
    bound = max((1 + slack) * ideal, ideal + max(tok.values()))
    assert max(sum(tok[t] for t in s) for s in shares) <= bound + 1e-9


ops_st = st.lists(st.tuples(st.sampled_from(["fetch", "fetch_again", "bad_field", "unknown_mb", "dup_put"]),
                            st.integers(0, 3), st.integers(0, 1)), max_size=30)


@settings(max_examples=40)
@given(lens=st.lists(st.integers(1, 30), min_size=4, max_size=16), ops=ops_st, seed=st.integers(0, 100))
def test_nothing_is_lost_or_delivered_twice_under_random_requests(lens, ops, seed):
    """Any sequence of valid and invalid requests delivers each (trajectory, field) at most once, with the bytes
    that were put; after every share is fetched, each was delivered exactly once."""
    rng = np.random.default_rng(seed)
    n = len(lens) - len(lens) % 2  # equal halves per mini-batch
    data = {t: {"ids": rng.integers(0, 99, lens[t]).astype(np.int64),
                "lp": rng.random(lens[t]).astype(np.float32), "score": rng.random(2).astype(np.float32)}
            for t in range(n)}
    dp = build_inprocess(SCHEMA, {"u0": "a", "u1": "b"}, ("a", "b"))
    for t in range(n):
        dp.client("u0" if t % 2 else "u1").put([TrajectoryPayload(t, data[t])])
    half = n // 2
    mbs = [MiniBatch(0, k, tuple(range(k * half, (k + 1) * half)), (k,), 0) for k in range(2)]
    for mb in mbs:
        dp.controller.admit(mb)
    c = dp.client()
    delivered: dict[tuple[int, str], int] = {}

    def take(mb_idx: int, rank: int, fields: tuple[str, ...]) -> None:
        share = c.fetch(mbs[mb_idx], rank, fields)
        for name in fields:
            f = share.fields[name]
            for i, t in enumerate(share.traj_ids):
                got = (f.values[f.cu_seqlens[i]:f.cu_seqlens[i + 1]] if f.cu_seqlens is not None
                       else f.values[i]).numpy()
                np.testing.assert_array_equal(got, data[t][name])
                delivered[(t, name)] = delivered.get((t, name), 0) + 1

    for op, k, rank in ops:
        mb_idx = k % 2
        try:
            if op == "fetch":
                take(mb_idx, rank, ("ids",))
            elif op == "fetch_again":
                take(mb_idx, rank, ("ids", "lp"))
            elif op == "bad_field":
                c.fetch(mbs[mb_idx], rank, ("ids", "nope"))
            elif op == "unknown_mb":
                c.fetch(MiniBatchKey(5, k), rank, ("ids",))
            else:
                dp.client("u0").put([TrajectoryPayload(k, {"ids": np.zeros(3, np.int64)})])
        except DataPlaneError:
            pass
    for mb_idx in range(2):  # drain: fetch every field not yet consumed
        for rank in range(2):
            for name in SCHEMA.names:
                try:
                    take(mb_idx, rank, (name,))
                except AlreadyConsumedError:
                    pass
    assert all(v == 1 for v in delivered.values())
    assert set(delivered) == {(t, name) for t in range(n) for name in SCHEMA.names}
    assert all(u.stats().nbytes == 0 for u in dp.units.values())  # released once fully consumed


@given(items=items_st, nodes=st.lists(st.sampled_from(["a", "b", "c"]), min_size=1, max_size=5),
       slack=st.sampled_from([0.0, 0.05, 0.5]), equal=st.booleans())
def test_the_split_is_never_less_balanced_or_less_local_than_lpt(items, nodes, slack, equal):
    """``assign_shares`` takes its consecutive-segment split (fewer runs per share, session 38) only where it is
    at least as balanced and as local as the LPT split it was before: a rank never waits longer at the step's
    collective, and no more bytes cross nodes, for the sake of the pack."""
    from knittrans.dataplane.assign import _lpt

    its = [ShareItem(i, tok, node) for i, (tok, node) in enumerate(items)]
    shares = assign_shares(its, nodes, slack, equal)
    cap = -(-len(its) // len(nodes)) if equal else len(its)
    lpt = _lpt(its, nodes, cap, (1 + slack) * sum(tok for tok, _ in items) / len(nodes))
    tok = {i.traj_id: i.tokens for i in its}
    local = {i.traj_id: i.node for i in its}
    assert max(sum(tok[t] for t in s) for s in shares) <= max(sum(tok[t] for t in s) for s in lpt)
    assert (sum(local[t] == nodes[r] for r, s in enumerate(shares) for t in s)
            >= sum(local[t] == nodes[r] for r, s in enumerate(lpt) for t in s))
