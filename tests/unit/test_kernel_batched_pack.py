"""batched_pack reference and planner: placement, position ids, cu_seqlens, clear errors, balance."""

from __future__ import annotations

import pytest
import torch

from triton_kernels.batched_pack import PackBuffers, PackedBatch, PackPlan, batched_pack, pack_field, plan_microbatches

OFF = torch.tensor([0, 3, 5, 5, 9])  # lengths 3, 2, 0, 4


def _plan(rows, offsets, num_rows=2, row_len=6):
    return PackPlan(torch.tensor(rows), torch.tensor(offsets), num_rows=num_rows, row_len=row_len)


def test_pack_places_each_sequence_and_pads_the_rest():
    out = pack_field(torch.arange(1, 10), OFF, _plan([0, 0, 1, 1], [0, 3, 0, 0]), pad_value=-1)
    assert out.tolist() == [[1, 2, 3, 4, 5, -1], [6, 7, 8, 9, -1, -1]]


def test_position_ids_reset_at_every_sequence_start():
    packed = batched_pack({"x": torch.arange(9.0)}, OFF, _plan([0, 0, 1, 1], [0, 3, 0, 0]))
    assert packed.position_ids.tolist() == [[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 0, 0]]
    assert packed.cu_seqlens.tolist() == [[0, 3, 5], [0, 0, 4]]
    assert packed.seq_counts.tolist() == [2, 2]
    assert packed.fields["x"].dtype == torch.float32


@pytest.mark.parametrize("rows, offsets, seq_off, match", [
    ([0, 0, 1, 1], [0, 2, 0, 0], OFF, "overlapping"),
    ([0, 0, 1, 2], [0, 3, 0, 0], OFF, "out of range"),
    ([0, 0, 1, 1], [0, 5, 0, 0], OFF, "out of range"),
    ([0, 0, 1, -1], [0, 3, 0, 0], OFF, "out of range"),
    ([0, 0, 1, 1], [0, 3, 0, 0], torch.tensor([0, 3, 5, 4, 9]), "negative length"),
    ([0, 0, 1, 1], [0, 3, 0, 0], torch.tensor([0, 3, 5, 5, 12]), "seq_offsets out of range"),
    ([0, 1], [0, 0], torch.tensor([0, 2, 9]), "longer than the budget"),
])
def test_bad_input_gets_a_clear_error(rows, offsets, seq_off, match):
    with pytest.raises(ValueError, match=match):
        pack_field(torch.arange(10), seq_off, _plan(rows, offsets))


def test_bad_field_and_plan_types_are_rejected():
    with pytest.raises(TypeError):
        pack_field(torch.zeros(3, 3), torch.tensor([0, 9]), _plan([0], [0]))
    with pytest.raises(ValueError, match="contiguous"):
        pack_field(torch.zeros(20)[::2], torch.tensor([0, 9]), _plan([0], [0], row_len=9))
    with pytest.raises(TypeError):
        PackPlan([0], torch.tensor([0]), 1, 4)
    with pytest.raises(ValueError, match="pad_values"):
        batched_pack({"x": torch.arange(9)}, OFF, _plan([0, 0, 1, 1], [0, 3, 0, 0]), {"y": 0})


def test_forcing_triton_on_cpu_without_interpreter_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        pack_field(torch.arange(9), OFF, _plan([0, 0, 1, 1], [0, 3, 0, 0]), impl="triton")


@pytest.mark.parametrize("method", ["ffd", "kk"])
def test_planner_places_every_sequence_once_within_budget(method):
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(0, 513, (200,), generator=g).tolist()
    p = plan_microbatches(lengths, num_ranks=4, max_tokens_per_microbatch=1024, method=method)
    seen = sorted(i for rank in p.microbatches for mb in rank for i in mb)
    assert seen == list(range(200))
    assert all(len(rank) == p.num_microbatches for rank in p.microbatches)
    assert max(t for r in p.microbatch_tokens for t in r) <= 1024
    assert sum(p.rank_tokens) == sum(lengths)
    assert p.rank_imbalance < 0.1


def test_karmarkar_karp_balances_ranks_at_least_as_well_as_ffd_here():
    g = torch.Generator().manual_seed(1)
    lengths = (torch.randint(1, 2048, (256,), generator=g) ** 1).tolist()
    kk = plan_microbatches(lengths, 8, 4096, method="kk")
    ffd = plan_microbatches(lengths, 8, 4096, method="ffd")
    assert kk.rank_imbalance <= ffd.rank_imbalance
    assert kk.rank_imbalance < 0.01


def test_planner_errors_and_edge_cases():
    with pytest.raises(ValueError, match="longer than"):
        plan_microbatches([5, 9], 2, 8)
    with pytest.raises(ValueError, match="negative"):
        plan_microbatches([5, -1], 2, 8)
    with pytest.raises(ValueError, match="method"):
        plan_microbatches([5], 2, 8, method="greedy")
    empty = plan_microbatches([], 3, 8)
    assert empty.num_microbatches == 1 and empty.pack.num_rows == 3 and empty.rank_imbalance == 0.0
    exact = plan_microbatches([8, 8, 8], 1, 8)
    assert exact.num_microbatches == 3 and exact.microbatch_imbalance == 0.0


# out=: a wrong buffer is rejected, naming the output and what is wrong, before anything is written.

PLAN = _plan([0, 0, 1, 1], [0, 3, 0, 0])  # 2 x 6


@pytest.mark.parametrize("make_out, error, match", [
    (lambda: torch.zeros(2, 5, dtype=torch.int64), ValueError, r"shape \(2, 5\), the plan needs \(2, 6\)"),
    (lambda: torch.zeros(12, dtype=torch.int64), ValueError, "shape"),
    (lambda: torch.zeros(2, 6, dtype=torch.int32), TypeError, "torch.int32, the packed values are torch.int64"),
    (lambda: torch.zeros(2, 6, dtype=torch.int64, device="meta"), ValueError, "is on meta"),
    (lambda: torch.zeros(6, 2, dtype=torch.int64).t(), ValueError, "contiguous"),
    (lambda: [[0] * 6] * 2, TypeError, "must be a tensor"),
])
def test_pack_field_rejects_a_wrong_out_buffer(make_out, error, match):
    for impl in ("reference", "triton"):
        with pytest.raises(error, match=match):
            pack_field(torch.arange(9), OFF, PLAN, impl=impl, out=make_out())


def test_an_out_buffer_overlapping_the_values_is_rejected():
    values = torch.zeros(20, dtype=torch.int64)
    values[:9] = torch.arange(9)
    with pytest.raises(ValueError, match="overlaps"):
        pack_field(values[:9], OFF, PLAN, out=values[8:].view(2, 6))


def test_batched_pack_rejects_wrong_out_batches_and_writes_nothing():
    fields = {"ids": torch.arange(9), "logp": torch.arange(9.0)}
    good = batched_pack(fields, OFF, PLAN)
    before = {k: v.clone() for k, v in good.fields.items()}
    other = {"ids": torch.arange(9) + 100, "logp": torch.arange(9.0) + 100}

    def wrong(**changes):
        kw = {"fields": dict(good.fields), "position_ids": good.position_ids, "cu_seqlens": good.cu_seqlens,
              "seq_counts": good.seq_counts, "plan": PLAN}
        kw.update(changes)
        return PackedBatch(**kw)

    cases = [
        (wrong(fields={"ids": good.fields["ids"]}), ValueError, "out has fields"),
        (wrong(fields={"ids": good.fields["ids"], "logp": good.fields["logp"].double()}), TypeError, "'logp'"),
        (wrong(position_ids=good.position_ids.int()), TypeError, "'position_ids'"),
        (wrong(position_ids=torch.zeros(3, 6, dtype=torch.int64)), ValueError, "'position_ids' has shape"),
        (wrong(fields={"ids": good.fields["ids"], "logp": good.fields["ids"].view(torch.float64)}), TypeError,
         "'logp'"),
        (wrong(position_ids=good.fields["ids"]), ValueError, "'ids' and out for 'position_ids' share memory"),
    ]
    for out, error, match in cases:
        with pytest.raises(error, match=match):
            batched_pack(other, OFF, PLAN, out=out)
        assert all(torch.equal(good.fields[k], before[k]) for k in before)  # validated before any write
    with pytest.raises(TypeError, match="PackedBatch, a PackBuffers or None"):
        batched_pack(other, OFF, PLAN, out={"ids": good.fields["ids"]})


def test_pack_buffers_hand_out_one_buffer_per_field_grown_to_the_largest_shape():
    bufs = PackBuffers()
    small, big = _plan([0], [0], num_rows=2, row_len=6), _plan([0], [0], num_rows=4, row_len=6)
    a = bufs.field("x", small, torch.float32, "cpu")
    assert a.shape == (2, 6) and a.is_contiguous()
    assert bufs.field("x", small, torch.float32, "cpu").data_ptr() == a.data_ptr()  # reused
    assert bufs.field("y", small, torch.float32, "cpu").data_ptr() != a.data_ptr()  # same dtype, own buffer
    assert bufs.position_ids(small, "cpu").dtype == torch.int64
    assert bufs.field("position_ids", small, torch.int64, "cpu").data_ptr() != \
        bufs.position_ids(small, "cpu").data_ptr()
    grown = bufs.field("x", big, torch.float32, "cpu")
    assert grown.shape == (4, 6) and bufs.field("x", small, torch.float32, "cpu").data_ptr() == grown.data_ptr()
    assert bufs.nbytes == (24 + 12) * 4 + 2 * 12 * 8
    bufs.clear()
    assert bufs.nbytes == 0
