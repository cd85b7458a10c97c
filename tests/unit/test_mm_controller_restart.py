"""The multimodal plane's controller (``MMController``) restarts like the text one (``knittrans.dataplane.recovery``):
rebuilt from its journal and the units' manifests, which re-report each trajectory's group and its images' content
keys (``MMStorageUnit.manifest``). After restarts mid-run every trajectory is trained exactly once, in the shares a
run without restarts makes, every image occurrence resolves to its own bytes and grid, each distinct image of a
share still moves once however many units hold copies, and the encoding stores end empty. In process
(``restart_controller``: the same rebuild a restarted Ray actor runs; the Ray run is
tests/e2e/test_mm_controller_restart_ray.py)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from knittrans.admission.minibatch import KnitTransAdmission
from knittrans.constraints import BatchConstraints
from knittrans.dataplane.faults import StepLedger
from knittrans.dataplane.types import DataLostError, MiniBatchKey
from knittrans.mmdedup.plane import IMAGE_FIELD, MMPayload, MMShareLocation, build_mm_inprocess
from knittrans.types import BatchPlan, GroupSpec, MiniBatch, Trajectory
from workloads.multimodal import MMWorkloadConfig, MultimodalWorkload
from workloads.multimodal_data import producer_of, trajectory_fields

UNITS = {"u0": "n0", "u1": "n1", "u2": "n2"}
RANKS = ("n0", "n1")
BATCHES, P, N, M = 2, 4, 4, 2


def _groups():
    wl = MultimodalWorkload(MMWorkloadConfig(prompts_per_batch=P, n=N, images_per_prompt=2,
                                             image_sizes=((56, 56), (56, 84)), seed=0))
    return [g for b in range(BATCHES) for g in wl.sample_batch(b)]


def check_occurrences(share, sample) -> int:  # noqa: ANN001
    """Every image occurrence of every trajectory of ``share`` is its own pixels and grid; returns the distinct
    images' bytes of the share's groups (what one copy per distinct image moves)."""
    ids, groups = share.image_ids, {}
    for t in share.traj_ids:
        g, s = sample[t]
        groups[id(g)] = g
        assert len(ids[t]) == len(s.image_index)
        for j, i in zip(s.image_index, ids[t]):
            assert torch.equal(share.images.pixels[i], g.images[j].pixel_values), f"trajectory {t} image {j}"
            assert share.images.grids[i] == g.images[j].grid_thw, f"trajectory {t} image {j}: grid"
    return sum(im.nbytes for g in groups.values() for im in g.images)


def _run(seed: int, restart_p: float):  # noqa: ANN202
    """GRPO groups spread over three units (verl's placement: a group's copies on every unit), completing in a
    random order under a KnitTrans admission policy; two ranks step as mini-batches are admitted; the controller
    restarts at random points (between puts, between a rank's fetch and its ack). Returns per (step, rank) the
    trajectories and pixel bytes moved, every trained id, the restarts and the data plane."""
    groups = _groups()
    sample = {s.traj_id: (g, s) for g in groups for s in g.samples}
    fields = {t: trajectory_fields(s) for t, (_, s) in sample.items()}
    c = BatchConstraints(batch_size=P * N, num_minibatches=M, group_size=N,
                         max_response_len=max(len(f["advantages"]) for f in fields.values()))
    dp = build_mm_inprocess(UNITS, RANKS, policy=KnitTransAdmission(c), recoverable=True)
    client, ctrl = dp.client(), dp.controller
    rng, chaos = np.random.default_rng(seed), np.random.default_rng(seed + 100)
    restarts = 0

    def maybe_restart() -> None:
        nonlocal restarts
        if chaos.random() < restart_p:
            restarts = dp.restart_controller()

    for b in range(BATCHES):
        ctrl.add_batch(BatchPlan(b, tuple(GroupSpec(b * P + g, b, N) for g in range(P))))
    ctrl.seal()
    ids = [int(t) for t in rng.permutation(sorted(sample))]
    seqs, ledgers, shares, trained = [0, 0], [StepLedger(), StepLedger()], {}, []
    while ids or min(seqs) < BATCHES * M:
        k = int(rng.integers(1, 4))
        chunk, ids = ids[:k], ids[k:]
        for t in chunk:
            g, s = sample[t]
            meta = Trajectory(t, s.prompt_id, s.prompt_id // P, len(fields[t]["advantages"]), v_gen=0)
            unit = producer_of("spread", s.prompt_id, t - s.prompt_id * N, N, len(UNITS))
            # group unset on purpose: the unit keeps the metadata's group for its manifest
            dp.client(f"u{unit}").put([MMPayload(t, fields[t], meta=meta,
                                                 encodings=tuple(g.images[j].pixel_values for j in s.image_index),
                                                 grids=tuple(g.images[j].grid_thw for j in s.image_index))])
        maybe_restart()
        for r in (0, 1):
            while seqs[r] < ctrl.stats().admitted:
                share = client.fetch_next(seqs[r], r, timeout=5, ack=False)
                distinct = check_occurrences(share, sample)
                out, new = ledgers[r].apply(share.key, lambda: list(share.traj_ids))
                trained += out if new else []
                shares[(share.seq, r)] = (tuple(sorted(share.traj_ids)), share.pixel_nbytes, distinct)
                maybe_restart()
                client.ack(share)
                seqs[r] += 1
        assert chunk or min(seqs) >= BATCHES * M, "every trajectory is put and a step is still not admitted"
    return shares, trained, restarts, dp


@pytest.mark.parametrize("seed", [0, 1])
def test_after_mm_controller_restarts_every_trajectory_trains_once_with_its_images_and_the_stores_end_empty(seed):
    ref_shares, ref_trained, _, _ = _run(seed, 0.0)
    shares, trained, restarts, dp = _run(seed, 0.35)
    assert restarts >= 4  # the controller really restarted, between every kind of call
    assert sorted(trained) == sorted(ref_trained) == sorted(t for g in _groups() for t in
                                                            (s.traj_id for s in g.samples))  # each once
    assert shares == ref_shares  # the same shares (groups kept whole after a rebuild), the same bytes moved
    assert all(moved == distinct for _, moved, distinct in shares.values())  # each distinct image once per share
    st = dp.controller.stats()
    assert (st.released_minibatches, st.restarts, st.missing, st.held) == (BATCHES * M, restarts, 0, 0)
    assert dp.live_bytes() == 0 and all(u.stats().nbytes == 0 for u in dp.units.values())  # stores empty
    assert dp.journal.size()["events"] == 0 and dp.journal.size()["admitted"] == 0


def _blank(t: int, img, grid):  # noqa: ANN001, ANN202
    f = {"input_ids": np.arange(6), "old_logprobs": np.zeros(2, np.float32), "advantages": np.ones(2, np.float32),
         "loss_mask": np.ones(2, bool)}
    return MMPayload(t, f, group=0, encodings=(img,), grids=(grid,))


def _blank_pair_plane():
    """The same bytes shown with two grids (56x84 and 84x56), on two units: four trajectories of one group."""
    img = torch.randn(24, 1176)
    dp = build_mm_inprocess(UNITS, ("n0",), recoverable=True)
    dp.client("u0").put([_blank(0, img, (1, 4, 6)), _blank(1, img, (1, 6, 4))])
    dp.client("u1").put([_blank(2, img.clone(), (1, 6, 4)), _blank(3, img.clone(), (1, 4, 6))])
    return dp, img


def test_after_a_restart_the_same_bytes_with_two_grids_stay_two_images_moved_once_each():
    dp, img = _blank_pair_plane()
    assert dp.restart_controller() == 1  # before admission: groups and keys come from the manifests only
    mb = MiniBatch(0, 0, (0, 1, 2, 3), (0,), 24)
    dp.controller.admit(mb)
    assert dp.restart_controller() == 2
    loc = dp.controller.claim(MiniBatchKey(0, 0), 0, ("input_ids", IMAGE_FIELD))
    assert isinstance(loc, MMShareLocation) and sum(len(k) for _, k in loc.image_sources) == 2
    dp.controller.unclaim(MiniBatchKey(0, 0), 0, ("input_ids", IMAGE_FIELD))
    share = dp.client().fetch(mb, rank=0)
    ids = share.image_ids
    assert ids[0] == ids[3] and ids[1] == ids[2] and ids[0] != ids[1]
    assert share.images.grids[ids[0][0]] == (1, 4, 6) and share.images.grids[ids[1][0]] == (1, 6, 4)
    assert all(torch.equal(p, img) for p in share.images.pixels)
    assert share.pixel_nbytes == 2 * img.numel() * 4  # two grids, each once: not once per unit holding a copy
    assert dp.live_bytes() == 0


def test_a_put_retried_across_a_restart_brings_the_keys_a_rebuild_did_not_see():
    dp, img = _blank_pair_plane()
    manifests = {u: unit.manifest() for u, unit in dp.units.items()}
    assert all(r.images is not None and r.group == 0 for ms in manifests.values() for r in ms)
    # a rebuild that saw the trajectories but not their keys (their put's images were still being recorded)
    blind = {u: [dataclasses.replace(r, images=None) for r in ms] for u, ms in manifests.items()}
    dp.controller.restore(dp.journal.attach(), blind)
    key = MiniBatchKey(0, 0)
    dp.controller.admit(MiniBatch(0, 0, (0, 1, 2, 3), (0,), 24))
    assert not isinstance(dp.controller.claim(key, 0, (IMAGE_FIELD,)), MMShareLocation)  # no keys: no sources
    dp.controller.unclaim(key, 0, (IMAGE_FIELD,))
    dp.controller.register(manifests["u0"] + manifests["u1"])  # the producers' retried registers: repeats
    assert sum(len(k) for _, k in dp.controller.claim(key, 0, (IMAGE_FIELD,)).image_sources) == 2


def test_a_unit_lost_while_the_mm_controller_was_down_is_reput_with_its_images_and_resolves_right():
    dp, img = _blank_pair_plane()
    mb = MiniBatch(0, 0, (0, 1, 2, 3), (0,), 24)
    dp.controller.admit(mb)
    dp.units["u1"].clear()  # u1 dies while the controller is down: the rebuild hears from u0 only
    dp.controller.restore(dp.journal.attach(), {"u0": dp.units["u0"].manifest()})
    assert sorted(dp.controller.missing()) == [2, 3]
    with pytest.raises(DataLostError):
        dp.client().fetch(mb, rank=0)
    dp.client("u2").put([_blank(2, img.clone(), (1, 6, 4)), _blank(3, img.clone(), (1, 4, 6))])  # the re-put
    share = dp.client().fetch(mb, rank=0)
    ids = share.image_ids
    assert ids[0] == ids[3] and ids[1] == ids[2] and ids[0] != ids[1]
    assert share.images.grids[ids[0][0]] == (1, 4, 6) and share.images.grids[ids[1][0]] == (1, 6, 4)
    assert all(torch.equal(p, img) for p in share.images.pixels)
    assert share.pixel_nbytes == 2 * img.numel() * 4  # the re-put's keys came with it: still each image once
    assert dp.live_bytes() == 0 and all(u.stats().nbytes == 0 for u in dp.units.values())
