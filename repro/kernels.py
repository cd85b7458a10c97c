"""Kernels table: encoding_hash and batched_pack against a memcpy of the same bytes, hashes/s, planner balance.

What it measures (issues 3, 12, 15; every claim, its bound and its metric's range: ``repro/spec/kernels.py``):
- Fraction of memcpy, per op and size, over ``passes`` interleaved passes: in each pass, for each point in turn,
  a memcpy moving the op's bytes (``triton_kernels.traffic``: each input byte read once, each output byte written
  once, counted by ``hash_traffic`` / ``pack_traffic`` next to the kernels) and then the op; the pass's fraction is
  memcpy time / op time. Claims take the median over passes at the largest size, with [min, max].
- On CPU the clock is the process's CPU time, every contender on one torch thread: on a shared machine a call
  longer than a scheduler slice waits for other tenants and its wall time measures their load (see
  ``triton_kernels/bench.py``); wall-clock fractions are logged beside it (measurements). On a GPU: wall time,
  synchronized, and the fraction of the GPU's spec bandwidth.
- Pack into reused outputs (``PackBuffers``, the claim) and fresh ones; profiles in the same passes: the hash's
  block sums alone (its int8 GEMM) and the pack's copies alone (``pack_copy_floor``), so a missed target says why.
- Hashes/s of SGLang's [3312, 1176] fp32 tensor; Triton == reference and hash length sensitivity
  (``triton_kernels.checks``); the planner's imbalance, first-fit-decreasing vs Karmarkar-Karp.

Triton: ``TRITON_INTERPRET`` is decided here, before any kernel is defined (``triton_kernels.backend``): compiled on
a GPU, interpreted without one (the kernels are then only checked on small inputs, never timed). So
``python -m repro.kernels logger=none`` runs as is, inside ``make`` or not.

Run: ``python -m repro.kernels logger=none`` (``device=cuda`` on a GPU; fields: ``KernelsConfig``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import hydra
import numpy as np
import torch
from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from repro.logger import publish
from repro.results import Results
from repro.spec.core import Trial
from repro.spec.kernels import Check, KernelCheckTrial, KernelOp, KernelTrial, PlanTrial
from triton_kernels import backend
from triton_kernels.bench import (SGLANG_SHAPE, Case, Memcpy, PassTime, hash_inputs, interleaved_passes,
                                  pack_copy_floor, pack_inputs, spec_bandwidth)
from triton_kernels.traffic import Traffic


@dataclass
class KernelsConfig:
    """Configuration of ``python -m repro.kernels``."""

    out_dir: str = "results/kernels"
    """Where summary.json, table.md, trials.jsonl, config.yaml, meta.json and the plot go."""
    logger: str = "wandb"
    """"wandb" (offline unless WANDB_MODE=online) or "none"."""
    seed: int = 0
    """Seeds the random inputs and the planner's length sample."""
    device: str = "auto"
    """"auto" (cuda when available, else cpu), "cpu" or "cuda"."""
    images: list[int] = field(default_factory=lambda: [1, 4, 16, 64])
    """Hash sweep: images of 448x448x3 fp32 (602 KB each) per call; the claim reads the largest."""
    pack_tokens: list[int] = field(default_factory=lambda: [16384, 131072, 1048576])
    """Pack sweep: tokens per batch (int64 ids, fp32 log-probs and advantages, bool mask); the claim reads the
    largest."""
    sglang_batch: int = 8
    """[3312, 1176] fp32 tensors hashed per call for hashes/s (0: skip)."""
    passes: int = 11
    """Interleaved timing passes (K); each pass times every point once after one untimed warm-up round."""
    profile: bool = True
    """Also time the profiles (hash block sums alone, pack copies alone) at the largest sizes, on CPU."""
    check_kernels: bool = True
    """Run the deterministic checks (Triton == reference: interpreted on CPU, so small inputs)."""
    plan_sequences: int = 1024
    """Sequences in the planner comparison (lognormal lengths, 8 ranks, 16k-token micro-batches; 0: skip)."""


ConfigStore.instance().store(name="kernels_schema", node=KernelsConfig)


def resolve_device(name: str) -> torch.device:
    if name not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {name!r}")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device=cuda but torch sees no CUDA device")
    return torch.device("cuda" if name == "cuda" or (name == "auto" and torch.cuda.is_available()) else "cpu")


@dataclass(frozen=True)
class Point:
    """What a timed case's rows say besides their timings: variant -> (op, outputs)."""

    size: str
    items: int
    traffic: Traffic
    variants: dict[str, tuple[KernelOp, str]]


def timing_cases(cfg: KernelsConfig, device: torch.device, gen: torch.Generator) -> tuple[list[Case], dict[str, Point]]:
    """Every timed point of the sweep with its calls (hash, pack fresh/reused, hash rate, profiles)."""
    from triton_kernels.batched_pack import PackBuffers, batched_pack, pack_traffic
    from triton_kernels.encoding_hash import encoding_hash, hash_traffic
    from triton_kernels.encoding_hash.reference import block_sums, check_segments, mixing_matrix

    cases, points = [], {}
    profile = cfg.profile and device.type == "cpu"
    for n in cfg.images:
        buf, off = hash_inputs(n, gen, device)
        calls = {"": lambda b=buf, o=off: encoding_hash(b, o)}
        variants = {"": (KernelOp.HASH, "")}
        if profile and n == max(cfg.images):
            flat, o = check_segments(buf, off)
            calls["block_sums"] = lambda f=flat, o=o: block_sums(f, o, mixing_matrix("cpu"))
            variants["block_sums"] = (KernelOp.HASH_BLOCK_SUMS, "")
        name = f"hash {n}"
        cases.append(Case(name, hash_traffic(off), calls))
        points[name] = Point(f"{n} x 448x448x3 fp32", n, hash_traffic(off), variants)
    for t in cfg.pack_tokens:
        fields, off, plan = pack_inputs(t, gen, device)
        bufs = PackBuffers()
        calls = {"reused": lambda f=fields, o=off, p=plan, b=bufs: batched_pack(f, o, p, out=b),
                 "fresh": lambda f=fields, o=off, p=plan: batched_pack(f, o, p)}
        variants = {"reused": (KernelOp.PACK, "reused"), "fresh": (KernelOp.PACK, "fresh")}
        if profile and t == max(cfg.pack_tokens):
            calls["copies"] = pack_copy_floor(fields, off, plan, batched_pack(fields, off, plan))
            variants["copies"] = (KernelOp.PACK_COPIES, "")
        name, traffic = f"pack {t}", pack_traffic(fields, off, plan)
        cases.append(Case(name, traffic, calls))
        points[name] = Point(f"{t} tokens, {plan.num_rows} rows of {plan.row_len}", t, traffic, variants)
    if cfg.sglang_batch > 0:
        one = SGLANG_SHAPE[0] * SGLANG_SHAPE[1] * 4
        buf, off = hash_inputs(cfg.sglang_batch, gen, device, tensor_bytes=one)
        cases.append(Case("hash_rate", hash_traffic(off), {"": lambda b=buf, o=off: encoding_hash(b, o)}))
        points["hash_rate"] = Point(f"{cfg.sglang_batch} x [3312,1176] fp32", cfg.sglang_batch, hash_traffic(off),
                                    {"": (KernelOp.HASH_RATE, "")})
    return cases, points


def timing_rows(cfg: KernelsConfig, device: torch.device, gen: torch.Generator) -> list[KernelTrial]:
    cases, points = timing_cases(cfg, device, gen)
    if not cases:
        return []
    memcpy = Memcpy(max(c.traffic.memcpy_bytes for c in cases), device)
    times = interleaved_passes(cases, memcpy, cfg.passes, threads=1 if device.type == "cpu" else None)
    impl = "triton" if device.type == "cuda" else "reference"
    bw = spec_bandwidth(device)
    return [_row(cfg.seed, t, points[t.case], impl, device, bw) for t in times]


def _row(seed: int, t: PassTime, p: Point, impl: str, device: torch.device, bw: float | None) -> KernelTrial:
    op, outputs = p.variants[t.variant]
    return KernelTrial(seed=seed, pass_index=t.pass_index, op=op.value, impl=impl, device=device.type, size=p.size,
                       items=p.items, bytes_read=p.traffic.read, bytes_written=p.traffic.written,
                       op_cpu_s=t.op.cpu, op_wall_s=t.op.wall, memcpy_cpu_s=t.memcpy.cpu,
                       memcpy_wall_s=t.memcpy.wall, outputs=outputs, spec_bandwidth=bw)


def check_rows(device: torch.device, seed: int) -> list[KernelCheckTrial]:
    """The deterministic checks; a Triton check that cannot run here is logged as not run, with the reason."""
    from triton_kernels import checks

    why = backend.triton_unavailable(device)
    runs = {Check.HASH_KERNEL: (lambda: checks.hash_kernel_vs_reference(device, seed), why),
            Check.PACK_KERNEL: (lambda: checks.pack_kernel_vs_spec(device, seed), why),
            Check.PACK_PATH: (lambda: checks.pack_path_vs_spec(device, seed), ""),
            Check.HASH_PAD: (lambda: checks.hash_pad_collisions(seed), "")}
    rows = []
    for check, (fn, skip) in runs.items():
        if skip:
            rows.append(KernelCheckTrial(seed, check.value, device.type, False, 0, 0, skip))
            continue
        r = fn()
        rows.append(KernelCheckTrial(seed, check.value, device.type, True, r.cases, r.mismatches, r.detail))
    return rows


def plan_rows(cfg: KernelsConfig, gen: torch.Generator) -> list[PlanTrial]:
    from triton_kernels.batched_pack import plan_microbatches

    if cfg.plan_sequences <= 0:
        return []
    lengths = torch.distributions.LogNormal(6.5, 0.9).sample((cfg.plan_sequences,)).clamp(1, 16384).long()
    rows = []
    for method in ("ffd", "kk"):
        p = plan_microbatches(lengths.tolist(), num_ranks=8, max_tokens_per_microbatch=16384, method=method)
        rows.append(PlanTrial(cfg.seed, method, cfg.plan_sequences, 8, p.num_microbatches, p.rank_imbalance,
                              p.microbatch_imbalance))
    return rows


def trials(cfg: KernelsConfig) -> tuple[list[Trial], str]:
    """Every row of a run, and the line saying how Triton ran. Decides TRITON_INTERPRET before any kernel import."""
    device = resolve_device(cfg.device)
    mode = backend.configure_triton(gpu=device.type == "cuda")
    torch.manual_seed(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed)
    rows: list[Trial] = list(timing_rows(cfg, device, gen))
    if cfg.check_kernels:
        rows += check_rows(device, cfg.seed)
    return rows + plan_rows(cfg, gen), mode


GATE_CONFIG = KernelsConfig(device="cpu", images=[16], pack_tokens=[1048576], sglang_batch=0, passes=9, profile=False,
                            plan_sequences=0)
"""The gate's timing points: the CPU claims at 16 images (38 MB) and 1M tokens (45 MB: smaller packs are mostly
fixed per-call cost, and a 6 MB memcpy runs from cache), 9 passes."""


def gate_trials() -> list[Trial]:
    """CI size (seconds on 2 busy cores): the deterministic checks on this machine's device and the CPU timing
    claims at ``GATE_CONFIG``'s sizes. Raises GateSkipped if the Triton kernels cannot run here (the kernel-equality
    claims would otherwise pass unchecked)."""
    from repro.gates import GateSkipped

    device = resolve_device("auto")
    try:
        backend.configure_triton(gpu=device.type == "cuda")
    except RuntimeError as e:
        raise GateSkipped(str(e)) from e
    why = backend.triton_unavailable(device)
    if why:
        raise GateSkipped(f"the kernel-equality claims need the Triton kernels: {why}")
    rows = timing_rows(GATE_CONFIG, torch.device("cpu"), torch.Generator().manual_seed(GATE_CONFIG.seed))
    return [*rows, *check_rows(device, GATE_CONFIG.seed)]


def summary_rows(rows: list[Trial]) -> list[dict]:
    """One row per timed point: GB/s and fraction of memcpy, medians over passes with [min, max]."""
    groups: dict[tuple, list[KernelTrial]] = {}
    for r in rows:
        if isinstance(r, KernelTrial):
            groups.setdefault((r.op, r.size, r.outputs), []).append(r)
    out = []
    for (op, size, outputs), rs in groups.items():
        clock = "cpu" if rs[0].device == "cpu" else "wall"
        frac = [r.fraction_of_memcpy(clock) for r in rs]
        out.append({"op": op, "impl": rs[0].impl, "device": rs[0].device, "size": size, "outputs": outputs,
                    "MB_moved": rs[0].nbytes / 1e6, "clock": clock,
                    "GB/s": float(np.median([r.gbps(clock) for r in rs])),
                    "memcpy_GB/s": float(np.median([r.nbytes / r.memcpy_s(clock) / 1e9 for r in rs])),
                    "frac_memcpy": float(np.median(frac)), "frac_min": min(frac), "frac_max": max(frac),
                    "frac_memcpy_wall": float(np.median([r.fraction_of_memcpy("wall") for r in rs])),
                    "passes": len(rs)})
    for r in rows:
        if isinstance(r, KernelCheckTrial):
            out.append({"op": r.check, "device": r.device, "size": r.detail,
                        "mismatches": r.mismatches if r.ran else None, "cases": r.cases})
        elif isinstance(r, PlanTrial):
            out.append({"op": "plan", "impl": r.method, "size": f"{r.sequences} seqs, {r.num_ranks} ranks",
                        "microbatches": r.microbatches, "rank_imbalance": r.rank_imbalance,
                        "microbatch_imbalance": r.microbatch_imbalance})
    return out


def run(cfg: KernelsConfig) -> Results:
    load0 = os.getloadavg()
    rows, mode = trials(cfg)
    results = Results(table="kernels", out_dir=cfg.out_dir)
    results.set_trials(rows)
    results.rows = summary_rows(rows)
    plot(results)
    results.text = notes(rows, mode, load0, os.getloadavg())
    return results


def plot(results: Results) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timed = [r for r in results.rows if "GB/s" in r and r["op"] in ("hash", "pack")]
    if not timed:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for op, outputs in (("hash", ""), ("pack", "fresh"), ("pack", "reused")):
        rs = [r for r in timed if r["op"] == op and r["outputs"] == outputs]
        if rs:
            ax.plot([r["MB_moved"] for r in rs], [r["GB/s"] for r in rs], "o-",
                    label=f"{op} ({rs[0]['impl']}{', ' + outputs + ' outputs' if outputs else ''})")
            ax.plot([r["MB_moved"] for r in rs], [r["memcpy_GB/s"] for r in rs], "k:", alpha=0.4)
    ax.set(xscale="log", xlabel="MB moved per call (read + written)", ylabel=f"GB/s ({timed[0]['clock']} time)",
           title="kernels vs memcpy of the same bytes (dotted)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(results.plot_path("kernels_gbps.png"), dpi=120)
    plt.close(fig)


def notes(rows: list[Trial], mode: str, load0: tuple, load1: tuple) -> str:
    timed = [r for r in rows if isinstance(r, KernelTrial)]
    dev = timed[0].device if timed else "cpu"
    lines = [
        f"Device: {dev}" + (f" ({torch.cuda.get_device_name()})" if dev == "cuda" else
                            f", {os.cpu_count()} CPUs; timed on one torch thread"),
        mode + ". Without a GPU the Triton kernels are only checked (interpreter), never timed.",
        "Bytes: each input byte read once, each output byte written once (triton_kernels.traffic; pack_traffic "
        "and hash_traffic beside the kernels). GB/s = (read + written) / s; a memcpy of the same total copies half.",
        "Fraction of memcpy = memcpy time / op time, the memcpy moving the same bytes right before the op; median "
        "over interleaved passes with [min, max]. CPU: process CPU time (robust to other tenants' load); the "
        "wall-clock fraction is logged too (frac_memcpy_wall).",
        f"Load average (1/5/15 min) at start {load0[0]:.1f}/{load0[1]:.1f}/{load0[2]:.1f}, at end "
        f"{load1[0]:.1f}/{load1[1]:.1f}/{load1[2]:.1f}.",
        "Pack outputs: reused = PackBuffers (a training loop's steady state, the claim); fresh = allocated per call "
        "(on CPU the first write to every new page faults). Profiles: hash_block_sums = its int8 GEMM alone; "
        "pack_copies = its concatenations alone (pieces prebuilt)."]
    return "\n\n".join(lines)


@hydra.main(config_path="conf", config_name="kernels", version_base=None)
def main(cfg: KernelsConfig) -> None:
    obj: KernelsConfig = OmegaConf.to_object(cfg)
    publish(run(obj), obj.logger, "kernels", config=cfg, seed=obj.seed)


if __name__ == "__main__":
    main()
