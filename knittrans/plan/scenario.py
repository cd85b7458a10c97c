"""From the user's inputs to what the simulator runs: the batches, the batch constraints and the time model.

``resolve`` fills every unset input with its default (the reference cluster of ``knittrans.sim.sweep.SystemModel``
for time, DAPO's batch shape), checks every input and says, per input, the value it took and where it came from
(``InputValue``). Bad inputs raise ``PlanInputError`` naming the input. The simulator runs the user's cluster as
given: no reference scaling (``SystemModel.scaled`` is for the staleness table's time-scaled replicas).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace
from typing import Callable, TypeVar

from knittrans.constraints import BatchConstraints, ConstraintError
from knittrans.plan.config import PlanConfig, PlanInputError
from knittrans.plan.workload import Lengths, describe, draw_batches, parse_dist, read_lengths
from knittrans.sim.config import (BudgetRelease, EngineConfig, FlowConfig, FlowKind, SimConfig, SyncConfig,
                                  TrainerConfig)
from knittrans.sim.lengths import LengthDist
from knittrans.sim.sweep import SystemModel
from knittrans.types import ExecutionMode, InflightPolicy, SyncPolicy, WorkloadBatch

T = TypeVar("T")
REFERENCE = SystemModel()
"""Where the time defaults come from (our DAPO-scale assumptions, docs/staleness.md)."""
DEFAULT_SHAPE = {"prompts_per_batch": 512, "group_size": 16, "num_minibatches": 16, "max_response_len": 20480}
"""DAPO's batch (``workloads.text``): 512 prompts x 16 samples, 16 mini-batches, responses up to 20480 tokens."""
DEFAULTS: dict[str, object] = {
    **DEFAULT_SHAPE, "engines": REFERENCE.num_engines, "slots": REFERENCE.slots, "decode_tok_s": 1.0 / REFERENCE.tpot,
    "train_tok_s": 1.0 / REFERENCE.per_token, "train_overhead_s": REFERENCE.step_overhead,
    "sync": SyncPolicy.EVERY_STEP, "sync_k": REFERENCE.sync_k, "sync_cost_s": REFERENCE.sync_cost,
    "inflight": REFERENCE.inflight, "release": BudgetRelease.STEP_END}
"""The value each unset input takes (without --calibrate, which fits some of them); the command's help shows them."""


class Source(str, enum.Enum):
    GIVEN = "given"
    DEFAULT = "default"
    DATA = "from the lengths"
    FITTED = "fitted from the trace"
    DERIVED = "derived"


@dataclass(frozen=True)
class InputValue:
    """One input as the planner used it."""

    name: str
    value: str
    source: Source
    note: str = ""


@dataclass(frozen=True)
class Scenario:
    """Everything one simulated setting needs besides its policy and knob."""

    batches: tuple[WorkloadBatch, ...]
    constraints: BatchConstraints
    prompts_per_batch: int
    group_size: int
    disaggregated: SimConfig
    """Engines, trainer and sync of the disaggregated runs (each setting sets its own flow control)."""
    colocated: SimConfig
    """The synchronous reference: generate a batch, then train its M mini-batches."""
    release: BudgetRelease
    warmup_batches: int
    inputs: tuple[InputValue, ...]

    @property
    def num_minibatches(self) -> int:
        return self.constraints.num_minibatches


class InputLog:
    """Collects each input's value and source as it is resolved."""

    def __init__(self, cfg: PlanConfig) -> None:
        self.cfg = cfg
        self.rows: list[InputValue] = []

    def take(self, name: str, default: T, check: Callable[[T], bool] = lambda v: True, what: str = "",
             source: Source = Source.DEFAULT, note: str = "") -> T:
        given = getattr(self.cfg, name)
        value = default if given is None else given
        if given is not None and not check(given):
            raise PlanInputError(name, f"must be {what}, got {given!r}")
        self.note(name, value, Source.GIVEN if given is not None else source, note)
        return value

    def note(self, name: str, value: object, source: Source, note: str = "") -> None:
        self.rows.append(InputValue(name, _fmt(value), source, note))


def _fmt(v: object) -> str:
    if isinstance(v, enum.Enum):
        return str(v.value)
    if isinstance(v, float):
        return f"{v:g}"
    return str(v)


def positive_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


def positive(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0


def take_enum(inp: InputLog, name: str, kind: type[T], default: T, source: Source = Source.DEFAULT) -> T:
    """Input ``name`` as a member of enum ``kind`` (by value); unset (or at the config's own default) takes
    ``default``, reported as ``source``."""
    given = getattr(inp.cfg, name)
    if given == getattr(PlanConfig, name, None):
        given = None
    try:
        value = kind(default if given is None else given)
    except ValueError:
        raise PlanInputError(name, f"{given!r} is not one of {[k.value for k in kind]}") from None
    inp.note(name, value, Source.GIVEN if given is not None else source)
    return value


def batch_shape(inp: InputLog, defaults: dict[str, int], source: Source, data_group_size: int | None
                ) -> tuple[int, int, BatchConstraints]:
    """``(P, n, constraints)`` from the inputs: every way a shape can be impossible is an error naming its input."""
    cfg = inp.cfg
    n = inp.take("group_size", data_group_size or defaults["group_size"], positive_int, "an int >= 1",
                 Source.DATA if data_group_size else source)
    if data_group_size and n != data_group_size:
        raise PlanInputError("group_size", f"{n}, but the lengths' groups hold {data_group_size} samples")
    if cfg.batch_size is not None:
        if not positive_int(cfg.batch_size):
            raise PlanInputError("batch_size", f"must be an int >= 1, got {cfg.batch_size!r}")
        if cfg.batch_size % n:
            raise PlanInputError("batch_size", f"B={cfg.batch_size} is not a multiple of the group size n={n}: a "
                                               f"batch holds whole groups")
        if cfg.prompts_per_batch is not None and cfg.prompts_per_batch * n != cfg.batch_size:
            raise PlanInputError("batch_size", f"B={cfg.batch_size} but --prompts-per-batch {cfg.prompts_per_batch}"
                                               f" x n={n} is {cfg.prompts_per_batch * n}")
        P = cfg.batch_size // n
        inp.note("prompts_per_batch", P, Source.DERIVED, f"--batch-size {cfg.batch_size} / n")
    else:
        P = inp.take("prompts_per_batch", defaults["prompts_per_batch"], positive_int, "an int >= 1", source=source)
    B = P * n
    M = inp.take("num_minibatches", defaults["num_minibatches"], positive_int, "an int >= 1", source=source)
    if M > B:
        raise PlanInputError("num_minibatches", f"M={M} mini-batches is more than the batch's {B} trajectories")
    if B % M:
        raise PlanInputError("num_minibatches", f"M={M} does not divide the batch of B={B} trajectories "
                                                f"(mini-batches are of exactly B/M)")
    if cfg.whole_groups and (B // M) % n:
        raise PlanInputError("num_minibatches", f"a mini-batch of B/M={B // M} trajectories cannot hold whole groups"
                                                f" of n={n}: choose M dividing P={P}, or --no-whole-groups")
    max_len = inp.take("max_response_len", defaults["max_response_len"], positive_int, "an int >= 1", source=source)
    inp.note("whole_groups", cfg.whole_groups, Source.GIVEN if not cfg.whole_groups else Source.DEFAULT)
    budget = inp.take("token_budget", None, positive_int, "an int >= 1")
    try:
        c = BatchConstraints(batch_size=B, num_minibatches=M, max_response_len=max_len, group_size=n,
                             whole_groups=cfg.whole_groups, token_budget=budget)
    except ConstraintError as e:
        raise PlanInputError("token_budget" if budget is not None else "num_minibatches", str(e)) from None
    return P, n, c


def rollout(inp: InputLog, n: int) -> EngineConfig:
    cfg = inp.cfg
    E = inp.take("engines", DEFAULTS["engines"], positive_int, "an int >= 1")
    C = inp.take("slots", DEFAULTS["slots"], positive_int, "an int >= 1")
    if C < n:
        raise PlanInputError("slots", f"{C} concurrent requests per engine cannot start one group of n={n} (a "
                                      f"group's samples start together)")
    if cfg.rollout_tok_s is not None:
        if cfg.decode_tok_s is not None:
            raise PlanInputError("rollout_tok_s", "give --decode-tok-s (per request) or --rollout-tok-s (all "
                                                  "engines), not both")
        total = inp.take("rollout_tok_s", 0.0, positive, "a number > 0")
        tpot = E * C / total  # every slot busy: E*C sequences each emit a token per decode step
        inp.note("decode_tok_s", 1.0 / tpot, Source.DERIVED, "--rollout-tok-s / (engines x slots)")
    else:
        tpot = 1.0 / inp.take("decode_tok_s", DEFAULTS["decode_tok_s"], positive, "a number > 0")
    return EngineConfig(num_engines=E, slots=C, tpot=tpot)


def trainer(inp: InputLog) -> TrainerConfig:
    cfg = inp.cfg
    if cfg.train_step_s is not None:
        for other in ("train_tok_s", "train_overhead_s"):
            if getattr(cfg, other) is not None:
                raise PlanInputError(other, "conflicts with --train-step-s (a fixed time per step)")
        return TrainerConfig(step_overhead=inp.take("train_step_s", 0.0, positive, "a number > 0"), per_token=0.0)
    tok_s = inp.take("train_tok_s", DEFAULTS["train_tok_s"], positive, "a number > 0")
    over = inp.take("train_overhead_s", DEFAULTS["train_overhead_s"], lambda v: positive(v) or v == 0, "a number >= 0")
    return TrainerConfig(step_overhead=over, per_token=1.0 / tok_s)


def sync(inp: InputLog) -> SyncConfig:
    policy = take_enum(inp, "sync", SyncPolicy, DEFAULTS["sync"])
    k = inp.take("sync_k", DEFAULTS["sync_k"], positive_int, "an int >= 1")
    cost = inp.take("sync_cost_s", DEFAULTS["sync_cost_s"], lambda v: positive(v) or v == 0, "a number >= 0")
    return SyncConfig(policy=policy, k=k, cost=cost, inflight=take_enum(inp, "inflight", InflightPolicy,
                                                                     DEFAULTS["inflight"]))


def colocated_of(base: SimConfig, prompts_per_batch: int) -> SimConfig:
    """The synchronous reference on ``base``'s engines and trainer (as the staleness table runs it: a batch of
    groups in flight, a switch per batch at the sync cost)."""
    return replace(base, mode=ExecutionMode.COLOCATED, colocated_switch_cost=base.sync.cost,
                   sync=replace(base.sync, policy=SyncPolicy.EVERY_BATCH),
                   flow=FlowConfig(kind=FlowKind.GROUPS, budget_groups=prompts_per_batch))


def lengths_source(inp: InputLog, max_len_default: int) -> Lengths | LengthDist:
    """The lengths file or distribution (``max_response_len`` is resolved by ``batch_shape`` later, so it is
    read here from the config or its default: a length over it is an error either way)."""
    cfg = inp.cfg
    max_len = cfg.max_response_len if cfg.max_response_len is not None else max_len_default
    if not positive_int(max_len):
        raise PlanInputError("max_response_len", f"must be an int >= 1, got {max_len!r}")
    if cfg.dist is not None:
        return parse_dist(cfg.dist, max_len)
    return read_lengths(cfg.lengths, max_len, cfg.column, cfg.group_column, cfg.group_size)


def finish(inp: InputLog, source: Lengths | LengthDist, P: int, n: int, c: BatchConstraints,
           base: SimConfig) -> Scenario:
    """The scenario, once the shape and the time model are resolved: the release convention, the batches drawn
    from ``source``, and every input's row (the lengths first: the one input without a default)."""
    cfg = inp.cfg
    release = take_enum(inp, "release", BudgetRelease, DEFAULTS["release"])
    inp.rows.insert(0, InputValue("lengths", cfg.dist or cfg.lengths or "the trace's",
                                  Source.GIVEN if (cfg.dist or cfg.lengths) else Source.FITTED, describe(source)))
    for name in ("num_batches", "warmup_batches", "seed"):
        inp.note(name, getattr(cfg, name), Source.DEFAULT if getattr(cfg, name) == getattr(PlanConfig, name, None)
                 else Source.GIVEN)
    batches = draw_batches(source, P, n, cfg.num_batches, cfg.seed)
    return Scenario(tuple(batches), c, P, n, base, colocated_of(base, P), release, cfg.warmup_batches,
                    tuple(inp.rows))


def resolve(cfg: PlanConfig) -> Scenario:
    """The scenario of a plan without a real run (``knittrans.plan.calibrated`` resolves one with)."""
    inp = InputLog(cfg)
    source = lengths_source(inp, DEFAULT_SHAPE["max_response_len"])
    P, n, c = batch_shape(inp, DEFAULT_SHAPE, Source.DEFAULT,
                          source.group_size if isinstance(source, Lengths) else None)
    base = SimConfig(engine=rollout(inp, n), trainer=trainer(inp), sync=sync(inp))
    return finish(inp, source, P, n, c, base)
