"""The multi-node hooks, without a cluster: placement in the bench layout, the controller's node in the handoff
config, the trace recorder (off unless opened), and the bytes a traced flow counts."""

from __future__ import annotations

import numpy as np
import pytest

from knittrans.bench import BenchLayout, ClusterPlacement
from knittrans.dataplane import trace
from knittrans.handoff import HandoffConfig


def test_placement_names_units_and_ranks_by_their_nodes():
    p = ClusterPlacement("d", ("u0", "u1"), ("r0", "r1", "r2"))
    lay = BenchLayout(num_ranks=3, num_units=2, placement=p)
    assert lay.unit_nodes == {"unit0": "u0", "unit1": "u1"} and lay.rank_nodes == ("r0", "r1", "r2")
    assert p.controller == "d" and ClusterPlacement("d", ("u",), ("r",), controller_node="c").controller == "c"


def test_without_placement_the_layout_keeps_its_logical_labels():
    lay = BenchLayout(num_ranks=3, num_units=2)
    assert lay.unit_nodes == {"unit0": "node0", "unit1": "node1"} and lay.rank_nodes == ("node0", "node1", "node0")
    assert HandoffConfig.grpo(2, 2, 1, 8).controller_node is None


def test_a_placement_must_place_every_unit_and_rank():
    with pytest.raises(ValueError, match="places 1 units and 2 ranks"):
        BenchLayout(num_ranks=2, num_units=2, placement=ClusterPlacement("d", ("u0",), ("r0", "r1")))
    with pytest.raises(ValueError, match="at least one unit node"):
        ClusterPlacement("d", (), ("r0",))


def test_local_cluster_rejects_sizes_it_cannot_run():
    from knittrans.bench.cluster import LocalCluster

    with pytest.raises(ValueError, match="at least 2 nodes"):
        LocalCluster(1)
    with pytest.raises(ValueError, match="object_store_mib"):
        LocalCluster(3, object_store_mib=10)


def test_nothing_is_recorded_unless_a_recorder_is_open():
    trace.record(trace.CpuEvent("x", "n", 0.0, 1.0))
    assert trace.active() is None
    with trace.recording() as rec, trace.keyed("r0/s3"):
        trace.record(trace.CpuEvent("x", "n", 0.0, 1.0))
        assert trace.current_key() == "r0/s3" and len(rec.events) == 1
    assert trace.active() is None and trace.current_key() == ""


def test_payload_nbytes_counts_every_array_once_at_any_depth():
    import dataclasses

    import torch

    @dataclasses.dataclass
    class Chunk:
        values: tuple
        pixels: tuple
        name: str = "u0"

    c = Chunk((np.zeros(10, np.int64), {"a": np.zeros(3, np.float32)}), (torch.zeros(4, 2),))
    assert trace.payload_nbytes(c) == 80 + 12 + 32
