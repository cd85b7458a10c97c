"""Properties of plan + pack: nothing lost, nothing duplicated, budget held, kernel == reference."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from triton_kernels.batched_pack import batched_pack, pack_field, plan_microbatches

lengths_st = st.lists(st.integers(0, 24), min_size=0, max_size=12)


@settings(max_examples=40)
@given(lengths=lengths_st, ranks=st.integers(1, 3), method=st.sampled_from(["ffd", "kk"]))
def test_every_token_lands_exactly_once_within_budget(lengths, ranks, method):
    plan = plan_microbatches(lengths, ranks, 24, method=method)
    off = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(torch.tensor(lengths, dtype=torch.int64), 0)])
    ids = torch.arange(1, int(off[-1]) + 1)
    packed = batched_pack({"ids": ids}, off, plan.pack)
    flat = packed.fields["ids"].flatten()
    assert sorted(flat[flat > 0].tolist()) == ids.tolist()  # nothing lost, nothing twice
    assert max([t for r in plan.microbatch_tokens for t in r] or [0]) <= 24
    # position ids restart at every sequence start: position 0 count == non-empty sequences
    starts = int(((packed.position_ids == 0) & (packed.fields["ids"] > 0)).sum())
    assert starts == sum(1 for n in lengths if n > 0)
    assert packed.cu_seqlens[:, -1].tolist() == [t for r in plan.microbatch_tokens for t in r]


@settings(max_examples=15)
@given(lengths=lengths_st, dtype=st.sampled_from([torch.int64, torch.float32, torch.bfloat16, torch.bool]))
def test_kernel_equals_reference(lengths, dtype):
    plan = plan_microbatches(lengths, 2, 24, method="kk").pack
    off = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(torch.tensor(lengths, dtype=torch.int64), 0)])
    values = (torch.arange(int(off[-1])) * 37 % 11).to(dtype)
    ref = pack_field(values, off, plan, impl="reference")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    assert torch.equal(ref, pack_field(values.to(device), off.to(device), plan, impl="triton").cpu())


@settings(max_examples=40)
@given(lengths=lengths_st, ranks=st.integers(1, 3), dtype=st.sampled_from([torch.int64, torch.bfloat16, torch.bool]))
def test_slice_copies_equal_the_per_token_scatter(lengths, ranks, dtype):
    from triton_kernels.batched_pack import (pack_field_reference, pack_field_slices, position_ids_reference,
                                             position_ids_slices)

    plan = plan_microbatches(lengths, ranks, 24, method="kk").pack
    off = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(torch.tensor(lengths, dtype=torch.int64), 0)])
    values = (torch.arange(int(off[-1])) * 37 % 11).to(dtype)
    assert torch.equal(pack_field_reference(values, off, plan, 1), pack_field_slices(values, off, plan, 1))
    assert torch.equal(position_ids_reference(off, plan), position_ids_slices(off, plan))


@settings(max_examples=40)
@given(steps=st.lists(st.tuples(lengths_st, st.integers(1, 3)), min_size=1, max_size=4),
       dtype=st.sampled_from([torch.int64, torch.float32, torch.bfloat16, torch.bool]), junk=st.integers(1, 255))
def test_reused_buffers_never_leak_a_previous_step_into_the_pack(steps, dtype, junk):
    from triton_kernels.batched_pack import PackBuffers

    bufs = PackBuffers()
    for lengths, ranks in steps:  # each step a new plan shape; the buffers hold the last step's data, then junk
        plan = plan_microbatches(lengths, ranks, 24, method="kk").pack
        off = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(torch.tensor(lengths, dtype=torch.int64), 0)])
        values = (torch.arange(int(off[-1])) * 37 % 11).to(dtype)
        bufs.field("v", plan, dtype, "cpu").view(torch.uint8).fill_(junk)
        bufs.position_ids(plan, "cpu").fill_(-junk)
        got = batched_pack({"v": values}, off, plan, {"v": 1}, out=bufs)
        fresh = batched_pack({"v": values}, off, plan, {"v": 1})
        assert torch.equal(got.fields["v"].view(torch.uint8), fresh.fields["v"].view(torch.uint8))
        assert torch.equal(got.position_ids, fresh.position_ids)
