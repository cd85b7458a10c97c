"""The faithful verl multimodal baseline on Ray (baselines/verl_mm.py): a raw and a steady pass through the rank
actors; bytes are deterministic (gather + three dispatches of every occurrence), timings only reported."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.ray


def test_verl_mm_ships_every_occurrence_for_each_of_three_dispatches():
    from baselines.verl_mm import DISPATCHES, VerlMMSystem
    from knittrans.bench import BenchLayout
    from knittrans.bench.ray_ranks import RaySession
    from workloads.multimodal_data import MMTransferWorkload
    from workloads.transfer_data import MMPasses

    layout = BenchLayout(num_ranks=2, num_units=2, lead_steps=1, warmup_batches=1)
    src = MMPasses(MMTransferWorkload(prompts_per_batch=4, group_size=4, images_per_prompt=1, image_side=56),
                   num_minibatches=2, num_producers=2)
    with RaySession(layout.num_ranks, num_cpus=2) as session:
        sys = VerlMMSystem("verl-mm", layout, session)
        d = src.make(0)
        built = sys.build(sys.stage(d), d)
        raw = sys.run_raw(src.make(1))
        steady = sys.run_steady([src.make(2), src.make(3)], iters_per_token=0.0)
    assert raw.pixel_nbytes == steady.pixel_nbytes == len(DISPATCHES) * d.occurrence_pixel_nbytes
    # gather G (every unit's rows), then the same rows three times: old log-prob (G), reference (G + the old
    # log-probs the driver unioned), update (G + both outputs)
    lr_bytes = built.batch.batch["responses"].numel() * 4
    assert raw.bytes_moved == 4 * built.gather_bytes + 3 * lr_bytes
    assert raw.raw_s > 0 and len(steady.exposed) == 1 and len(steady.exposed[0]) == 2
