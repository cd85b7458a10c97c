"""A plan calibrated from a real trial: the time model, batch shape and lengths fitted from run traces.

The traces are what ``knittrans.sim.trace.save_traces`` writes for ``knittrans.runtime`` runs (every trajectory's
dispatch and completion times, ``v_gen`` and ``v_train``, every optimizer step's interval and tokens, the weight
syncs' cost). The time model is ``knittrans.sim.calibrate.fit_time_model`` over the calibration runs (the
runtime's engine generates static waves; the fit recovers their decode step time, the trainer's time per step
and token, interference and sync cost); the simulator then runs ``calibrate.sim_config`` of the run's config,
which is what ``calibrate.predict`` runs, so the planner's prediction at a setting the user ran is exactly the
calibrated simulator's.

Held-out error (``heldout``), the same procedure as the sim-vs-real table (``repro.simcheck``): traces marked
``role="heldout"`` are predicted from a model fitted to the others, with a calibration run's lengths (the same
seed's when one calibrated); without roles every run is predicted from the others (leave one run out); a single
run has no held-out error, and the plan says so.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Mapping, Sequence

import numpy as np

from knittrans.plan.config import PlanConfig, PlanInputError
from knittrans.plan.policies import PolicyFactory
from knittrans.plan.scenario import (InputLog, Scenario, Source, batch_shape, finish, lengths_source, positive,
                                     take_enum)
from knittrans.plan.workload import Lengths
from knittrans.sim.calibrate import (FLOW_DETERMINED_SPREAD, TimeModel, fit_time_model, heldout_error, predict,
                                     sim_config, timing_spread, workload_of)
from knittrans.sim.config import SimConfig
from knittrans.types import AdmissionKind, ExecutionMode, InflightPolicy, SyncPolicy

FITTED = ("engines", "slots", "decode_tok_s", "rollout_tok_s", "train_step_s", "train_tok_s", "train_overhead_s")
"""Inputs the fit replaces (giving one with --calibrate is an error: the trace measured it)."""


@dataclass(frozen=True)
class HeldOut:
    """One real run predicted by a time model fitted without it."""

    setting: str
    """``system/b<budget>/<sync>/w<wave groups>``, as the sim-vs-real table names settings."""
    seed: int
    measured_mean: float
    predicted_mean: float
    spread: float
    """How far the prediction moves with rollout 2x faster or slower (``calibrate.timing_spread``)."""
    measured_steps_per_s: float
    predicted_steps_per_s: float

    @property
    def error(self) -> float:
        return heldout_error(self.predicted_mean, self.measured_mean)

    @property
    def steps_error(self) -> float:
        """|predicted / measured - 1| of whole-run steps/s (context: the sim-vs-real bound is on staleness)."""
        return abs(self.predicted_steps_per_s / self.measured_steps_per_s - 1.0)

    @property
    def timing_sensitive(self) -> bool:
        """False where flow control alone sets the staleness (any predictor that knows the budget is right)."""
        return self.spread >= FLOW_DETERMINED_SPREAD


def load_runs(paths: Sequence[str]) -> list:
    """Every run in the trace files ``paths`` (``knittrans.sim.trace.RunTrace``)."""
    from knittrans.sim.trace import TraceFormatError, load_traces  # the runtime's config: imported only here

    runs = []
    for p in paths:
        try:
            runs += load_traces(p)
        except (TraceFormatError, FileNotFoundError) as e:
            raise PlanInputError("calibrate", str(e)) from None
    if not runs:
        raise PlanInputError("calibrate", f"no runs in {list(paths)}")
    return runs


def split(runs: Sequence) -> tuple[list, list]:
    """(calibration runs, held-out runs) by the traces' roles; all calibrate when none is marked held out."""
    held = [r for r in runs if r.role == "heldout"]
    return ([r for r in runs if r.role != "heldout"], held) if held else (list(runs), [])


def setting_of(run) -> str:  # noqa: ANN001 - a RunTrace
    c = run.config
    return f"{c.system}/b{c.budget}/{c.sync.value}/w{c.wave_groups}"


def _fitted_inputs(inp: InputLog, tm: TimeModel, r2: tuple[float, float], wave_groups: int, runs: int) -> None:
    f = Source.FITTED
    inp.note("engines", 1, f, f"the runtime's engine: static waves of {wave_groups} groups (the first calibration "
                              f"run's wave size)")
    inp.note("decode_s", tm.decode_s, f, f"per decode step of a wave, plus decode_per_seq_s per sequence "
                                         f"(r2 {r2[0]:.2f} over {runs} runs)")
    inp.note("decode_per_seq_s", tm.decode_per_seq_s, f)
    inp.note("train_overhead_s", tm.step_overhead, f, f"plus 1/train_tok_s per token (r2 {r2[1]:.2f})")
    inp.note("train_tok_s", 1.0 / tm.per_token if tm.per_token > 0 else float("inf"), f)
    inp.note("interference", f"rollout +{tm.engine_interference:.0%}, trainer +{tm.trainer_interference:.0%}", f,
             "each side's slowdown while the other runs (shared hardware)")


def resolve_calibrated(cfg: PlanConfig, runs: Sequence) -> tuple[Scenario, TimeModel]:
    """The scenario of a plan calibrated from ``runs`` (its calibration runs: ``split``)."""
    for name in FITTED:
        if getattr(cfg, name) is not None:
            raise PlanInputError(name, "is measured by the trace (--calibrate fits the time model); drop one of them")
    cal, _ = split(runs)
    tm, r2w, r2s = fit_time_model(cal)
    rc = cal[0].config
    inp = InputLog(cfg)
    defaults = {"prompts_per_batch": rc.prompts_per_batch, "group_size": rc.group_size,
                "num_minibatches": rc.num_minibatches, "max_response_len": rc.max_new_tokens}
    if cfg.lengths is None and cfg.dist is None:
        groups = tuple(wb.lengths[g.group_id] for r in cal for wb in workload_of(r) for g in wb.plan.groups)
        values = np.concatenate(groups)
        source = Lengths(values, groups, f"the {len(cal)} calibration run(s)")
        if values.max() > (cfg.max_response_len or rc.max_new_tokens):
            raise PlanInputError("max_response_len", f"the trace holds a {values.max()}-token response, over "
                                                     f"{cfg.max_response_len or rc.max_new_tokens}")
    else:
        source = lengths_source(inp, rc.max_new_tokens)
    P, n, c = batch_shape(inp, defaults, Source.FITTED, source.group_size if isinstance(source, Lengths) else None)
    _fitted_inputs(inp, tm, (r2w, r2s), rc.wave_groups, len(cal))
    sync = take_enum(inp, "sync", SyncPolicy, rc.sync, Source.FITTED)
    k = inp.take("sync_k", rc.sync_every, lambda v: isinstance(v, int) and v >= 1, "an int >= 1", Source.FITTED)
    cost = inp.take("sync_cost_s", tm.sync_cost, lambda v: positive(v) or v == 0, "a number >= 0", Source.FITTED)
    inflight = take_enum(inp, "inflight", InflightPolicy, InflightPolicy.CONTINUE)
    # the run's config reshaped to the plan's batch; admission and budget are set per setting by the sweep
    shaped = replace(rc, mode=ExecutionMode.DISAGGREGATED, admission=AdmissionKind.KNITTRANS, inflight_groups=0,
                     prompts_per_batch=P, group_size=n, num_minibatches=c.num_minibatches,
                     max_new_tokens=c.max_response_len, sync=sync, sync_every=k)
    base: SimConfig = sim_config(shaped, replace(tm, sync_cost=cost))
    base = replace(base, sync=replace(base.sync, inflight=inflight))
    return finish(inp, source, P, n, c, base), tm


def heldout(runs: Sequence, factories: Mapping[str, PolicyFactory]) -> tuple[str, list[HeldOut]]:
    """How the held-out error was measured, and each held-out run's prediction (module docstring)."""
    cal, held = split(runs)
    if held:
        return "trace roles: fitted to the calibration runs, predicting the held-out ones", \
            _predict(cal, held, factories)
    if len(runs) < 2:
        return "none: one run (a second trial at another setting gives a held-out error)", []
    out = []
    for i, r in enumerate(runs):
        out += _predict([q for j, q in enumerate(runs) if j != i], [r], factories)
    return "leave one run out: each run predicted from a model fitted to the others", out


def _predict(cal: Sequence, held: Sequence, factories: Mapping[str, PolicyFactory]) -> list[HeldOut]:
    tm, _, _ = fit_time_model(cal)
    by_seed = {r.config.seed: workload_of(r) for r in reversed(cal)}  # each seed's first calibration run
    first = workload_of(cal[0])

    def make_policy(kind, constraints):  # noqa: ANN001, ANN202 - calibrate.PolicyFactory over the registry
        name = AdmissionKind(kind).value
        if name not in factories:
            raise PlanInputError("policies", f"a trace ran {name!r}, which is not registered: {sorted(factories)}")
        return factories[name](constraints)

    out = []
    for r in held:
        batches = by_seed.get(r.config.seed, first)
        res = predict(r.config, tm, batches, make_policy)
        out.append(HeldOut(setting_of(r), r.config.seed, float(r.staleness().mean()), float(res.records.staleness.mean()),
                           timing_spread(r.config, tm, batches, make_policy), r.throughput_steps_per_s(),
                           len(res.steps) / res.total_time if res.total_time > 0 else float("nan")))
    return out
