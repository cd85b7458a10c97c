"""Properties of encoding_hash: keys depend on bytes and length only; kernel == reference."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from triton_kernels.encoding_hash import encoding_hash, key_bytes

segments_st = st.lists(st.binary(min_size=0, max_size=300), min_size=1, max_size=6)


def _tensors(segs):
    return [torch.tensor(list(s), dtype=torch.uint8) for s in segs]


@settings(max_examples=40)
@given(segs=segments_st)
def test_equal_bytes_equal_keys_and_distinct_bytes_distinct_keys(segs):
    keys = [key_bytes(k) for k in encoding_hash(_tensors(segs))]
    for a, ka in zip(segs, keys):
        for b, kb in zip(segs, keys):
            assert (ka == kb) == (a == b)


@settings(max_examples=10)
@given(segs=segments_st)
def test_kernel_equals_reference(segs):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    ref = encoding_hash(_tensors(segs), impl="reference")
    assert torch.equal(ref, encoding_hash([t.to(device) for t in _tensors(segs)], impl="triton").cpu())
