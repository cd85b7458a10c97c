"""The paper's setting, projected with the validated cluster model: MODELLED numbers, never measurements.

Inputs, each either measured or an assumption stated here and in docs/cluster.md:

- **CPU phases (measured)**: each phase of a recorded trace (``PhaseCosts.from_trace``) splits into a fixed part
  and a bytes-proportional part; the bytes-proportional part runs at this machine's measured memcpy rate and the
  fixed part is what remains of the measured duration at the recorded size (median over instances). At paper
  scale a phase then costs ``fixed + bytes / memcpy``: the driver's build and serialization, a unit's source work,
  a rank's unpickle and packing all grow with the bytes they copy, per-call overheads (claims, hand-overs) do not.
- **Network (modelled, swept)**: every node its own machine with a NIC of ``bandwidth_Bps`` per direction, no host
  cap, flows fair-shared (``cluster_model.fair_rates``), the per-flow latency of the validated fit.
- **Workload (assumption)**: ``PaperSetting``: P prompts x n samples with k images each of ``patches_per_image``
  patches x 1176 fp32 (448 x 448: 1024 patches, 4.8 MB), ``tokens_per_sample`` tokens, ``field_bytes_per_sample``
  of token fields; one rollout node per trainer rank (U = R); each distinct image moved once per rank share
  (groups whole per share; dedup across units, issue 14 item 2).
- **Training (measured balance, assumed scale)**: the vision-per-patch / LM-per-token cost ratio is measured on
  the 7B-balance model (``StepBalance.from_steps``); the LM's absolute cost per token is an assumed GPU
  (``GpuAssumption``: 6 x params FLOPs per token at ``mfu`` of ``peak_flops``).

Per batch: the baseline (verl's driver) exposes its scatter (gather and build are built ahead while the previous
batch trains, in its favour) and trains every image occurrence; KnitTrans's ranks read each share while the
previous step computes (batch b+1 completes when b's last step starts), exposing ``max(0, share read - step)``
per mini-batch, and encode each distinct image once. Where the trace measured verl's own phases (graph
"verl_wg"), ``verl_wg_pass`` projects it too: its gather and build ahead, its three dispatches exposed.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Mapping

from knittrans.dataplane.trace import CpuEvent, FlowEvent
from knittrans.sim.cluster_model import LinkModel, Task, fair_rates, simulate

PIXEL_ROW_BYTES = 1176 * 4
"""One patch of Qwen2-VL pixel_values: 3 x 2 x 14 x 14 = 1176 fp32."""


@dataclass(frozen=True)
class PhaseCosts:
    """Measured CPU phases: ``fixed_s[graph/label]`` + bytes / ``copy_Bps``."""

    fixed_s: Mapping[str, float]
    copy_Bps: float

    def cpu(self, phase: str, nbytes: float = 0.0) -> float:
        if phase not in self.fixed_s:
            raise KeyError(f"no measured CPU phase {phase!r} (have {sorted(self.fixed_s)})")
        return self.fixed_s[phase] + nbytes / self.copy_Bps

    @classmethod
    def from_trace(cls, passes, copy_Bps: float) -> "PhaseCosts":  # noqa: ANN001 - RecordedPass list
        """Median fixed part per phase over every recorded instance (bytes: what the phase handles)."""
        samples: dict[str, list[float]] = {}

        def add(name: str, seconds: float, nbytes: float) -> None:
            samples.setdefault(name, []).append(max(0.0, seconds - nbytes / copy_Bps))

        for p in passes:
            cpu = [e for e in p.events if isinstance(e, CpuEvent)]
            flows = [e for e in p.events if isinstance(e, FlowEvent)]
            if p.graph == "central":
                scat = {f.key: f.nbytes for f in flows if f.label == "scatter"}
                gathered = sum(f.nbytes for f in flows if f.label == "gather")
                for e in cpu:
                    nb = {"deser": gathered, "build": sum(scat.values()), "ser": scat.get(e.key, 0)}.get(e.label, 0)
                    add(f"central/{e.label}", e.t_end - e.t_start, nb)
            elif p.graph == "verl_wg":  # verl's own code: per dispatch every rank's chunk converted and put at once
                scat = {f.key: f.nbytes for f in flows if f.label == "scatter"}
                gathered = sum(f.nbytes for f in flows if f.label == "gather")
                fields = gathered - p.pixel_bytes // 3  # pixel_bytes: every occurrence, once per dispatch (3)
                per_dispatch: dict[str, int] = {}
                for k, nb in scat.items():
                    per_dispatch[k.split("/")[0]] = per_dispatch.get(k.split("/")[0], 0) + nb
                for e in cpu:  # build and convert copy the dense token fields; the per-row dicts are re-indexed
                    nb = {"deser": gathered, "build": fields, "convert": fields,
                          "ser": per_dispatch.get(e.key, 0), "tail": scat.get(e.key, 0)}.get(e.label, 0)
                    add(f"verl_wg/{e.label}", e.t_end - e.t_start, nb)
            elif p.graph == "knittrans":
                read = {}
                for f in flows:
                    read[f.key] = read.get(f.key, 0) + f.nbytes
                first = {}
                for e in cpu:
                    if e.label == "claim":
                        r = e.key.split("/")[0]
                        first[r] = min(first.get(r, e.t_start), e.t_start)
                packs = {e.key: e for e in cpu if e.label == "pack"}
                for e in cpu:
                    if e.label == "claim" and e.t_start == first[e.key.split("/")[0]]:
                        continue  # the first claim waited for the admission at t0: not a per-share cost
                    nb = read.get(e.key, 0) if e.label in ("source", "deser", "pack") else 0
                    add(f"knittrans/{e.label}", e.t_end - e.t_start, nb)
                    if e.label == "claim":  # the hand-over since the rank's previous share was packed
                        prev = [q for q in packs.values() if q.key.split("/")[0] == e.key.split("/")[0]
                                and q.t_end <= e.t_start]
                        if prev:
                            add("knittrans/gap", e.t_start - max(q.t_end for q in prev), 0)
        return cls({k: statistics.median(v) for k, v in samples.items()}, copy_Bps)


@dataclass(frozen=True)
class StepBalance:
    """Measured training costs on the 7B-balance model: seconds per vision patch and per LM token (this CPU)."""

    vision_s_per_patch: float
    lm_s_per_token: float

    @property
    def ratio(self) -> float:
        """Vision cost per patch / LM cost per token (what carries over to the GPU)."""
        return self.vision_s_per_patch / self.lm_s_per_token

    @classmethod
    def from_steps(cls, baseline_s: float, dedup_s: float, tokens: int, occurrence_patches: int,
                   distinct_patches: int) -> "StepBalance":
        """Solve ``baseline = L*tokens + V*occurrences``, ``dedup = L*tokens + V*distinct`` (one share, both
        measured)."""
        if occurrence_patches <= distinct_patches or tokens <= 0:
            raise ValueError("StepBalance needs more occurrence patches than distinct ones and tokens > 0")
        v = (baseline_s - dedup_s) / (occurrence_patches - distinct_patches)
        lm = (dedup_s - v * distinct_patches) / tokens
        if v <= 0 or lm <= 0:
            raise ValueError(f"measured steps give no positive vision/LM split: baseline {baseline_s:.4g} s, dedup "
                             f"{dedup_s:.4g} s (noise larger than the vision tower's share?)")
        return cls(v, lm)


@dataclass(frozen=True)
class GpuAssumption:
    """The trainer GPU (an assumption): LM seconds per token = 6 x params / (peak x mfu)."""

    params: float = 7.6e9
    """Qwen2-VL-7B's language model."""
    peak_flops: float = 989e12
    """H100 SXM dense bf16."""
    mfu: float = 0.4

    @property
    def lm_s_per_token(self) -> float:
        return 6 * self.params / (self.peak_flops * self.mfu)


@dataclass(frozen=True)
class PaperSetting:
    bandwidth_Bps: float
    num_ranks: int
    group_size: int
    prompts: int = 128
    images_per_prompt: int = 2
    patches_per_image: int = 1024
    tokens_per_sample: int = 1100
    """256 merged image tokens per image x 2 + ~64 prompt text + ~512 response tokens (assumption)."""
    field_bytes_per_sample: int = 1100 * 8 + 512 * 9
    """input_ids (int64) + response-length old_logprobs, advantages (fp32) and loss_mask (bool)."""
    num_minibatches: int = 16
    gpu: GpuAssumption = field(default_factory=GpuAssumption)

    @property
    def image_bytes(self) -> int:
        return self.patches_per_image * PIXEL_ROW_BYTES

    @property
    def num_units(self) -> int:
        return self.num_ranks


@dataclass(frozen=True)
class Projection:
    setting: PaperSetting
    central_raw_s: float
    knittrans_raw_s: float
    central_exposed_s: float
    knittrans_exposed_s: float
    central_train_s: float
    knittrans_train_s: float
    verl_raw_s: float | None = None
    """verl's own code (``verl_wg_graph``, ``verl_wg_pass``), when the trace measured its phases: raw and exposed."""
    verl_exposed_s: float | None = None


def project(s: PaperSetting, costs: PhaseCosts, link: LinkModel, balance: StepBalance) -> Projection:
    """Both systems' raw transfer, exposed transfer and training per batch at ``s`` (see the module docstring)."""
    link = LinkModel(s.bandwidth_Bps, link.latency_s, None, link.object_s)  # separate machines: no host cap
    R, U, M, n, k = s.num_ranks, s.num_units, s.num_minibatches, s.group_size, s.images_per_prompt
    B = s.prompts * n
    fields = B * s.field_bytes_per_sample
    distinct_pixels = s.prompts * k * s.image_bytes
    dense = fields + n * distinct_pixels
    # centralized: gather the fields, unpickle, build, then per rank serialize its chunk and scatter it
    tasks = [Task(f"g{u}", src=f"unit{u}", dst="driver", nbytes=fields // U) for u in range(U)]
    tasks += [Task("deser", tuple(t.name for t in tasks), costs.cpu("central/deser", fields)),
              Task("build", ("deser",), costs.cpu("central/build", dense))]
    prev = "build"
    for r in range(R):
        tasks += [Task(f"ser{r}", (prev,), costs.cpu("central/ser", dense / R)),
                  Task(f"sc{r}", (f"ser{r}",), src="driver", dst=f"rank{r}", nbytes=dense // R),
                  Task(f"tail{r}", (f"sc{r}",), costs.cpu("central/tail"))]
        prev = f"ser{r}"
    done = simulate(tasks, link)
    central_raw = max(e for _, e in done.values())
    central_exposed = central_raw - done["build"][1]  # gather and build run ahead, during the previous batch
    # KnitTrans: ranks in lockstep (symmetric), each share read from every unit at the fair rate of one round
    share = (fields + distinct_pixels) / (M * R)
    flows = [Task(f"u{u}r{r}", src=f"unit{u}", dst=f"rank{r}", nbytes=1) for u in range(U) for r in range(R)]
    rate = min(fair_rates(flows, link))
    read = costs.cpu("knittrans/claim") + costs.cpu("knittrans/source", share) + link.latency_s + link.object_s \
        + share / U / rate + costs.cpu("knittrans/deser", share) + costs.cpu("knittrans/pack", share)
    # The hand-over between a rank's shares: measured only where its fetches ran one after another. The prefetcher
    # runs ``depth`` fetches at once (since 3f775ac), so with M <= depth a rank's claims all start before any pack
    # ends and no hand-over exists to measure: 0, and the shares are modelled back to back, which is what the link
    # allows when it is the bottleneck (concurrent reads of one rank share its ingress).
    gap = costs.fixed_s.get("knittrans/gap", 0.0)
    # The rank takes share k once it is packed and once its turn after share k-1 (its ack) ended (0 in a trace
    # recorded without turns).
    turn = costs.fixed_s.get("knittrans/turn", 0.0)
    knit_raw = read
    for k in range(2, M + 1):
        knit_raw = max(k * read + (k - 1) * gap, knit_raw + turn)
    # training per mini-batch on one rank: LM over its tokens, vision over its (occurrence / distinct) patches
    lm = s.gpu.lm_s_per_token
    vis = lm * balance.ratio
    tokens = B * s.tokens_per_sample / (M * R)
    occ_patches = B * k * s.patches_per_image / (M * R)
    step_c = tokens * lm + occ_patches * vis
    step_k = tokens * lm + occ_patches / n * vis
    knit_exposed = M * max(0.0, read - step_k)
    verl = verl_wg_pass(s, costs, link, fields, n * distinct_pixels) if "verl_wg/build" in costs.fixed_s else None
    return Projection(s, central_raw, knit_raw, central_exposed, knit_exposed, M * step_c, M * step_k,
                      *(verl or (None, None)))


def _gather_build(s: PaperSetting, costs: PhaseCosts, graph: str, fields: float, dense: float) -> list[Task]:
    """A verl driver's start: the ``dense`` batch (every occurrence) pulled from the U rollout nodes to the driver,
    unpickled, built (the build copies the token ``fields``; the per-row pixel dicts are re-indexed)."""
    U = s.num_units
    tasks = [Task(f"g{u}", src=f"unit{u}", dst="driver", nbytes=int(dense // U)) for u in range(U)]
    return tasks + [Task("deser", tuple(t.name for t in tasks), costs.cpu(f"{graph}/deser", dense)),
                    Task("build", ("deser",), costs.cpu(f"{graph}/build", fields))]


def verl_wg_pass(s: PaperSetting, costs: PhaseCosts, link: LinkModel, fields: float,
                 pixels: float) -> tuple[float, float]:
    """verl's own step's raw and exposed transfer per batch (``cluster_model.verl_wg_graph``): every sample's own
    pixel_values (``pixels``: n copies of every image) gathered from the U rollout nodes to the driver, unpickled
    and built, then three dispatches of the whole batch, each a conversion (the dense ``fields``), verl's dispatch
    (every rank's chunk put at once: ``dense`` bytes), R pulls at once and each rank's work on its chunk, the two
    forward ones followed by their results' return and the union. Gather and build run ahead during the previous
    batch (in its favour); the three dispatches are exposed; the forward passes cost no compute (in its favour)."""
    R, dense = s.num_ranks, fields + pixels
    tasks = _gather_build(s, costs, "verl_wg", fields, dense)
    prev = "build"
    for d in range(3):
        tasks += [Task(f"cv{d}", (prev,), costs.cpu("verl_wg/convert", fields)),
                  Task(f"ser{d}", (f"cv{d}",), costs.cpu("verl_wg/ser", dense))]
        tails = []
        for r in range(R):
            k = f"d{d}r{r}"
            tasks += [Task(f"sc{k}", (f"ser{d}",), src="driver", dst=f"rank{r}", nbytes=int(dense // R)),
                      Task(f"tail{k}", (f"sc{k}",), costs.cpu("verl_wg/tail", dense / R))]
            tails.append(f"tail{k}")
        prev = f"ser{d}"
        if d < 2:
            tasks += [Task(f"ret{d}", (prev, *tails), costs.cpu("verl_wg/ret")),
                      Task(f"union{d}", (f"ret{d}",), costs.cpu("verl_wg/union"))]
            prev = f"union{d}"
    done = simulate(tasks, link)
    raw = max(e for _, e in done.values())
    return raw, raw - done["build"][1]
