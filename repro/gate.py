"""Regression gates: every paper claim and performance target as a check over a deterministic quantity.

    python -m repro.gate                         # all gates at CI-friendly sizes; exit 1 if any fails
    python -m repro.gate --only staleness        # one table's gates
    python -m repro.gate --inject knittrans_waits_whole_batch   # prove the gates catch a regression

A gate measures a deterministic quantity (simulated staleness with a fixed seed, bytes moved, dedup counts,
bit-exact equality) or a ratio of timings measured in one run, with a stated margin; never an absolute time. A
failing gate prints the claim, the measured value and the bound. ``--inject`` switches on a deliberate
regression (see ``INJECTIONS``); the gates it targets must then fail, which ``tests/unit/test_gates.py`` checks.
"""

from __future__ import annotations

import argparse
import enum
import sys
import time
from dataclasses import dataclass, replace
from typing import Callable


class Injection(str, enum.Enum):
    NONE = "none"
    KNITTRANS_WAITS_WHOLE_BATCH = "knittrans_waits_whole_batch"  # KnitTrans admission replaced by train-batch
    NO_FEASIBILITY_CHECK = "no_feasibility_check"  # KnitTrans admission replaced by greedy streaming
    DISABLE_DEDUP = "disable_dedup"  # the multimodal trainer path encodes every image occurrence


INJECTIONS = {i.value: i for i in Injection}


@dataclass(frozen=True)
class Gate:
    name: str
    """The claim or target the gate protects (as named in the table's summary.json)."""
    table: str
    op: str
    """'>=' or '<=' or '=='."""
    bound: float
    measure: Callable[[Injection], tuple[float, str]]
    """Returns (measured value, context for the message)."""
    why: str
    """What the bound is and where its margin comes from."""
    timing: bool = False
    """True for a ratio of timings measured in one run (noisy); False for a deterministic quantity."""

    def check(self, value: float) -> bool:
        if self.op == ">=":
            return value >= self.bound
        if self.op == "<=":
            return value <= self.bound
        if self.op == "==":
            return value == self.bound
        raise ValueError(f"unknown gate operator {self.op!r}")


@dataclass(frozen=True)
class GateResult:
    gate: Gate
    measured: float
    passed: bool
    context: str
    seconds: float

    @property
    def message(self) -> str:
        status = "ok  " if self.passed else "FAIL"
        return (f"{status} {self.gate.table}/{self.gate.name}: measured {self.measured:.4g}, required "
                f"{self.gate.op} {self.gate.bound:.4g} ({self.gate.why}){'; ' + self.context if self.context else ''}")


# -- staleness -------------------------------------------------------------------------------------------------

_STALENESS_CACHE: dict[Injection, list] = {}


def _staleness_points(inj: Injection):
    """A CI-size slice of the staleness table: the time-scaled 64-prompt config with n=16, M=16 (the DAPO shape),
    and the variable-group scenario; deterministic given the seed."""
    if inj in _STALENESS_CACHE:
        return _STALENESS_CACHE[inj]
    from repro.staleness import Point, SystemConf, run_point

    sysc = SystemConf()
    swap = {Injection.KNITTRANS_WAITS_WHOLE_BATCH: "train_batch", Injection.NO_FEASIBILITY_CHECK: "greedy"}
    pts = []
    for pol in ("knittrans", "train_batch"):
        for b in (0.5, 1.0, 1.5, 2.0):
            pts.append(Point("gate", pol, 64, 16, 16, "light", b, "every_step", 5, 2, 0, sysc))
    for pol in ("knittrans", "greedy"):
        for b in (1.0, 2.0):
            pts.append(Point("gate_var", pol, 32, 8, 4, "light", b, "every_step", 5, 2, 0, sysc, batch_total=192))
    results = []
    for p in pts:
        run_as = swap.get(inj, "knittrans") if p.policy == "knittrans" else p.policy
        r = run_point(replace(p, policy=run_as))
        results.append(replace(r, point=p))  # label it as the policy it stands in for
    _STALENESS_CACHE[inj] = results
    return results


def _reduction(inj: Injection) -> tuple[float, str]:
    from repro.staleness import matched_reduction

    rs = [r for r in _staleness_points(inj) if r.point.scenario == "gate"]
    m = matched_reduction([r for r in rs if r.point.policy == "knittrans"],
                          [r for r in rs if r.point.policy == "train_batch"])
    if m is None:
        return float("-inf"), "no matched operating point"
    return m.reduction, (f"train-batch budget {m.tb.point.budget} A={m.tb.metrics['arch_staleness']:.2f} vs "
                         f"KnitTrans budget {m.kt.point.budget} A={m.kt.metrics['arch_staleness']:.2f}")


def _throughput_ratio(inj: Injection) -> tuple[float, str]:
    rs = [r for r in _staleness_points(inj) if r.point.scenario == "gate" and r.ok]
    thr = {(r.point.policy, r.point.budget): r.metrics["throughput_traj_s"] for r in rs}
    ratios = {b: thr[("knittrans", b)] / thr[("train_batch", b)] for (_, b) in thr
              if ("knittrans", b) in thr and ("train_batch", b) in thr}
    worst = min(ratios.values())
    return worst, "per budget: " + ", ".join(f"{b}: {x:.3f}" for b, x in sorted(ratios.items()))


def _knittrans_violations(inj: Injection) -> tuple[float, str]:
    rs = [r for r in _staleness_points(inj) if r.point.scenario == "gate_var" and r.point.policy == "knittrans"]
    bad = sum(r.metrics.get("violations", 0) for r in rs if r.ok) + sum(1 for r in rs if not r.ok)
    return float(bad), "variable group sizes, exact mini-batch sizes"


def _greedy_dead_ends(inj: Injection) -> tuple[float, str]:
    rs = [r for r in _staleness_points(inj) if r.point.scenario == "gate_var" and r.point.policy == "greedy"]
    return float(sum(r.metrics.get("dead_ends", 0) for r in rs if r.ok)), "the baseline must still dead-end here"


def _littles_law(inj: Injection) -> tuple[float, str]:
    import numpy as np

    from baselines.admission import BoundedAsyncAdmission
    from knittrans.constraints import BatchConstraints
    from knittrans.sim import (EngineConfig, FlowConfig, FlowKind, SimConfig, SyncConfig, SyncPolicy,
                               TrainerConfig, simulate)
    from knittrans.staleness import pre_queue_staleness
    from workloads.text import LengthDist, TextWorkloadConfig, generate_batches

    worst = 0.0
    for rho in (0.5, 2.0):
        wl = TextWorkloadConfig(name="theory", prompts_per_batch=16, group_size=8, num_minibatches=1,
                                lengths=LengthDist(median=400, sigma=0.8, max_len=4000, min_len=8), prompt_len=0)
        batches = generate_batches(wl, 60, seed=1)
        lens = np.concatenate([g for b in batches for g in b.lengths.values()])
        m_tail = np.mean([g.max() for b in batches for g in b.lengths.values()]) / lens.mean()
        C, B, tpot = 256, wl.batch_size, 0.01
        step = B * rho / (C / (lens.mean() * tpot))
        cfg = SimConfig(engine=EngineConfig(num_engines=2, slots=128, tpot=tpot),
                        trainer=TrainerConfig(step_overhead=step, per_token=0.0),
                        sync=SyncConfig(policy=SyncPolicy.EVERY_STEP, cost=0.0),
                        flow=FlowConfig(kind=FlowKind.UNBOUNDED))
        res = simulate(cfg, BoundedAsyncAdmission(BatchConstraints(B, 1, 4000, group_size=8)), batches)
        start = res.records.t_start
        done = ~np.isnan(res.records.t_group_complete)
        pq = np.full(len(start), np.nan)
        pq[done] = pre_queue_staleness(res)
        lo, hi = np.quantile(start, [0.2, 0.7])
        measured = np.nanmean(pq[(start >= lo) & (start <= hi)])
        worst = max(worst, abs(measured / (C * m_tail / (B * max(1.0, rho))) - 1))
    return worst, "rho in {0.5, 2.0}"


# -- multimodal dedup (deterministic) ---------------------------------------------------------------------------

_MM_N = 4


def _mm_batches(inj: Injection):
    """A tiny GRPO multimodal batch through the encoding plane: n samples per prompt share their images."""
    from knittrans.mmdedup import BatchTokens, EncodingPlane, ImageSet, TrainSample, collate
    from workloads.multimodal import MMWorkloadConfig, MultimodalWorkload
    from workloads.vlm import TinyVLMConfig

    vc = TinyVLMConfig()
    wl = MultimodalWorkload(MMWorkloadConfig(prompts_per_batch=2, n=_MM_N, images_per_prompt=1,
                                             image_sizes=((56, 56), (56, 84)), seed=0, vlm=vc))
    groups = wl.sample_batch(0)
    plane = EncodingPlane(["u0"])
    samples = [s for g in groups for s in g.samples]
    for g in groups:
        for smp in g.samples:
            plane.register("u0", smp.traj_id, [g.images[i].pixel_values for i in smp.image_index],
                           [g.images[i].grid_thw for i in smp.image_index])
    fetched = plane.fetch([smp.traj_id for smp in samples])
    tokens = BatchTokens(wl.vocab.pad_id, wl.vocab.image_pad_id, vc.spatial_merge_size)
    dd = [TrainSample(smp.traj_id, smp.token_ids, smp.loss_mask, smp.advantage, fetched.image_ids[smp.traj_id])
          for smp in samples]
    dedup = collate(dd, fetched.images, tokens)
    pixels, grids, occ = [], [], []
    for smp in dd:
        ids = []
        for i in smp.image_ids:
            ids.append(len(pixels))
            pixels.append(fetched.images.pixels[i])
            grids.append(fetched.images.grids[i])
        occ.append(TrainSample(smp.traj_id, smp.token_ids, smp.loss_mask, smp.advantage, tuple(ids)))
    baseline = collate(occ, ImageSet(tuple(pixels), tuple(grids)), tokens)
    return vc, wl, fetched, dedup, baseline


def _mm_encoder_ratio(inj: Injection) -> tuple[float, str]:
    import torch

    from knittrans.mmdedup import policy_logits
    from workloads.vlm import build_tiny_vlm, vision_tower

    vc, wl, _, dedup, baseline = _mm_batches(inj)
    model = build_tiny_vlm(vc, wl.vocab, seed=0, dtype=torch.float32)
    seen: list[int] = []
    hook = vision_tower(model).register_forward_hook(lambda m, args, out: seen.append(int(args[0].shape[0])))
    try:
        with torch.no_grad():
            if inj is Injection.DISABLE_DEDUP:
                policy_logits(model, baseline, dedup=False)  # the regression: every occurrence encoded
            else:
                policy_logits(model, dedup, dedup=True)
            policy_logits(model, baseline, dedup=False)
    finally:
        hook.remove()
    return seen[1] / seen[0], f"vision-tower patches without / with dedup, n={_MM_N} samples per image"


def _mm_bytes_ratio(inj: Injection) -> tuple[float, str]:
    _, _, fetched, _, _ = _mm_batches(inj)
    return fetched.occurrence_nbytes / fetched.nbytes, f"pixel bytes per occurrence / moved, n={_MM_N}"


# -- reliability (deterministic counts) --------------------------------------------------------------------------

_REL_CACHE: dict = {}


def _reliability_claims() -> dict:
    if "claims" not in _REL_CACHE:
        import json
        import tempfile
        from pathlib import Path

        from repro.reliability import ReliabilityConf, run

        import contextlib
        import io

        with tempfile.TemporaryDirectory() as tmp, contextlib.redirect_stdout(io.StringIO()):
            run(ReliabilityConf(out_dir=tmp, logger="none", load_trajectories=4000, load_minibatch=200,
                                transports=["inprocess"], runtime_faults=False))
            data = json.loads((Path(tmp) / "summary.json").read_text())
        _REL_CACHE["claims"] = {c["name"]: c for c in data["claims"]}
    return _REL_CACHE["claims"]


def _rel(name: str):
    def measure(inj: Injection) -> tuple[float, str]:
        c = _reliability_claims()[name]
        return float(c["measured"]), "in-process data-plane faults, bad-input catalogue, 4k-trajectory load"
    return measure


def _rel_missing(name: str):
    def measure(inj: Injection) -> tuple[float, str]:
        c = _reliability_claims()[name]
        return float(c["paper"]) - float(c["measured"]), "injected/tried minus survived/rejected"
    return measure


# -- kernels ---------------------------------------------------------------------------------------------------


def _hash_pad_collisions(inj: Injection) -> tuple[float, str]:
    import torch

    from triton_kernels.encoding_hash import encoding_hash

    g = torch.Generator().manual_seed(0)
    segs = [torch.randint(0, 256, (int(n),), generator=g, dtype=torch.uint8) for n in (1, 3, 64, 1000, 4097)]
    padded = [torch.cat([s, torch.zeros(k, dtype=torch.uint8)]) for s in segs for k in (1, 4)]
    keys = encoding_hash(segs + padded).tolist()
    distinct = len({tuple(k) for k in keys})
    return float(len(keys) - distinct), f"{len(keys)} segments: originals and zero-padded copies"


def _hash_kernel_equals_reference(inj: Injection) -> tuple[float, str]:
    import os

    import torch

    if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        return 0.0, "skipped: no GPU and TRITON_INTERPRET!=1"
    from triton_kernels.encoding_hash import encoding_hash

    g = torch.Generator().manual_seed(1)
    segs = [torch.randint(0, 256, (int(n),), generator=g, dtype=torch.uint8) for n in (0, 1, 5, 4096, 4099)]
    a = encoding_hash(segs, impl="reference")
    b = encoding_hash(segs, impl="triton")
    return float((a != b).any(dim=1).sum().item()), "mismatching keys on awkward sizes"


def gates() -> list[Gate]:
    return [
        Gate("arch_staleness_reduction", "staleness", ">=", 0.90, _reduction,
             "paper: up to 0.93; CI-size slice (64x16, M=16, time-scaled), matched throughput"),
        Gate("throughput_ratio", "staleness", ">=", 0.999, _throughput_ratio,
             "KnitTrans / train-batch at equal in-flight budget; equality allowed (both rollout-bound)"),
        Gate("knittrans_constraint_violations", "staleness", "==", 0.0, _knittrans_violations,
             "admission must never break a batch constraint or stall"),
        Gate("greedy_dead_ends", "staleness", ">=", 1.0, _greedy_dead_ends,
             "the scenario must keep exercising feasibility"),
        Gate("littles_law_error", "staleness", "<=", 0.10, _littles_law,
             "simulator vs C*M_tail/(B*max(1,rho)), relative"),
        Gate("mm_encoder_patch_ratio", "speedup", "==", float(_MM_N), _mm_encoder_ratio,
             "dedup encodes each distinct image once: exactly n times fewer vision-tower patches"),
        Gate("mm_bytes_ratio", "transfer-multimodal", "==", float(_MM_N), _mm_bytes_ratio,
             "bytes moved with dedup = the distinct images' bytes"),
        Gate("trajectories_lost", "reliability", "==", 0.0, _rel("trajectories_lost"), "nothing lost"),
        Gate("trajectories_duplicated", "reliability", "==", 0.0, _rel("trajectories_duplicated"),
             "nothing consumed twice"),
        Gate("faults_not_survived", "reliability", "==", 0.0, _rel_missing("faults_survived"),
             "every injected fault survived"),
        Gate("bad_input_not_rejected", "reliability", "==", 0.0, _rel_missing("bad_input_rejected"),
             "every bad-input case rejected with a clear error"),
        Gate("hash_zero_pad_collisions", "kernels", "==", 0.0, _hash_pad_collisions,
             "length sensitivity: a zero-padded copy must hash differently"),
        Gate("hash_kernel_equals_reference", "kernels", "==", 0.0, _hash_kernel_equals_reference,
             "Triton kernel and torch reference agree bit for bit"),
    ]


def run_gates(inject: Injection = Injection.NONE, only: str | None = None,
              timing: bool = True) -> list[GateResult]:
    """Run the gates (of one table with ``only``; without the timing-ratio gates with ``timing=False``)."""
    out = []
    for g in gates():
        if (only and g.table != only) or (g.timing and not timing):
            continue
        t = time.perf_counter()
        value, ctx = g.measure(inject)
        out.append(GateResult(g, value, g.check(value), ctx, time.perf_counter() - t))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="KnitTrans regression gates")
    ap.add_argument("--inject", default="none", choices=sorted(INJECTIONS),
                    help="switch on a deliberate regression (the targeted gates must fail)")
    ap.add_argument("--only", default=None, help="run only this table's gates (staleness, kernels, ...)")
    ap.add_argument("--no-timing", action="store_true", help="skip the gates over timing ratios")
    args = ap.parse_args(argv)
    results = run_gates(INJECTIONS[args.inject], args.only, timing=not args.no_timing)
    for r in results:
        print(r.message, flush=True)
    failed = [r for r in results if not r.passed]
    print(f"{len(results) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
