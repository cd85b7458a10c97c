"""The engine ceiling (``knittrans.bench.ceiling``) on the multimodal workload: the same units' objects read with
no control path, each share's fields and distinct images packed once -- the bound ``mm_ceiling_transfer_ratio``
reads. It must move exactly the bytes knittrans-ray moves for the same batch (nothing skipped, no image twice), or
the bound would be a bound of something else."""

from __future__ import annotations

import pytest

pytest.importorskip("ray")

from knittrans.bench import BenchLayout  # noqa: E402
from knittrans.bench.ray_ranks import RaySession  # noqa: E402
from repro.transfer import TransferConfig, passes_of  # noqa: E402
from repro.transfer_systems import MM_SYSTEMS, System, make_system  # noqa: E402
from workloads.multimodal_data import MMTransferWorkload  # noqa: E402


@pytest.mark.ray
def test_the_multimodal_ceiling_moves_exactly_the_bytes_knittrans_moves():
    assert System.ENGINE_CEILING in MM_SYSTEMS
    cfg = TransferConfig(workload="multimodal", num_minibatches=2,
                         multimodal=MMTransferWorkload(prompts_per_batch=8, group_size=4, image_side=112))
    layout = BenchLayout(cfg.num_ranks, cfg.num_units, cfg.lead_steps, cfg.warmup_batches, cfg.prefetch_depth)
    src = passes_of(cfg)
    with RaySession(cfg.num_ranks, cfg.ray_num_cpus) as session:
        ceiling = make_system(System.ENGINE_CEILING, cfg, layout, session)
        knit = make_system(System.KNITTRANS_RAY, cfg, layout, session)
        try:
            d = src.make(0, 0)
            top = ceiling.run_raw(d)
            ours = knit.run_raw(src.make(0, 0))
        finally:
            ceiling.close()
            knit.close()
    assert top.raw_s > 0 and len(top.get_s) == cfg.num_ranks * cfg.num_minibatches
    assert top.pixel_nbytes > 0 and top.pixel_nbytes == ours.pixel_nbytes  # each distinct image once per share
    assert top.bytes_moved == ours.bytes_moved
    assert top.pixel_nbytes < sum(im.nbytes for r in d.rollouts for im in r.images)  # not once per sample


def test_the_in_process_ceiling_moves_exactly_the_bytes_knittrans_inproc_moves():
    """knittrans-inproc's ceiling (``inproc-ceiling``): ranks as threads, every share claimed before t0; the same
    bytes as knittrans-inproc's raw pass, timed get by get (no unit read: the units' arrays are the sources), and no
    Ray at all."""
    assert System.INPROC_CEILING not in MM_SYSTEMS  # the in-process claim is the text table's
    cfg = TransferConfig(workload="text", num_minibatches=2, systems=["inproc-ceiling", "knittrans-inproc"])
    cfg.text.prompts_per_batch = 4
    layout = BenchLayout(cfg.num_ranks, cfg.num_units, cfg.lead_steps, cfg.warmup_batches, cfg.prefetch_depth)
    src = passes_of(cfg)
    ceiling = make_system(System.INPROC_CEILING, cfg, layout, None)
    knit = make_system(System.KNITTRANS_INPROC, cfg, layout, None)
    try:
        top = ceiling.run_raw(src.make(0, 0))
        again = ceiling.run_raw(src.make(1, 0))  # a second pass on the same plane: the first one was released
        ours = knit.run_raw(src.make(2, 0))
    finally:
        ceiling.close()
        knit.close()
    for res in (top, again):
        assert res.raw_s > 0 and len(res.get_s) == cfg.num_ranks * cfg.num_minibatches
        assert all(p[0] == 0.0 for p in res.get_parts)  # no claim inside the timed window
        assert res.bytes_moved == ours.bytes_moved


@pytest.mark.ray
@pytest.mark.parametrize("workload,waves", [("text", 2), ("multimodal", 1)])
def test_the_one_message_bound_moves_the_ceilings_bytes_and_leaves_the_other_batch_behind(workload, waves):
    """``knittrans.bench.bounds`` (``scripts/ceiling_under_load.py``, ``scripts/mm_bound.py``): the ceiling's ranks
    read each wave of their shares once one message says that wave's completing put is registered, while another
    batch's completing puts run beside them. The same bytes as the ceiling alone, every get timed with the wait as
    its claim, the other batch's puts finished and discarded (the plane holds nothing of it after the pass)."""
    from knittrans.bench.bounds import CompletingPuts, Notifier, notified

    mm = workload == "multimodal"
    cfg = TransferConfig(workload=workload, num_minibatches=2,
                         multimodal=MMTransferWorkload(prompts_per_batch=8, group_size=4, image_side=112))
    cfg.text.prompts_per_batch = 4
    layout = BenchLayout(cfg.num_ranks, cfg.num_units, cfg.lead_steps, cfg.warmup_batches, cfg.prefetch_depth)
    src = passes_of(cfg)
    with RaySession(cfg.num_ranks, cfg.ray_num_cpus) as session:
        ceiling = make_system(System.ENGINE_CEILING, cfg, layout, session)
        note = Notifier.remote(waves)
        try:
            alone = ceiling.run_raw(src.make(0, 0))
            batch = src.make(1, 0)
            dp = ceiling._dp(batch)
            puts = CompletingPuts(dp, src.make(1000, 0), layout, streamed=mm, multimodal=mm)
            told = notified(ceiling, batch, puts, note, waves)
            held = dp.controller.stats().held
        finally:
            ceiling.close()
    assert puts.started and not any(t.is_alive() for t in puts.threads)
    assert told.bytes_moved == alone.bytes_moved and len(told.get_s) == cfg.num_ranks * cfg.num_minibatches
    assert all(p[0] >= 0.0 for p in told.get_parts) and told.raw_s > 0
    assert held == 0
