"""The planner: "will mini-batch admission help my run?" answered on the user's own workload, before integration.

A user's response lengths (a file, a named distribution, or a real trial's traces), batch shape, rollout capacity,
trainer time and weight-sync semantics go in (``PlanConfig``); each admission policy's knob is swept in the
discrete-event simulator (``knittrans.sim``), and out come each policy's staleness-throughput frontier, the
recommended setting for a target, and the simulator's validation error beside them (``Plan``). The command is
``knittrans-plan`` (``knittrans.plan.cli``); docs/planner.md says what is modelled and what is not.

    >>> from knittrans.plan import DEFAULT_POLICIES, PlanConfig, plan
    >>> p = plan(PlanConfig(dist="light", prompts_per_batch=32, group_size=4, num_minibatches=4, engines=1,
    ...                     slots=32, max_response_len=20480, num_batches=4, workers=1), progress=False)
    >>> sorted(p.frontiers) == sorted(DEFAULT_POLICIES)
    True
"""

from knittrans.plan.config import DEFAULT_POLICIES, LengthsError, PlanConfig, PlanError, PlanInputError
from knittrans.plan.planner import Plan, Validation, plan
from knittrans.plan.recommend import Binding, Target, TargetKind, TargetUnreachable, frontier, recommend
from knittrans.plan.sweep import PlanPoint, Setting

__all__ = ["DEFAULT_POLICIES", "Binding", "LengthsError", "Plan", "PlanConfig", "PlanError", "PlanInputError", "PlanPoint", "Setting",
           "Target", "TargetKind", "TargetUnreachable", "Validation", "frontier", "plan", "recommend"]
