"""batched_pack reference and planner: placement, position ids, cu_seqlens, clear errors, balance."""

from __future__ import annotations

import pytest
import torch

from triton_kernels.batched_pack import PackPlan, batched_pack, pack_field, plan_microbatches

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
