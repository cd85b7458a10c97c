"""``HandoffConfig.read_timeout_s`` reaches the reads of both transports: a unit hung in ``get`` ends a trainer's
fetch with the typed ``ReadTimeoutError`` at the configured deadline, and the claim is undone."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from knittrans.dataplane.client import PrepareConfig
from knittrans.dataplane.types import ReadTimeoutError
from knittrans.handoff import Handoff, HandoffConfig, Rollout
from knittrans.types import BatchPlan, GroupSpec, Trajectory


def _rollout(t: int) -> Rollout:
    return Rollout(Trajectory(traj_id=t, group_id=t // 2, batch_id=0, num_tokens=2, v_gen=0),
                   {"input_ids": np.arange(5) + t, "old_logprobs": np.full(2, -1.0, np.float32),
                    "advantages": np.ones(2, np.float32), "loss_mask": np.ones(2, bool)})


def test_a_hung_unit_read_fails_with_the_typed_timeout_at_the_configured_deadline():
    # Reads through the unit (a direct read from the put's sources never waits on the unit: test_dataplane_buffers)
    cfg = HandoffConfig.grpo(prompts_per_batch=2, group_size=2, num_minibatches=1, max_response_len=8,
                             read_timeout_s=0.3, prepare=PrepareConfig(direct_reads=False))
    h = Handoff(cfg)
    assert h.plane.read_timeout_s == 0.3
    unit = h.plane.units["u0"]
    wake, held = threading.Event(), threading.Event()

    def stuck() -> None:  # the unit hangs mid-operation holding its lock (an in-process get waits only on it)
        with unit._lock:
            held.set()
            wake.wait(timeout=30)

    try:
        h.add_batch(BatchPlan(0, (GroupSpec(0, 0, 2), GroupSpec(1, 0, 2))))
        h.seal()
        h.producer().put([_rollout(t) for t in range(4)])
        hang = threading.Thread(target=stuck, daemon=True)
        hang.start()
        assert held.wait(timeout=10)
        with pytest.raises(ReadTimeoutError, match=r"unit u0 did not answer a read within 0\.3 s"):
            h.consumer(0).take(1)
        assert not wake.is_set()  # it ended at the configured deadline, not when the unit answered
        wake.set()
        hang.join(timeout=10)
        share = h.consumer(0).take(1)[0]  # the claim was undone: a new consumer gets the whole share
        assert share.traj_ids == (0, 1, 2, 3)
    finally:
        wake.set()
        h.close()


@pytest.mark.parametrize("bad", [0, -1.0, float("inf"), "5", True])
def test_read_timeout_must_be_a_positive_finite_number_or_none(bad):
    with pytest.raises(ValueError, match="read_timeout_s"):
        HandoffConfig.grpo(prompts_per_batch=1, group_size=2, num_minibatches=1, max_response_len=8,
                           read_timeout_s=bad)
