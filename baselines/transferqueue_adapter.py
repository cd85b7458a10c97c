"""TransferQueue (``transferqueue`` on PyPI, an optional extra) behind a small adapter, on the same workload.

TransferQueue (Ascend/TransferQueue) is the closest existing system: a metadata controller plus storage units,
clients that put and get per-sample fields. We drive its key-value API (``kv_batch_put`` / ``kv_batch_get``)
with the default ``SimpleStorage`` backend (ZMQ, in-memory units as Ray actors): keys are trajectory ids,
ragged fields travel as jagged nested tensors, and a get returns them already packed (values + offsets), so
the trainer-side result is the same varlen layout KnitTrans hands out.

Operational notes: TransferQueue places its controller and each storage unit as Ray actors that each take a
logical CPU; with fewer than ``1 + num_storage_units`` logical CPUs free it waits silently, so
``required_ray_cpus`` says how many to give ``ray.init``. Its import is optional: ``transferqueue_available()``
is False when it is not installed, and callers skip it.
"""

from __future__ import annotations

import importlib.util
import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from knittrans.dataplane.types import TrajectoryPayload, TrajectorySchema


def transferqueue_available() -> bool:
    """True when the ``transfer_queue`` package can be imported (without importing it)."""
    return importlib.util.find_spec("transfer_queue") is not None


def required_ray_cpus(num_storage_units: int) -> int:
    """Logical CPUs TransferQueue's actors need: its controller plus one per storage unit."""
    return 1 + num_storage_units


@dataclass(frozen=True)
class TQConfig:
    """How TransferQueue is started."""

    num_storage_units: int = 2
    """SimpleStorage units (Ray actors, round-robin over nodes)."""
    partition: str = "train"
    """Partition that holds the benchmark's trajectories."""


@dataclass(frozen=True)
class TQShare:
    """A rank's share as TransferQueue returns it: packed values and cu_seqlens per ragged field."""

    traj_ids: tuple[int, ...]
    values: dict[str, np.ndarray]
    cu_seqlens: dict[str, np.ndarray]
    nbytes: int
    tokens: int
    get_s: float


def start(config: TQConfig = TQConfig()) -> None:
    """Start (or attach to) TransferQueue in the current Ray cluster."""
    import transfer_queue as tq
    from omegaconf import OmegaConf

    tq.init(OmegaConf.create({"backend": {"SimpleStorage": {"num_data_storage_units": config.num_storage_units}}}))


def attach() -> None:
    """Connect this process (e.g. a trainer-rank actor) to the TransferQueue already running."""
    import transfer_queue as tq

    tq.init()


def close() -> None:
    import transfer_queue as tq

    tq.close()


def _key(traj_id: int) -> str:
    return str(traj_id)


def put(payloads: Sequence[TrajectoryPayload], schema: TrajectorySchema, partition: str) -> None:
    """Write trajectories (every schema field) in one ``kv_batch_put``."""
    import torch
    import transfer_queue as tq
    from tensordict import TensorDict

    cols = {}
    for spec in schema.fields:
        ts = [torch.from_numpy(np.ascontiguousarray(p.tensors[spec.name])) for p in payloads]
        if spec.ragged:
            cols[spec.name] = torch.nested.as_nested_tensor(ts, layout=torch.jagged)
        else:
            cols[spec.name] = torch.stack(ts)
    tq.kv_batch_put(keys=[_key(p.traj_id) for p in payloads], partition_id=partition,
                    fields=TensorDict(cols, batch_size=len(payloads)))


def get(traj_ids: Sequence[int], fields: Sequence[str], schema: TrajectorySchema, partition: str) -> TQShare:
    """A rank's share in one ``kv_batch_get``; timing covers the get and unpacking to values + offsets."""
    import transfer_queue as tq

    t = time.perf_counter()
    td = tq.kv_batch_get(keys=[_key(i) for i in traj_ids], partition_id=partition, select_fields=list(fields))
    values, cus = {}, {}
    nbytes = 0
    for name in fields:
        x = td[name]
        if schema.get(name).ragged:
            v = x.values().numpy()
            cu = x.offsets().numpy()
        else:
            v = x.numpy()
            cu = None
        values[name] = v
        if cu is not None:
            cus[name] = cu
        nbytes += int(v.nbytes)
    get_s = time.perf_counter() - t
    tok = int(values[schema.token_field].shape[0]) if schema.token_field in values else 0
    return TQShare(tuple(traj_ids), values, cus, nbytes, tok, get_s)


def clear(traj_ids: Sequence[int], partition: str) -> None:
    import transfer_queue as tq

    tq.kv_clear(keys=[_key(i) for i in traj_ids], partition_id=partition)
