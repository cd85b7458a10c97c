"""The bad-input catalogue: one case per kind of malformed input a user of the data plane, the admission policy,
the runtime or the image pipeline can hand us. Each must raise its typed error with a message naming the problem and
leave what was already stored intact. ``tests/unit/test_bad_input.py`` runs it in CI; ``python -m repro.reliability``
counts it in the reliability table.

    >>> from workloads.reliability_catalogue import catalogue, try_case
    >>> all(try_case(c)[0] for c in catalogue()[:3])
    True
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

import numpy as np


@dataclass(frozen=True)
class BadInputCase:
    """One malformed input: ``run`` must raise ``error`` with a message matching ``pattern`` and return normally
    from its own after-check that nothing already stored was lost. ``covered_by`` names tests with more."""

    name: str
    category: str
    error: type
    pattern: str
    run: Callable[[], Callable[[], None]]
    """Sets up state; returns (bad call, after-check) via ``Case``."""
    covered_by: str = ""


@dataclass
class Case:
    bad: Callable[[], object]
    after: Callable[[], None]
    close: Callable[[], None] | None = None
    """Releases what the case built (a handoff), whatever happened."""


def _text_plane(n: int = 8, checksums: bool = False, faults=None):  # noqa: ANN202
    """A data plane holding ``n`` good trajectories (returns plane, payloads, a check that they all survive)."""
    from knittrans.dataplane import TrajectoryPayload, build_inprocess
    from knittrans.types import MiniBatch
    from workloads.text_data import TEXT_SCHEMA

    rng = np.random.default_rng(0)
    good = []
    for t in range(n):
        L = int(rng.integers(2, 9))
        good.append(TrajectoryPayload(t, {"input_ids": rng.integers(0, 99, L + 3), "old_logprobs":
                                          -rng.random(L).astype(np.float32), "advantages":
                                          np.ones(L, np.float32), "loss_mask": np.ones(L, bool)}))
    dp = build_inprocess(_strict(TEXT_SCHEMA), {"u0": "n0"}, ("n0",), checksums=checksums, faults=faults)
    dp.client("u0").put(good)

    def survives() -> None:
        c = dp.client()
        c.admit(MiniBatch(99, 0, tuple(range(n)), (0,), 0))
        share = c.fetch(MiniBatch(99, 0, tuple(range(n)), (0,), 0), 0)
        f = share.fields["input_ids"]
        for i, p in enumerate(good):
            got = f.values[f.cu_seqlens[i]:f.cu_seqlens[i + 1]].numpy()
            if not np.array_equal(got, p.tensors["input_ids"]):
                raise AssertionError(f"trajectory {p.traj_id} changed after a rejected message")
        if dp.units["u0"].stats().nbytes != 0:
            raise AssertionError("storage not freed")

    return dp, good, survives


def _strict(schema):  # noqa: ANN202
    """The text schema with the checks a trainer wants: finite log-probs and advantages, one row per response
    token in each of the per-token fields."""
    from dataclasses import replace

    from workloads.text_data import RESPONSE_FIELDS

    fields = tuple(replace(f, finite=True) if f.name in ("old_logprobs", "advantages") else f for f in schema.fields)
    return replace(schema, fields=fields, same_length=(RESPONSE_FIELDS,))


def _dp_case(payload_fn, checksums=False, faults=None):  # noqa: ANN202
    def setup() -> Case:
        dp, good, survives = _text_plane(checksums=checksums, faults=faults)
        return Case(lambda: dp.client("u0").put(payload_fn(good)), survives)
    return setup


def _tensors(good, **over):  # noqa: ANN202
    return {**good[0].tensors, **over}


def _payload(traj_id, tensors):  # noqa: ANN202
    from knittrans.dataplane import TrajectoryPayload

    return [TrajectoryPayload(traj_id, tensors)]


def _admission_case(bad_traj):  # noqa: ANN202
    def setup() -> Case:
        from baselines.admission import make_policy
        from knittrans.constraints import BatchConstraints
        from knittrans.types import BatchPlan, GroupSpec, Trajectory

        c = BatchConstraints(batch_size=8, num_minibatches=2, max_response_len=16, group_size=2)
        p = make_policy("knittrans", c)
        p.add_batch(BatchPlan(0, tuple(GroupSpec(g, 0, 2) for g in range(4))))
        good = [Trajectory(i, group_id=i // 2, batch_id=0, num_tokens=1 + i, v_gen=0) for i in range(8)]
        out = []
        for t in good[:3]:
            p.on_complete(t)
            out += p.on_trainer_ready(0.0)

        def after() -> None:
            nonlocal out
            for t in good[3:]:
                p.on_complete(t)
                out += p.on_trainer_ready(0.0)
            consumed = sorted(i for mb in out for i in mb.traj_ids)
            if consumed != list(range(8)):
                raise AssertionError(f"admission lost or duplicated trajectories: {consumed}")
        return Case(lambda: p.on_complete(bad_traj()), after)
    return setup


def _raises_only(fn):  # noqa: ANN202 - a case with no stored state to check
    def setup() -> Case:
        return Case(fn, lambda: None)
    return setup


def _image(arr_fn):  # noqa: ANN202
    def bad():  # noqa: ANN202
        from workloads.multimodal import preprocess_image
        return preprocess_image(arr_fn())
    return _raises_only(bad)


def catalogue() -> list[BadInputCase]:
    from knittrans.admission import AdmissionError
    from knittrans.constraints import BatchConstraints, ConstraintError
    from knittrans.dataplane.faults import CorruptGet, CorruptPut, FaultPlan
    from knittrans.dataplane.types import CorruptPayloadError, DuplicatePutError, SchemaMismatchError
    from knittrans.runtime.config import RuntimeConfig, RuntimeConfigError
    from knittrans.runtime.engine import GenerationError, Sample
    from knittrans.types import Trajectory
    from workloads.arith import RewardError, check_reward
    from workloads.multimodal import ImageInputError

    T = Trajectory
    dp_tests = "tests/unit/test_dataplane.py::test_put_with_mismatched_schema_is_rejected_atomically"
    adm_tests = ("tests/unit/test_types_constraints.py::"
                 "test_nothing_already_admitted_is_lost_when_a_bad_trajectory_arrives")

    def corrupt_get() -> Case:
        from knittrans.types import MiniBatch
        dp, good, survives = _text_plane(checksums=True, faults=FaultPlan((CorruptGet("u0", 1, "advantages"),)))
        mb = MiniBatch(99, 0, tuple(range(len(good))), (0,), 0)
        dp.client().admit(mb)
        return Case(lambda: dp.client().fetch(mb, 0), lambda: dp.client().fetch(mb, 0))

    return _issue13_cases() + handoff_catalogue("inprocess") + _handoff_config_cases() + [
        BadInputCase("wrong_dtype", "trajectory", SchemaMismatchError, r"trajectory 50: field 'old_logprobs' has dtype "
                     r"float64", _dp_case(lambda g: _payload(50, _tensors(g, old_logprobs=g[0].tensors[
                         "old_logprobs"].astype(np.float64)))), dp_tests),
        BadInputCase("wrong_shape", "trajectory", SchemaMismatchError, r"trajectory 51: field 'input_ids' has shape "
                     r"\(1, \d+\)", _dp_case(lambda g: _payload(51, _tensors(g, input_ids=g[0].tensors[
                         "input_ids"].reshape(1, -1)))), dp_tests),
        BadInputCase("mismatched_field_lengths", "trajectory", SchemaMismatchError, r"trajectory 52: fields of "
                     r"mismatched length", _dp_case(lambda g: _payload(52, _tensors(g, loss_mask=np.ones(1, bool))))),
        BadInputCase("nan_logprobs", "trajectory", SchemaMismatchError, r"trajectory 53: field 'old_logprobs' holds 1 "
                     r"non-finite", _dp_case(lambda g: _payload(53, _tensors(g, old_logprobs=np.where(
                         np.arange(g[0].tensors["old_logprobs"].size) == 0, np.nan, g[0].tensors[
                             "old_logprobs"]).astype(np.float32))))),
        BadInputCase("inf_advantages", "trajectory", SchemaMismatchError, r"field 'advantages' holds \d+ non-finite",
                     _dp_case(lambda g: _payload(54, _tensors(g, advantages=np.full(
                         g[0].tensors["advantages"].size, np.inf, np.float32))))),
        BadInputCase("nan_reward", "trajectory", RewardError, r"non-finite reward nan for trajectory 5",
                     _raises_only(lambda: check_reward(float("nan"), "trajectory 5")),
                     "tests/unit/test_runtime_components.py::test_non_finite_reward_is_a_clear_error"),
        BadInputCase("inf_reward", "trajectory", RewardError, r"non-finite reward inf",
                     _raises_only(lambda: check_reward(float("inf"), "trajectory 6"))),
        BadInputCase("empty_response_admission", "trajectory", ValueError, r"num_tokens must be >= 1 \(an empty",
                     _raises_only(lambda: T(7, 0, 0, num_tokens=0, v_gen=0)),
                     "tests/unit/test_types_constraints.py::test_empty_or_negative_length_trajectory_is_rejected_naming_num_tokens"),
        BadInputCase("empty_response_engine", "trajectory", GenerationError, r"trajectory 8 \(group 0\): empty "
                     r"generation", _raises_only(lambda: Sample(8, 0, 0, (1,), (), (), 0, 0.0, 0.0)),
                     "tests/unit/test_runtime_components.py::test_empty_generation_is_a_clear_error"),
        BadInputCase("logprobs_response_mismatch", "trajectory", GenerationError, r"trajectory 9: 1 log-probs for 2",
                     _raises_only(lambda: Sample(9, 0, 0, (1,), (3, 4), (-0.1,), 0, 0.0, 0.0))),
        BadInputCase("unknown_group", "trajectory", AdmissionError, r"trajectory 90: group 7 is unknown to batch 0",
                     _admission_case(lambda: T(90, group_id=7, batch_id=0, num_tokens=3, v_gen=0)), adm_tests),
        BadInputCase("duplicate_id_admission", "trajectory", AdmissionError, r"duplicate trajectory id 0",
                     _admission_case(lambda: T(0, group_id=1, batch_id=0, num_tokens=3, v_gen=0)), adm_tests),
        BadInputCase("duplicate_id_dataplane", "trajectory", DuplicatePutError, r"field 'input_ids' of trajectory 0 "
                     r"was already written with different content", _dp_case(lambda g: _payload(0, g[1].tensors)),
                     "tests/unit/test_dataplane.py::test_duplicate_put_is_rejected_and_the_original_survives"),
        BadInputCase("group_beyond_declared_size", "trajectory", AdmissionError, r"group 0 already has its declared 2 "
                     r"trajectories", _admission_case(lambda: T(92, group_id=0, batch_id=0, num_tokens=3, v_gen=0)),
                     adm_tests),
        BadInputCase("image_wrong_channels", "image", ImageInputError, r"expected \[height, width, 3\]",
                     _image(lambda: np.zeros((56, 56, 4), np.uint8)),
                     "tests/unit/test_mmdedup_workload.py"),
        BadInputCase("image_zero_size", "image", ImageInputError, r"zero size", _image(lambda: np.zeros((0, 56, 3),
                                                                                                         np.uint8))),
        BadInputCase("constraints_indivisible", "constraints", ConstraintError, r"batch_size=8 is not a multiple of "
                     r"num_minibatches=3", _raises_only(lambda: BatchConstraints(8, 3, 10)),
                     "tests/unit/test_types_constraints.py::"
                     "test_unsatisfiable_constraint_sets_are_rejected_naming_the_field"),
        BadInputCase("constraints_budget_below_one_response", "constraints", ConstraintError,
                     r"token_budget=5 is below", _raises_only(lambda: BatchConstraints(8, 2, 10, token_budget=5))),
        BadInputCase("constraints_dp_unsplittable", "constraints", ConstraintError, r"unsatisfiable constraint set",
                     _raises_only(lambda: BatchConstraints(8, 2, 10, group_size=4, dp_size=3))),
        BadInputCase("budget_that_deadlocks", "constraints", RuntimeConfigError,
                     r"would deadlock admission 'train_batch'",
                     _raises_only(lambda: RuntimeConfig.for_system("train_batch", prompts_per_batch=8,
                                                                   inflight_groups=4)),
                     "tests/unit/test_runtime_components.py::"
                     "test_budget_that_would_deadlock_train_batch_admission_is_rejected"),
        BadInputCase("corrupted_put", "transport", CorruptPayloadError, r"trajectory 60: field 'input_ids' is corrupt "
                     r"on put", _dp_case(lambda g: _payload(60, g[1].tensors), checksums=True,
                                         faults=FaultPlan((CorruptPut("u0", 2, "input_ids"),))),
                     "tests/e2e/test_reliability_ray.py (Ray transport)"),
        BadInputCase("corrupted_fetch", "transport", CorruptPayloadError, r"trajectory \d+: field 'advantages' is "
                     r"corrupt on fetch from unit u0", corrupt_get,
                     "tests/e2e/test_reliability_ray.py (Ray transport)"),
    ]


def _fetch_case(bad):
    """A plane with one admitted mini-batch of every trajectory; ``bad(client, mb)`` is the malformed call, and
    afterwards both ranks' shares are still whole and byte-exact (nothing claimed by the rejected call)."""
    def setup() -> Case:
        from knittrans.types import MiniBatch

        dp, good, _ = _text_plane()
        mb = MiniBatch(99, 0, tuple(range(len(good))), (0,), 0)
        dp.client().admit(mb)

        def after() -> None:
            got = {}
            for r in (0,):
                share = dp.client().fetch(mb, r)
                f = share.fields["input_ids"]
                for i, t in enumerate(share.traj_ids):
                    got[t] = f.values[f.cu_seqlens[i]:f.cu_seqlens[i + 1]].numpy()
            if sorted(got) != list(range(len(good))) or any(not np.array_equal(got[p.traj_id], p.tensors[
                    "input_ids"]) for p in good):
                raise AssertionError("the admitted mini-batch changed after a rejected fetch")
        return Case(lambda: bad(dp.client(), mb), after)
    return setup


def _discard_admitted() -> Case:
    from knittrans.types import MiniBatch

    dp, good, _ = _text_plane()
    mb = MiniBatch(99, 0, tuple(range(len(good))), (0,), 0)
    dp.client().admit(mb)

    def after() -> None:
        if len(dp.client().fetch(mb, 0).traj_ids) != len(good):
            raise AssertionError("discard changed an admitted mini-batch")
    return Case(lambda: dp.client().discard([0]), after)


def _issue13_cases() -> list[BadInputCase]:
    """Inputs the issue-13 red team found accepted (or failing with the wrong error): each now rejected by name."""
    import torch

    from knittrans.constraints import BatchConstraints, ConstraintError
    from knittrans.dataplane.types import AdmissionStateError, SchemaMismatchError
    from knittrans.mmdedup.fetch import EncodingPlane
    from knittrans.mmdedup.keys import EncodingInputError
    from knittrans.types import MiniBatch

    def resp(g, n):  # noqa: ANN001, ANN202 - the response fields of good[0] cut to n rows
        return {k: v[:n] for k, v in g[0].tensors.items() if k != "input_ids"}

    def image(px, grid):  # noqa: ANN001, ANN202
        return lambda: EncodingPlane(["u0"]).register("u0", 0, [px], [grid])

    px = torch.randn(4, 8)
    return [
        BadInputCase("fetch_negative_seq", "fetch", SchemaMismatchError, r"seq must be an int >= 0",
                     _fetch_case(lambda c, mb: c.fetch_next(-1, 0, timeout=1.0))),
        BadInputCase("fetch_bool_rank", "fetch", SchemaMismatchError, r"rank must be an int, got True",
                     _fetch_case(lambda c, mb: c.fetch_next(0, True, timeout=1.0))),
        BadInputCase("fetch_rank_out_of_range", "fetch", AdmissionStateError, r"rank 5 out of range",
                     _fetch_case(lambda c, mb: c.fetch(mb, 5))),
        BadInputCase("discard_admitted", "fetch", AdmissionStateError, r"trajectory 0 is admitted in",
                     _discard_admitted),
        BadInputCase("minibatch_str_index", "minibatch", ValueError, r"MiniBatch.index must be an int >= 0, got '1'",
                     _raises_only(lambda: MiniBatch(0, "1", (0,), (0,), 0))),
        BadInputCase("minibatch_empty", "minibatch", ValueError, r"traj_ids is empty",
                     _raises_only(lambda: MiniBatch(0, 0, (), (0,), 0))),
        BadInputCase("zero_length_response", "trajectory", SchemaMismatchError, r"trajectory 55: zero-length response",
                     _dp_case(lambda g: _payload(55, {"input_ids": g[0].tensors["input_ids"], **resp(g, 0)}))),
        BadInputCase("empty_token_field", "trajectory", SchemaMismatchError, r"token field 'input_ids' is empty",
                     _dp_case(lambda g: _payload(56, {**g[0].tensors, "input_ids": np.zeros(0, np.int64)}))),
        BadInputCase("bf16_tensor", "trajectory", SchemaMismatchError, r"field 'old_logprobs' has dtype torch.bfloat16",
                     _dp_case(lambda g: _payload(57, _tensors(g, old_logprobs=torch.from_numpy(
                         g[0].tensors["old_logprobs"]).to(torch.bfloat16))))),
        BadInputCase("meta_tensor", "trajectory", SchemaMismatchError, r"field 'advantages' is a meta-device tensor",
                     _dp_case(lambda g: _payload(58, _tensors(g, advantages=torch.empty(
                         g[0].tensors["advantages"].shape, device="meta"))))),
        BadInputCase("absurd_size_slack", "constraints", ConstraintError, r"size_slack=3000000 exceeds batch_size=8",
                     _raises_only(lambda: BatchConstraints(8, 2, 10, size_slack=3_000_000))),
        BadInputCase("grid_with_str", "image", EncodingInputError, r"grid_thw must be three ints",
                     _raises_only(image(px, (1, "2", 2)))),
        BadInputCase("nan_pixels", "image", EncodingInputError, r"1 non-finite value",
                     _raises_only(image(torch.where(torch.arange(32).view(4, 8) == 3, float("nan"), px), (1, 2, 2)))),
    ]


CATALOGUE_NAMES = ("trajectory", "image", "constraints", "transport", "fetch", "minibatch", "handoff")


def try_case(case: BadInputCase) -> tuple[bool, str]:
    """Run one case: (rejected as specified and nothing lost, the error message or what went wrong)."""
    c = case.run()
    try:
        c.bad()
    except case.error as e:
        msg = str(e)
        if not re.search(case.pattern, msg):
            return False, f"message does not name the problem: {msg!r} !~ {case.pattern!r}"
        try:
            c.after()
        except Exception as e2:  # noqa: BLE001 - reported as a failed case, never swallowed
            return False, f"state damaged after rejection: {type(e2).__name__}: {e2}"
        return True, msg
    except Exception as e:  # noqa: BLE001
        return False, f"wrong error {type(e).__name__}: {e}"
    finally:
        if c.close is not None:
            c.close()
    return False, "accepted"



# -- the Handoff's own surface (issue 29): bad arguments and puts a Handoff user can make --------------------------


def _handoff_config_cases() -> list[BadInputCase]:
    """``HandoffConfig`` arguments accepted before and failing later (one at the first admission, leaving the
    controller failed): each refused at construction, naming the argument."""
    from knittrans.handoff import HandoffConfig

    def config(**kw):  # noqa: ANN003, ANN202
        return _raises_only(lambda: HandoffConfig.grpo(2, 2, 1, 8, **kw))

    return [
        BadInputCase("handoff_negative_balance_slack", "handoff", ValueError,
                     r"HandoffConfig.balance_slack must be a finite number >= 0.0, got -1", config(balance_slack=-1),
                     "tests/e2e/test_handoff_surface.py::test_a_bad_handoff_config_is_refused_at_construction_naming_"
                     "the_argument"),
        BadInputCase("handoff_negative_admit_timeout", "handoff", ValueError,
                     r"HandoffConfig.admit_timeout_s must be a finite number > 0.0 or None, got -5",
                     config(admit_timeout_s=-5)),
        BadInputCase("handoff_fractional_prefetch_depth", "handoff", TypeError,
                     r"HandoffConfig.prefetch_depth must be an int, got float 2.5", config(prefetch_depth=2.5)),
    ]


def handoff_catalogue(transport: str) -> list[BadInputCase]:
    """Bad calls on a built ``Handoff`` of ``transport`` (names end in ``/ray`` on Ray): multimodal rollouts the text
    handoff refuses (NaN log-probs, inf advantages, response fields of different lengths), ``num_tokens`` that
    disagrees with the tensors, consumer arguments of the wrong kind, and a put after close. Each case's after-check
    trains what was put before it and compares every byte."""
    from knittrans.dataplane.types import DataPlaneClosedError, FieldNotProducedError, SchemaMismatchError

    sfx = "" if transport == "inprocess" else f"/{transport}"
    cov = "tests/e2e/test_handoff_surface.py"
    mm = lambda bad: _handoff_case(transport, lambda h: h.put([bad()]), multimodal=True)  # noqa: E731

    def mm_bad(**over):  # noqa: ANN003, ANN202 - trajectory 3 with some tensors replaced
        return lambda: _mm_rollout(3, over)

    n3 = len(_expected(3)["old_logprobs"])
    return [
        BadInputCase(f"mm_nan_logprobs{sfx}", "handoff", SchemaMismatchError,
                     r"trajectory 3: field 'old_logprobs' holds 1 non-finite",
                     mm(mm_bad(old_logprobs=np.array([np.nan] + [-0.5] * (n3 - 1), np.float32))), cov),
        BadInputCase(f"mm_inf_advantages{sfx}", "handoff", SchemaMismatchError,
                     r"trajectory 3: field 'advantages' holds \d+ non-finite",
                     mm(mm_bad(advantages=np.full(n3, np.inf, np.float32))), cov),
        BadInputCase(f"mm_mismatched_response_lengths{sfx}", "handoff", SchemaMismatchError,
                     r"trajectory 3: fields of mismatched length", mm(mm_bad(loss_mask=np.ones(n3 + 2, bool))), cov),
        BadInputCase(f"num_tokens_disagrees_with_tensors{sfx}", "handoff", SchemaMismatchError,
                     rf"trajectory 3: Trajectory.num_tokens=1 disagrees with its tensors: field 'old_logprobs' has "
                     rf"{n3} rows", _handoff_case(transport, lambda h: h.put([_text_rollout(3, num_tokens=1)])), cov),
        BadInputCase(f"consumer_fields_bare_str{sfx}", "handoff", TypeError,
                     r"consumer fields must be a sequence of field names, e.g. \('input_ids',\), got the str",
                     _handoff_case(transport, lambda h: h.consumer(0, fields="input_ids")), cov),
        BadInputCase(f"consumer_unknown_field{sfx}", "handoff", FieldNotProducedError,
                     r"consumer fields \['pixels'\] are not in the schema",
                     _handoff_case(transport, lambda h: h.consumer(0, fields=["pixels"])), cov),
        BadInputCase(f"consumer_negative_start_seq{sfx}", "handoff", ValueError, r"Consumer.start_seq must be >= 0",
                     _handoff_case(transport, lambda h: h.consumer(0, start_seq=-1)), cov),
        BadInputCase(f"consumer_negative_count{sfx}", "handoff", ValueError, r"Consumer.count must be >= 0 or None",
                     _handoff_case(transport, lambda h: h.consumer(0, count=-1)), cov),
        BadInputCase(f"put_after_close{sfx}", "handoff", DataPlaneClosedError, r"the handoff is closed",
                     _handoff_case(transport, lambda h: (h.close(), h.put([_text_rollout(3)])), closes=True), cov),
    ]


def _expected(t: int) -> dict[str, np.ndarray]:
    from workloads.chaos import expected

    return expected(t)


def _text_rollout(t: int, num_tokens: int | None = None):  # noqa: ANN202
    from workloads.chaos import handoff_rollout

    return handoff_rollout(t, t // 2, 0, num_tokens)


def _mm_rollout(t: int, over: dict | None = None):  # noqa: ANN202 - trajectory t with its group's image
    import torch

    from knittrans.handoff import Rollout

    r = _text_rollout(t)
    img = torch.arange(16 * 12, dtype=torch.float32).reshape(16, 12) / 7 + t // 2
    return Rollout(r.traj, {**r.tensors, **(over or {})}, images=(img,), grids=((1, 4, 4),))


def _handoff_case(transport: str, bad, multimodal: bool = False, closes: bool = False):  # noqa: ANN001, ANN202
    """A handoff (one unit, one rank, one batch of 4 trajectories in 1 mini-batch, checksums on) holding trajectories
    0-2; ``bad(h)`` is the malformed call; the after-check puts trajectory 3 and trains all four byte-exactly (or,
    for a case that closes the handoff, checks the unit holds nothing of the refused put)."""
    def setup() -> Case:
        from knittrans.handoff import Handoff, HandoffConfig, Transport
        from knittrans.types import BatchPlan, GroupSpec

        h = Handoff(HandoffConfig.grpo(2, 2, 1, 8, transport=Transport(transport), multimodal=multimodal,
                                       checksums=True, admit_timeout_s=60.0))
        h.add_batch(BatchPlan(0, (GroupSpec(0, 0, 2), GroupSpec(1, 0, 2))))
        h.seal()
        roll = _mm_rollout if multimodal else _text_rollout
        h.put([roll(t) for t in range(3)])

        def after() -> None:
            if closes:
                return  # closed by the case: the refused put reached no unit (DataPlaneClosedError before it)
            h.put([roll(3)])
            c = h.consumer(0)
            (share,) = c.take(1)
            for name, f in share.fields.items():
                if name == "image_index":
                    continue
                cu = f.cu_seqlens.tolist()
                for i, t in enumerate(share.traj_ids):
                    if not np.array_equal(f.values[cu[i]:cu[i + 1]].numpy(), _expected(t)[name]):
                        raise AssertionError(f"trajectory {t} field {name} changed after a rejected call")
            if sorted(share.traj_ids) != [0, 1, 2, 3]:
                raise AssertionError(f"trained {share.traj_ids}, not trajectories 0-3")
            c.ack(share)

        return Case(lambda: bad(h), after, h.close)
    return setup
