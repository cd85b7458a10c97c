"""On-demand data plane: metadata controller, storage units near producers, per-rank fetch with prefetch.

See docs/dataplane.md. Transports: ``build_inprocess`` (embedded, zero-copy) and
``knittrans.dataplane.ray_transport.build_ray`` (units and controller as Ray actors; imported lazily so the
in-process path never needs Ray).
"""

from knittrans.dataplane.assign import ShareItem, assign_shares
from knittrans.dataplane.client import (ControllerAPI, DataPlaneClient, FetchTiming, PrepareConfig, UnitAPI,
                                        pack_share)
from knittrans.dataplane.controller import Controller, ControllerConfig, ControllerStats
from knittrans.dataplane.inprocess import InProcessDataPlane, build_inprocess
from knittrans.dataplane.prefetch import PrefetchConfig, PrefetchEvent, Prefetcher
from knittrans.dataplane.storage import StorageUnit, UnitStats
from knittrans.dataplane.types import (AdmissionStateError, AdmittedMiniBatch, AlreadyConsumedError,
                                       DataPlaneClosedError, DataPlaneError, DuplicatePutError, FieldMeta,
                                       FieldNotProducedError, FieldSpec, MiniBatchKey, PackedField, PackedShare,
                                       PutRecord, SchemaMismatchError, ShareLocation, TrajectoryPayload,
                                       TrajectorySchema, UnitChunk, UnknownMiniBatchError)

__all__ = [
    "AdmissionStateError", "AdmittedMiniBatch", "AlreadyConsumedError", "Controller", "ControllerAPI",
    "ControllerConfig", "ControllerStats", "DataPlaneClient", "DataPlaneClosedError", "DataPlaneError",
    "DuplicatePutError", "FetchTiming", "FieldMeta", "FieldNotProducedError", "FieldSpec", "InProcessDataPlane",
    "MiniBatchKey", "PackedField", "PackedShare", "PrefetchConfig", "PrefetchEvent", "Prefetcher",
    "PrepareConfig", "PutRecord", "SchemaMismatchError", "ShareItem", "ShareLocation", "StorageUnit",
    "TrajectoryPayload", "TrajectorySchema", "UnitAPI", "UnitChunk", "UnitStats", "UnknownMiniBatchError",
    "assign_shares", "build_inprocess", "pack_share",
]
