"""From scored samples to handoff messages: the ``Rollout`` a producer puts, and a local packer for learners.

``to_rollout`` turns one generated ``Sample`` with its group-normalized advantage (``TrainItem``) and its
request's images into the ``knittrans.handoff.Rollout`` the orchestrator puts: the text schema's fields
(``TEXT_SCHEMA``, also the text part of ``MM_SCHEMA``)::

    input_ids      int64    prompt + response
    old_logprobs   float32  behaviour log-prob of each response token (the importance ratio's denominator)
    advantages     float32  the sample's advantage, on every response token
    loss_mask      bool     True on every response token

``pack_rollouts`` packs rollouts into one ``PackedShare`` exactly as the data plane does
(``knittrans.dataplane.client.pack_share``), without a data plane: for tests and offline steps of a ``Learner``.

Example::

    >>> from knittrans.runtime.engine import Sample
    >>> from knittrans.runtime.trainer import TrainItem
    >>> s = Sample(traj_id=0, group_id=0, batch_id=0, prompt_ids=(1, 5), response_ids=(7, 2),
    ...            logprobs=(-0.5, -0.1), v_gen=3, t_start=0.0, t_end=0.0)
    >>> r = to_rollout(TrainItem(s, reward=1.0, advantage=0.7))
    >>> r.traj.v_gen, r.tensors["input_ids"].tolist(), r.tensors["advantages"].tolist()
    (3, [1, 5, 7, 2], [0.699999988079071, 0.699999988079071])
    >>> share = pack_rollouts([r])
    >>> share.fields["input_ids"].cu_seqlens.tolist(), share["loss_mask"].tolist()
    ([0, 4], [True, True])
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import numpy as np

from knittrans.dataplane.client import pack_share
from knittrans.dataplane.types import (TEXT_SCHEMA, MiniBatchKey, PackedShare, ShareLocation, TrajectorySchema,
                                       UnitChunk)
from knittrans.handoff import Rollout
from knittrans.runtime.engine import GroupRequest
from knittrans.types import Trajectory

if TYPE_CHECKING:
    from knittrans.runtime.trainer import TrainItem


def to_rollout(item: "TrainItem", request: GroupRequest | None = None, t_complete: float = 0.0) -> Rollout:
    """The handoff message of one scored sample (``request``: its group's request, whose images and grids it
    shows; None for text)."""
    s = item.sample
    n = len(s.response_ids)
    tensors = {"input_ids": np.asarray(s.prompt_ids + s.response_ids, dtype=np.int64),
               "old_logprobs": np.asarray(s.logprobs, dtype=np.float32),
               "advantages": np.full(n, item.advantage, dtype=np.float32),
               "loss_mask": np.ones(n, dtype=bool)}
    traj = Trajectory(s.traj_id, s.group_id, s.batch_id, n, s.v_gen, len(s.prompt_ids), t_complete)
    if request is None:
        return Rollout(traj, tensors)
    return Rollout(traj, tensors, images=tuple(request.images), grids=tuple(request.grids))


def pack_rollouts(rollouts: Sequence[Rollout], schema: TrajectorySchema = TEXT_SCHEMA, seq: int = 0,
                  key: MiniBatchKey = MiniBatchKey(0, 0)) -> PackedShare:
    """One rank's share holding ``rollouts`` (in order), packed by the data plane's own ``pack_share``."""
    if not rollouts:
        raise ValueError("pack_rollouts: no rollouts")
    names = tuple(f.name for f in schema.fields if f.name in rollouts[0].tensors)
    ids = tuple(r.traj.traj_id for r in rollouts)
    values, lengths, nbytes = [], [], 0
    for name in names:
        spec = schema.get(name)
        arrs = [np.asarray(r.tensors[name]) for r in rollouts]
        for t, a in zip(ids, arrs):
            spec.check(t, a)
        values.append(np.concatenate(arrs) if spec.ragged else np.stack(arrs))
        lengths.append(np.array([a.shape[0] for a in arrs], dtype=np.int64) if spec.ragged else None)
        nbytes += sum(a.nbytes for a in arrs)
    loc = ShareLocation(key=key, rank=0, traj_ids=ids, unit_ids=("local",) * len(ids), fields=names, nbytes=nbytes,
                        seq=seq, group_ids=tuple(dict.fromkeys(r.traj.group_id for r in rollouts)))
    return pack_share(loc, [UnitChunk("local", ids, names, tuple(values), tuple(lengths))], schema)
