"""The planner's input: one flat config whose fields are the command's flags, and the planner's typed errors.

Every field but the lengths source has a default; ``None`` means "take the default" (or, with ``calibrate``, the
value fitted from the real run), so the planner can print which value each setting took and where it came from.
The help text of every flag is the field's ``help`` metadata (``knittrans.plan.cli`` builds the flags from the
fields, and their defaults from ``knittrans.plan.scenario.DEFAULTS``, so neither can drift from the code). Field ``x_y`` is flag ``--x-y``; an error names the field as that flag.
"""

from __future__ import annotations

from dataclasses import dataclass, field


DEFAULT_POLICIES = ("train_batch", "greedy", "bounded_async", "knittrans")
"""Swept by default: the three baselines of ``baselines.admission`` and KnitTrans (``knittrans.plan.policies``)."""


class PlanError(ValueError):
    """Anything the planner cannot do with what it was given."""


class PlanInputError(PlanError):
    """A bad input. ``argument`` is the config field (and, with dashes, the command's flag) that holds it."""

    def __init__(self, argument: str, problem: str) -> None:
        self.argument = argument
        self.problem = problem
        super().__init__(f"{flag(argument)}: {problem}")


class LengthsError(PlanInputError):
    """Response lengths that are empty, not whole numbers of tokens, not positive or over the maximum response
    length. ``line`` is the 1-based line (or row) of the offending value in its file, None when it has none."""

    def __init__(self, argument: str, problem: str, line: int | None = None) -> None:
        self.line = line
        super().__init__(argument, problem if line is None else f"line {line}: {problem}")


def flag(argument: str) -> str:
    """The command-line flag of config field ``argument``."""
    return "--" + argument.replace("_", "-")


def _f(help: str, default=None):  # noqa: ANN001, ANN202 - a dataclass field with its flag's help text
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class PlanConfig:
    """What the user tells the planner about their run (see docs/planner.md for what each setting models)."""

    # -- the workload: exactly one of lengths / dist, or calibrate (whose runs carry their lengths) ------------
    lengths: str | None = _f("file of response lengths in tokens: one number per line (.txt), CSV/TSV, JSONL or "
                             "Parquet with a named --column")
    column: str | None = _f("the column (CSV, Parquet) or key (JSONL) holding the lengths; optional for a CSV with "
                            "one column")
    group_column: str | None = _f("the column holding each response's group (prompt) id: keeps the real group "
                                  "structure (without it, groups are drawn sample by sample from all lengths)")
    dist: str | None = _f("a named length distribution instead of a file: light, heavy, or "
                          "lognormal:median=M,sigma=S[,prompt_share=F]")
    calibrate: tuple[str, ...] = _f("run traces of a real trial (knittrans.sim.trace files written by "
                                    "save_traces): fit the time model, batch shape and lengths from them",
                                    default=())
    # -- the batch --------------------------------------------------------------------------------------------
    prompts_per_batch: int | None = _f("P: prompts (groups) per training batch")
    batch_size: int | None = _f("B: trajectories per batch, instead of --prompts-per-batch (must be a multiple "
                                "of --group-size)")
    group_size: int | None = _f("n: samples per prompt (GRPO group size); a lengths file's groups set it")
    num_minibatches: int | None = _f("M: optimizer steps (mini-batches) per batch")
    max_response_len: int | None = _f("longest response the rollout may return, in tokens")
    whole_groups: bool = _f("keep every group inside one mini-batch (off: --no-whole-groups)", default=True)
    token_budget: int | None = _f("most response tokens in one mini-batch")
    # -- rollout ----------------------------------------------------------------------------------------------
    engines: int | None = _f("rollout engines (vLLM instances)")
    slots: int | None = _f("concurrent requests per engine (vLLM max_num_seqs)")
    decode_tok_s: float | None = _f("decode tokens/s of one request at light load")
    rollout_tok_s: float | None = _f("measured decode tokens/s of all engines together at full load, instead of "
                                     "--decode-tok-s")
    # -- trainer ----------------------------------------------------------------------------------------------
    train_step_s: float | None = _f("seconds per optimizer step, whatever its size (instead of the per-token "
                                    "model)")
    train_tok_s: float | None = _f("trainer response tokens/s (forward + backward + old-logprob recompute) "
                                   "[80000]")
    train_overhead_s: float | None = _f("trainer seconds per step on top of its tokens")
    # -- weight sync and versions -----------------------------------------------------------------------------
    sync: str | None = _f("when weights reach the engines: every_step, every_k or every_batch")
    sync_k: int | None = _f("k of every_k")
    sync_cost_s: float | None = _f("seconds both sides pause per weight sync")
    inflight: str | None = _f("requests in flight at a sync: continue (keep their oldest version) or abort "
                              "(regenerate)")
    release: str = _f("when a consumed group frees its in-flight budget place: step_end (the runtime's) or "
                      "step_start", default="step_end")
    # -- the sweep and the answer -----------------------------------------------------------------------------
    policies: tuple[str, ...] = _f("admission policies to sweep (names registered under the knittrans.policies "
                                   "entry points)", default=DEFAULT_POLICIES)
    grid: tuple[str, ...] = _f("a policy's knob values, e.g. knittrans=0.25,0.5,1 (in-flight budget in batches) "
                               "or bounded_async=0,1,2 (AReaL's eta); repeatable", default=())
    target: str = _f("max-throughput, staleness<=S (mean, steps), p99<=S, or steps/s>=X",
                     default="max-throughput")
    num_batches: int = _f("training batches simulated per setting", default=20)
    warmup_batches: int = _f("batches left out of the metrics (the pipeline fill)", default=2)
    seed: int = _f("seed of the drawn lengths", default=0)
    workers: int = _f("processes for the sweep (0: one per core)", default=0)
    out_dir: str = _f("where plan.md, frontier.png and plan.json go", default="results/plan")

    def __post_init__(self) -> None:
        object.__setattr__(self, "calibrate", tuple(self.calibrate))
        object.__setattr__(self, "policies", tuple(self.policies))
        object.__setattr__(self, "grid", tuple(self.grid))
        for name in ("num_batches", "seed", "workers", "warmup_batches"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < (1 if name == "num_batches" else 0):
                raise PlanInputError(name, f"must be an int >= {1 if name == 'num_batches' else 0}, got {v!r}")
        if self.warmup_batches >= self.num_batches:
            raise PlanInputError("warmup_batches", f"{self.warmup_batches} leaves none of the {self.num_batches} "
                                                   f"batches (--num-batches) to measure")
        sources = [n for n in ("lengths", "dist") if getattr(self, n) is not None]
        if len(sources) > 1:
            raise PlanInputError("dist", "give the lengths as a file (--lengths) or a distribution (--dist), not both")
        if not sources and not self.calibrate:
            raise PlanInputError("lengths", "no response lengths: give --lengths FILE, --dist NAME, or --calibrate "
                                            "TRACE (the only input without a default)")
        if self.lengths is None and (self.column or self.group_column):
            raise PlanInputError("column", "--column and --group-column name columns of a --lengths file")
        if not self.policies:
            raise PlanInputError("policies", "no policy to sweep")
