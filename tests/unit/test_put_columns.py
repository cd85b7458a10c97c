"""Columnar puts (``knittrans.dataplane.columns``): the plain put travels as columns, is checked a column at a time,
and registers to the same state as the per-payload path; every other put -- and every put the column checks
refuse -- goes the per-payload way, which accepts and refuses exactly as before."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from knittrans.dataplane import TrajectoryPayload, build_inprocess
from knittrans.dataplane.columns import check_columns, columns_of, payloads_of
from knittrans.dataplane.storage import StorageUnit, validate_payload
from knittrans.dataplane.types import DataPlaneError, FieldSpec, TrajectorySchema
from knittrans.handoff import HandoffConfig
from knittrans.types import Trajectory
from workloads.text_data import TEXT_SCHEMA, TextDataConfig, make_text_batch

SCHEMA = HandoffConfig.grpo(prompts_per_batch=4, group_size=2, num_minibatches=2, max_response_len=64).resolved_schema


def _payload(t: int, n: int = 5, prompt: int = 7, meta: bool = True, **over) -> TrajectoryPayload:
    tensors = {"input_ids": np.arange(prompt + n, dtype=np.int64), "old_logprobs": np.zeros(n, np.float32),
               "advantages": np.ones(n, np.float32), "loss_mask": np.ones(n, bool)}
    tensors.update(over)
    return TrajectoryPayload(t, tensors, meta=Trajectory(t, t // 2, 0, n, 0) if meta else None)


def test_the_plain_put_becomes_columns_and_round_trips():
    payloads = [_payload(t, n=3 + t) for t in range(4)]
    cols, arrays = columns_of(payloads, SCHEMA)
    assert cols.names == tuple(payloads[0].tensors) and len(cols) == 4 and check_columns(SCHEMA, cols, arrays)
    back = payloads_of(cols, arrays)
    for p, q in zip(payloads, back):
        assert p.traj_id == q.traj_id and p.meta == q.meta
        assert all(np.array_equal(p.tensors[k], q.tensors[k]) for k in p.tensors)
    import pickle

    again = pickle.loads(pickle.dumps(cols))
    assert again.metas == cols.metas and np.array_equal(again.traj_ids, cols.traj_ids)


@pytest.mark.parametrize("what", ["checksums", "tensor", "fields", "fixed", "subclass", "empty"])
def test_any_other_put_keeps_the_per_payload_path(what):
    ps = [_payload(t) for t in range(3)]
    schema = SCHEMA
    if what == "checksums":
        ps[1] = dataclasses.replace(ps[1], checksums={"input_ids": 1})
    elif what == "tensor":
        ps[2] = dataclasses.replace(ps[2], tensors={**ps[2].tensors, "advantages": torch.ones(5)})
    elif what == "fields":
        ps[0] = dataclasses.replace(ps[0], tensors={k: v for k, v in ps[0].tensors.items() if k != "loss_mask"})
    elif what == "fixed":
        schema = TrajectorySchema((FieldSpec("input_ids", "int64"), FieldSpec("reward", "float32", ragged=False)),
                                  token_field="input_ids")
        ps = [TrajectoryPayload(t, {"input_ids": np.arange(4), "reward": np.float32(1.0)}) for t in range(3)]
    elif what == "subclass":
        from knittrans.mmdedup.plane import MMPayload

        ps = [MMPayload(p.traj_id, p.tensors, meta=p.meta, group=0) for p in ps]
    else:
        ps = []
    assert columns_of(ps, schema) is None


BAD = {
    "dtype": dict(old_logprobs=np.zeros(5, np.float64)),
    "nan": dict(advantages=np.array([1, np.nan, 1, 1, 1], np.float32)),
    "lengths": dict(loss_mask=np.ones(4, bool)),
    "empty_response": dict(old_logprobs=np.zeros(0, np.float32), advantages=np.zeros(0, np.float32),
                           loss_mask=np.ones(0, bool)),
    "tokens": dict(input_ids=np.arange(3, dtype=np.int64)),
    "shape": dict(input_ids=np.zeros((12, 2), np.int64)),
}


@pytest.mark.parametrize("bad", sorted(BAD))
def test_a_column_check_refuses_exactly_what_the_per_payload_check_refuses(bad):
    ps = [_payload(t) for t in range(4)]
    ps[2] = dataclasses.replace(ps[2], tensors={**ps[2].tensors, **BAD[bad]})
    with pytest.raises(DataPlaneError):
        validate_payload(SCHEMA, ps[2])
    got = columns_of(ps, SCHEMA)
    assert got is None or not check_columns(SCHEMA, *got)
    assert StorageUnit("u0", "n0", SCHEMA).put_columns(*got) is None if got is not None else True


def test_metadata_that_disagrees_with_the_tensors_is_refused_by_the_columns_too():
    ps = [_payload(t) for t in range(3)]
    ps[1] = dataclasses.replace(ps[1], meta=Trajectory(1, 0, 0, 6, 0))  # 5 response rows, metadata says 6
    cols, arrays = columns_of(ps, SCHEMA)
    assert not check_columns(SCHEMA, cols, arrays)


def _state(dp):
    ctrl = dp.controller
    trajs = {t: (st.unit_id, dict(st.fields), st.num_tokens, st.meta) for t, st in ctrl._trajs.items()}  # noqa: SLF001
    return trajs, ctrl.stats()


def test_a_columnar_put_registers_the_same_state_as_the_per_payload_put_and_reads_the_same_bytes():
    batch = make_text_batch(TextDataConfig(num_prompts=4, group_size=4, response_len_median=64, max_response_len=512,
                                           prompt_len_mean=32, seed=3))
    planes = [build_inprocess(TEXT_SCHEMA, {"u0": "n0", "u1": "n1"}, ("n0", "n1")) for _ in range(2)]
    for i, u in enumerate(("u0", "u1")):
        payloads = [t.payload() for t in batch.trajectories if t.group_id % 2 == i]
        planes[0].client(u).put(payloads)  # columns
        unit = planes[1].units[u]
        planes[1].controller.register(unit.put(payloads))  # payload by payload
    assert len(planes[0].units["u0"]._data) and _state(planes[0]) == _state(planes[1])  # noqa: SLF001
    for mb in batch.minibatches(2):
        for dp in planes:
            dp.client().admit(mb)
        for rank in range(2):
            a, b = (dp.client().fetch(mb, rank) for dp in planes)
            assert a.traj_ids == b.traj_ids
            assert all(torch.equal(a[n], b[n]) for n in TEXT_SCHEMA.names)


def test_a_put_the_columns_cannot_take_is_decided_payload_by_payload_and_nothing_half_done_stays():
    dp = build_inprocess(TEXT_SCHEMA, {"u0": "n0"}, ("n0",))
    batch = make_text_batch(TextDataConfig(num_prompts=2, group_size=2, response_len_median=16, max_response_len=64,
                                           prompt_len_mean=8, seed=1))
    payloads = [t.payload() for t in batch.trajectories]
    c = dp.client("u0")
    c.put(payloads)
    c.put(payloads)  # a retry: the unit holds every field already (a repeat, accepted as a no-op)
    assert dp.controller.stats().trajectories == len(payloads)
    changed = [dataclasses.replace(payloads[0], tensors={k: ~v if v.dtype == bool else v + 1
                                                         for k, v in payloads[0].tensors.items()}),
               *[TrajectoryPayload(100 + p.traj_id, p.tensors) for p in payloads[1:]]]
    from knittrans.dataplane.types import DuplicatePutError

    with pytest.raises(DuplicatePutError):  # the same fields with other bytes: refused, all or nothing
        c.put(changed)
    assert dp.controller.stats().trajectories == len(payloads)
    assert all(100 + p.traj_id not in dp.units["u0"]._data for p in payloads[1:])  # noqa: SLF001
