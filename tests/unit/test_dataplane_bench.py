"""The transfer benchmark's pieces: the centralized (DataProto-like) batch, compute emulation, a tiny table run."""

from __future__ import annotations

import numpy as np
import pytest

from baselines.centralized import balance_plan, build_dense_batch, rank_minibatches, real_tokens
from baselines.transferqueue_adapter import required_ray_cpus, transferqueue_available
from knittrans.dataplane.harness import MiniBatchTiming, RankTrace, summarize_exposed
from workloads.text_data import TextDataConfig, make_text_batch


def _batch():
    return make_text_batch(TextDataConfig(num_prompts=8, group_size=4, response_len_median=40, max_response_len=300,
                                          prompt_len_mean=20, seed=5))


def test_text_workload_is_deterministic_in_its_seed():
    a, b = _batch(), _batch()
    assert all(np.array_equal(x.input_ids, y.input_ids) and np.array_equal(x.advantages, y.advantages)
               for x, y in zip(a.trajectories, b.trajectories))
    c = make_text_batch(TextDataConfig(num_prompts=8, group_size=4, response_len_median=40, max_response_len=300,
                                       prompt_len_mean=20, seed=6))
    assert not all(np.array_equal(x.input_ids, y.input_ids) for x, y in zip(a.trajectories, c.trajectories))


def test_centralized_batch_holds_every_trajectory_unpadded_under_its_mask():
    batch = _batch()
    mbs = batch.minibatches(2)
    tokens = {t.traj_id: int(t.input_ids.shape[0]) for t in batch.trajectories}
    plan = balance_plan(mbs, tokens, 2)
    gathered = [[t.payload() for t in batch.trajectories[i::2]] for i in range(2)]
    dense = build_dense_batch(gathered, batch.prompts, {t.traj_id: t.group_id for t in batch.trajectories}, 4, plan)
    by_id = {t.traj_id: t for t in batch.trajectories}
    for row, tid in enumerate(dense.traj_ids.tolist()):
        mask = dense.tensors["attention_mask"][row].astype(bool)
        np.testing.assert_array_equal(dense.tensors["input_ids"][row][mask], by_id[tid].input_ids)
        n = by_id[tid].response_len
        np.testing.assert_array_equal(dense.tensors["old_logprobs"][row][:n], by_id[tid].old_logprobs)
        assert not dense.tensors["loss_mask"][row][n:].any()
    assert real_tokens(dense) == sum(tokens.values())
    chunks = dense.chunk(2)
    for r, chunk in enumerate(chunks):
        pieces = rank_minibatches(chunk, plan.per_minibatch)
        assert len(pieces) == 2
        for k, piece in enumerate(pieces):  # rank r's k-th mini-batch holds only mini-batch k's trajectories
            assert set(piece.traj_ids.tolist()) <= set(mbs[k].traj_ids)
    assert dense.nbytes > batch.nbytes  # padding: what the single-controller path pays for dense tensors


def test_exposed_latency_is_the_slowest_ranks_wait_after_ready():
    t0 = 10.0
    a = RankTrace(0, (MiniBatchTiming(0, 9.0, 10.5, 11.0, 0.5, 1, 1), MiniBatchTiming(1, 11.0, 11.0, 12.0, 0, 1, 1)))
    b = RankTrace(1, (MiniBatchTiming(0, 9.5, 10.2, 11.0, 0.2, 1, 1), MiniBatchTiming(1, 11.0, 11.3, 12.0, 0, 1, 1)))
    assert summarize_exposed([a, b], t0) == pytest.approx([0.5, 0.3])


def test_transferqueue_adapter_reports_availability_and_cpus():
    assert isinstance(transferqueue_available(), bool)
    assert required_ray_cpus(2) == 3


def test_tiny_transfer_table_runs_in_process(tmp_path):
    from repro.transfer import TextWorkload, TransferConfig, run

    cfg = TransferConfig(text=TextWorkload(num_prompts=4, group_size=4, prompt_len_mean=16, response_len_median=32,
                                           max_response_len=128),
                         systems=["knittrans-inproc"], num_minibatches=2, compute_s_per_minibatch=0.01, repeats=1,
                         logger="none", out_dir=str(tmp_path))
    res = run(cfg)
    (row,) = res.rows
    batch = make_text_batch(TextDataConfig(num_prompts=4, group_size=4, prompt_len_mean=16, response_len_median=32,
                                           max_response_len=128, seed=0))
    assert row["system"] == "knittrans-inproc" and row["bytes_moved"] == batch.nbytes
    assert len([k for k in row if k.startswith("exposed_mb") and k[10:-2].isdigit()]) == 2
    assert (tmp_path / "exposed_latency.png").exists()
