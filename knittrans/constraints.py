"""Batch constraints: what a valid split of a training batch into mini-batches looks like.

A training batch has B trajectories (P prompts x n samples), split into exactly M mini-batches (one optimizer
step each). Constraints a user can switch on:

- exact mini-batch size B/M (``size_slack=0``), or sizes within ``B/M +- size_slack``;
- whole groups per mini-batch (``whole_groups``; GRPO normalizes advantages within a group, and many stacks
  keep a group in one step);
- variable group sizes (``group_size=None``: each group declares its size when dispatched);
- a per-mini-batch token budget (``token_budget``, response tokens);
- an even split across D data-parallel ranks (``dp_size``: every mini-batch size is a multiple of D).

Uncertainty: the length of a response still being generated is only bounded, by ``max_response_len``. Token
limits are monotone (a shorter response never breaks one), so a set of in-flight trajectories is safe for every
outcome iff it is safe with each at ``max_response_len``. A constraint set is accepted only if it is satisfiable
for *every* outcome of lengths (robustly satisfiable); otherwise no admission policy, train-batch admission
included, could promise to finish a batch, and the constructor says so.

Example::

    >>> c = BatchConstraints(batch_size=8, num_minibatches=2, group_size=4, max_response_len=100)
    >>> c.minibatch_size, c.size_ok(4), c.size_ok(6)
    (4, True, False)
    >>> BatchConstraints(batch_size=8, num_minibatches=3, max_response_len=100)
    Traceback (most recent call last):
    ...
    knittrans.constraints.ConstraintError: BatchConstraints: mini-batch size does not divide the batch: batch_size=8 is not a multiple of num_minibatches=3 (set size_slack > 0 to allow unequal mini-batches)
"""

from __future__ import annotations

from dataclasses import dataclass
from math import gcd

from knittrans.types import BatchPlan


class ConstraintError(ValueError):
    """A constraint set or a batch plan that cannot be satisfied; the message names the field and value."""


@dataclass(frozen=True)
class BatchConstraints:
    batch_size: int
    """B: trajectories per training batch (nominal; with variable group sizes a batch's total may deviate as
    long as it can be split into M mini-batches within the size range)."""
    num_minibatches: int
    """M: mini-batches (optimizer steps) per batch, exactly."""
    max_response_len: int
    """Upper bound on a response's length in tokens (generation truncates there)."""
    group_size: int | None = None
    """n: samples per prompt when every group has the same size; None for variable group sizes."""
    whole_groups: bool = True
    """Keep every group inside one mini-batch (group atomicity)."""
    size_slack: int = 0
    """0: every mini-batch has exactly B/M trajectories; k > 0: sizes within [B/M - k, B/M + k]."""
    token_budget: int | None = None
    """Maximum response tokens in one mini-batch; None for no budget."""
    dp_size: int = 1
    """D: data-parallel ranks; every mini-batch size must be a multiple of D so it splits evenly."""

    def __post_init__(self) -> None:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ConstraintError(f"BatchConstraints: {msg}")

        for name in ("batch_size", "num_minibatches", "max_response_len", "dp_size"):
            v = getattr(self, name)
            need(isinstance(v, int) and not isinstance(v, bool) and v >= 1, f"{name} must be an int >= 1, got {v!r}")
        def is_int(v: object) -> bool:  # bool is an int subclass; a True where a count belongs is a bug
            return isinstance(v, int) and not isinstance(v, bool)

        need(is_int(self.size_slack) and self.size_slack >= 0,
             f"size_slack must be an int >= 0, got {self.size_slack!r}")
        # a slack past B allows nothing more (sizes lie in 1..B anyway) but makes every size search scan it
        need(self.size_slack <= self.batch_size, f"size_slack={self.size_slack} exceeds batch_size="
             f"{self.batch_size} (mini-batch sizes lie within 1..batch_size; a larger slack allows nothing more)")
        if self.group_size is not None:
            need(is_int(self.group_size) and self.group_size >= 1,
                 f"group_size must be an int >= 1 or None, got {self.group_size!r}")
        need(self.token_budget is None or is_int(self.token_budget),
             f"token_budget must be an int or None, got {self.token_budget!r}")
        if self.size_slack == 0:
            need(self.batch_size % self.num_minibatches == 0,
                 f"mini-batch size does not divide the batch: batch_size={self.batch_size} is not a multiple of "
                 f"num_minibatches={self.num_minibatches} (set size_slack > 0 to allow unequal mini-batches)")
        if self.token_budget is not None:
            need(isinstance(self.token_budget, int) and self.token_budget >= self.max_response_len,
                 f"token_budget={self.token_budget!r} is below the longest allowed trajectory "
                 f"(max_response_len={self.max_response_len})")
        sizes = self.allowed_sizes()
        need(len(sizes) > 0,
             f"unsatisfiable constraint set: no mini-batch size in [{self.min_minibatch_size}, "
             f"{self.max_minibatch_size}] is a multiple of dp_size={self.dp_size}"
             + (f" and of group_size={self.group_size}" if self._unit_size() > 1 else ""))
        need(self.num_minibatches * sizes[0] <= self.batch_size <= self.num_minibatches * sizes[-1],
             f"unsatisfiable constraint set: batch_size={self.batch_size} cannot be split into "
             f"num_minibatches={self.num_minibatches} mini-batches with sizes in {sizes[0]}..{sizes[-1]}")
        need(self.batch_size % self._step() == 0,
             f"unsatisfiable constraint set: batch_size={self.batch_size} is not a multiple of {self._step()}, "
             f"the step of the allowed mini-batch sizes {sizes} (dp_size={self.dp_size}"
             + (f", group_size={self.group_size})" if self._unit_size() > 1 else ")"))
        if self.token_budget is not None:
            # Robust satisfiability: even if every response runs to max_response_len, the smallest allowed
            # mini-batch must fit the budget, or a batch of long responses could never be split.
            need(sizes[0] * self.max_response_len <= self.token_budget,
                 f"unsatisfiable constraint set: token_budget={self.token_budget} cannot hold the smallest allowed "
                 f"mini-batch ({sizes[0]} trajectories) at max_response_len={self.max_response_len}; a batch of "
                 f"long responses could never be split. Raise token_budget, or allow smaller mini-batches with "
                 f"size_slack")
            # ... and M mini-batches that fit the budget at max_response_len must be able to hold the batch.
            fit = self.robust_sizes()
            need(self.batch_size <= self.num_minibatches * fit[-1],
                 f"unsatisfiable constraint set: token_budget={self.token_budget} holds at most {fit[-1]} "
                 f"trajectories at max_response_len={self.max_response_len}, so num_minibatches="
                 f"{self.num_minibatches} mini-batches cannot hold batch_size={self.batch_size} long responses")

    # -- derived quantities -------------------------------------------------------------------------------

    @property
    def minibatch_size(self) -> int:
        """Nominal mini-batch size B/M (rounded down when size_slack > 0)."""
        return self.batch_size // self.num_minibatches

    @property
    def min_minibatch_size(self) -> int:
        return max(1, self.minibatch_size - self.size_slack)

    @property
    def max_minibatch_size(self) -> int:
        return self.minibatch_size + self.size_slack + (1 if self.batch_size % self.num_minibatches else 0)

    def _unit_size(self) -> int:
        return self.group_size if (self.whole_groups and self.group_size is not None) else 1

    def size_ok(self, size: int) -> bool:
        """Whether a mini-batch of ``size`` trajectories satisfies the size and data-parallel constraints."""
        return self.min_minibatch_size <= size <= self.max_minibatch_size and size % self.dp_size == 0

    def _step(self) -> int:
        return self._unit_size() * self.dp_size // gcd(self._unit_size(), self.dp_size)

    def allowed_sizes(self) -> list[int]:
        """Mini-batch sizes allowed by size, DP and (uniform, whole-group) group-size constraints."""
        step = self._step()
        lo = -(-self.min_minibatch_size // step) * step
        return list(range(lo, self.max_minibatch_size + 1, step))

    def robust_sizes(self) -> list[int]:
        """Allowed sizes whose mini-batch fits the token budget even with every response at max_response_len."""
        sizes = self.allowed_sizes()
        if self.token_budget is None:
            return sizes
        return [s for s in sizes if s * self.max_response_len <= self.token_budget]

    def tokens_ok(self, tokens: int) -> bool:
        return self.token_budget is None or tokens <= self.token_budget

    # -- batch plans ----------------------------------------------------------------------------------------

    def check_plan(self, plan: BatchPlan) -> None:
        """Reject a batch plan that no admission could split: wrong group sizes, a group larger than any
        allowed mini-batch, or a total that M allowed mini-batches cannot hold. Raises ConstraintError.

        Arithmetic only: whether whole groups of these sizes can be binned into M mini-batches is a packing
        question, answered by ``knittrans.admission.feasibility.check_plan`` (which calls this first)."""
        total = plan.num_trajectories
        for g in plan.groups:
            if self.group_size is not None and g.size != self.group_size:
                raise ConstraintError(
                    f"batch {plan.batch_id}: group {g.group_id} has size {g.size} but group_size={self.group_size}"
                    f" (use group_size=None for variable group sizes)")
            if self.whole_groups and g.size > self.max_minibatch_size:
                raise ConstraintError(
                    f"batch {plan.batch_id}: group {g.group_id} of size {g.size} is larger than the largest allowed "
                    f"mini-batch ({self.max_minibatch_size}) but whole_groups=True")
        if self.size_slack == 0 and total != self.batch_size:
            raise ConstraintError(f"batch {plan.batch_id} holds {total} trajectories but batch_size="
                                  f"{self.batch_size} and mini-batch sizes are exact (size_slack=0)")
        sizes = self.robust_sizes()
        if not (self.num_minibatches * sizes[0] <= total <= self.num_minibatches * sizes[-1]) \
                or total % self._step():
            raise ConstraintError(f"batch {plan.batch_id} holds {total} trajectories, which cannot be split into "
                                  f"{self.num_minibatches} mini-batches with sizes in {sizes} (the allowed sizes "
                                  f"that fit token_budget={self.token_budget} at max_response_len="
                                  f"{self.max_response_len})")
