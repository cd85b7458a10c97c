"""Speedup table: transfer plus training time per batch, verl-style baseline against KnitTrans (issue 6).

Per sweep point (n samples per prompt x images per prompt), on the same multimodal batch
(``workloads.multimodal``, P prompts, M mini-batches of whole groups, R ranks):

- **transfer**: ``knittrans.mmdedup.transfer_mm`` -- the baseline's raw transfer (gather, repeat pixel_values
  n times, split, scatter; nothing overlaps it) against KnitTrans's exposed transfer (dedup-aware per-rank
  fetch with prefetch, emulated compute in between);
- **training**: one real GRPO step of the tiny Qwen2-VL (``workloads.vlm``, trainable vision tower) on one rank's
  mini-batch share, timed, times M: the baseline encodes every image occurrence (``policy_logits(dedup=False)``),
  KnitTrans each distinct image once (``dedup=True``), with the same gradients (tests/equivalence).

speedup = (baseline raw transfer + M x baseline step) / (KnitTrans exposed transfer + M x KnitTrans step).
The breakdown reports bytes saved, vision-encoder patches (forward and backward FLOPs are proportional) saved and
time hidden by overlap. Claim ``mm_transfer_train_speedup``: the largest speedup over the sweep (paper: up to 5.8x).

Run: ``python -m repro.speedup`` (``scale=paper`` for 448 x 448 images; ``logger=none`` to skip W&B).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from dataclasses import dataclass, field

import hydra
import torch
from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from repro.logger import publish


@dataclass
class SpeedupConfig:
    """Configuration of ``python -m repro.speedup``."""

    scale: str = "default"
    """"default" (CPU-sized, below) or "paper" (448 x 448 images, 8 prompts; overrides image_side/prompts)."""
    ns: list[int] = field(default_factory=lambda: [4, 8, 16])
    """Group sizes n to sweep."""
    images_per_prompt: list[int] = field(default_factory=lambda: [1, 2])
    """Images per prompt to sweep."""
    prompts: int = 4
    """P: prompts per batch (a multiple of num_minibatches x num_ranks: whole groups per rank share)."""
    num_minibatches: int = 2
    """M: optimizer steps per batch."""
    num_ranks: int = 2
    """Data-parallel trainer ranks."""
    num_units: int = 2
    """KnitTrans storage units (one per rollout node)."""
    image_side: int = 168
    """Nominal image side (pixels); prompts draw from side x side and two 3/4 rectangles."""
    arch: str = "qwen2_vl"
    """Policy architecture: qwen2_vl or qwen2_5_vl."""
    train_repeats: int = 2
    """Timed training steps per system and point (after one warm-up); the median is used."""
    transfer_repeats: int = 1
    """Measured transfer passes per system and point (after one warm-up); medians."""
    out_dir: str = "results/speedup"
    """Where summary.json, table.md, config.yaml, meta.json and the plot go."""
    logger: str = "wandb"
    """"wandb" (offline unless WANDB_MODE=online) or "none"."""
    seed: int = 0
    """Seeds the workload and the model."""


def resolved(cfg: SpeedupConfig) -> SpeedupConfig:
    if cfg.scale == "default":
        return cfg
    if cfg.scale == "paper":
        return dataclasses.replace(cfg, image_side=448, prompts=8)
    raise ValueError(f"scale must be 'default' or 'paper', got {cfg.scale!r}")


@dataclass(frozen=True)
class PointResult:
    """One sweep point: transfer and training times per batch (seconds) and the breakdown."""

    n: int
    k: int
    base_transfer_s: float
    kt_transfer_s: float
    kt_raw_transfer_s: float
    base_train_s: float
    kt_train_s: float
    base_bytes: int
    kt_bytes: int
    base_patches: int
    kt_patches: int

    @property
    def speedup(self) -> float:
        return (self.base_transfer_s + self.base_train_s) / (self.kt_transfer_s + self.kt_train_s)

    def row(self) -> dict:
        return {"n": self.n, "images_per_prompt": self.k,
                "baseline_transfer_s": self.base_transfer_s, "baseline_train_s": self.base_train_s,
                "knittrans_transfer_s": self.kt_transfer_s, "knittrans_train_s": self.kt_train_s,
                "speedup": self.speedup, "transfer_speedup": self.base_transfer_s / max(self.kt_transfer_s, 1e-9),
                "train_speedup": self.base_train_s / self.kt_train_s,
                "bytes_saved": self.base_bytes - self.kt_bytes, "baseline_bytes": self.base_bytes,
                "knittrans_bytes": self.kt_bytes, "encoder_patches_saved": self.base_patches - self.kt_patches,
                "encoder_patch_ratio": self.base_patches / self.kt_patches,
                "hidden_by_overlap_s": max(0.0, self.kt_raw_transfer_s - self.kt_transfer_s)}


def time_train_step(model, batch, dedup: bool, repeats: int) -> float:
    """Median wall time of one forward + backward + optimizer-free gradient step on ``batch``."""
    from knittrans.mmdedup import grpo_loss, policy_logits

    times = []
    for i in range(repeats + 1):
        model.zero_grad(set_to_none=True)
        t = time.perf_counter()
        grpo_loss(policy_logits(model, batch, dedup=dedup), batch).backward()
        if i > 0:
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def share_batches(groups, plan, vlm_cfg, vocab):
    """Rank 0's mini-batch-0 share as the dedup batch (distinct images through the encoding plane) and as the
    baseline batch (one image copy per occurrence)."""
    from knittrans.mmdedup import BatchTokens, EncodingPlane, ImageSet, TrainSample, collate

    ids = plan.shares[0][0]
    by_id = {s.traj_id: (g, s) for g in groups for s in g.samples}
    plane = EncodingPlane(["u"])
    for t in ids:
        g, s = by_id[t]
        plane.register("u", t, [g.images[i].pixel_values for i in s.image_index],
                       [g.images[i].grid_thw for i in s.image_index])
    f = plane.fetch(ids)
    tokens = BatchTokens(vocab.pad_id, vocab.image_pad_id, vlm_cfg.spatial_merge_size)
    dd = [TrainSample(t, by_id[t][1].token_ids, by_id[t][1].loss_mask, by_id[t][1].advantage, f.image_ids[t])
          for t in ids]
    dedup = collate(dd, f.images, tokens)
    pix, grids, bl = [], [], []
    for s in dd:
        occ = []
        for i in s.image_ids:
            occ.append(len(pix))
            pix.append(f.images.pixels[i].clone())
            grids.append(f.images.grids[i])
        bl.append(dataclasses.replace(s, image_ids=tuple(occ)))
    plane.consume(ids)
    return dedup, collate(bl, ImageSet(tuple(pix), tuple(grids)), tokens)


def run_point(cfg: SpeedupConfig, n: int, k: int) -> PointResult:
    from knittrans.mmdedup.transfer_mm import MMPlan, MMTransferWorkload, measure, workload_config
    from workloads.multimodal import MultimodalWorkload
    from workloads.vlm import TinyVLMConfig, build_tiny_vlm

    w = MMTransferWorkload(prompts=cfg.prompts, n=n, images_per_prompt=k, image_side=cfg.image_side)
    vcfg = TinyVLMConfig(arch=cfg.arch)
    wcfg = dataclasses.replace(workload_config(w, cfg.seed), vlm=vcfg)
    wl = MultimodalWorkload(wcfg)
    groups = wl.sample_batch(0)
    plan = MMPlan.make(groups, cfg.num_minibatches, cfg.num_ranks)
    model = build_tiny_vlm(vcfg, wl.vocab, seed=cfg.seed)
    model.train()
    dedup, baseline = share_batches(groups, plan, vcfg, wl.vocab)
    base_step = time_train_step(model, baseline, False, cfg.train_repeats)
    kt_step = time_train_step(model, dedup, True, cfg.train_repeats)
    # emulated compute during the exposed transfer pass = the measured KnitTrans step (what prefetch overlaps)
    tr = measure(groups, plan, cfg.num_units, cfg.transfer_repeats, kt_step)
    base, kt = tr["verl-baseline"], tr["knittrans"]
    M = cfg.num_minibatches
    return PointResult(n, k, base.raw.raw_s, sum(kt.exposed.exposed_s), kt.raw.raw_s, M * base_step, M * kt_step,
                       base.raw.bytes_moved, kt.raw.bytes_moved,
                       M * cfg.num_ranks * baseline.encoder_patches(dedup=False),
                       M * cfg.num_ranks * dedup.encoder_patches(dedup=True))


def run(cfg: SpeedupConfig):
    from tqdm import tqdm

    from repro.results import Claim, Results

    cfg = resolved(cfg)
    torch.set_num_threads(1)
    results = Results(table="speedup", out_dir=cfg.out_dir)
    points = [(n, k) for k in cfg.images_per_prompt for n in cfg.ns]
    out = []
    for n, k in tqdm(points, desc="speedup", disable=None):
        out.append(run_point(cfg, n, k))
    results.rows = [p.row() for p in out]
    best = max(out, key=lambda p: p.speedup)
    results.claims.append(Claim(
        "mm_transfer_train_speedup", paper=5.8, measured=best.speedup, unit="x", holds=best.speedup >= 5.8 * 0.8,
        note=f"max over the sweep (n={best.n}, {best.k} image(s) per prompt) of (baseline raw transfer + M steps) / "
             f"(KnitTrans exposed transfer + M dedup steps); target >= 0.8 x 5.8 (4.6x)"))
    results.claims.append(Claim(
        "mm_encoder_patch_ratio", paper=None, measured=best.base_patches / best.kt_patches, unit="x",
        holds=all(p.base_patches == p.n * p.kt_patches for p in out),
        note="vision-tower patches encoded, baseline / KnitTrans; holds iff exactly n at every point"))
    plot(results, out)
    results.text = notes(cfg)
    return results


def notes(cfg: SpeedupConfig) -> str:
    return (f"Batch: {cfg.prompts} prompts x n, M={cfg.num_minibatches} mini-batches of whole groups, "
            f"{cfg.num_ranks} ranks, {cfg.num_units} units; images {cfg.image_side}px (and 3/4 rectangles); "
            f"tiny {cfg.arch} (trainable vision tower), one torch thread. Training time = M x the timed step of one "
            "rank's share (ranks run in parallel). Transfer: baseline raw (nothing overlaps the gather/repeat/"
            "scatter), KnitTrans exposed (prefetch overlaps the measured step); transport emulated in-process "
            "(a hop = pickle round trip), see docs/mmdedup.md. The tiny model's vision tower is a larger share of "
            "its step than in a 7B VLM's, and the in-process transport is faster than a cluster's driver path: "
            "both shift where the speedup lands.\n")


def plot(results, out) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    labels = [f"n={p.n}\nk={p.k}" for p in out]
    x = range(len(out))
    w = 0.38
    ax.bar([i - w / 2 for i in x], [p.base_train_s for p in out], w, label="baseline train", color="tab:red")
    ax.bar([i - w / 2 for i in x], [p.base_transfer_s for p in out], w, bottom=[p.base_train_s for p in out],
           label="baseline transfer", color="salmon")
    ax.bar([i + w / 2 for i in x], [p.kt_train_s for p in out], w, label="KnitTrans train", color="tab:blue")
    ax.bar([i + w / 2 for i in x], [p.kt_transfer_s for p in out], w, bottom=[p.kt_train_s for p in out],
           label="KnitTrans exposed transfer", color="lightblue")
    for i, p in enumerate(out):
        ax.text(i, p.base_train_s + p.base_transfer_s, f"{p.speedup:.1f}x", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(x), labels)
    ax.set_ylabel("seconds per batch")
    ax.set_title("transfer + training per batch (k = images per prompt)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(results.plot_path("speedup.png"), dpi=120)
    plt.close(fig)


def _register() -> None:
    """Register the schema in Hydra's ConfigStore (idempotent; also run at import so tests/unit/test_configs.py
    can compose conf/speedup.yaml after importing this module)."""
    ConfigStore.instance().store(name="speedup_schema", node=SpeedupConfig)


_register()


def main() -> None:
    _register()

    @hydra.main(config_path="conf", config_name="speedup", version_base=None)
    def app(dcfg) -> None:
        cfg: SpeedupConfig = OmegaConf.to_object(dcfg)
        publish(run(cfg), cfg.logger, "speedup", config=dcfg, seed=cfg.seed)

    app()


if __name__ == "__main__":
    main()
