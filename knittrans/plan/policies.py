"""Which admission policies the planner can sweep, and each one's knob.

The core never imports the baselines (``tests/unit/test_layering.py``), so the policies reach the planner as
arguments: ``plan(..., factories={name: factory})`` takes them directly (a factory is called with the batch's
``BatchConstraints`` and returns an ``AdmissionPolicy``), and the command finds them as Python entry points of
the group ``knittrans.policies`` (``pyproject.toml`` registers KnitTrans's policy and the three baselines of
``baselines.admission``; installing the package registers them). An entry point is the standard plugin
mechanism, so a policy of the user's own is swept by registering it under a new name in their own package: it
gets the in-flight budget knob.

Knobs: the in-flight budget in batches of groups (``Knob.BUDGET``: groups dispatched and not yet consumed, as
a multiple of P) for every policy but AReaL's bounded async, whose knob is its ``eta`` (``Knob.ETA``: at most
``(eta + batches trained + 1) * B`` trajectories submitted). Train-batch admission needs at least one batch in
flight; a budget of 2 batches is verl's one-step-off pipeline.
"""

from __future__ import annotations

import enum
from importlib.metadata import EntryPoint, entry_points
from typing import Callable, Mapping, Sequence

from knittrans.admission.base import AdmissionPolicy
from knittrans.constraints import BatchConstraints
from knittrans.plan.config import PlanInputError
from knittrans.types import AdmissionKind

GROUP = "knittrans.policies"
"""The entry-point group the command reads policies from."""
COLOCATED = "colocated"
"""The synchronous reference every plan includes (train-batch admission, generation and training in turn)."""

PolicyFactory = Callable[[BatchConstraints], AdmissionPolicy]


class Knob(str, enum.Enum):
    BUDGET = "budget"
    """In-flight budget, in batches of groups."""
    ETA = "eta"
    """AReaL's maximum staleness in batches (``max_head_offpolicyness``)."""


DEFAULT_GRIDS: dict[str, tuple[float, ...]] = {
    AdmissionKind.TRAIN_BATCH.value: (1.0, 2.0, 3.0),
    AdmissionKind.GREEDY.value: (0.5, 1.0, 2.0, 3.0),
    AdmissionKind.BOUNDED_ASYNC.value: (0.0, 1.0, 2.0),
    AdmissionKind.KNITTRANS.value: (0.125, 0.25, 0.5, 1.0, 2.0, 3.0),
}
"""The default sweep (17 settings with the colocated reference), sized for a DAPO batch over 20 batches to run in
well under a minute on one core (``tests/bench/test_bench_plan.py``; ~2 s of simulation per setting). Every
budget-knob policy reaches the same 3 batches in flight (eta 2 is AReaL's equivalent), so the frontiers cover the
same range; dense below one batch, where mini-batch admission differs most. Pass --grid to sweep other values."""


def knob(policy: str) -> Knob:
    return Knob.ETA if policy == AdmissionKind.BOUNDED_ASYNC.value else Knob.BUDGET


def whole_batch(policy: str) -> bool:
    """Commits nothing before a whole batch has completed, so its budget must hold a batch."""
    return policy in (AdmissionKind.TRAIN_BATCH.value, AdmissionKind.BOUNDED_ASYNC.value, COLOCATED)


def registered() -> dict[str, PolicyFactory]:
    """The policies installed under ``knittrans.policies``, each loaded on first use."""
    return {ep.name: _EntryPointFactory(ep) for ep in entry_points(group=GROUP)}


class _EntryPointFactory:
    """Calls the object an entry point names (loaded on the first call). Picklable, as the entry point is, so a
    sweep's worker process can be handed it."""

    def __init__(self, ep: EntryPoint) -> None:
        self.ep = ep

    def __call__(self, constraints: BatchConstraints) -> AdmissionPolicy:
        return self.ep.load()(constraints)

    def __repr__(self) -> str:
        return f"entry point {self.ep.value}"


def resolve(names: Sequence[str], factories: Mapping[str, PolicyFactory] | None = None) -> dict[str, PolicyFactory]:
    """A factory for each of ``names`` and for train-batch admission (the colocated reference admits with it),
    from ``factories`` or else from the entry points."""
    available = dict(factories) if factories is not None else registered()
    want = list(dict.fromkeys([*names, AdmissionKind.TRAIN_BATCH.value]))
    missing = [n for n in want if n not in available]
    if missing:
        hint = ("" if factories is not None else
                f" (policies are found through the {GROUP!r} entry points: install the package, e.g. "
                f"`pip install -e .`, so that they are registered)")
        raise PlanInputError("policies", f"no policy named {missing}; available: {sorted(available)}{hint}")
    return {n: available[n] for n in want}


def grids(policies: Sequence[str], overrides: Sequence[str], num_minibatches: int) -> dict[str, tuple[float, ...]]:
    """Each policy's knob values: its default grid (a policy of the user's gets KnitTrans's), replaced by any
    ``policy=v1,v2,...`` in ``overrides``. Budgets below one mini-batch (1/M batches), budgets of whole-batch
    policies below one batch and non-integer etas are errors when given, and dropped from a default grid."""
    given: dict[str, tuple[float, ...]] = {}
    for item in overrides:
        name, eq, vals = item.partition("=")
        if not eq or name not in policies:
            raise PlanInputError("grid", f"{item!r}: expected POLICY=v1,v2,... with POLICY one of {list(policies)}")
        try:
            given[name] = tuple(sorted({float(v) for v in vals.split(",") if v.strip()}))
        except ValueError:
            raise PlanInputError("grid", f"{item!r}: the values must be numbers") from None
        if not given[name]:
            raise PlanInputError("grid", f"{item!r}: no values")
    out = {}
    for p in policies:
        vals = given.get(p, DEFAULT_GRIDS.get(p, DEFAULT_GRIDS[AdmissionKind.KNITTRANS.value]))
        ok = [v for v in vals if _knob_problem(p, v, num_minibatches) is None]
        if p in given and len(ok) < len(vals):
            bad = next(v for v in vals if v not in ok)
            raise PlanInputError("grid", f"{p}={bad:g}: {_knob_problem(p, bad, num_minibatches)}")
        out[p] = tuple(ok)
    return out


def _knob_problem(policy: str, v: float, num_minibatches: int) -> str | None:
    if knob(policy) is Knob.ETA:
        return None if v >= 0 and float(v).is_integer() else "eta is a whole number of batches >= 0"
    if whole_batch(policy) and v < 1:
        return "it commits nothing before a whole batch has completed, so its budget must be >= 1 batch"
    if v * num_minibatches < 1 - 1e-9:
        return f"a budget below one mini-batch (1/{num_minibatches} batch) never fills a step"
    return None
