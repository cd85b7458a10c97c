"""batched_pack: the Triton kernel gives the reference's buffers and position ids bit for bit."""

from __future__ import annotations

import pytest
import torch

from triton_kernels.batched_pack import PackPlan, batched_pack, pack_field, plan_microbatches

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.int64, torch.int32, torch.float32, torch.bfloat16, torch.float16, torch.uint8, torch.bool,
          torch.float64]


def _ragged(lengths, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    total = int(sum(lengths))
    values = (torch.randn(total, generator=g) * 100).to(dtype)
    off = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(torch.tensor(lengths, dtype=torch.int64), 0)])
    return values, off


def _same(values, off, plan, pad=0):
    ref = pack_field(values, off, plan, pad, impl="reference")
    tri = pack_field(values.to(DEVICE), off.to(DEVICE), plan, pad, impl="triton").cpu()
    return torch.equal(ref.view(torch.uint8), tri.view(torch.uint8))  # bitwise, NaN payloads included


@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_equals_reference_for_every_field_dtype(dtype):
    lengths = [0, 1, 7, 16, 3, 0, 11, 16]  # empty, single, odd, exactly the budget
    values, off = _ragged(lengths, dtype)
    plan = plan_microbatches(lengths, num_ranks=2, max_tokens_per_microbatch=16, method="kk").pack
    assert _same(values, off, plan, pad=1 if dtype != torch.bool else True)


def test_kernel_equals_reference_for_one_sequence_and_for_none():
    values, off = _ragged([5], torch.float32)
    assert _same(values, off, PackPlan(torch.tensor([0]), torch.tensor([3]), num_rows=1, row_len=8))
    values, off = _ragged([], torch.float32)
    assert _same(values, off, PackPlan(torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64),
                                       num_rows=2, row_len=4))


def test_kernel_equals_reference_with_gaps_and_sequences_longer_than_a_block():
    from triton_kernels.batched_pack.kernel import pack_field_triton

    lengths = [2500, 40, 1]
    values, off = _ragged(lengths, torch.int64)
    plan = PackPlan(torch.tensor([0, 1, 1]), torch.tensor([3, 100, 7]), num_rows=2, row_len=2600)
    ref = pack_field(values, off, plan, -1, impl="reference")
    assert torch.equal(ref, pack_field_triton(values.to(DEVICE), off.to(DEVICE), plan, -1, block=256).cpu())


def test_batched_pack_kernel_equals_reference_for_all_outputs():
    lengths = [9, 4, 4, 1, 0, 13, 2]
    ids, off = _ragged(lengths, torch.int64)
    logp, _ = _ragged(lengths, torch.float32, seed=1)
    mask, _ = _ragged(lengths, torch.bool, seed=2)
    plan = plan_microbatches(lengths, num_ranks=2, max_tokens_per_microbatch=13, method="ffd").pack
    fields = {"input_ids": ids, "old_logprobs": logp, "loss_mask": mask}
    ref = batched_pack(fields, off, plan, {"input_ids": 7}, impl="reference")
    tri = batched_pack({k: v.to(DEVICE) for k, v in fields.items()}, off.to(DEVICE), plan, {"input_ids": 7},
                       impl="triton")
    for name in fields:
        assert torch.equal(ref.fields[name], tri.fields[name].cpu()), name
    assert torch.equal(ref.position_ids, tri.position_ids.cpu())
    assert torch.equal(ref.cu_seqlens, tri.cu_seqlens.cpu())


# The torch path (slices.py, one copy per sequence) against the per-token scatter it replaces (reference.py,
# the specification): same bits for every dtype, gaps, empty rows and sequences, and an offset source.

def test_slice_copies_equal_the_per_token_scatter_for_every_dtype():
    from triton_kernels.batched_pack import pack_field_reference, pack_field_slices

    lengths = [0, 1, 7, 16, 3, 0, 11, 16]
    plan = plan_microbatches(lengths, num_ranks=2, max_tokens_per_microbatch=16, method="kk").pack
    for dtype in DTYPES:
        values, off = _ragged(lengths, dtype)
        pad = 1 if dtype != torch.bool else True
        ref = pack_field_reference(values, off, plan, pad)
        assert torch.equal(ref.view(torch.uint8), pack_field_slices(values, off, plan, pad).view(torch.uint8)), dtype


def test_slice_copies_equal_the_scatter_with_gaps_empty_rows_and_an_offset_source():
    from triton_kernels.batched_pack import (pack_field_reference, pack_field_slices, position_ids_reference,
                                             position_ids_slices)

    values = torch.arange(100, 160)
    off = torch.tensor([5, 30, 30, 34, 35, 50])  # source starts at 5, ends before the field's end; one empty
    plan = PackPlan(torch.tensor([3, 0, 0, 0, 3]), torch.tensor([0, 9, 20, 0, 28]), num_rows=5, row_len=45)
    assert torch.equal(pack_field_reference(values, off, plan, -7), pack_field_slices(values, off, plan, -7))
    assert torch.equal(position_ids_reference(off, plan), position_ids_slices(off, plan))
    none = PackPlan(torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64), num_rows=3, row_len=4)
    assert torch.equal(pack_field_slices(values, torch.tensor([0]), none, 2), torch.full((3, 4), 2))


def test_batched_pack_torch_path_equals_the_scatter_for_all_outputs():
    from triton_kernels.batched_pack import pack_field_reference, position_ids_reference

    lengths = [9, 4, 4, 1, 0, 13, 2]
    ids, off = _ragged(lengths, torch.int64)
    plan = plan_microbatches(lengths, num_ranks=2, max_tokens_per_microbatch=13, method="ffd").pack
    packed = batched_pack({"input_ids": ids}, off, plan, {"input_ids": 7}, impl="reference")
    assert torch.equal(packed.fields["input_ids"], pack_field_reference(ids, off, plan, 7))
    assert torch.equal(packed.position_ids, position_ids_reference(off, plan))


# out= (caller's buffers, reused across steps): bit for bit the fresh result on both paths, whatever the buffer
# held before. Garbage is random bytes, so a pad the pack forgot to rewrite would show up as a mismatch.

IMPLS = ["reference", "triton"]


def _garbage_like(t, seed):
    g = torch.Generator().manual_seed(seed)
    junk = torch.randint(1, 256, (t.numel() * t.element_size(),), dtype=torch.uint8, generator=g)
    t.view(torch.uint8).view(-1).copy_(junk.to(t.device))  # bit patterns no pad value has (never all-zero bytes)
    return t


def _bits(t):
    return t.cpu().contiguous().view(torch.uint8)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_out_buffer_gives_the_fresh_result_and_no_old_data_leaks_for_every_dtype(dtype, impl):
    lengths = [0, 1, 7, 16, 3, 0, 11, 16]
    values, off = _ragged(lengths, dtype)
    values, off = values.to(DEVICE), off.to(DEVICE)
    plan = plan_microbatches(lengths, num_ranks=2, max_tokens_per_microbatch=20, method="kk").pack  # pads
    pad = 1 if dtype != torch.bool else True
    fresh = pack_field(values, off, plan, pad, impl=impl)
    out = _garbage_like(torch.empty(plan.num_rows, plan.row_len, dtype=dtype, device=DEVICE), seed=3)
    got = pack_field(values, off, plan, pad, impl=impl, out=out)
    assert got is out
    assert torch.equal(_bits(got), _bits(fresh))


@pytest.mark.parametrize("impl", IMPLS)
def test_pack_buffers_reused_across_steps_of_changing_shape_equal_fresh_packs(impl):
    from triton_kernels.batched_pack import PackBuffers

    bufs = PackBuffers()
    # rows: 2 ranks x (3, then 1, then 4) micro-batches: the buffers grow, get a smaller view, grow again
    for step, lengths in enumerate([[9, 4, 4, 1, 0, 13, 2, 5], [3, 1], [13, 13, 12, 1, 13, 7, 9, 13, 2]]):
        ids, off = _ragged(lengths, torch.int64, seed=step)
        logp, _ = _ragged(lengths, torch.bfloat16, seed=step + 10)
        mask, _ = _ragged(lengths, torch.bool, seed=step + 20)
        fields = {"input_ids": ids.to(DEVICE), "old_logprobs": logp.to(DEVICE), "loss_mask": mask.to(DEVICE)}
        plan = plan_microbatches(lengths, num_ranks=2, max_tokens_per_microbatch=13, method="ffd").pack
        fresh = batched_pack(fields, off.to(DEVICE), plan, {"input_ids": -1}, impl=impl)
        for name in fields:  # what the previous step left, scrambled
            _garbage_like(bufs.field(name, plan, fields[name].dtype, fields[name].device), seed=step)
        _garbage_like(bufs.position_ids(plan, fields["input_ids"].device), seed=step + 1)
        got = batched_pack(fields, off.to(DEVICE), plan, {"input_ids": -1}, impl=impl, out=bufs)
        for name, v in fields.items():
            assert got.fields[name].data_ptr() == bufs.field(name, plan, v.dtype, v.device).data_ptr()
            assert torch.equal(_bits(got.fields[name]), _bits(fresh.fields[name])), (step, name)
        assert torch.equal(got.position_ids.cpu(), fresh.position_ids.cpu())
        assert torch.equal(got.cu_seqlens.cpu(), fresh.cu_seqlens.cpu())
        assert torch.equal(got.seq_counts.cpu(), fresh.seq_counts.cpu())


@pytest.mark.parametrize("impl", IMPLS)
def test_a_previous_packed_batch_as_out_is_overwritten_in_place_with_the_fresh_result(impl):
    lengths = [9, 4, 4, 1, 0, 13, 2]
    plan = plan_microbatches(lengths, num_ranks=2, max_tokens_per_microbatch=13, method="kk").pack
    ids, off = _ragged(lengths, torch.int64)
    logp, _ = _ragged(lengths, torch.float32, seed=1)
    prev = batched_pack({"ids": ids.to(DEVICE) + 5, "logp": logp.to(DEVICE) * 3}, off.to(DEVICE), plan, impl=impl)
    ptrs = [prev.fields["ids"].data_ptr(), prev.fields["logp"].data_ptr(), prev.position_ids.data_ptr()]
    fields = {"ids": ids.to(DEVICE), "logp": logp.to(DEVICE)}
    fresh = batched_pack(fields, off.to(DEVICE), plan, {"logp": float("nan")}, impl=impl)
    got = batched_pack(fields, off.to(DEVICE), plan, {"logp": float("nan")}, impl=impl, out=prev)
    assert got is prev
    assert [got.fields["ids"].data_ptr(), got.fields["logp"].data_ptr(), got.position_ids.data_ptr()] == ptrs
    for name in fields:
        assert torch.equal(_bits(got.fields[name]), _bits(fresh.fields[name]))
    assert torch.equal(got.position_ids.cpu(), fresh.position_ids.cpu())


@pytest.mark.parametrize("dtype", DTYPES)
def test_torch_cat_assembly_equals_the_numpy_one_on_cpu(dtype, monkeypatch):
    """slices.py concatenates with numpy on CPU and torch.cat elsewhere; run the torch twin on CPU too."""
    from triton_kernels.batched_pack import PackBuffers, slices

    lengths = [0, 1, 7, 16, 3, 0, 11, 16]
    values, off = _ragged(lengths, dtype)
    plan = plan_microbatches(lengths, num_ranks=2, max_tokens_per_microbatch=20, method="kk").pack
    pad = 1 if dtype != torch.bool else True
    host = batched_pack({"v": values}, off, plan, {"v": pad}, impl="reference")
    monkeypatch.setattr(slices, "_host", lambda t: t)
    bufs = PackBuffers()
    _garbage_like(bufs.field("v", plan, dtype, "cpu"), seed=5)
    _garbage_like(bufs.position_ids(plan, "cpu"), seed=6)
    for out in (None, bufs):
        cat = batched_pack({"v": values}, off, plan, {"v": pad}, impl="reference", out=out)
        assert torch.equal(_bits(cat.fields["v"]), _bits(host.fields["v"]))
        assert torch.equal(cat.position_ids, host.position_ids)
