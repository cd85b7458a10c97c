"""The verl baseline runs verl's code (baselines/verl_system.py, verl 0.9.1): a small batch goes through verl's
DataProto and single controller (RayWorkerGroup, the actor's nd-compute dispatch) to two trainer ranks. Every row
arrives exactly once and intact (its tokens, advantages and, multimodal, its own pixel_values), in verl's order:
rank r trains the r-th ``DataProto.chunk`` of the balanced batch, mini-batch k its k-th ``split``."""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.ray


def _check_rows(sys, d, built_batch) -> None:  # noqa: ANN001
    got = sys.received
    assert sorted(r.traj_id for r in got) == sorted(r.traj.traj_id for r in d.rollouts)  # each row exactly once
    by_id = {r.traj.traj_id: r for r in d.rollouts}
    for row in got:
        src = by_id[row.traj_id]
        np.testing.assert_array_equal(row.input_ids.numpy(), src.tensors["input_ids"])
        np.testing.assert_array_equal(row.advantages.numpy(), src.tensors["advantages"])
        if d.multimodal:
            g = d.prompt_of[row.traj_id]
            np.testing.assert_array_equal(row.pixel_values.numpy(), np.concatenate(d.images[g]))
        else:
            assert row.pixel_values is None
    R, M = sys.layout.num_ranks, d.num_minibatches
    for r, chunk in enumerate(built_batch.chunk(R)):  # verl's order: DataProto.chunk, then split per mini-batch
        for k, mb in enumerate(chunk.split(len(chunk) // M)):
            assert [x.traj_id for x in got if (x.rank, x.minibatch) == (r, k)] == mb.batch["traj_id"].tolist()


@pytest.mark.parametrize("workload", ["multimodal", "text"])
def test_verl_rows_arrive_intact_in_verls_order(workload):
    from baselines.verl_system import VerlConfig, VerlSystem, build, padded_lengths
    from knittrans.bench import BenchLayout
    from knittrans.bench.ray_ranks import RaySession
    from workloads.multimodal_data import MMTransferWorkload
    from workloads.text_data import TextDataConfig
    from workloads.transfer_data import MMPasses, TextPasses

    def _cycle_tensor_bytes(_rank) -> int:  # noqa: ANN001 - run in a rank; nested, so Ray sends it by value
        """The bytes of the tensors in this process that only reference cycles keep (a collection's garbage)."""
        import gc

        import torch

        gc.set_debug(gc.DEBUG_SAVEALL)
        try:
            gc.collect()
            return sum(o.untyped_storage().nbytes() for o in gc.garbage if isinstance(o, torch.Tensor))
        finally:
            gc.set_debug(0)
            gc.garbage.clear()

    layout = BenchLayout(num_ranks=2, num_units=2, lead_steps=1, warmup_batches=1)
    if workload == "multimodal":
        src = MMPasses(MMTransferWorkload(prompts_per_batch=4, group_size=4, images_per_prompt=1, image_side=56),
                       num_minibatches=2, num_producers=2)
        config = VerlConfig()
    else:
        src = TextPasses(TextDataConfig(num_prompts=4, group_size=4, prompt_len_mean=16, response_len_median=12,
                                        max_response_len=48),
                         num_minibatches=2, num_producers=2)
        config = VerlConfig(max_prompt_len=128, max_response_len=48)  # padded to the maxima, as verl's agent loop
    with RaySession(layout.num_ranks, num_cpus=4) as session:
        sys = VerlSystem("verl", layout, session, config, record_rows=True)
        try:
            d = src.make(1)
            import ray

            expected = build(ray.get(sys.stage(d)), d, layout.num_ranks, padded_lengths(d, config)[1]).batch
            raw = sys.run_raw(d)
            _check_rows(sys, d, expected)
            steady = sys.run_steady([src.make(2), src.make(3)], iters_per_token=0.0)
            # each pass's drain collected what verl's dispatch leaves in reference cycles (without it ~1 GB a rank a
            # pass stayed at the default text size): no tensor is left for a collection now
            held = ray.get([w.__ray_call__.remote(_cycle_tensor_bytes) for w in sys.wg.workers])
            assert held == [0] * layout.num_ranks, held
        finally:
            sys.close()
    assert raw.raw_s > 0 and len(steady.exposed) == 1 and len(steady.exposed[0]) == 2
    # three dispatches of every row: multimodal, each of them carries every sample's own pixel_values
    assert raw.pixel_nbytes == steady.pixel_nbytes == (3 * d.occurrence_pixel_nbytes if d.multimodal else 0)
    assert raw.bytes_moved > 3 * d.field_nbytes
