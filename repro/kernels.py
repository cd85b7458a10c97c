"""Kernels table: encoding_hash and batched_pack throughput beside the memory-bandwidth limit, and hashes/s.

What it measures (issue 3, "Measurements"):
- GB/s of each op = (bytes read + bytes written) / median time, the Triton-tutorial convention, over sizes from
  one 448x448 RGB fp32 image to a whole multimodal batch; as a fraction of a memcpy (``torch`` ``copy_``)
  measured in the same run on the same device and, on a GPU with a known spec, of its spec bandwidth.
- pack throughput two ways, each beside a memcpy of its output bytes timed interleaved with it (medians): into
  fresh outputs (every call allocates; on CPU the first write to each new page faults) and into reused ones
  (``PackBuffers``: a training loop's steady state, which the claim uses; the note gives both).
- hashes/s of a [3312, 1176] fp32 tensor, beside SGLang's published figure (1000 such hashes in ~0.6 s on a GPU).
- the planner's imbalance, first-fit-decreasing vs Karmarkar-Karp, on a long-tailed length distribution.

The path measured is what ``impl="auto"`` runs on the device: the torch references on CPU (the Triton kernels
are only *checked* there, under the interpreter, on small inputs), the Triton kernels on CUDA.

Run: ``python -m repro.kernels`` (``logger=none`` to skip W&B; ``device=cuda`` on a GPU; see conf/kernels.yaml).
"""

from __future__ import annotations

import math
import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

import hydra
import numpy as np
import torch
from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from repro.logger import publish
from repro.results import Claim, Results

IMAGE_BYTES = 448 * 448 * 3 * 4  # one 448x448 RGB image in fp32
SGLANG_SHAPE = (3312, 1176)  # fp32 pixel-value tensor SGLang hashes per image
SGLANG_RATE = 1000 / 0.6  # hashes/s: SGLang's published "1000 hashes in about 0.6 s" (GPU)
SPEC_BANDWIDTH = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.039e12, "L40S": 0.864e12, "A10": 0.6e12}


@dataclass
class KernelsConfig:
    """Configuration of ``python -m repro.kernels``."""

    out_dir: str = "results/kernels"
    """Where summary.json, table.md, config.yaml, meta.json and the plot go."""
    logger: str = "wandb"
    """"wandb" (offline unless WANDB_MODE=online) or "none"."""
    seed: int = 0
    """Seeds the random inputs and the planner's length sample."""
    device: str = "auto"
    """"auto" (cuda when available, else cpu), "cpu" or "cuda"."""
    images: list[int] = field(default_factory=lambda: [1, 4, 16, 64])
    """Batch sizes in 448x448x3 fp32 images (2.4 MB each) for the hash sweep."""
    pack_tokens: list[int] = field(default_factory=lambda: [16384, 131072, 1048576])
    """Total tokens per batch for the pack sweep (fields: int64 ids, fp32 logprobs and advantages, bool mask)."""
    sglang_batch: int = 8
    """How many [3312, 1176] fp32 tensors to hash in one call when measuring hashes/s."""
    repeats: int = 5
    """Timed repetitions per point (median reported), after one warm-up."""
    check_kernels: bool = True
    """Check Triton == reference on small inputs (interpreted on CPU: slow, so small)."""
    plan_sequences: int = 1024
    """Sequences in the planner comparison (lognormal lengths, 8 ranks, 16k-token micro-batches)."""


ConfigStore.instance().store(name="kernels_schema", node=KernelsConfig)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median wall time of ``fn`` after one warm-up call (synchronizing a GPU around each call)."""
    fn()
    _sync(device)
    times = []
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def interleaved_medians(fns: dict[str, Callable[[], object]], device: torch.device, repeats: int) -> dict[str, float]:
    """Median wall time of each ``fn``, timed round-robin after one warm-up each, so that load on a shared
    machine (or a clock change) hits every contender alike and their ratios hold within one run."""
    for fn in fns.values():
        fn()
    _sync(device)
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(max(1, repeats)):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            _sync(device)
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def memcpy_gbps(nbytes: int, device: torch.device, repeats: int) -> float:
    """Measured copy bandwidth, counted like the kernels: (bytes read + bytes written) / s."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    return 2 * nbytes / median_seconds(lambda: dst.copy_(src), device, repeats) / 1e9


def spec_bandwidth(device: torch.device) -> float | None:
    """The spec memory bandwidth (bytes/s) of a known GPU, None otherwise."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((bw for key, bw in SPEC_BANDWIDTH.items() if key in name), None)


def hash_inputs(n_images: int, gen: torch.Generator, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    buf = torch.randint(0, 256, (n_images * IMAGE_BYTES,), dtype=torch.uint8, generator=gen).to(device)
    return buf, (torch.arange(n_images + 1, dtype=torch.int64) * IMAGE_BYTES).to(device)


def pack_inputs(total_tokens: int, gen: torch.Generator, device: torch.device):
    """Ragged fields of ~total_tokens tokens (lengths 64..4096) and a 4-rank plan with 8192-token rows."""
    from triton_kernels.batched_pack import plan_microbatches

    lengths = []
    while sum(lengths) < total_tokens:
        lengths.append(int(torch.randint(64, 4097, (1,), generator=gen)))
    lengths[-1] -= sum(lengths) - total_tokens
    off = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(torch.tensor(lengths), 0)])
    t = int(off[-1])
    fields = {"input_ids": torch.randint(0, 150000, (t,), generator=gen),
              "old_logprobs": torch.randn(t, generator=gen), "advantages": torch.randn(t, generator=gen),
              "loss_mask": torch.rand(t, generator=gen) > 0.2}
    plan = plan_microbatches(lengths, num_ranks=4, max_tokens_per_microbatch=8192, method="kk").pack
    return {k: v.to(device) for k, v in fields.items()}, off.to(device), plan


def pack_bytes(fields: dict[str, torch.Tensor], plan) -> int:
    """Reads T*b per field; writes the padded buffer (fill) and the T*b tokens into it; + int64 position_ids."""
    out_elems = plan.num_rows * plan.row_len
    total = sum(v.numel() * v.element_size() * 2 + out_elems * v.element_size() for v in fields.values())
    return total + out_elems * 8


def pack_out_bytes(fields: dict[str, torch.Tensor], plan) -> int:
    """Bytes of the packed outputs: one num_rows x row_len buffer per field plus int64 position_ids."""
    return plan.num_rows * plan.row_len * (sum(v.element_size() for v in fields.values()) + 8)


@dataclass
class PackTiming:
    """One pack size timed three ways, interleaved (``interleaved_medians``): medians in seconds."""

    fresh_s: float
    """batched_pack allocating its outputs (what every call did before ``out=``)."""
    reused_s: float
    """batched_pack into ``PackBuffers`` that earlier calls touched (a training loop's steady state)."""
    memcpy_s: float
    """A copy of ``memcpy_bytes`` between two touched buffers: the faster of torch's ``copy_`` (intra-op threads)
    and, on CPU, numpy's single-threaded ``copyto`` (on a loaded machine a multi-threaded copy can wait ms at its
    barrier, which would flatter everything measured against it)."""
    memcpy_bytes: int
    """The pack's output bytes (``pack_out_bytes``): the memcpy writes what the pack writes."""

    @property
    def memcpy_gbps(self) -> float:
        return 2 * self.memcpy_bytes / self.memcpy_s / 1e9


def pack_timing(fields: dict[str, torch.Tensor], seq_offsets: torch.Tensor, plan, impl: str, device: torch.device,
                repeats: int) -> PackTiming:
    """Fresh outputs, reused outputs and a memcpy of the output bytes, interleaved in one process."""
    from triton_kernels.batched_pack import PackBuffers, batched_pack

    nbytes = pack_out_bytes(fields, plan)
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.zeros_like(src)
    bufs = PackBuffers()
    fns = {"fresh": lambda: batched_pack(fields, seq_offsets, plan, impl=impl),
           "reused": lambda: batched_pack(fields, seq_offsets, plan, impl=impl, out=bufs),
           "memcpy": lambda: dst.copy_(src)}
    if device.type == "cpu":
        src_np, dst_np = src.numpy(), dst.numpy()
        fns["memcpy_1thread"] = lambda: np.copyto(dst_np, src_np)
    med = interleaved_medians(fns, device, repeats)
    return PackTiming(med["fresh"], med["reused"], min(med["memcpy"], med.get("memcpy_1thread", math.inf)), nbytes)


def check_kernels(gen: torch.Generator, device: torch.device) -> bool:
    """Triton == reference on small awkward inputs (on CPU this runs Triton's interpreter)."""
    from triton_kernels.batched_pack import batched_pack
    from triton_kernels.encoding_hash import encoding_hash

    sizes = [0, 1, 5, 4095, 4097, 70001]
    buf = torch.randint(0, 256, (sum(sizes),), dtype=torch.uint8, generator=gen)
    off = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(torch.tensor(sizes), 0)])
    ok = torch.equal(encoding_hash(buf, off, impl="reference"),
                     encoding_hash(buf.to(device), off.to(device), impl="triton").cpu())
    fields, poff, plan = pack_inputs(6000, gen, torch.device("cpu"))
    ref = batched_pack(fields, poff, plan, impl="reference")
    tri = batched_pack({k: v.to(device) for k, v in fields.items()}, poff.to(device), plan, impl="triton")
    ok &= all(torch.equal(ref.fields[k], tri.fields[k].cpu()) for k in fields)
    return bool(ok and torch.equal(ref.position_ids, tri.position_ids.cpu()))


def plan_rows(cfg: KernelsConfig, gen: torch.Generator) -> list[dict]:
    from triton_kernels.batched_pack import plan_microbatches

    lengths = torch.distributions.LogNormal(6.5, 0.9).sample((cfg.plan_sequences,)).clamp(1, 16384).long()
    rows = []
    for method in ("ffd", "kk"):
        t0 = time.perf_counter()
        p = plan_microbatches(lengths.tolist(), num_ranks=8, max_tokens_per_microbatch=16384, method=method)
        rows.append({"op": "plan", "impl": method, "size": f"{cfg.plan_sequences} seqs", "bytes": None,
                     "seconds": time.perf_counter() - t0, "microbatches": p.num_microbatches,
                     "rank_imbalance": p.rank_imbalance, "microbatch_imbalance": p.microbatch_imbalance})
    return rows


def run(cfg: KernelsConfig) -> Results:
    from tqdm import tqdm

    from triton_kernels.encoding_hash import encoding_hash

    device = torch.device("cuda" if cfg.device == "auto" and torch.cuda.is_available() else
                          (cfg.device if cfg.device != "auto" else "cpu"))
    impl = "triton" if device.type == "cuda" else "reference"
    gen = torch.Generator().manual_seed(cfg.seed)
    results = Results(table="kernels", out_dir=cfg.out_dir)
    spec = spec_bandwidth(device)
    memcpy = memcpy_gbps(max(cfg.images) * IMAGE_BYTES, device, cfg.repeats)
    sweep = [("hash", n) for n in cfg.images] + [("pack", t) for t in cfg.pack_tokens]
    for op, size in tqdm(sweep, desc="kernels", disable=None):
        if op == "hash":
            buf, off = hash_inputs(size, gen, device)
            nbytes = buf.numel() + 16 * size
            sec = median_seconds(lambda: encoding_hash(buf, off, impl=impl), device, cfg.repeats)
            results.rows.append(_gbps_row(op, impl, device, f"{size} x 448x448 img", nbytes, sec, memcpy, spec))
            continue
        fields, off, plan = pack_inputs(size, gen, device)
        nbytes, timing = pack_bytes(fields, plan), pack_timing(fields, off, plan, impl, device, cfg.repeats)
        for outputs, sec in (("fresh", timing.fresh_s), ("reused", timing.reused_s)):
            results.rows.append(_gbps_row(op, impl, device, f"{size} tokens, {outputs}", nbytes, sec,
                                          timing.memcpy_gbps, spec, outputs=outputs)
                                | {"memcpy_time_ratio": timing.memcpy_s / sec})
    # hashes/s of SGLang's tensor, many in one call
    one = SGLANG_SHAPE[0] * SGLANG_SHAPE[1] * 4
    buf = torch.randint(0, 256, (cfg.sglang_batch * one,), dtype=torch.uint8, generator=gen).to(device)
    off = (torch.arange(cfg.sglang_batch + 1, dtype=torch.int64) * one).to(device)
    rate = cfg.sglang_batch / median_seconds(lambda: encoding_hash(buf, off, impl=impl), device, cfg.repeats)
    del buf
    results.rows.append({"op": "hash_rate", "impl": impl, "device": device.type,
                         "size": f"{cfg.sglang_batch} x [3312,1176] fp32", "bytes": cfg.sglang_batch * one,
                         "hashes_per_s": rate, "vs_sglang": rate / SGLANG_RATE})
    results.rows += plan_rows(cfg, gen)
    equal = check_kernels(gen, device) if cfg.check_kernels else None
    add_claims(results, device, memcpy, spec, rate, equal)
    plot(results, memcpy, spec)
    results.text = notes(device, memcpy, spec)
    return results


def _gbps_row(op: str, impl: str, device: torch.device, label: str, nbytes: int, sec: float, memcpy: float,
              spec: float | None, outputs: str | None = None) -> dict:
    gbps = nbytes / sec / 1e9
    row = {"op": op, "impl": impl, "device": device.type, "size": label, "bytes": nbytes, "seconds": sec,
           "gbps": gbps, "memcpy_gbps": memcpy, "frac_memcpy": gbps / memcpy,
           "frac_spec": gbps * 1e9 / spec if spec else None}
    return row | ({"outputs": outputs} if outputs else {})


def _largest(results: Results, op: str, outputs: str | None = None) -> dict:
    return [r for r in results.rows if r["op"] == op and r.get("outputs") == outputs][-1]


def add_claims(results: Results, device: torch.device, memcpy: float, spec: float | None, rate: float,
               equal: bool | None) -> None:
    h, p, pf = _largest(results, "hash"), _largest(results, "pack", "reused"), _largest(results, "pack", "fresh")
    fresh = (f"fresh outputs (allocated per call): {pf['gbps']:.2f} GB/s = {pf['frac_memcpy']:.2f} of memcpy; "
             f"time of a memcpy of the output bytes / pack time: reused {p['memcpy_time_ratio']:.2f}, fresh "
             f"{pf['memcpy_time_ratio']:.2f}")
    c = results.claims
    if device.type == "cpu":
        c.append(Claim("hash_reference_fraction_of_memcpy", 0.25, h["frac_memcpy"], "fraction",
                       h["frac_memcpy"] >= 0.25, f"torch reference, {h['size']}, {h['gbps']:.2f} GB/s vs memcpy "
                       f"{memcpy:.1f} GB/s (read+write); target >= 0.25"))
        c.append(Claim("pack_reference_fraction_of_memcpy", 0.5, p["frac_memcpy"], "fraction",
                       p["frac_memcpy"] >= 0.5, f"torch path, {p['size']} outputs (PackBuffers, a training loop's "
                       f"steady state): {p['gbps']:.2f} GB/s vs memcpy {p['memcpy_gbps']:.1f} GB/s of the same "
                       f"output bytes, interleaved medians; {fresh}; target >= 0.5"))
        for name in ("hash_kernel_fraction_of_hbm", "pack_kernel_fraction_of_hbm"):
            c.append(Claim(name, 0.7, None, "fraction", False, "no GPU in this run"))
    else:
        for op, row in (("hash", h), ("pack", p)):
            frac = row["frac_spec"] if row["frac_spec"] is not None else row["frac_memcpy"]
            c.append(Claim(f"{op}_kernel_fraction_of_hbm", 0.7, frac, "fraction", frac >= 0.7,
                           f"Triton, {row['size']}, {row['gbps']:.0f} GB/s; spec {spec and spec / 1e9:.0f} GB/s, "
                           f"device memcpy {row['memcpy_gbps']:.0f} GB/s (fraction {row['frac_memcpy']:.2f})"
                           + (f"; {fresh}" if op == "pack" else "") + "; target >= 0.7"))
    c.append(Claim("hash_rate_vs_sglang", 50.0, rate / SGLANG_RATE, "x", rate / SGLANG_RATE >= 50,
                   f"{rate:.0f} hashes/s of [3312,1176] fp32 on {device.type} vs SGLang's {SGLANG_RATE:.0f}/s "
                   f"(GPU); the 50x target is for an H200" + ("; CPU reference here" if device.type == "cpu" else "")))
    c.append(Claim("kernel_equals_reference", 1.0, None if equal is None else float(equal), "bool", bool(equal),
                   "Triton vs torch on awkward sizes, bit for bit" + (" (interpreter)" if device.type == "cpu"
                                                                      else "")))


def plot(results: Results, memcpy: float, spec: float | None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for op, outputs in (("hash", None), ("pack", "fresh"), ("pack", "reused")):
        rows = [r for r in results.rows if r["op"] == op and r.get("outputs") == outputs]
        label = f"{op} ({rows[0]['impl']}" + (f", {outputs} outputs)" if outputs else ")")
        ax.plot([r["bytes"] / 1e6 for r in rows], [r["gbps"] for r in rows], "o-", label=label)
    ax.axhline(memcpy, color="k", ls="--", label=f"memcpy {memcpy:.0f} GB/s")
    if spec:
        ax.axhline(spec / 1e9, color="r", ls=":", label=f"spec {spec / 1e9:.0f} GB/s")
    ax.set(xscale="log", xlabel="bytes moved per call (MB)", ylabel="GB/s (read + write)", title="kernels")
    ax.legend()
    fig.tight_layout()
    fig.savefig(results.plot_path("kernels_gbps.png"), dpi=120)
    plt.close(fig)


def notes(device: torch.device, memcpy: float, spec: float | None) -> str:
    lines = [f"Device: {device.type}" + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else
                                         f", {os.cpu_count()} CPUs, {torch.get_num_threads()} torch threads"),
             f"Measured memcpy: {memcpy:.1f} GB/s (read + write)" + (f"; spec {spec / 1e9:.0f} GB/s" if spec else "")
             + "; pack rows use a memcpy of their own output bytes, timed interleaved with them.",
             "Pack outputs: fresh = allocated per call (on CPU every new page faults on first write); reused = "
             "PackBuffers (what a training loop packing every step sees).",
             "GB/s counts bytes read + written, as a memcpy does (2 x its size).",
             "On CPU the Triton kernels are only checked (interpreter), never timed: the interpreter is not a kernel."]
    return "\n\n".join(lines)


@hydra.main(config_path="conf", config_name="kernels", version_base=None)
def main(cfg: KernelsConfig) -> None:
    obj: KernelsConfig = OmegaConf.to_object(cfg)
    publish(run(obj), obj.logger, "kernels", config=cfg, seed=obj.seed)


if __name__ == "__main__":
    main()
