"""A trainer rank on verl's single controller: a ``verl.single_controller.base.Worker`` whose three step methods are
registered with the dispatch verl 0.9.1's actor worker uses (``verl/workers/engine_workers.py``,
``ActorRolloutRefWorker``): ``make_nd_compute_dataproto_dispatch_fn(mesh_name="actor")`` for ``compute_log_prob``
and ``update_actor``, ``mesh_name="ref"`` for ``compute_ref_log_prob``. With every rank its own data-parallel rank
(``_register_dispatch_collect_info``), verl's dispatch chunks the driver's TensorDict into one piece per rank
(``chunk_tensordict``, ``consolidate``), puts the pieces into the object store (``parallel_put``) and calls each
rank with its ref; the collect concatenates the ranks' outputs (``concat_tensordict``).

What runs inside a rank is ours, and the same as in every other system's rank actor
(``knittrans.bench.ray_ranks.RankActor``): one torch thread, the startup heap frozen, ``loop.rank_loop`` over the
rank's mini-batches with the emulated compute. ``update_actor`` splits its chunk with verl's own iterator
(``tensordict_utils.make_iterator``, ``shuffle=False`` as verl's actor default) and, per mini-batch, concatenates
the rows' ``pixel_values`` (what the engine does before the forward); the two forward methods walk their chunk
the same way and return zero log-probs shaped as verl's (a jagged tensor over every token), with no emulated
compute (in verl's favour: KnitTrans's rows charge none for them either). Per-rank timings cannot come back
through verl's collect (``concat_tensordict`` keeps one rank's non-tensor metrics), so each rank keeps its
``RankTrace``s and hands them over on ``drain_traces`` (``Dispatch.ONE_TO_ALL``), after the timed part.

This module imports verl at import time: import it only where verl runs (``baselines.verl_system`` does, lazily).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterator

import torch
from tensordict import TensorDict
from verl.single_controller.base import Worker
from verl.single_controller.base.decorator import Dispatch, make_nd_compute_dataproto_dispatch_fn, register
from verl.utils import tensordict_utils as tu

from knittrans.bench.loop import Notify, rank_loop
from knittrans.bench.ray_ranks import map_object_store
from knittrans.bench.types import Obtained
from knittrans.dataplane.harness import RankTrace
from knittrans.dataplane.heap import freeze_startup_heap

MM_KEY = "multi_modal_inputs"
RUN_KEY = "knittrans_run"
"""The non-tensor entry of a dispatched TensorDict that carries our ``VerlRun`` (as verl carries its
``mini_batch_size``, ``epochs``, ... in the same TensorDict)."""


@dataclass(frozen=True)
class VerlRun:
    """What one dispatch asks of a rank besides verl's own settings."""

    num_minibatches: int
    """M: mini-batches (optimizer steps) in the chunk; the forward methods walk it in the same pieces."""
    iters_per_token: float = 0.0
    """Emulated compute per token per step (``update_actor`` only)."""
    first_batch: int = 0
    tag: int = 0
    """The pass's tag in step signals (``loop.step_key``)."""
    t0: float = 0.0
    """The batch's completion (``perf_counter``): mini-batch 0's get latency is t0 -> the call started."""
    first_ask: float | None = None
    """The rank has been ready since then; None: since its previous ``update_actor`` ended (or, for its first, the
    call's start)."""
    label: str = ""
    """Which dispatch this is, for the rank's trace ("d0", "d1", "d2")."""
    record_rows: bool = False
    """``update_actor`` keeps every row it trained on (``ReceivedRow``) for ``drain_traces``: what a test checks
    the rows against (off in the tables: it copies every row)."""


@dataclass(frozen=True)
class ReceivedRow:
    """One row as ``update_actor`` saw it in mini-batch ``minibatch``: its id and its unpadded tokens, advantages
    and pixel_values (None for text)."""

    rank: int
    minibatch: int
    traj_id: int
    input_ids: torch.Tensor
    advantages: torch.Tensor
    pixel_values: torch.Tensor | None


@dataclass(frozen=True)
class RankCall:
    """One call on one rank, for the trace: the dispatch, when the method body started (verl's dispatch had put
    the chunk, Ray had pulled and unpickled it) and ended, the chunk's payload bytes."""

    label: str
    rank: int
    t_start: float
    t_end: float
    nbytes: int


def payload_nbytes(td: TensorDict) -> int:
    """Bytes of a TensorDict's tensors (a jagged tensor's values and offsets) and of every row's multimodal
    tensors; other non-tensor entries (verl's settings, uids) are not counted."""
    total = 0
    for key in td.keys():
        if key == MM_KEY:
            total += sum(int(t.nbytes) for row in td[MM_KEY] for t in row.values())
            continue
        v = td.get(key)
        if isinstance(v, torch.Tensor):
            total += int(v.values().nbytes + v.offsets().nbytes) if v.is_nested else int(v.nbytes)
    return total


def pixel_nbytes(td: TensorDict) -> int:
    return sum(int(row["pixel_values"].nbytes) for row in td[MM_KEY]) if MM_KEY in td.keys() else 0


def minibatches(td: TensorDict, num_minibatches: int) -> Iterator[TensorDict]:
    """The chunk's mini-batches as verl's actor iterates them (``make_iterator``, in order, one epoch, one
    mini-batch copied out at a time; after its ``maybe_fix_3d_position_ids``, which an unpickled chunk's M-RoPE
    positions need)."""
    tu.maybe_fix_3d_position_ids(td)
    if len(td) % num_minibatches:
        raise ValueError(f"a chunk of {len(td)} rows does not split into {num_minibatches} mini-batches")
    return iter(tu.make_iterator(td, mini_batch_size=len(td) // num_minibatches, epochs=1, seed=0,
                                 dataloader_kwargs={"shuffle": False}))


def prepare(mb: TensorDict) -> tuple[int, int]:
    """What the engine does with a mini-batch before its forward: the rows' ``pixel_values`` concatenated (one
    copy of every occurrence). Returns (tokens computed on, pixel bytes)."""
    if MM_KEY in mb.keys() and len(mb):
        torch.cat([row["pixel_values"] for row in mb[MM_KEY]])
    return int(mb["input_ids"].offsets().diff().sum()), pixel_nbytes(mb)


def received_rows(rank: int, td: TensorDict, num_minibatches: int) -> list[ReceivedRow]:
    """Every row of an ``update_actor`` chunk, mini-batch by mini-batch, unpadded (``advantages`` cut to the
    response's length: the response half of ``attention_mask``)."""
    out = []
    for k, mb in enumerate(minibatches(td, num_minibatches)):
        mm = mb[MM_KEY] if MM_KEY in mb.keys() else [None] * len(mb)
        lp = mb["prompts"].shape[1]
        for i, (ids, row) in enumerate(zip(mb["input_ids"].unbind(), mm)):
            adv = mb["advantages"][i][:int(mb["attention_mask"][i, lp:].sum())]
            out.append(ReceivedRow(rank, k, int(mb["traj_id"][i]), ids.clone(), adv.clone(),
                                   None if row is None else row["pixel_values"].clone()))
    return out


@dataclass
class ChunkSource:
    """A ``StepSource`` over a rank's ``update_actor`` chunk (it arrived as the call's argument)."""

    chunk: TensorDict
    run: VerlRun

    def open(self, rank: int) -> None:
        self._t_start = time.perf_counter()
        self._mbs = minibatches(self.chunk, self.run.num_minibatches)

    def obtain(self, step: int) -> Obtained:
        mb = next(self._mbs)  # steps come in order (loop.rank_loop): mini-batch ``step``
        tokens, pixels = prepare(mb)
        return Obtained(payload_nbytes(mb), tokens, (self._t_start - self.run.t0) if step == 0 else 0.0, pixels)

    def release(self, step: int) -> None:
        pass

    def close(self) -> None:
        self._mbs = iter(())


class VerlRank(Worker):
    """One trainer rank (see the module docstring). ``signals``: the session's ``SignalActor`` (rank 0 announces
    each step there, which drives every system's rollout clock)."""

    def __init__(self, signals=None) -> None:  # noqa: ANN001 - a ray ActorHandle
        super().__init__()
        torch.set_num_threads(1)
        for mesh in ("actor", "ref"):
            self._register_dispatch_collect_info(mesh, dp_rank=self.rank, is_collect=True)
        self.signals = signals
        self.last_done: float | None = None
        self.traces: list[RankTrace] = []
        self.calls: list[RankCall] = []
        self.rows: list[ReceivedRow] = []
        freeze_startup_heap()  # as RankActor: the same process set-up for every system's steps
        map_object_store()  # and the same mapped object store (RaySession.warm_object_store)

    def _notify(self) -> Notify | None:
        signals = self.signals
        return None if signals is None else (lambda key, t: signals.set.remote(key, t))

    def _forward(self, data: TensorDict) -> TensorDict:
        t = time.perf_counter()
        run: VerlRun = tu.get(data, RUN_KEY)
        for mb in minibatches(data, run.num_minibatches):
            prepare(mb)
        ids = data["input_ids"]
        zeros = torch.zeros(ids.values().shape[0], dtype=torch.float32)
        out = tu.get_tensordict({"log_probs": torch.nested.nested_tensor_from_jagged(zeros, offsets=ids.offsets()),
                                 "entropy": torch.nested.nested_tensor_from_jagged(zeros.clone(),
                                                                                   offsets=ids.offsets())})
        self.calls.append(RankCall(run.label, self.rank, t, time.perf_counter(), payload_nbytes(data)))
        return out

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn(mesh_name="actor"))
    def compute_log_prob(self, data: TensorDict) -> TensorDict:
        return self._forward(data)

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn(mesh_name="ref"))
    def compute_ref_log_prob(self, data: TensorDict) -> TensorDict:
        return self._forward(data)

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn(mesh_name="actor"))
    def update_actor(self, data: TensorDict) -> TensorDict:
        t = time.perf_counter()
        run: VerlRun = tu.get(data, RUN_KEY)
        first_ask = run.first_ask if run.first_ask is not None else self.last_done
        nbytes = payload_nbytes(data)
        out = rank_loop(self.rank, ChunkSource(data, run), 1, run.num_minibatches, run.iters_per_token,
                        first_ask=first_ask, first_batch=run.first_batch, notify=self._notify(), tag=run.tag)
        self.last_done = out.timings[-1].t_done
        self.traces.append(out)
        if run.record_rows:
            self.rows += received_rows(self.rank, data, run.num_minibatches)
        self.calls.append(RankCall(run.label, self.rank, t, max(m.t_got for m in out.timings), nbytes))
        return tu.get_tensordict(tensor_dict={}, non_tensor_dict={"metrics": {"steps": [len(out.timings)]}})

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def drain_traces(self) -> tuple[list[RankTrace], list[RankCall], list[ReceivedRow]]:
        """This rank's ``update_actor`` traces, every call's timing and the recorded rows since the last drain; then
        the heap collected and frozen, as ``RankActor.settle`` before every system's pass (the drain is outside the
        timed part). Without it a pass's chunks stay: verl's TensorDicts sit in reference cycles (~4k objects, ~600
        MB a rank a pass at the default text size) that the generational collector rarely reaches, and five passes
        of the text table grew each rank by ~1 GB a pass until Ray's memory monitor killed them."""
        out = (self.traces, self.calls, self.rows)
        self.traces, self.calls, self.rows = [], [], []
        freeze_startup_heap()
        return out

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()
