"""The bad-input catalogue (``workloads.reliability_catalogue``): every kind of malformed input raises its typed
error with a message naming the problem, and nothing already stored is lost. The same catalogue feeds the
reliability table; ``covered_by`` points at the tests that go deeper (schema checks, the admission ledger,
images, constraints)."""

from __future__ import annotations

import pytest

from workloads.reliability_catalogue import CATALOGUE_NAMES, catalogue, try_case

CASES = catalogue()


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input_is_rejected_by_name_and_nothing_stored_is_lost(case):
    ok, msg = try_case(case)
    assert ok, f"{case.name}: {msg}"


def test_catalogue_covers_every_category_the_issue_names():
    names = {c.name for c in CASES}
    assert len(CASES) >= 30
    assert {c.category for c in CASES} == set(CATALOGUE_NAMES)
    for need in ("wrong_dtype", "wrong_shape", "mismatched_field_lengths", "nan_logprobs", "nan_reward", "inf_reward",
                 "empty_response_admission", "unknown_group", "duplicate_id_admission", "duplicate_id_dataplane",
                 "group_beyond_declared_size", "image_wrong_channels", "image_zero_size", "constraints_indivisible",
                 "corrupted_put", "corrupted_fetch",
                 # issue 13: accepted before, now rejected by name
                 "fetch_negative_seq", "fetch_bool_rank", "minibatch_str_index", "minibatch_empty",
                 "zero_length_response", "absurd_size_slack", "bf16_tensor", "meta_tensor", "grid_with_str",
                 "nan_pixels"):
        assert need in names


def test_a_case_that_is_accepted_or_misnamed_is_reported_not_passed():
    from dataclasses import replace

    case = next(c for c in CASES if c.name == "wrong_dtype")
    ok, msg = try_case(replace(case, pattern=r"something else"))
    assert not ok and "does not name the problem" in msg
    ok, msg = try_case(replace(case, error=KeyError))
    assert not ok and "wrong error SchemaMismatchError" in msg
