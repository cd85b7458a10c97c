"""Bytes counted as moved: each op's traffic is exactly its inputs read once and its outputs written once."""

from __future__ import annotations

import pytest
import torch

from triton_kernels.batched_pack import batched_pack, pack_traffic, plan_microbatches
from triton_kernels.bench import Case, Memcpy, interleaved_passes, pack_inputs
from triton_kernels.encoding_hash import encoding_hash, hash_traffic
from triton_kernels.traffic import Traffic


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@pytest.mark.parametrize("lengths, ranks", [([5, 0, 17, 1, 64], 2), ([], 1), ([64] * 9, 3)])
def test_pack_traffic_is_the_inputs_read_once_and_every_output_written_once(lengths, ranks):
    off = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(torch.tensor(lengths, dtype=torch.int64), 0)])
    t = int(off[-1])
    fields = {"ids": torch.arange(t), "logp": torch.zeros(t), "mask": torch.ones(t, dtype=torch.bool)}
    plan = plan_microbatches(lengths, ranks, 64).pack
    out = batched_pack(fields, off, plan)
    traffic = pack_traffic(fields, off, plan)
    outputs = [*out.fields.values(), out.position_ids, out.cu_seqlens, out.seq_counts]
    assert traffic.written == sum(_nbytes(o) for o in outputs)
    assert traffic.read == sum(_nbytes(v) for v in fields.values()) + _nbytes(off) + _nbytes(plan.row) + \
        _nbytes(plan.offset)


def test_pack_traffic_counts_the_sequences_not_a_longer_field():
    off = torch.tensor([2, 5, 9])  # tokens 2..9 of a 12-token field
    plan = plan_microbatches([3, 4], 1, 8).pack
    short, long_ = pack_traffic({"x": torch.zeros(9)}, off, plan), pack_traffic({"x": torch.zeros(12)}, off, plan)
    assert short == long_ and short.read == 7 * 4 + 3 * 8 + 2 * 16


def test_hash_traffic_is_the_segment_bytes_read_once_and_a_key_written_per_segment():
    buf = torch.zeros(10_000, dtype=torch.uint8)
    off = torch.tensor([100, 100, 4196, 9000])
    keys = encoding_hash(buf, off)
    assert hash_traffic(off) == Traffic(read=8900 + _nbytes(off), written=_nbytes(keys))


def test_traffic_rejects_negative_counts_and_a_memcpy_moves_the_same_total():
    with pytest.raises(ValueError, match="negative"):
        Traffic(-1, 0)
    assert Traffic(7, 9).memcpy_bytes * 2 == 16


def test_interleaved_passes_time_every_call_once_per_pass_after_its_memcpy():
    fields, off, plan = pack_inputs(4096, torch.Generator().manual_seed(0), torch.device("cpu"))
    calls = []
    case = Case("pack", pack_traffic(fields, off, plan),
                {"a": lambda: calls.append("a"), "b": lambda: calls.append("b")})
    times = interleaved_passes([case], Memcpy(case.traffic.memcpy_bytes, torch.device("cpu")), passes=3, threads=1)
    assert [(t.pass_index, t.variant) for t in times] == [(p, v) for p in range(3) for v in "ab"]
    assert calls == ["a", "b"] * 4  # one warm-up round, then three passes
    assert all(t.memcpy.wall > 0 and t.op.cpu >= 0 for t in times)
    assert torch.get_num_threads() >= 1
    with pytest.raises(ValueError, match="passes"):
        interleaved_passes([case], Memcpy(8, torch.device("cpu")), passes=0)
