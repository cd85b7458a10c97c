"""A faithful verl multimodal baseline: per-sample ``multi_modal_inputs`` (dicts of torch tensors) in a DataProto,
gathered from the rollout units to the driver and scattered to the trainer ranks once per dispatch verl makes in a
step (issue 14). Beside ``centralized_system`` / ``centralized_mm`` (kept: they ship one contiguous numpy buffer of
pixels, once per step, a kinder baseline than verl).

Which verl code path each stage follows (verl main, ``verl/trainer/ppo/ray_trainer.py`` ``RayPPOTrainer.fit``, the
agent loop ``verl/experimental/agent_loop/agent_loop.py``, ``verl/protocol.py`` ``DataProto``,
``verl/workers/actor/dp_actor.py``):

1. **Rollout** (before t0, not timed): every sample is its own agent-loop request, routed to the least-loaded
   server (``AsyncLLMServerManager._choose_server``; the workload's ``placement``). Each sample runs the processor
   on its own (``processor(text=..., images=...)``): ``multi_modal_inputs`` = ``{"pixel_values": [patches, 1176],
   "image_grid_thw": [k, 3]}``, its own tensors (the n samples of a group do not share them). The worker's
   ``_postprocess`` returns a ``DataProto``: padded ``prompts`` / ``responses`` / ``input_ids`` / ``attention_mask``
   / 3-D M-RoPE ``position_ids`` (Qwen2-VL) in ``batch``, ``non_tensor_batch["multi_modal_inputs"] =
   np.array(per_sample_dicts, dtype=object)`` and the group ``uid``. Here: one such ``VerlProto`` per rollout unit,
   ``ray.put`` (the worker's return value).
2. **Gather** at t0 (train-batch admission: ``generate_sequences`` returns once every sample is done):
   ``ray.get`` of every unit's output on the driver and ``DataProto.concat``; the dense tensors travel as
   ``torch.save`` bytes and the per-row dicts through pickle (``DataProto.__getstate__``), a copy each way.
3. **Balance**: ``_balance_batch`` reorders rows (``DataProto.reorder``: the object array is re-indexed, the dicts
   are shared).
4. **Three dispatches of the same rows** (``Dispatch.DP_COMPUTE_PROTO``: ``data.chunk(world_size)``, one chunk per
   rank as a Ray call argument, serialized again each time): ``actor_rollout_wg.compute_log_prob(batch)`` (old
   log-prob), ``ref_policy_wg.compute_ref_log_prob(batch)`` (reference), then ``actor_rollout_wg.update_actor
   (batch)``. The first two return ``[B, Lr]`` fp32 log-probs the driver ``union``s into the batch (made on the
   driver here: small next to the pixels); a rank's ``dp_actor`` splits its chunk into micro-batches and
   ``torch.cat``s the rows' ``pixel_values`` per micro-batch before the forward (done here per mini-batch share).
5. **Update**: the rank splits its chunk into mini-batches (``data.split``), one optimizer step each (emulated
   compute, the same as every system's).

Choices in the baseline's favour, stated: the two forward passes (old and reference log-prob) cost no emulated
compute here (only their transfer is charged: KnitTrans's rows charge none either); the raw images
(``multi_modal_data``) are not carried; prompts and responses are padded to the batch's longest (verl pads to the
configured maxima). Across batches the driver overlaps as ``centralized_system.CentralOverlap`` says (build-ahead:
gather, concat and balance b+1 while b trains; the dispatches wait for b's ``update_actor``).
"""

from __future__ import annotations

import dataclasses
import io
import time
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import ray
import torch

from baselines.centralized import balance_plan
from baselines.centralized_system import CentralOverlap, traced_gather
from baselines.verl_system import pad_rows, padded_rows
from knittrans.bench.loop import finish_raw, finish_steady, merge_traces, step_key
from knittrans.bench.ray_ranks import RankRun, RaySession, actor_wait, pinned
from knittrans.bench.types import BenchLayout, Obtained, PassData, PassResult
from knittrans.dataplane.harness import RankTrace
from knittrans.dataplane.trace import CpuEvent, FlowEvent

MM_KEY = "multi_modal_inputs"
DISPATCHES = ("compute_log_prob", "compute_ref_log_prob", "update_actor")
"""What verl dispatches to the trainer ranks per step, each with the whole batch (its multimodal inputs included)."""


@dataclass
class VerlProto:
    """A ``DataProto`` as verl serializes it: ``batch`` (equal-length rows of torch tensors, a TensorDict there),
    ``non_tensor_batch`` (numpy object arrays, one entry per row: ``multi_modal_inputs`` holds each row's dict of
    tensors), ``meta_info``. Pickles as ``DataProto.__getstate__`` does: ``torch.save`` of the (consolidated) batch
    to bytes, the object arrays through pickle."""

    batch: dict[str, torch.Tensor]
    non_tensor_batch: dict[str, np.ndarray] = field(default_factory=dict)
    meta_info: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return int(next(iter(self.batch.values())).shape[0]) if self.batch else 0

    def __getstate__(self) -> tuple:
        buf = io.BytesIO()
        torch.save({k: v.contiguous().clone() for k, v in self.batch.items()}, buf)  # consolidate(): own storage
        return buf.getvalue(), self.non_tensor_batch, self.meta_info

    def __setstate__(self, state: tuple) -> None:
        raw, self.non_tensor_batch, self.meta_info = state
        self.batch = torch.load(io.BytesIO(raw), weights_only=True)

    @staticmethod
    def concat(protos: Sequence["VerlProto"]) -> "VerlProto":
        """``DataProto.concat``: rows of every piece, in order."""
        keys = protos[0].non_tensor_batch.keys()
        return VerlProto({k: torch.cat([p.batch[k] for p in protos]) for k in protos[0].batch},
                         {k: np.concatenate([p.non_tensor_batch[k] for p in protos]) for k in keys})

    def select(self, rows: np.ndarray) -> "VerlProto":
        """``DataProto.reorder`` / ``select_idxs``: tensors gathered (a copy), object arrays re-indexed (the
        per-row dicts shared)."""
        idx = torch.as_tensor(rows, dtype=torch.long)
        return VerlProto({k: v[idx] for k, v in self.batch.items()},
                         {k: v[rows] for k, v in self.non_tensor_batch.items()}, dict(self.meta_info))

    def split(self, size: int) -> list["VerlProto"]:
        """``DataProto.split``: consecutive pieces of ``size`` rows (views)."""
        return [VerlProto({k: v[i:i + size] for k, v in self.batch.items()},
                          {k: v[i:i + size] for k, v in self.non_tensor_batch.items()}, self.meta_info)
                for i in range(0, len(self), size)]

    def chunk(self, k: int) -> list["VerlProto"]:
        if len(self) % k:
            raise ValueError(f"VerlProto.chunk: {len(self)} rows do not split into {k} equal chunks")
        return self.split(len(self) // k)

    def union(self, tensors: dict[str, torch.Tensor]) -> None:
        """``DataProto.union`` with a dispatch's output (the log-probs)."""
        self.batch.update(tensors)

    @property
    def pixel_nbytes(self) -> int:
        return sum(int(d["pixel_values"].nbytes) for d in self.non_tensor_batch.get(MM_KEY, ()))

    @property
    def nbytes(self) -> int:
        """Payload bytes: the dense tensors and every row's multimodal tensors."""
        mm = sum(int(t.nbytes) for d in self.non_tensor_batch.get(MM_KEY, ()) for t in d.values())
        return sum(int(v.nbytes) for v in self.batch.values()) + mm


def rollout_output(d: PassData, traj_ids: Sequence[int], lp: int, lr: int) -> VerlProto:
    """One agent-loop worker's ``_postprocess`` output for the samples it generated (see the module docstring)."""
    rs, prompts, responses, attention, pos = padded_rows(d, traj_ids, lp, lr)
    batch = {"prompts": prompts, "responses": responses, "input_ids": torch.cat([prompts, responses], 1),
             "attention_mask": attention, "position_ids": pos[:, None, :].expand(-1, 3, -1).contiguous(),
             "rollout_log_probs": pad_rows([r.tensors["old_logprobs"] for r in rs], lr, False, torch.float32),
             "advantages": pad_rows([r.tensors["advantages"] for r in rs], lr, False, torch.float32),
             "response_mask": pad_rows([r.tensors["loss_mask"] for r in rs], lr, False, torch.bool)}
    mm = np.empty(len(rs), dtype=object)
    for i, r in enumerate(rs):  # the processor ran per sample: its own tensors, not the group's
        mm[i] = {"pixel_values": torch.cat([torch.as_tensor(x) for x in r.images]),  # cat: a fresh tensor
                 "image_grid_thw": torch.tensor(r.grids, dtype=torch.int64).reshape(-1, 3)}
    uid = np.array([f"g{r.traj.group_id}" for r in rs], dtype=object)
    return VerlProto(batch, {MM_KEY: mm, "uid": uid, "traj_id": np.asarray(traj_ids, dtype=np.int64)})


def concat_pixels(rows: VerlProto) -> tuple[torch.Tensor, torch.Tensor]:
    """What ``dp_actor`` does per micro-batch before the forward: the rows' ``pixel_values`` and grids, concatenated
    (one copy of every occurrence)."""
    mm = rows.non_tensor_batch[MM_KEY]
    if not len(mm):
        return torch.zeros((0, 1176)), torch.zeros((0, 3), dtype=torch.int64)
    return torch.cat([m["pixel_values"] for m in mm]), torch.cat([m["image_grid_thw"] for m in mm])


@dataclass
class ForwardSource:
    """A forward dispatch (old or reference log-prob) on a rank: one step that splits the chunk into micro-batches
    of ``micro`` rows and concatenates each one's pixel_values, no emulated compute."""

    chunk: VerlProto
    micro: int

    def open(self, rank: int) -> None:
        pass

    def obtain(self, step: int) -> Obtained:
        for mb in self.chunk.split(self.micro):
            concat_pixels(mb)
        return Obtained(self.chunk.nbytes, 0, 0.0, self.chunk.pixel_nbytes)

    def release(self, step: int) -> None:
        pass

    def close(self) -> None:
        self.chunk = VerlProto({})


@dataclass
class UpdateSource:
    """``update_actor`` on a rank: its chunk split into mini-batches; step k concatenates mini-batch k's pixels.
    Mini-batch 0's get latency is t0 -> the call started (gather, build and all three dispatches)."""

    chunk: VerlProto
    per_minibatch: int
    t0: float

    def open(self, rank: int) -> None:
        self._t_start = time.perf_counter()
        self._mbs = self.chunk.split(self.per_minibatch)

    def obtain(self, step: int) -> Obtained:
        mb = self._mbs[step]
        concat_pixels(mb)
        return Obtained(mb.nbytes, int(mb.batch["attention_mask"].sum()),
                        (self._t_start - self.t0) if step == 0 else 0.0, mb.pixel_nbytes)

    def release(self, step: int) -> None:
        pass

    def close(self) -> None:
        self._mbs = []


@dataclass
class Built:
    """A batch on the driver after gather, concat and balance."""

    batch: VerlProto
    per_minibatch: int
    gather_bytes: int


@ray.remote(num_cpus=0)
def _rollout_output(out: VerlProto) -> VerlProto:
    """An agent-loop worker's output, created in its node's object store (the task runs there and returns it)."""
    return out


class VerlMMSystem:
    """The verl multimodal step (see the module docstring) on a ``RaySession``'s rank actors."""

    def __init__(self, name: str, layout: BenchLayout, session: RaySession,
                 overlap: CentralOverlap = CentralOverlap.BUILD_AHEAD, trace: bool = False) -> None:
        self.name, self.layout, self.session, self.overlap = name, layout, session, CentralOverlap(overlap)
        self.trace = trace
        """On a cluster (``layout.placement``), raw passes record the driver's path (``PassResult.trace``, as
        ``CentralizedSystem``'s): one pull per rollout output ("gather"), the unpickle ("deser"), concat + balance
        ("build"); per dispatch (keys "d<i>/r<rank>") each rank's chunk serialized on the driver ("ser"), pulled to
        the rank ("scatter") and split there ("tail"); after each forward dispatch the results' return to the
        driver ("ret": the slowest rank's end -> the driver's ``ray.get`` returned) and the union ("union")."""
        self._events: list = []
        self._chunk_bytes: dict[tuple[int, int], int] = {}
        self._source_of: dict = {}  # rollout output ref -> (its node, its payload bytes), on a cluster

    @property
    def _traced(self) -> bool:
        return self.trace and self.layout.placement is not None

    def stage(self, d: PassData) -> list:
        """The rollout units' outputs in the object store when the batch completes (one ``VerlProto`` each); on a
        cluster (``layout.placement``) each is created on its rollout node (unit ``producer mod U``'s)."""
        if not d.multimodal:
            raise ValueError(f"{self.name} moves multimodal batches (PassData without images)")
        lp = max(int(p.shape[0]) for p in d.prompts)
        lr = max(int(r.tensors["old_logprobs"].shape[0]) for r in d.rollouts)
        by_producer: dict[int, list[int]] = {}
        for r in d.rollouts:
            by_producer.setdefault(d.producer_of[r.traj.traj_id], []).append(r.traj.traj_id)
        outs = [(p, rollout_output(d, ts, lp, lr)) for p, ts in sorted(by_producer.items())]
        place = self.layout.placement
        if place is None:
            return [ray.put(o) for _, o in outs]
        nodes = [place.unit_nodes[p % len(place.unit_nodes)] for p, _ in outs]
        refs = [_rollout_output.options(**pinned(n)).remote(o) for n, (_, o) in zip(nodes, outs)]
        ray.wait(refs, num_returns=len(refs), fetch_local=False)  # written before t0, on the rollout nodes
        self._source_of.update({ref: (n, o.nbytes) for ref, n, (_, o) in zip(refs, nodes, outs)})
        return refs

    def _traced_gather(self, refs: list) -> list:
        """``ray.get(refs)`` split into one pull per rollout output (a flow each) and the unpickle."""
        sources = [self._source_of.pop(ref) for ref in refs]
        out, events = traced_gather(refs, sources, self.layout.placement.driver_node)
        self._events += events
        return out

    def build(self, refs: list, d: PassData) -> Built:
        gathered = self._traced_gather(refs) if self._traced else ray.get(refs)  # gather, deserialized
        t_build = time.perf_counter()
        batch = VerlProto.concat(gathered)
        plan = balance_plan(d.minibatches, d.tokens, self.layout.num_ranks)
        row = {int(t): i for i, t in enumerate(batch.non_tensor_batch["traj_id"])}
        order = np.array([row[t] for rows in plan.rows_per_rank for t in rows], dtype=np.int64)
        built = Built(batch.select(order), plan.per_minibatch, sum(p.nbytes for p in gathered))
        if self._traced:
            self._events.append(CpuEvent("build", self.layout.placement.driver_node, t_build, time.perf_counter()))
        return built

    def _ship(self, i: int, chunks: list, call) -> list:  # noqa: ANN001 - call(rank actor, rank, chunk)
        """Dispatch ``i``: one call per rank with its chunk as the argument (``.remote()`` serializes it into the
        driver's object store: timed as "ser" when traced)."""
        out = []
        for r, (rk, c) in enumerate(zip(self.session.ranks, chunks)):
            t = time.perf_counter()
            out.append(call(rk, r, c))
            if self._traced:
                self._events.append(CpuEvent("ser", self.layout.placement.driver_node, t, time.perf_counter(),
                                             f"d{i}/r{r}"))
                self._chunk_bytes[(i, r)] = int(c.nbytes)
        return out

    def _forward(self, built: Built, i: int, out_key: str) -> int:
        """Forward dispatch ``i`` (chunk, ship, wait); the driver unions its output. Returns the bytes shipped."""
        chunks = built.batch.chunk(self.layout.num_ranks)
        traces = ray.get(self._ship(i, chunks, lambda rk, r, c: rk.run.remote(ForwardSource(c, built.per_minibatch),
                                                                            RankRun(1, 1, 0.0))))
        t_ret = time.perf_counter()
        b = built.batch
        built.batch.union({out_key: torch.zeros(b.batch["responses"].shape, dtype=torch.float32)})
        if self._traced:
            driver = self.layout.placement.driver_node
            self._rank_events(i, traces)
            last = max(m.t_got for tr in traces for m in tr.timings)
            self._events += [CpuEvent("ret", driver, min(last, t_ret), t_ret, f"d{i}"),
                             CpuEvent("union", driver, t_ret, time.perf_counter(), f"d{i}")]
        return sum(c.nbytes for c in chunks)

    def _rank_events(self, i: int, traces: Sequence[RankTrace]) -> None:
        """Per rank, dispatch ``i``'s chunk pull (serialized -> the rank's call started: the chunk is the call's
        argument) and the rank's tail (call started -> its last piece in hand)."""
        place = self.layout.placement
        ser = {e.key: e for e in self._events if e.label == "ser"}
        for tr in sorted(traces, key=lambda t: t.rank):
            first = min(tr.timings, key=lambda m: (m.batch, m.index))
            started = first.t_ask + first.fetch_s  # t_ask = the call's first ask (or t0 + the update's latency)
            key, node = f"d{i}/r{tr.rank}", place.rank_nodes[tr.rank]
            self._events += [FlowEvent("scatter", place.driver_node, node, self._chunk_bytes[(i, tr.rank)],
                                       ser[key].t_end, started, key),
                             CpuEvent("tail", node, started, max(m.t_got for m in tr.timings), key)]

    def _dispatch(self, built: Built, t0: float, iters_per_token: float, batch: int, tag: int, m: int,
                  first_ask: Sequence[float]) -> tuple[list, int, int]:
        """The three dispatches of one step; returns the running update calls, bytes and pixel bytes shipped."""
        moved = self._forward(built, 0, "old_log_probs") + self._forward(built, 1, "ref_log_prob")
        s = self.session
        chunks = built.batch.chunk(self.layout.num_ranks)
        running = self._ship(2, chunks, lambda rk, r, c: rk.run.remote(
            UpdateSource(c, built.per_minibatch, t0),
            RankRun(1, m, iters_per_token, first_batch=batch, tag=tag, signals=s.signals, first_ask=first_ask[r])))
        return running, moved + sum(c.nbytes for c in chunks), len(DISPATCHES) * built.batch.pixel_nbytes

    def run_raw(self, batch: PassData) -> PassResult:
        refs = self.stage(batch)
        self._events, self._chunk_bytes = [], {}
        t0 = time.perf_counter()
        built = self.build(refs, batch)
        running, moved, pixels = self._dispatch(built, t0, 0.0, 0, batch.batch_id, batch.num_minibatches,
                                                [t0] * self.layout.num_ranks)
        traces = ray.get(running)
        res = dataclasses.replace(finish_raw(traces, t0, built.gather_bytes + moved), pixel_nbytes=pixels)
        if not self._traced:
            return res
        self._rank_events(2, traces)
        return dataclasses.replace(res, trace=tuple(self._events), t0=t0)

    def run_steady(self, batches: Sequence[PassData], iters_per_token: float) -> PassResult:
        refs = [self.stage(d) for d in batches]  # written while generating, before t0 (as for every system)
        m, tag = batches[0].num_minibatches, batches[0].batch_id
        self.layout.check(len(batches), m)
        wait = actor_wait(self.session.signals)
        t0: dict[int, float] = {}
        finished: list = []
        running: list | None = None
        moved = pixels = 0
        for b, d in enumerate(batches):
            if b:  # batch b completes while batch b-1 trains
                wait(step_key(tag, b - 1, m - self.layout.lead_steps))
            t0[b] = time.perf_counter()
            ahead = b == 0 or self.overlap is CentralOverlap.BUILD_AHEAD
            built = self.build(refs[b], d) if ahead else None
            ready = [t0[b]] * self.layout.num_ranks
            if running is not None:
                traces = ray.get(running)  # the driver is blocked in batch b-1's update_actor
                finished.append(traces)
                ready = [tr.timings[-1].t_done for tr in sorted(traces, key=lambda tr: tr.rank)]
            if built is None:
                built = self.build(refs[b], d)
            running, moved, pixels = self._dispatch(built, t0[b], iters_per_token, b, tag, m, ready)
            moved += built.gather_bytes
            del built
        finished.append(ray.get(running))
        res = finish_steady(merge_traces(finished), t0, self.layout.warmup_batches, moved)
        return dataclasses.replace(res, pixel_nbytes=pixels)

    def close(self) -> None:
        pass
