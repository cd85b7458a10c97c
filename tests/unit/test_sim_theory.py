"""The simulator against queueing theory (Little's law) in the fully asynchronous group-queue setting.

Whole groups enter a queue when their last sample finishes; the trainer consumes B trajectories per step; weights
reach the engines after every step at no cost; rollout keeps every slot busy (no flow control). A trajectory is
in generation from its start until its group completes, E[max length in a group] * tpot on average, while steps
happen at min(rollout, trainer) throughput / B. So its mean pre-queue staleness is

    C * M_tail / (B * max(1, rho)),   M_tail = E[max length in a group] / E[length],  rho = rollout / trainer

with C the concurrent slots and rho the ratio of rollout to trainer throughput in trajectories per second.
"""

import numpy as np
import pytest

from baselines.admission import BoundedAsyncAdmission
from knittrans.constraints import BatchConstraints
from knittrans.sim import EngineConfig, FlowConfig, FlowKind, SimConfig, SyncConfig, SyncPolicy, TrainerConfig, simulate
from knittrans.staleness import pre_queue_staleness
from workloads.text import LengthDist, TextWorkloadConfig, generate_batches

SLOTS, ENGINES, TPOT = 128, 2, 0.01
N, PROMPTS, BATCHES = 8, 16, 60  # B = 128 trajectories per step


def _run(rho: float):
    wl = TextWorkloadConfig(name="theory", prompts_per_batch=PROMPTS, group_size=N, num_minibatches=1,
                            lengths=LengthDist(median=400, sigma=0.8, max_len=4000, min_len=8), prompt_len=0)
    batches = generate_batches(wl, BATCHES, seed=1)
    lengths = np.concatenate([np.concatenate(list(b.lengths.values())) for b in batches])
    mean_len = lengths.mean()
    m_tail = np.mean([g.max() for b in batches for g in b.lengths.values()]) / mean_len
    C = SLOTS * ENGINES
    B = wl.batch_size
    rollout_thr = C / (mean_len * TPOT)  # trajectories per second with every slot busy
    step_time = B * rho / rollout_thr  # trainer throughput = rollout_thr / rho
    cfg = SimConfig(engine=EngineConfig(num_engines=ENGINES, slots=SLOTS, tpot=TPOT),
                    trainer=TrainerConfig(step_overhead=step_time, per_token=0.0),
                    sync=SyncConfig(policy=SyncPolicy.EVERY_STEP, cost=0.0),
                    flow=FlowConfig(kind=FlowKind.UNBOUNDED))
    c = BatchConstraints(batch_size=B, num_minibatches=1, group_size=N, max_response_len=4000)
    res = simulate(cfg, BoundedAsyncAdmission(c), batches)
    # steady state: trajectories that started in the middle of the rollout phase
    start = res.records.t_start
    done = ~np.isnan(res.records.t_group_complete)
    lo, hi = np.quantile(start, [0.2, 0.7])
    pq_all = np.full(len(start), np.nan)
    pq_all[done] = pre_queue_staleness(res)
    sel = (start >= lo) & (start <= hi)
    measured = np.nanmean(pq_all[sel])
    predicted = C * m_tail / (B * max(1.0, rho))
    return measured, predicted


@pytest.mark.parametrize("rho", [0.3, 0.5, 0.8, 1.0, 1.25, 2.0, 4.0])
def test_pre_queue_staleness_matches_littles_law(rho):
    measured, predicted = _run(rho)
    assert measured == pytest.approx(predicted, rel=0.10), (rho, measured, predicted)
