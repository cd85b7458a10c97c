"""The transfer tables' systems (``repro.transfer``, ``repro.cluster``): each a ``knittrans.bench.TransferSystem``
built from the table's config, so a table's rows differ in the system alone."""

from __future__ import annotations

from enum import Enum

from baselines.centralized import CentralizedConfig
from baselines.centralized_system import CentralizedSystem, CentralOverlap
from baselines.verl_system import VerlConfig, VerlSystem
from knittrans.bench import BenchLayout, KnitTransSystem, TransferSystem
from knittrans.handoff import Transport


class System(str, Enum):
    CENTRALIZED = "centralized"
    CENTRALIZED_PADMAX = "centralized-padmax"
    TRANSFERQUEUE = "transferqueue"
    KNITTRANS_RAY = "knittrans-ray"
    KNITTRANS_RAY_NOPREFETCH = "knittrans-ray-noprefetch"
    KNITTRANS_INPROC = "knittrans-inproc"
    VERL = "verl"
    KNITTRANS_RAY_DRAIN = "knittrans-ray-drain"
    """knittrans-ray whose raw pass is a drain: everything put and admitted before t0, ranks ack, no compute."""
    ENGINE_CEILING = "engine-ceiling"
    """Ray's own ceiling for KnitTrans's read path on the same objects (``knittrans.bench.ceiling``); raw only."""
    INPROC_CEILING = "inproc-ceiling"
    """The same in process: knittrans-inproc's ceiling, its ranks as threads copying the same shares; raw only."""


MM_SYSTEMS = (System.CENTRALIZED, System.VERL, System.TRANSFERQUEUE, System.KNITTRANS_RAY,
              System.KNITTRANS_RAY_NOPREFETCH, System.KNITTRANS_INPROC, System.ENGINE_CEILING)
"""padmax is the text table's variant. TransferQueue moves per-trajectory fields with each sample's own images. The
engine ceiling reads each share's fields and distinct images (the multimodal units' objects) with one pack: the
least raw pass a design reading through Ray can have (``mm_ceiling_transfer_ratio``)."""
TEXT_SYSTEMS = tuple(System)
"""Every system (the in-process ceiling only here: the in-process claim is a text claim). (``verl-mm``, our
re-implementation of verl's multimodal step, ran until session 33: it measured nothing verl's own code does not;
docs/experiments.md has both side by side.)"""


def make_system(kind: System, cfg, layout: BenchLayout, session) -> TransferSystem:  # noqa: ANN001
    """``kind`` for ``cfg`` (a ``repro.transfer.TransferConfig``) on ``layout``; ``session``: the table's
    ``RaySession``."""
    mm = cfg.workload == "multimodal"
    if kind in (System.CENTRALIZED, System.CENTRALIZED_PADMAX):
        pad = "max" if kind is System.CENTRALIZED_PADMAX else "longest"
        conf = CentralizedConfig(pad_to=pad, max_prompt_len=cfg.text.max_prompt_len,
                                 max_response_len=cfg.text.max_response_len)
        return CentralizedSystem(kind.value, layout, session, conf, CentralOverlap(cfg.central_overlap))
    if kind in (System.ENGINE_CEILING, System.INPROC_CEILING):
        from knittrans.bench.ceiling import EngineCeilingSystem

        return EngineCeilingSystem(kind.value, layout, session, multimodal=mm,
                                   in_process=kind is System.INPROC_CEILING)
    if kind is System.VERL:  # verl's agent loop pads to rollout.prompt_length / response_length (text's maxima)
        conf = VerlConfig() if mm else VerlConfig(cfg.text.max_prompt_len, cfg.text.max_response_len)
        return VerlSystem(kind.value, layout, session, conf, CentralOverlap(cfg.central_overlap))
    if kind is System.TRANSFERQUEUE:
        from baselines.transferqueue_system import TransferQueueSystem
        from knittrans.dataplane.types import TEXT_SCHEMA

        return TransferQueueSystem(kind.value, layout, session, TEXT_SCHEMA, cfg.tq_storage_units, multimodal=mm)
    transport = Transport.INPROCESS if kind is System.KNITTRANS_INPROC else Transport.RAY
    return KnitTransSystem(kind.value, layout, transport, multimodal=mm,
                           prefetch=kind is not System.KNITTRANS_RAY_NOPREFETCH, session=session,
                           drain=kind is System.KNITTRANS_RAY_DRAIN)
