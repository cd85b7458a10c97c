"""Spec of the transfer tables ("transfer-text", "transfer-multimodal"): one row per (pass, system), claims as pure
functions of those rows.

Every timing claim is a within-pass ratio (the systems of a pass alternate on the same machine state), decided on
the median over the K passes and reported with [min, max]. The headline compares KnitTrans and the verl-style
baseline on the same transport and process layout: both Ray, trainer ranks as actors (``knittrans-ray`` vs
``centralized``); in-process KnitTrans is a different layout and only a MEASUREMENT. KnitTrans's exposed latency
is often a few milliseconds per batch, so its ratios have tiny denominators: every such claim says how large the
denominator was, and denominators below ``FLOOR_S`` count as ``FLOOR_S`` (timer and signalling resolution).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


from repro.spec.core import Bound, Claim, ClaimKind, Trial, naming_verl, trial
from repro.spec.transfer_measures import (  # noqa: F401 - the measures the claims below use, and re-exported
    CEILING_SYSTEM, FLOOR_S, INPROC_CEILING_SYSTEM, TINY_S, _num, _pairs, bytes_ratio,
    ceiling_fraction, exposed_fraction, exposed_ms, get_latency_ratio, get_profile, live_bytes_after,
    memcpy_fraction, pixel_ratio_over_n, rate_ratio, ratio, tq_get_ratio)

GATES = {"transfer-text": "repro.transfer", "transfer-multimodal": "repro.transfer"}


@dataclass(frozen=True)
class TransferTrialBase(Trial):
    """One system in one pass. Times in seconds per batch, bytes per batch; NaN/None where the pass kind did not
    run."""

    pass_index: int
    system: str
    exposed_s: float | None
    """Steady pass: exposed transfer latency per batch (the slowest rank's wait for data after it was ready,
    summed over the batch's M mini-batches), averaged over the pass's measured batches. [0, inf)."""
    exposed_mb0_s: float | None
    """Of which mini-batch 0 (the one the previous batch's training must hide)."""
    raw_s: float | None
    """Raw pass: one batch, no compute: t0 -> every rank holds its share of every mini-batch."""
    get_s: float | None
    """Raw pass: mean latency of one get (claim + read + pack; centralized: mini-batch 0 waited for the scatter)."""
    bytes_moved: int
    """Payload bytes per batch: what the ranks received (centralized: gather + scatter)."""
    gbps: float | None
    """bytes_moved / raw_s, in GB/s."""
    memcpy_gbps: float
    """This machine's single-thread memcpy, for scale."""
    measured_batches: int
    live_bytes_after: int | None
    """KnitTrans: bytes its units still held after the pass (every drop confirmed); None for other systems."""
    compute_s: float | None = dataclasses.field(default=None, kw_only=True)
    """The emulated compute of one mini-batch share on one rank that the steady pass calibrates to (seconds): the
    step the exposed latency is a fraction of. None for rows written before this column."""
    num_minibatches: int | None = dataclasses.field(default=None, kw_only=True)
    """M: steps per batch (the exposed latency per batch is summed over them)."""


@trial("transfer-text")
@dataclass(frozen=True)
class TextTransferTrial(TransferTrialBase):
    get_gbps: float | None = None
    """Raw pass: the data plane's get bandwidth as one rank sees it, GB/s (1e9 B/s): the share bytes its gets
    delivered (each payload byte counted once, as memcpy counts a copied byte once) over the time the gets took
    (claim + read + pack, summed over every get of the pass: ``knittrans.bench.PassResult.get_gbps``). None where
    shares arrive as call arguments (centralized) or for rows written before this column."""
    claim_s: float | None = None
    """Raw pass, KnitTrans: of the gets' time (``get_gbps``'s denominator, summed over the pass's gets), the part
    spent claiming: the control path after the admission (``feed._since_admission``: the location's arrival less the
    controller's admission stamp on one machine), never the wait for admission; None where not recorded."""
    read_s: float | None = None
    """Of the same, the unit reads (every unit's chunk requested at once, then received)."""
    pack_s: float | None = None
    """Of the same, verifying and packing the chunks into the rank's share."""
    pack_cpu_s: float | None = None
    """The CPU time (``time.thread_time`` of the packing threads) within ``pack_s``: ``pack_s`` minus it is the
    pack waiting for a core or the GIL. None where not recorded."""
    rank_gbps: float | None = None
    """Raw pass: the slowest rank's bytes over its own time to its last share (from t0, or from its first ask
    when the ranks start after t0: a drain), GB/s; None for rows written before this column."""
    verl_version: str | None = None
    """The ``verl`` system's rows: the installed verl that ran (``baselines.verl_system.verl_version``); None on
    other systems' rows."""


@trial("transfer-multimodal")
@dataclass(frozen=True)
class MMTransferTrial(TransferTrialBase):
    group_size: int
    """n: samples per prompt (how often each image recurs in a batch)."""
    pixel_bytes: int
    """pixel_values bytes delivered to the ranks per batch (centralized: every occurrence; KnitTrans: each distinct
    image once per share)."""
    distinct_pixel_bytes: int
    """The batch's distinct pixel_values bytes (each image once)."""
    get_gbps: float | None = None
    """As ``TextTransferTrial.get_gbps``."""
    claim_s: float | None = None
    """As ``TextTransferTrial.claim_s`` (and ``read_s``, ``pack_s``, ``pack_cpu_s``: the gets' profile)."""
    read_s: float | None = None
    pack_s: float | None = None
    pack_cpu_s: float | None = None
    rank_gbps: float | None = None
    verl_version: str | None = None
    """As ``TextTransferTrial.verl_version``."""


# -- claims ----------------------------------------------------------------------------------------------------

T, MM = "transfer-text", "transfer-multimodal"
CEILING = ("per pass, the data-plane get bandwidth of {system} (as in ray_fraction_of_memcpy) / the engine ceiling's "
           "in the same pass: the same units' objects (the same stream and completion puts of the same batch, the same "
           "share assignment), their refs and byte ranges handed to the same rank actors at t0 (no claim, no "
           "admission, no puts completing beside the reads), one ray.get and one pack per share by the same "
           "pack_runs; median over K passes, [min, max]; range [0, ~1]")
DRAIN = ("the handoff's drain on Ray (knittrans-ray-drain: every trajectory put and every mini-batch admitted before "
         "t0, and claimed by the ranks' feeds as the engine ceiling's are (each rank's Consumer lives across passes "
         "and reads each pass with Consumer.steps: no byte is read before t0); then each rank actor iterates its "
         "prefetching Consumer, acks each share, no compute): the slowest "
         "rank's share bytes over its own time from its first ask to its last share, / single-thread memcpy in the "
         "same run; median over K passes, [min, max]")
SAME_LAYOUT = ("both on Ray: the same trainer-rank actors (one process each), the same seeded trajectories at the same "
               "positions of each pass, the same emulated compute (matmuls per token, calibrated once per run), the "
               "same rollout clock (batch b+1 completes when rank 0 starts step M - lead_steps of batch b); what "
               "changes is the system: verl's driver path with train-batch admission vs knittrans.Handoff (admission "
               "in the controller, units, prefetching consumers, ack after the step)")
EXPOSED = ("exposed transfer latency per batch (steady state: the first batch of each pass excluded), "
           "{num} / {den}, per pass; median over K interleaved passes, [min, max]; range [0, inf)")
RAW = ("raw transfer (one batch, no compute, t0 -> every rank holds every share; the median of the pass's "
       "raw_repeats raw passes), {num} / {den}, per pass")
MEMCPY_FRACTION = ("data-plane get bandwidth of {system} / single-thread memcpy bandwidth measured in the same run: "
                   "bytes = the share payloads the gets delivered, each byte counted once (as memcpy counts a copied "
                   "byte once; the copies the path makes on the way are not counted again); time = the gets' claim + "
                   "read + pack, summed over the gets of the pass's raw passes (one rank's stream: the ranks run side "
                   "by side). Median over K passes, [min, max]; range [0, ~1]")
RAW_FRACTION = ("end-to-end raw bandwidth of {system} / memcpy in the same run: the batch's share bytes over t0 -> "
                "every rank holds every share (includes the producers' completing puts, admission in the "
                "controller and every claim, read and pack); median over K passes, [min, max]")

TQ_GET = ("mean get latency per (mini-batch, rank) in the raw pass (KnitTrans: claim + read + pack, without the wait "
          "for admission; TransferQueue: one kv_batch_get and its unpacking), transferqueue / knittrans-ray, per pass; "
          "median over K passes, [min, max]; not measured when TransferQueue is not installed")
SEQUENTIAL = ("; the same handoff without its prefetcher, so each rank runs one get at a time as TransferQueue's "
              "ranks do (with prefetch depth 2 two gets of a rank overlap, and each one's latency counts the other's "
              "time on the same cores)")
TQ_GET_SEQUENTIAL = TQ_GET.replace("knittrans-ray", "knittrans-ray-noprefetch") + SEQUENTIAL
TQ_LAYOUT = ("the same rank actors, the same seeded trajectories; TransferQueue's get starts once the batch is "
             "complete (no prefetcher), KnitTrans's once the mini-batch is admitted")

CLAIMS: tuple[Claim, ...] = (
    Claim("exposed_latency_ratio", T, ClaimKind.TARGET, ">= 10x (KnitTrans exposes <= 10% of the baseline's "
          "transfer latency)", "x", EXPOSED.format(num="centralized (pad to the batch's longest, build-ahead)",
                                                  den="knittrans-ray") +
          ". Gate bound 25 at CI size (512 trajectories, 3 passes, batch b+1 complete two steps before b ends): "
          "medians 51-1500 on a loaded 2-core machine (402 with the direct read path, issue 25), while the same "
          "handoff without prefetch gives 8.2 [3.0, 13.2] with the direct reads (1.3-5.6 before them: faster gets "
          "leave less to hide, so the bound moved from 8 to 25)",
          ratio("centralized", "knittrans-ray", "exposed_s"), bound=Bound(">=", 10.0), gate=Bound(">=", 25.0),
          comparison=SAME_LAYOUT),
    Claim("raw_transfer_ratio", T, ClaimKind.MEASUREMENT, "(context)", "x",
          RAW.format(num="centralized", den="knittrans-ray"), ratio("centralized", "knittrans-ray", "raw_s"),
          comparison=SAME_LAYOUT),
    Claim("bytes_ratio", T, ClaimKind.MEASUREMENT, "(context)", "x",
          "bytes per batch, centralized (gather ragged + scatter padded dense) / knittrans-ray (share payloads)",
          bytes_ratio("centralized", "knittrans-ray"), comparison=SAME_LAYOUT),
    Claim("exposed_latency_ratio_padmax", T, ClaimKind.MEASUREMENT, "(context)", "x",
          EXPOSED.format(num="centralized-padmax (pads to the configured maxima, as verl's rollout ships)",
                         den="knittrans-ray"), ratio("centralized-padmax", "knittrans-ray", "exposed_s"),
          comparison=SAME_LAYOUT),
    Claim("prefetch_exposed_ratio", T, ClaimKind.MEASUREMENT, "(context)", "x",
          EXPOSED.format(num="knittrans-ray-noprefetch", den="knittrans-ray") + ": what prefetch hides",
          ratio("knittrans-ray-noprefetch", "knittrans-ray", "exposed_s")),
    Claim("exposed_latency_ratio_inproc", T, ClaimKind.MEASUREMENT, "(context)", "x",
          EXPOSED.format(num="centralized (Ray)", den="knittrans-inproc (threads of one process)"),
          ratio("centralized", "knittrans-inproc", "exposed_s"),
          comparison="different layouts (Ray actors vs threads of one process): not a like-for-like comparison"),
    Claim("exposed_latency_ratio_verl", T, ClaimKind.MEASUREMENT, "(context)", "x",
          EXPOSED.format(num="verl (verl's own code, the version named in the note: DataProto through the driver "
                             "and verl's single controller, three dispatches per step, padded as its agent loop pads: "
                             "to max_prompt_len / max_response_len; build-ahead)", den="knittrans-ray"),
          naming_verl(ratio("verl", "knittrans-ray", "exposed_s")), comparison=SAME_LAYOUT),
    Claim("raw_transfer_ratio_verl", T, ClaimKind.MEASUREMENT, "(context)", "x",
          RAW.format(num="verl", den="knittrans-ray"), naming_verl(ratio("verl", "knittrans-ray", "raw_s")),
          comparison=SAME_LAYOUT),
    Claim("bytes_ratio_verl", T, ClaimKind.MEASUREMENT, "(context)", "x",
          "payload bytes per batch, verl (gather padded + three dispatches, each without input_ids' and "
          "position_ids' padding, as verl's left_right_2_no_padding) / knittrans-ray (share payloads)",
          naming_verl(bytes_ratio("verl", "knittrans-ray")), comparison=SAME_LAYOUT),
    Claim("verl_vs_centralized_padmax_raw", T, ClaimKind.MEASUREMENT, "(context)", "x",
          RAW.format(num="verl", den="centralized-padmax (the re-implemented driver path, padded to the same maxima, "
                                     "one dispatch)") + ": how far the re-implementation is from verl's code",
          naming_verl(ratio("verl", "centralized-padmax", "raw_s"))),
    Claim("tq_get_latency_ratio", T, ClaimKind.MEASUREMENT, "(issue 15 goal) >= 5x", "x", TQ_GET, get_latency_ratio,
          comparison=TQ_LAYOUT),
    Claim("tq_get_latency_ratio_sequential", T, ClaimKind.MEASUREMENT, "(context)", "x",
          TQ_GET_SEQUENTIAL, tq_get_ratio("knittrans-ray-noprefetch"), comparison=TQ_LAYOUT),
    Claim("inproc_fraction_of_memcpy", T, ClaimKind.TARGET, "(issue 15) >= 50% of memcpy", "x memcpy",
          MEMCPY_FRACTION.format(system="knittrans-inproc (ranks as threads: one pack copy per byte, from the units' "
                                        "stored copies into a reused buffer)") + ". Not gated: at CI size on a "
          "loaded 2-core runner the same code measured 0.05-0.09 between runs, and the regression that costs Ray 30x "
          "(one unit read per trajectory) costs in process < 2x (a read is a dict lookup there): no bound separates "
          "them", memcpy_fraction("knittrans-inproc", "get_gbps"), bound=Bound(">=", 0.5)),
    Claim("ray_fraction_of_memcpy", T, ClaimKind.TARGET, "(issue 15) >= 25% of memcpy", "x memcpy",
          MEMCPY_FRACTION.format(system="knittrans-ray (rank actors on the units' node: a unit keeps each large put "
                                        "as an object-store object of its own and answers a read with where the rows "
                                        "lie, the rank maps the objects and packs once into its own buffer)")
          + ". Gate bound 0.01 at CI size (512 trajectories, one raw pass per pass): 0.033 with the direct reads on a "
          "loaded 2-core machine (0.006-0.024 before them); reading one trajectory per unit call (one actor round "
          "trip each) gives 0.0007",
          memcpy_fraction("knittrans-ray", "get_gbps"), bound=Bound(">=", 0.25), gate=Bound(">=", 0.01)),
    Claim("ray_fraction_of_ceiling", T, ClaimKind.TARGET, "(issue 25) >= 0.7 of the engine's ceiling", "x ceiling",
          CEILING.format(system="knittrans-ray") + ". Gate bound 0.05 at CI size: 0.29 [0.12, 0.31] on a loaded "
          "2-core machine; reads of one trajectory per unit call, ~0.006", ceiling_fraction("knittrans-ray"),
          bound=Bound(">=", 0.7), gate=Bound(">=", 0.05)),
    Claim("ceiling_fraction_of_memcpy", T, ClaimKind.MEASUREMENT, "(context)", "x memcpy",
          MEMCPY_FRACTION.format(system=CEILING_SYSTEM + " (refs handed over, one ray.get, one pack)"),
          memcpy_fraction(CEILING_SYSTEM, "get_gbps")),
    Claim("inproc_ceiling_fraction_of_memcpy", T, ClaimKind.MEASUREMENT, "(context: the bound of "
          "inproc_fraction_of_memcpy)", "x memcpy",
          MEMCPY_FRACTION.format(system=INPROC_CEILING_SYSTEM + " (knittrans-inproc's ceiling: every share admitted "
                                 "and claimed before t0, then both ranks as threads of one process, each resolving "
                                 "and packing its shares with the same client code, no puts, admission, prefetcher "
                                 "or feed beside them)"),
          memcpy_fraction(INPROC_CEILING_SYSTEM, "get_gbps")),
    Claim("inproc_fraction_of_ceiling", T, ClaimKind.MEASUREMENT, "(context)", "x ceiling",
          "per pass, the data-plane get bandwidth of knittrans-inproc (as in inproc_fraction_of_memcpy) / the "
          "in-process ceiling's (" + INPROC_CEILING_SYSTEM + ", inproc_ceiling_fraction_of_memcpy) in the same pass: "
          "what the handoff's control path and the puts completing beside the reads cost an in-process rank; median "
          "over K passes, [min, max]; range [0, ~1] (Ray's engine ceiling, a different layout, was the denominator "
          "until session 45)",
          ceiling_fraction("knittrans-inproc", INPROC_CEILING_SYSTEM)),
    Claim("tq_fraction_of_ceiling", T, ClaimKind.MEASUREMENT, "(context)", "x ceiling",
          CEILING.format(system="transferqueue (one kv_batch_get per share)"), ceiling_fraction("transferqueue")),
    Claim("drain_fraction_of_memcpy", T, ClaimKind.TARGET, "(issue 25) >= 0.2 of memcpy per rank", "x memcpy",
          DRAIN + ". Gate bound 0.008 at CI size: 0.034 [0.027, 0.047] on a loaded 2-core machine; reads of one "
          "trajectory per unit call, ~0.001", memcpy_fraction("knittrans-ray-drain", "rank_gbps"),
          bound=Bound(">=", 0.2), gate=Bound(">=", 0.008)),
    Claim("ceiling_rank_fraction_of_memcpy", T, ClaimKind.MEASUREMENT, "(context)", "x memcpy",
          "the engine ceiling's per-rank rate, the drain target's own ceiling: the slowest rank's share bytes over its "
          "own time from its first share's start to its last share (as drain_fraction_of_memcpy measures the drain), "
          "when the refs are handed over and each share is one ray.get and one pack (no claim, no ack, no drop) / "
          "single-thread memcpy in the same run; median over K passes, [min, max]",
          memcpy_fraction(CEILING_SYSTEM, "rank_gbps")),
    Claim("drain_fraction_of_ceiling", T, ClaimKind.MEASUREMENT, "(context)", "x ceiling",
          "per pass, the drain's slowest-rank rate (drain_fraction_of_memcpy) / the engine ceiling's "
          "(ceiling_rank_fraction_of_memcpy) in the same pass: what the handoff's control path (claims, acks, "
          "releases, the units' drops) costs a draining rank; median over K passes, [min, max]",
          rate_ratio("knittrans-ray-drain", CEILING_SYSTEM, "rank_gbps")),
    Claim("inproc_raw_fraction_of_memcpy", T, ClaimKind.MEASUREMENT, "(context)", "x memcpy",
          RAW_FRACTION.format(system="knittrans-inproc"), memcpy_fraction("knittrans-inproc", "gbps")),
    Claim("ray_raw_fraction_of_memcpy", T, ClaimKind.MEASUREMENT, "(context)", "x memcpy",
          RAW_FRACTION.format(system="knittrans-ray"), memcpy_fraction("knittrans-ray", "gbps")),
    Claim("mm_transfer_latency_ratio", MM, ClaimKind.TARGET, "~100x (two orders of magnitude)", "x",
          RAW.format(num="centralized", den="knittrans-ray") + "; median over K passes, [min, max]; paper claim 3 "
          "is decided here, on raw transfer latency (DESIGN.md) and nothing else; pre-registered "
          "bound 50 (two orders of magnitude with a 2x margin). Gate bound 1 at CI size (16 x n=16, 336px, M=2, "
          "K=5 passes, the median of 3 raw passes per pass): on one machine every hop is a memcpy and KnitTrans "
          "pays a few round trips per mini-batch, so the ratio is 1.56-1.75 (3-pass medians, 2-core machine); reads "
          "of one trajectory per unit call give 0.14. The same plane with dedup off reads 0.6-1.8 (the baseline's "
          "raw pass varies 0.2-0.6 s for the same 0.59 GB), so that regression is the bytes gate's to catch; at "
          "224px dedup on and off overlapped outright (docs/experiments.md, session 22)",
          ratio("centralized", "knittrans-ray", "raw_s"), bound=Bound(">=", 50.0), gate=Bound(">=", 1.0),
          comparison=SAME_LAYOUT, paper_claim=3),
    Claim("mm_ceiling_transfer_ratio", MM, ClaimKind.MEASUREMENT, "(context: the bound of claim 3 on this "
          "machine)", "x", RAW.format(num="centralized", den=CEILING_SYSTEM + " (the same units' objects, every "
                                      "mini-batch admitted and claimed before t0; at t0 each rank gets its shares' "
                                      "refs and reads and packs them: each share's fields and distinct images once, "
                                      "no control path at all)") + "; median over K passes, [min, max]: the most "
          "mm_transfer_latency_ratio can read for this batch on this machine for a design that reads each share "
          "through Ray and packs it once (knittrans-ray's raw pass adds the completing puts, admission and claims)",
          ratio("centralized", CEILING_SYSTEM, "raw_s"), comparison=SAME_LAYOUT),
    Claim("mm_exposed_latency_ratio", MM, ClaimKind.MEASUREMENT, "(context: claim 3 is decided on raw transfer)",
          "x", EXPOSED.format(num="centralized (build-ahead)", den="knittrans-ray (prefetch)") + ". Not the paper's "
          "claim: its denominator is KnitTrans's hand-over once prefetch has hidden the transfer behind the "
          "emulated step (~0.3 ms), so any system that hides its transfer passes any bound; what KnitTrans exposes "
          "is reported in ms and as a fraction of the step below. Gate (a regression guard for prefetch, not a "
          "verdict): bound 50 at CI size (batch b+1 complete two steps before b ends); the same handoff without "
          "prefetch gives ~10-30 there (it still moves 1/n of the bytes)",
          ratio("centralized", "knittrans-ray", "exposed_s"), gate=Bound(">=", 50.0), comparison=SAME_LAYOUT),
    Claim("mm_exposed_latency_ms", MM, ClaimKind.MEASUREMENT, "(context)", "ms",
          "knittrans-ray's exposed transfer latency per batch (steady state: the slowest rank's wait for data after "
          "it was ready to compute, summed over the batch's M mini-batches), median over K passes, [min, max]",
          exposed_ms("knittrans-ray"), comparison=SAME_LAYOUT),
    Claim("mm_exposed_fraction_of_step", MM, ClaimKind.MEASUREMENT, "(context)", "fraction",
          "knittrans-ray's exposed transfer latency per batch / the batch's emulated training (M x the calibrated "
          "step of one mini-batch share), per pass; median over K passes, [min, max]; range [0, inf)",
          exposed_fraction("knittrans-ray"), comparison=SAME_LAYOUT),
    Claim("mm_exposed_fraction_of_step_centralized", MM, ClaimKind.MEASUREMENT, "(context)", "fraction",
          "the same fraction for centralized (build-ahead): what the baseline's transfer adds to its training",
          exposed_fraction("centralized"), comparison=SAME_LAYOUT),
    Claim("mm_bytes_ratio", MM, ClaimKind.TARGET, "n (each distinct image moved once instead of once per sample)",
          "x n", "pixel_values bytes delivered to the ranks per batch, centralized / knittrans-ray, divided by the "
          "group size n; exactly 1 when the plane moves each distinct image once per share (deterministic; the "
          "pass farthest from 1 decides)", pixel_ratio_over_n, bound=Bound("==", 1.0), gate=Bound("==", 1.0),
          comparison=SAME_LAYOUT),
    Claim("mm_store_live_bytes_after", MM, ClaimKind.TARGET, "(ours) 0: nothing leaked", "B",
          "bytes the KnitTrans units (fields and encoding stores) still held after a pass was consumed and every "
          "drop confirmed (wait_drained), the most over every KnitTrans pass; refcounts back to zero = 0",
          live_bytes_after, bound=Bound("==", 0.0), gate=Bound("==", 0.0)),
    Claim("mm_tq_get_latency_ratio", MM, ClaimKind.MEASUREMENT, "(issue 15 goal) >= 5x", "x",
          TQ_GET + "; TransferQueue's rows carry each sample's own pixel_values (no dedup), KnitTrans's each distinct "
          "image once per share", get_latency_ratio, comparison=TQ_LAYOUT),
    Claim("mm_tq_get_latency_ratio_sequential", MM, ClaimKind.MEASUREMENT, "(context)", "x",
          TQ_GET_SEQUENTIAL, tq_get_ratio("knittrans-ray-noprefetch"), comparison=TQ_LAYOUT),
    Claim("mm_total_bytes_ratio", MM, ClaimKind.MEASUREMENT, "(context)", "x",
          "all bytes per batch, centralized (gather + scatter incl. every image occurrence) / knittrans-ray (fields + "
          "distinct images)", bytes_ratio("centralized", "knittrans-ray"), comparison=SAME_LAYOUT),
    Claim("mm_transfer_latency_ratio_verl", MM, ClaimKind.MEASUREMENT, "(context)", "x",
          RAW.format(num="verl (verl's own code, the installed version named in the note: DataProto with per-row "
                         "multi_modal_inputs, gathered, repeated and balanced on the driver, moved through verl's "
                         "single controller for each of old log-prob, reference, update)",
                     den="knittrans-ray") + "; median over K passes, [min, max]",
          naming_verl(ratio("verl", "knittrans-ray", "raw_s")), comparison=SAME_LAYOUT),
    Claim("mm_exposed_latency_ratio_verl", MM, ClaimKind.MEASUREMENT, "(context)", "x",
          EXPOSED.format(num="verl (build-ahead)", den="knittrans-ray (prefetch)"),
          naming_verl(ratio("verl", "knittrans-ray", "exposed_s")), comparison=SAME_LAYOUT),
    Claim("mm_total_bytes_ratio_verl", MM, ClaimKind.MEASUREMENT, "(context)", "x",
          "all payload bytes per batch, verl (gather + three dispatches, every image occurrence each time) / "
          "knittrans-ray", naming_verl(bytes_ratio("verl", "knittrans-ray")), comparison=SAME_LAYOUT),
    Claim("mm_verl_vs_centralized_raw", MM, ClaimKind.MEASUREMENT, "(context)", "x",
          RAW.format(num="verl", den="centralized (one contiguous pixel buffer, one dispatch)") + ": how much "
          "kinder than verl the centralized baseline is", naming_verl(ratio("verl", "centralized", "raw_s"))),
    Claim("mm_transfer_latency_ratio_inproc", MM, ClaimKind.MEASUREMENT, "(context)", "x",
          RAW.format(num="centralized (Ray)", den="knittrans-inproc"),
          ratio("centralized", "knittrans-inproc", "raw_s"),
          comparison="different layouts (Ray actors vs threads of one process)"),
    Claim("mm_exposed_latency_ratio_inproc", MM, ClaimKind.MEASUREMENT, "(context)", "x",
          EXPOSED.format(num="centralized (Ray)", den="knittrans-inproc"),
          ratio("centralized", "knittrans-inproc", "exposed_s"),
          comparison="different layouts (Ray actors vs threads of one process)"),
)
