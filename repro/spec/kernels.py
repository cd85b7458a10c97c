"""The kernels table's contract (issues 3, 12, 15): trial rows and claims of ``python -m repro.kernels``.

Rows
----
- ``KernelTrial``: one timed call of an op (hash, pack, hash_rate, or a profile of one) in one pass, beside a memcpy
  that moves the same bytes (``triton_kernels.traffic``: each input byte read once, each output byte written once),
  timed right before it in the same pass, on two clocks: the process's CPU time and wall time.
  ``fraction_of_memcpy(clock) = memcpy seconds / op seconds`` (= op GB/s / memcpy GB/s on the same bytes; in
  (0, inf), 1 = as fast as a copy).
  CPU claims decide on CPU time (every contender on one thread: on a shared machine wall time measures the other
  tenants' load, which preempts a long call far more than a short memcpy); GPU claims on synchronized wall time.
- ``KernelCheckTrial``: a deterministic check (kernel == reference bit for bit, collisions) with its mismatch count,
  or ``ran=False`` and why it could not run here.
- ``PlanTrial``: the micro-batch planner's imbalance, one row per method.

Timing claims are decided on the median over passes of the per-pass fraction, at the largest size of the run,
reported with [min, max]; never the best pass. GPU claims read only rows a GPU produced: on a CPU-only run they are
NOT MEASURED, never "holds".
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Callable, Sequence

from repro.spec.core import Bound, Claim, ClaimKind, Measured, Trial, median_range, not_measured, trial

TABLE = "kernels"
GATES = {"kernels": "repro.kernels"}

SGLANG_RATE = 1000 / 0.6
"""Hashes/s of a [3312, 1176] fp32 tensor: SGLang's published "1000 hashes in about 0.6 s" (on a GPU)."""


class KernelOp(str, Enum):
    HASH = "hash"  # encoding_hash over n 448x448x3 fp32 images
    PACK = "pack"  # batched_pack of 4 RL fields + position_ids + cu_seqlens
    HASH_RATE = "hash_rate"  # encoding_hash over n SGLang-sized tensors, for hashes/s
    HASH_BLOCK_SUMS = "hash_block_sums"  # profile: the hash's step 1 alone (the int8 GEMM), same bytes
    PACK_COPIES = "pack_copies"  # profile: the pack's concatenations alone (pieces prebuilt), same bytes


class Check(str, Enum):
    HASH_KERNEL = "hash_kernel_equals_reference"
    PACK_KERNEL = "pack_kernel_equals_reference"
    PACK_PATH = "pack_path_equals_specification"
    HASH_PAD = "hash_zero_pad_collisions"


@trial(TABLE)
@dataclass(frozen=True)
class KernelTrial(Trial):
    pass_index: int
    op: str
    """A ``KernelOp`` value."""
    impl: str
    """"reference" (the torch path, what CPU runs) or "triton"."""
    device: str
    """"cpu" or "cuda"."""
    size: str
    """Human label of the input (e.g. "64 x 448x448x3 fp32")."""
    items: int
    """Images, tokens or tensors in one call."""
    bytes_read: int
    bytes_written: int
    op_cpu_s: float
    """CPU seconds of this process (user + system, all threads) during the call."""
    op_wall_s: float
    """Wall seconds of this call (GPU synchronized)."""
    memcpy_cpu_s: float
    """The same for a memcpy moving bytes_read + bytes_written, timed right before this call (on CPU the faster, by
    CPU time, of torch's and numpy's copy there)."""
    memcpy_wall_s: float
    outputs: str = ""
    """Pack only: "reused" (``PackBuffers``: a training loop's steady state) or "fresh" (allocated per call)."""
    spec_bandwidth: float | None = None
    """The GPU's spec memory bandwidth in bytes/s, None when unknown or on CPU."""

    @property
    def nbytes(self) -> int:
        return self.bytes_read + self.bytes_written

    def op_s(self, clock: str) -> float:
        return self.op_cpu_s if clock == "cpu" else self.op_wall_s

    def memcpy_s(self, clock: str) -> float:
        return self.memcpy_cpu_s if clock == "cpu" else self.memcpy_wall_s

    def gbps(self, clock: str) -> float:
        return self.nbytes / self.op_s(clock) / 1e9

    def fraction_of_memcpy(self, clock: str) -> float:
        return self.memcpy_s(clock) / self.op_s(clock)


@trial(TABLE)
@dataclass(frozen=True)
class KernelCheckTrial(Trial):
    check: str
    """A ``Check`` value."""
    device: str
    ran: bool
    """False: the check could not run here (``detail`` says why); its claim is then NOT MEASURED."""
    cases: int
    mismatches: int
    """Cases whose outputs differ bit for bit (or keys that collide, for the pad check)."""
    detail: str = ""


@trial(TABLE)
@dataclass(frozen=True)
class PlanTrial(Trial):
    method: str
    sequences: int
    num_ranks: int
    microbatches: int
    rank_imbalance: float
    microbatch_imbalance: float


# -- measures ----------------------------------------------------------------------------------------------------


def _largest(rows: Sequence[Trial], op: KernelOp, device: str, outputs: str = "") -> list[KernelTrial]:
    """Rows of ``op`` on ``device`` at the largest byte count of the run (one per pass)."""
    mine = [r for r in rows if isinstance(r, KernelTrial) and r.op == op.value and r.device == device
            and r.outputs == outputs]
    top = max((r.nbytes for r in mine), default=None)
    return [r for r in mine if r.nbytes == top]


def _gb(x: float) -> str:
    return f"{x / 1e9:.2f} GB/s"


def _median(xs: Sequence[float]) -> float:
    return float(median_range(xs).value or 0.0)


def _profile_note(rows: Sequence[Trial], op: KernelOp, profile: KernelOp, outputs: str, clock: str) -> str:
    """What the same passes' profile of ``op`` says: the profiled part's own fraction and its share of the time."""
    prof = _largest(rows, profile, "cpu")
    whole = {r.pass_index: r for r in _largest(rows, op, "cpu", outputs)}
    if not prof or not whole:
        return ""
    part = {KernelOp.HASH_BLOCK_SUMS: "its block sums alone (the exact GEMM: torch._int_mm on an int8 dot-product "
                                      "CPU, chunked fp32 otherwise)",
            KernelOp.PACK_COPIES: "its copies alone (the concatenations, pieces prebuilt)"}[profile]
    share = _median([p.op_s(clock) / whole[p.pass_index].op_s(clock) for p in prof if p.pass_index in whole])
    return (f"profile, same passes: {part} run at {_median([p.fraction_of_memcpy(clock) for p in prof]):.2f} of "
            f"memcpy and take {share:.0%} of the {op.value} time")


def fraction_of_memcpy(op: KernelOp, outputs: str = "", clock: str = "cpu", profile: KernelOp | None = None,
                       why: str = "", target: float = 0.0) -> Callable[[Sequence[Trial]], Measured]:
    """Median over passes of memcpy seconds / op seconds on ``clock``, CPU torch path, largest size. ``profile``:
    the same passes' profile rows, summarized in the note; ``why`` (the reason a gap remains) joins it when the
    median is below ``target``."""

    def measure(rows: Sequence[Trial]) -> Measured:
        sel = _largest(rows, op, "cpu", outputs)
        if not sel:
            return not_measured(f"no CPU {op.value} rows in this run")
        note = (f"{sel[0].impl} path, {sel[0].size}, {sel[0].nbytes / 1e6:.1f} MB moved per call: "
                f"{_gb(_median([r.gbps(clock) * 1e9 for r in sel]))} vs memcpy "
                f"{_gb(_median([r.nbytes / r.memcpy_s(clock) for r in sel]))} on the same bytes ({clock} time, medians "
                f"of {len(sel)} interleaved passes)")
        m = median_range([r.fraction_of_memcpy(clock) for r in sel])
        prof = _profile_note(rows, op, profile, outputs, clock) if profile else ""
        if prof:
            note += f"; {prof}" + (f"; short of {target:g}: {why}" if why and (m.value or 0.0) < target else "")
        return median_range([r.fraction_of_memcpy(clock) for r in sel], note)

    return measure


def fraction_of_spec(op: KernelOp, outputs: str = "") -> Callable[[Sequence[Trial]], Measured]:
    """GPU rows only: median over passes of (bytes / s) / spec bandwidth."""

    def measure(rows: Sequence[Trial]) -> Measured:
        sel = [r for r in _largest(rows, op, "cuda", outputs) if r.impl == "triton"]
        if not sel:
            return not_measured("no GPU ran the Triton kernel in this run (scripts/gpu_check.sh does)")
        if sel[0].spec_bandwidth is None:
            return not_measured(f"unknown spec bandwidth of this GPU; measured {_gb(sel[0].gbps('wall') * 1e9)}")
        return median_range([r.gbps("wall") * 1e9 / r.spec_bandwidth for r in sel],
                            f"Triton, {sel[0].size}; spec {_gb(sel[0].spec_bandwidth)}; device memcpy fraction "
                            f"{_median([r.fraction_of_memcpy('wall') for r in sel]):.2f}")

    return measure


def hash_rate(device: str) -> Callable[[Sequence[Trial]], Measured]:
    """Hashes/s of SGLang's tensor over SGLang's published rate, median over passes."""

    def measure(rows: Sequence[Trial]) -> Measured:
        sel = _largest(rows, KernelOp.HASH_RATE, device)
        if not sel:
            return not_measured(f"no {device} hash-rate rows in this run"
                                + (" (no GPU; scripts/gpu_check.sh runs it)" if device == "cuda" else ""))
        rates = [r.items / r.op_s("wall" if device == "cuda" else "cpu") for r in sel]
        return median_range([x / SGLANG_RATE for x in rates],
                            f"{sel[0].impl} on {device}, {sel[0].size}: {median_range(rates).value:.0f} hashes/s "
                            f"vs SGLang's {SGLANG_RATE:.0f}/s (GPU)")

    return measure


def mismatches(check: Check) -> Callable[[Sequence[Trial]], Measured]:
    """Sum of mismatches over the check's rows; NOT MEASURED if any row could not run."""

    def measure(rows: Sequence[Trial]) -> Measured:
        sel = [r for r in rows if isinstance(r, KernelCheckTrial) and r.check == check.value]
        if not sel:
            return not_measured(f"{check.value} was not run")
        skipped = [r for r in sel if not r.ran]
        if skipped:
            return not_measured(f"could not run: {skipped[0].detail}")
        cases = sum(r.cases for r in sel)
        bad = sum(r.mismatches for r in sel)
        devices = ", ".join(sorted({r.device for r in sel}))
        return Measured(float(bad), n=cases, note=f"{bad} of {cases} cases on {devices}"
                        + "".join(f"; {r.detail}" for r in sel if r.detail))

    return measure


def plan_imbalance(rows: Sequence[Trial]) -> Measured:
    sel = {r.method: r for r in rows if isinstance(r, PlanTrial)}
    if "kk" not in sel:
        return not_measured("no planner rows")
    other = f"; ffd: {sel['ffd'].rank_imbalance:.4f}" if "ffd" in sel else ""
    kk = sel["kk"]
    return Measured(kk.rank_imbalance, n=1, note=f"{kk.sequences} sequences on {kk.num_ranks} ranks, "
                    f"{kk.microbatches} micro-batches{other}")


# -- claims --------------------------------------------------------------------------------------------------------

_FRACTION = ("memcpy seconds / op seconds, the memcpy timed right before the op in the same pass and moving the op's "
             "bytes (read + written, each counted once: triton_kernels.traffic); range (0, inf), 1 = memcpy speed; "
             "process CPU time, one thread; decided on the median over interleaved passes at the run's largest size "
             "(default: ")
_CPU = "CPU torch path vs a memcpy of the same bytes on the same machine, interleaved in one process, one thread"
HASH_WHY = ("the block-sum GEMM (16 multiply-adds per input byte) bounds the hash on this CPU: the claim can "
            "reach at most the GEMM's own fraction")
PACK_WHY = ("the pack copies each output piece by piece (one piece per sequence or pad run, sources "
            "scattered by the plan: ~640 per output at 1M tokens), and piecewise the same bytes move at well under a "
            "memcpy's speed; validating, "
            "planning the pieces and building the views take the rest")

def _int8_dot_cpu() -> str:
    """The hash gate's 0.05 was set on a CPU with an int8 dot product (VNNI), where the int8 GEMM runs at memory
    speed; without one every exact GEMM is compute-bound (on an AVX2-only EPYC the fastest, chunked fp32, reached
    ~0.01 of memcpy), so the gate would fail on the hardware, not on a regression."""
    from triton_kernels.encoding_hash.reference import cpu_has_int8_dot

    return "" if cpu_has_int8_dot() else ("this CPU has no int8 dot product (AVX512-VNNI/AVX-VNNI/AMX): the hash's "
                                          "int8 GEMM is compute-bound here, the gate's bound was set where it is not")


CLAIMS: tuple[Claim, ...] = (
    Claim("hash_reference_fraction_of_memcpy", TABLE, ClaimKind.TARGET, ">= 0.25 (ours, issue 15)", "fraction",
          _FRACTION + "64 images of 448x448x3 fp32, 154 MB). Gate: >= 0.05 at 16 images, a 5x margin for a "
          "shared 2-core CI machine; without the int8 GEMM (the float64 fallback) the hash runs far below it",
          fraction_of_memcpy(KernelOp.HASH, profile=KernelOp.HASH_BLOCK_SUMS, why=HASH_WHY, target=0.25),
          bound=Bound(">=", 0.25), gate=Bound(">=", 0.05), comparison=_CPU, gate_needs=_int8_dot_cpu),
    Claim("pack_fraction_of_memcpy", TABLE, ClaimKind.TARGET, ">= 0.5 (ours, issue 15)", "fraction",
          _FRACTION + "1M tokens, 4 fields + position_ids + cu_seqlens, ~45 MB) into reused outputs "
          "(PackBuffers: a training loop's steady state). Gate: >= 0.1 at 1M tokens, a 3x margin for a shared "
          "2-core CI machine; the per-token scatter (the specification) runs far below it",
          fraction_of_memcpy(KernelOp.PACK, "reused", profile=KernelOp.PACK_COPIES, why=PACK_WHY, target=0.5),
          bound=Bound(">=", 0.5), gate=Bound(">=", 0.1), comparison=_CPU),
    Claim("pack_fresh_fraction_of_memcpy", TABLE, ClaimKind.MEASUREMENT, "(ours)", "fraction",
          _FRACTION + "1M tokens) into fresh outputs allocated per call: on CPU the first write to each new page "
          "faults (system time, counted), which a memcpy between touched buffers never pays",
          fraction_of_memcpy(KernelOp.PACK, "fresh"), comparison=_CPU),
    Claim("hash_reference_fraction_of_memcpy_wall", TABLE, ClaimKind.MEASUREMENT, "(context)", "fraction",
          "the hash claim's fraction on wall-clock time (same rows): on a shared machine it also measures the other "
          "tenants' load", fraction_of_memcpy(KernelOp.HASH, clock="wall"), comparison=_CPU),
    Claim("pack_fraction_of_memcpy_wall", TABLE, ClaimKind.MEASUREMENT, "(context)", "fraction",
          "the pack claim's fraction on wall-clock time (same rows, reused outputs): on a shared machine it also "
          "measures the other tenants' load", fraction_of_memcpy(KernelOp.PACK, "reused", clock="wall"),
          comparison=_CPU),
    Claim("hash_kernel_fraction_of_hbm", TABLE, ClaimKind.TARGET, ">= 0.7 (ours, issue 3)", "fraction",
          "Triton hash bytes/s over the GPU's spec memory bandwidth, median over passes; GPU rows only",
          fraction_of_spec(KernelOp.HASH), bound=Bound(">=", 0.7)),
    Claim("pack_kernel_fraction_of_hbm", TABLE, ClaimKind.TARGET, ">= 0.7 (ours, issue 3)", "fraction",
          "Triton pack bytes/s (reused outputs) over the GPU's spec memory bandwidth, median over passes; GPU rows "
          "only", fraction_of_spec(KernelOp.PACK, "reused"), bound=Bound(">=", 0.7)),
    Claim("hash_rate_vs_sglang", TABLE, ClaimKind.TARGET, ">= 50x (ours, issue 3)", "x",
          "hashes/s of [3312, 1176] fp32 tensors (many per call) on a GPU over SGLang's published 1667/s; GPU rows "
          "only", hash_rate("cuda"), bound=Bound(">=", 50.0),
          comparison="SGLang's figure is published, not measured here; same tensor shape"),
    Claim("hash_rate_cpu_vs_sglang", TABLE, ClaimKind.MEASUREMENT, "(context)", "x",
          "the CPU torch reference's hashes per CPU-second (one thread) over SGLang's GPU figure: context only "
          "(different hardware)",
          hash_rate("cpu")),
    Claim(Check.HASH_KERNEL.value, TABLE, ClaimKind.TARGET, "== 0 (ours)", "mismatching keys",
          "Triton encoding_hash vs the torch reference on awkward segment sizes (0, 1, non-multiples of the 4 KiB "
          "block, several blocks), bit for bit; on CPU under Triton's interpreter; NOT MEASURED where Triton "
          "cannot run", mismatches(Check.HASH_KERNEL), bound=Bound("==", 0.0), gate=Bound("==", 0.0)),
    Claim(Check.PACK_KERNEL.value, TABLE, ClaimKind.TARGET, "== 0 (ours)", "mismatching outputs",
          "Triton batched_pack vs the per-token scatter specification: every field (int64, fp32, bool), "
          "position_ids and cu_seqlens, bit for bit, on a plan with empty and one-token sequences; interpreter on "
          "CPU; NOT MEASURED where Triton cannot run", mismatches(Check.PACK_KERNEL), bound=Bound("==", 0.0),
          gate=Bound("==", 0.0)),
    Claim(Check.PACK_PATH.value, TABLE, ClaimKind.TARGET, "== 0 (ours)", "mismatching outputs",
          "the torch slice path (fresh and reused outputs) vs the per-token scatter specification, same inputs "
          "and outputs as the kernel check: position ids reset at every sequence start, pads everywhere else",
          mismatches(Check.PACK_PATH), bound=Bound("==", 0.0), gate=Bound("==", 0.0)),
    Claim(Check.HASH_PAD.value, TABLE, ClaimKind.TARGET, "== 0 (ours)", "colliding keys",
          "length sensitivity: segments (1 B to past one block) and their copies padded with 1-4 zero bytes, "
          "and an empty segment, hashed by the dispatch path (CPU: the reference); keys that collide",
          mismatches(Check.HASH_PAD), bound=Bound("==", 0.0), gate=Bound("==", 0.0)),
    Claim("plan_kk_rank_imbalance", TABLE, ClaimKind.MEASUREMENT, "(context)", "max/mean - 1",
          "token imbalance over ranks of the Karmarkar-Karp plan (0 = perfect) on lognormal lengths; the note "
          "gives first-fit-decreasing's", plan_imbalance),
)
