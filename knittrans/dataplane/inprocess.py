"""The in-process transport (the embedded default): controller and units are plain objects in this process.

Zero-copy: a unit stores the producer's arrays by reference and hands the same arrays to the fetching rank,
which packs them (the one copy a ready-to-use tensor needs). Producers and ranks are threads.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Mapping

from knittrans.dataplane.client import DataPlaneClient, PrepareConfig
from knittrans.dataplane.controller import Controller, ControllerConfig, ControllerStats
from knittrans.dataplane.storage import StorageUnit, UnitStats
from knittrans.dataplane.types import TrajectorySchema

if TYPE_CHECKING:
    from knittrans.admission.base import AdmissionPolicy
    from knittrans.dataplane.faults import FaultPlan


@dataclass
class InProcessDataPlane:
    """A controller and its units in this process; ``client(unit)`` gives a producer or rank its handle."""

    schema: TrajectorySchema
    controller: Controller
    units: dict[str, StorageUnit]
    prepare: PrepareConfig = field(default_factory=PrepareConfig)
    checksums: bool = False
    """Clients checksum every put and verify every fetch (``DataPlaneClient.checksums``)."""

    def client(self, local_unit: str | None = None) -> DataPlaneClient:
        return DataPlaneClient(self.controller, self.units, self.schema, local_unit, self.prepare,
                               checksums=self.checksums)

    def wait_drained(self, timeout: float | None = None) -> int:
        """Drops happen inside ``ack`` on this transport (synchronously): nothing is ever pending."""
        return 0

    def unit_stats(self) -> list[UnitStats]:
        return [u.stats() for u in self.units.values()]

    def controller_stats(self) -> ControllerStats:
        return self.controller.stats()

    def close(self) -> None:
        self.controller.close()


def build_inprocess(schema: TrajectorySchema, unit_nodes: Mapping[str, str], rank_nodes: tuple[str, ...],
                    balance_slack: float = 0.05, equal_counts: bool = True,
                    prepare: PrepareConfig | None = None, checksums: bool = False,
                    faults: "FaultPlan | None" = None, policy: "AdmissionPolicy | None" = None
                    ) -> InProcessDataPlane:
    """One unit per ``unit_nodes`` entry (unit id -> node), ``len(rank_nodes)`` trainer ranks. ``faults``
    (``knittrans.dataplane.faults.FaultPlan``) wraps the units it names in a ``FaultyUnit``; None: no wrapper."""
    ctrl = Controller(schema, unit_nodes, ControllerConfig(tuple(rank_nodes), balance_slack, equal_counts), policy)
    units = {u: StorageUnit(u, n, schema) for u, n in unit_nodes.items()}
    if faults:
        from knittrans.dataplane.faults import FaultyUnit

        units = {u: FaultyUnit(unit, faults.for_unit(u)) if faults.for_unit(u) else unit for u, unit in units.items()}
    return InProcessDataPlane(schema, ctrl, units, prepare or PrepareConfig(), checksums)
