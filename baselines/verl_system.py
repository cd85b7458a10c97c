"""verl's own step as a ``knittrans.bench.TransferSystem``: the batch is a real ``verl.protocol.DataProto`` and
reaches the trainer ranks through verl's single controller (``verl.single_controller.ray.RayWorkerGroup``), as in
verl 0.9.1's ``RayPPOTrainer.fit`` (``verl/trainer/ppo/ray_trainer.py``). Text and multimodal alike; the version
that ran is ``verl_version()``.

Per batch, the stages and the verl code each one runs (ours only where named):

1. **Rollout** (before t0, not timed): the agent-loop manager chunks the repeated prompt batch over its workers
   (``DataProto.chunk``); each worker returns its rows as one ``DataProto`` (``AgentLoopWorker._postprocess``):
   ``prompts`` left-padded and ``responses`` right-padded to ``rollout.prompt_length`` / ``response_length``
   (``VerlConfig``), ``response_mask``, ``input_ids``, ``attention_mask``, ``position_ids`` (multimodal: 4 rows per
   token, text + M-RoPE, as verl's Qwen2-VL path), ``rollout_log_probs`` in its TensorDict;
   ``non_tensor_batch["multi_modal_inputs"]``: per row its own dict of tensors (``pixel_values``,
   ``image_grid_thw``, ``images_seqlens``: the processor ran per sample). Worker w's output is created on rollout
   node ``w mod U`` (a pinned task, as for every baseline). Ours: a ``traj_id`` row tensor (8 B a row: the test
   names rows by it).
2. **Gather** at t0 (train-batch admission): ``ray.get`` of every worker's output and ``DataProto.concat``.
3. **Build**: the dataloader's prompt batch (``uid`` per prompt) ``repeat(n, interleave=True)`` and ``union`` with
   the rollout output; ``_balance_batch`` (verl's ``calculate_workload`` and ``get_seqlen_balanced_partitions``,
   the trainer's default ``keep_minibatch=False``; the trainer method's dozen lines are re-written here because it
   needs a whole trainer) and ``DataProto.reorder``.
4. **Three dispatches**, each as the trainer's ``_compute_old_log_prob`` / ``_compute_ref_log_prob`` /
   ``_update_actor``: ``batch.to_tensordict()``, ``left_right_2_no_padding``, ``tu.assign_non_tensor`` (verl's
   settings and our ``VerlRun``), then the worker group's method (verl's dispatch: chunk per data-parallel rank,
   ``parallel_put``, one call per rank; ``baselines.verl_worker``). After each forward one the driver pads the
   returned log-probs back (``no_padding_2_padding``) and ``union``s them into the batch; before the update it adds
   what verl's driver computes there (``token_level_scores``, ``token_level_rewards``, ``advantages``, ``returns``:
   GRPO sets ``returns = advantages``), from the trajectories' advantages (the values are stand-ins where verl
   derives them from rewards; their bytes are verl's).
5. **Update** on each rank: its chunk split into M mini-batches (verl's ``make_iterator``), one emulated optimizer
   step each, the same ``loop.rank_loop`` as every system's.

verl's ``update_actor`` blocks the driver until every rank is done. Across batches (``CentralOverlap``) the update
call runs on a driver thread, so that with ``BUILD_AHEAD`` the driver gathers and builds batch b+1 while b trains
(verl's one-step-off at best; in its favour); the dispatches of b+1 follow b's update, as on verl's one worker group.
Not charged, in verl's favour: the forward passes' compute, the reward step, the raw images (``multi_modal_data``).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import ray
import torch

from baselines.centralized_system import CentralOverlap, traced_gather
from knittrans.bench.loop import finish_raw, finish_steady, merge_traces, step_key
from knittrans.bench.ray_ranks import RaySession, actor_wait, pinned
from knittrans.bench.types import BenchLayout, PassData, PassResult
from knittrans.dataplane.trace import CpuEvent, FlowEvent

MM_KEY = "multi_modal_inputs"


def verl_version() -> str:
    """The installed verl's version (the tables name it beside every verl row)."""
    import verl

    return str(verl.__version__)


@dataclass(frozen=True)
class VerlConfig:
    """verl's settings that shape what it ships."""

    max_prompt_len: int | None = None
    """``rollout.prompt_length``: the agent loop left-pads every prompt to it; None: to the batch's longest
    prompt (in verl's favour, for a workload that configures no maximum)."""
    max_response_len: int | None = None
    """``rollout.response_length``: responses right-padded to it; None: to the batch's longest."""

    def __post_init__(self) -> None:
        for name in ("max_prompt_len", "max_response_len"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ValueError(f"VerlConfig.{name} must be >= 1 or None, got {v}")


# -- rollout outputs and the driver's batch --------------------------------------------------------------------------


def request_order(d: PassData) -> list[int]:
    """Trajectory ids in the order of the repeated prompt batch (row g*n + i: sample i of prompt g)."""
    groups: dict[int, list[int]] = {}
    for r in d.rollouts:
        groups.setdefault(d.prompt_of[r.traj.traj_id], []).append(r.traj.traj_id)
    return [t for g in sorted(groups) for t in sorted(groups[g])]


def pad_rows(rows: Sequence[np.ndarray], width: int, left: bool, dtype: torch.dtype) -> torch.Tensor:
    out = torch.zeros((len(rows), width), dtype=dtype)
    for i, r in enumerate(rows):
        n = int(r.shape[0])
        if n > width:
            raise ValueError(f"a row of {n} tokens exceeds the padded width {width} (VerlConfig's maxima)")
        if n:
            t = torch.from_numpy(np.ascontiguousarray(r)).to(dtype)
            if left:
                out[i, width - n:] = t
            else:
                out[i, :n] = t
    return out


def padded_lengths(d: PassData, config: VerlConfig) -> tuple[int, int]:
    """(prompt, response) widths of the padded layout."""
    lp = max(int(p.shape[0]) for p in d.prompts)
    lr = max(int(r.tensors["old_logprobs"].shape[0]) for r in d.rollouts)
    return config.max_prompt_len or lp, config.max_response_len or lr


def padded_rows(d: PassData, traj_ids: Sequence[int], lp: int, lr: int) -> tuple:
    """The agent loop's padded layout of rows ``traj_ids``: (their rollouts, ``prompts`` left-padded to ``lp``,
    ``responses`` right-padded to ``lr``, ``attention_mask``, text ``position_ids``), int64 tensors."""
    by_id = {r.traj.traj_id: r for r in d.rollouts}
    rs = [by_id[t] for t in traj_ids]
    plen = [int(d.prompts[d.prompt_of[t]].shape[0]) for t in traj_ids]
    prompts = pad_rows([r.tensors["input_ids"][:p] for r, p in zip(rs, plen)], lp, True, torch.int64)
    responses = pad_rows([r.tensors["input_ids"][p:] for r, p in zip(rs, plen)], lr, False, torch.int64)
    cols = torch.arange(lp + lr)
    pl = torch.tensor(plen)
    rl = torch.tensor([int(r.tensors["input_ids"].shape[0]) - p for r, p in zip(rs, plen)])
    attention = ((cols >= (lp - pl)[:, None]) & (cols < (lp + rl)[:, None])).long()
    return rs, prompts, responses, attention, (attention.cumsum(1) - 1).clamp(min=0)


def agent_loop_output(d: PassData, traj_ids: Sequence[int], lp: int, lr: int):  # noqa: ANN201 - a DataProto
    """One agent-loop worker's ``_postprocess`` output for its rows (see the module docstring)."""
    from tensordict import TensorDict
    from verl import DataProto

    rs, prompts, responses, attention, pos = padded_rows(d, traj_ids, lp, lr)
    if d.multimodal:  # Qwen2-VL in verl: (text, t, h, w) positions per token
        pos = pos[:, None, :].expand(-1, 4, -1).contiguous()
    batch = TensorDict({"prompts": prompts, "responses": responses,
                        "response_mask": pad_rows([r.tensors["loss_mask"] for r in rs], lr, False, torch.int64),
                        "input_ids": torch.cat([prompts, responses], 1), "attention_mask": attention,
                        "position_ids": pos, "rollout_log_probs": pad_rows([r.tensors["old_logprobs"] for r in rs],
                                                                           lr, False, torch.float32),
                        "traj_id": torch.tensor(list(traj_ids), dtype=torch.int64)}, batch_size=len(rs))
    non_tensor = {"__num_turns__": np.full(len(rs), 2, dtype=np.int32)}
    if d.multimodal:
        mm = np.empty(len(rs), dtype=object)
        for i, t in enumerate(traj_ids):  # the processor ran per sample: its own tensors, not the group's
            g = d.prompt_of[t]
            grid = torch.tensor(d.grids[g], dtype=torch.int64).reshape(-1, 3)
            mm[i] = {"pixel_values": torch.cat([torch.as_tensor(x) for x in d.images[g]]),  # cat: a fresh tensor
                     "image_grid_thw": grid,
                     "images_seqlens": torch.repeat_interleave(grid[:, 1] * grid[:, 2], grid[:, 0])}
        non_tensor[MM_KEY] = mm
    return DataProto(batch=batch, non_tensor_batch=non_tensor, meta_info={})


def prompt_batch(d: PassData):  # noqa: ANN201 - a DataProto
    """The dataloader's batch after the generation keys were popped (``_get_gen_batch``): verl's RL dataset's
    ``dummy_tensor`` (a DataProto needs a tensor) and a ``uid`` per prompt."""
    from verl import DataProto

    groups = sorted({d.prompt_of[r.traj.traj_id] for r in d.rollouts})
    return DataProto.from_dict(tensors={"dummy_tensor": torch.zeros((len(groups), 1), dtype=torch.uint8)},
                               non_tensors={"uid": np.array([f"b{d.batch_id}g{g}" for g in groups], dtype=object)})


def proto_nbytes(p) -> int:  # noqa: ANN001 - a DataProto
    """Payload bytes of a DataProto: its TensorDict's tensors and every row's multimodal tensors."""
    dense = sum(int(v.nbytes) for v in p.batch.values()) if p.batch is not None else 0
    mm = p.non_tensor_batch.get(MM_KEY, ())
    return dense + sum(int(t.nbytes) for row in mm for t in row.values())


def balance(batch, dp_size: int) -> None:  # noqa: ANN001 - a DataProto
    """``RayPPOTrainer._balance_batch`` (``keep_minibatch=False``): partitions of equal size and balanced
    workload, each sorted with its smaller rows at both ends, the batch reordered in place."""
    from verl.utils.seqlen_balancing import calculate_workload, get_seqlen_balanced_partitions

    mask = batch.batch["attention_mask"]
    workload = calculate_workload(mask.view(mask.shape[0], -1).sum(-1))
    parts = get_seqlen_balanced_partitions(workload, k_partitions=dp_size, equal_size=True)
    for i, part in enumerate(parts):
        part.sort(key=lambda x: (workload[x], x))
        parts[i] = part[::2] + part[1::2][::-1]
    batch.reorder(torch.tensor([j for part in parts for j in part]))


@dataclass
class Built:
    """A batch on the driver after gather, build and balance; ``rewards``: what verl's driver adds before the
    update, in the balanced row order."""

    batch: object  # a DataProto
    rewards: dict[str, torch.Tensor]
    gather_bytes: int


def build(gathered: Sequence, d: PassData, dp_size: int, lr: int) -> Built:
    """Stages 2-3 on gathered rollout outputs (see the module docstring)."""
    from verl import DataProto

    gen = DataProto.concat(list(gathered))
    batch = prompt_batch(d).repeat(repeat_times=d.group_size, interleave=True).union(gen)
    balance(batch, dp_size)
    by_id = {r.traj.traj_id: r for r in d.rollouts}
    adv = pad_rows([by_id[int(t)].tensors["advantages"] for t in batch.batch["traj_id"]], lr, False, torch.float32)
    rewards = {"token_level_scores": adv.clone(), "token_level_rewards": adv.clone(), "advantages": adv,
               "returns": adv.clone()}
    return Built(batch, rewards, sum(proto_nbytes(p) for p in gathered))


# -- the system ------------------------------------------------------------------------------------------------------


@ray.remote(num_cpus=0)
def _rollout_output(out):  # noqa: ANN001, ANN201 - a DataProto
    """An agent-loop worker's output, created in its node's object store (the task runs there and returns it)."""
    return out


def node_resource(node_id: str) -> str:
    """A custom resource only ``node_id`` has (``knittrans.bench.cluster.LocalCluster`` gives node i ``node_<i>``):
    how a placement-group bundle is pinned to a node."""
    for n in ray.nodes():
        if n["NodeID"] == node_id:
            own = [k for k in n["Resources"] if k.startswith("node_") and not k.startswith("node:")]
            if own:
                return own[0]
    raise ValueError(f"Ray node {node_id} has no node_<i> resource to pin a placement group to")


def worker_group(layout: BenchLayout, session: RaySession):  # noqa: ANN201 - a RayWorkerGroup
    """The trainer ranks as verl builds them: ``RayClassWithInitArgs`` of ``VerlRank`` in a CPU resource pool
    (``use_gpu=False``, one process per bundle). On a cluster (``layout.placement``) each rank's bundle is pinned
    to its node (``SubRayResourcePool`` over one placement group per rank)."""
    from ray.util.placement_group import placement_group
    from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup, SubRayResourcePool

    from baselines.verl_worker import VerlRank

    cls = RayClassWithInitArgs(ray.remote(VerlRank), signals=session.signals)
    R, place = layout.num_ranks, layout.placement
    if place is None:
        pool = RayResourcePool([R], use_gpu=False, max_colocate_count=1)
    else:
        pgs = [placement_group([{"CPU": 1, node_resource(n): 1e-3}], strategy="STRICT_PACK") for n in place.rank_nodes]
        ray.get([pg.ready() for pg in pgs])
        pool = SubRayResourcePool(pgs, 0, R, process_on_nodes=[1] * R, use_gpu=False, max_colocate_count=1)
    wg = RayWorkerGroup(pool, cls, device_name="cpu")
    if place is not None and tuple(wg.node_id()) != tuple(place.rank_nodes):
        raise RuntimeError(f"verl's ranks landed on {wg.node_id()}, not on the rank nodes {place.rank_nodes}")
    return wg


class VerlSystem:
    """verl's step (see the module docstring) on its own worker group; the session's signal board paces it."""

    def __init__(self, name: str, layout: BenchLayout, session: RaySession, config: VerlConfig = VerlConfig(),
                 overlap: CentralOverlap = CentralOverlap.BUILD_AHEAD, record_rows: bool = False,
                 trace: bool = False) -> None:
        self.name, self.layout, self.session, self.config = name, layout, session, config
        self.overlap = CentralOverlap(overlap)
        self.record_rows = record_rows
        """Ranks keep every row they trained on (``verl_worker.ReceivedRow``; ``received`` after a pass)."""
        self.trace = trace
        """On a cluster (``layout.placement``), raw passes record the driver's path (``PassResult.trace``, as
        ``CentralizedSystem``'s): one pull per rollout output ("gather"), the unpickle ("deser"), concat, repeat,
        union and balance ("build"); per dispatch (keys "d<i>") the conversion to a TensorDict ("convert") and
        verl's dispatch function (chunk per rank and ``parallel_put``: "ser"), per rank (keys "d<i>/r<rank>") the
        chunk's pull to the rank ("scatter": the put's end -> the rank's method started) and the rank's work
        ("tail"); after each forward dispatch the results' return ("ret": the slowest rank's end -> verl's collect
        returned) and the union ("union"). Traced, a worker-group call runs verl's own steps one by one (the
        method's registered dispatch function, ``execute_all``, ``ray.get``, its collect function: what
        ``RayWorkerGroup``'s bound method runs) with a clock between them."""
        self.received: list = []
        self._events: list = []
        self._ser: dict[str, CpuEvent] = {}
        self._t_ret: dict[str, float] = {}
        self._source_of: dict = {}  # rollout output ref -> (its node, its payload bytes), on a cluster
        self.wg = worker_group(layout, session)

    @property
    def _traced(self) -> bool:
        return self.trace and self.layout.placement is not None

    def _cpu(self, label: str, t_start: float, key: str = "") -> None:
        if self._traced:
            self._events.append(CpuEvent(label, self.layout.placement.driver_node, t_start, time.perf_counter(), key))

    @property
    def ranks(self) -> int:
        return self.layout.num_ranks

    def stage(self, d: PassData) -> list:
        """The agent-loop workers' outputs in the object store when the batch completes: one per rollout unit,
        contiguous rows of the request order (``DataProto.chunk``), created on that unit's node on a cluster."""
        lp, lr = padded_lengths(d, self.config)
        order = request_order(d)
        W = self.layout.num_units
        if len(order) % W:
            raise ValueError(f"{len(order)} rows do not chunk over {W} agent-loop workers (DataProto.chunk)")
        step = len(order) // W
        outs = [agent_loop_output(d, order[w * step:(w + 1) * step], lp, lr) for w in range(W)]
        place = self.layout.placement
        if place is None:
            return [ray.put(o) for o in outs]
        nodes = [place.unit_nodes[w % len(place.unit_nodes)] for w in range(W)]
        refs = [_rollout_output.options(**pinned(n)).remote(o) for n, o in zip(nodes, outs)]
        ray.wait(refs, num_returns=len(refs), fetch_local=False)  # written before t0, on the rollout nodes
        self._source_of.update({ref: (n, proto_nbytes(o)) for ref, n, o in zip(refs, nodes, outs)})
        return refs

    def _traced_gather(self, refs: list) -> list:
        """``ray.get(refs)`` split into one pull per rollout output (a flow each) and the unpickle."""
        sources = [self._source_of.pop(ref) for ref in refs]
        out, events = traced_gather(refs, sources, self.layout.placement.driver_node)
        self._events += events
        return out

    def build(self, refs: list, d: PassData) -> Built:
        gathered = self._traced_gather(refs) if self._traced else ray.get(refs)
        t = time.perf_counter()
        built = build(gathered, d, self.ranks, padded_lengths(d, self.config)[1])
        self._cpu("build", t)
        return built

    def _call(self, method: str, td, label: str):  # noqa: ANN001, ANN202 - a TensorDict in, the collected one out
        """``wg.<method>(td)``; traced, verl's steps of that call one by one (see ``trace``)."""
        if not self._traced:
            return getattr(self.wg, method)(td)
        from verl.single_controller.base.decorator import MAGIC_ATTR

        from baselines.verl_worker import VerlRank

        mode = getattr(getattr(VerlRank, method), MAGIC_ATTR)["dispatch_mode"]  # the nd-compute dispatch's functions
        t = time.perf_counter()
        args, kwargs = mode["dispatch_fn"](self.wg, td)
        self._cpu("ser", t, label)
        self._ser[label] = self._events[-1]
        out = mode["collect_fn"](self.wg, ray.get(self.wg.execute_all(method, *args, **kwargs)))
        self._t_ret[label] = time.perf_counter()
        return out

    def _forward(self, built: Built, run, ref: bool) -> tuple[int, int]:  # noqa: ANN001 - a VerlRun
        """``_compute_old_log_prob`` (or ``_compute_ref_log_prob``): convert, dispatch, pad back, union. Returns the
        payload and pixel bytes dispatched."""
        from verl import DataProto
        from verl.utils import tensordict_utils as tu
        from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding

        from baselines.verl_worker import payload_nbytes, pixel_nbytes

        t = time.perf_counter()
        td = left_right_2_no_padding(built.batch.to_tensordict())
        tu.assign_non_tensor(td, calculate_entropy=not ref, compute_loss=False, knittrans_run=run)
        self._cpu("convert", t, run.label)
        sent = (payload_nbytes(td), pixel_nbytes(td))
        out = self._call("compute_ref_log_prob" if ref else "compute_log_prob", td, run.label)
        t = time.perf_counter()
        lp = no_padding_2_padding(tu.get(out, "log_probs"), td)
        key = "ref_log_prob" if ref else "old_log_probs"
        built.batch = built.batch.union(DataProto.from_tensordict(tu.get_tensordict({key: lp.float()})))
        self._cpu("union", t, run.label)
        return sent

    def _update_td(self, built: Built, d: PassData, run):  # noqa: ANN001, ANN202 - a VerlRun -> TensorDict
        """``_update_actor``'s conversion: the rewards in, to a TensorDict without padding, verl's settings."""
        from verl import DataProto
        from verl.utils import tensordict_utils as tu
        from verl.workers.utils.padding import left_right_2_no_padding

        t = time.perf_counter()
        built.batch = built.batch.union(DataProto.from_dict(built.rewards))
        td = left_right_2_no_padding(built.batch.to_tensordict())
        per_minibatch = len(built.batch) // d.num_minibatches
        tu.assign_non_tensor(td, calculate_entropy=False, global_batch_size=per_minibatch,
                             mini_batch_size=per_minibatch, epochs=1, seed=42, dataloader_kwargs={"shuffle": False},
                             compute_loss=True, knittrans_run=run)
        self._cpu("convert", t, run.label)
        return td

    def _runs(self, d: PassData, t0: float, iters_per_token: float, batch: int, tag: int,
              first_ask: float | None):  # noqa: ANN202 - three VerlRuns
        from baselines.verl_worker import VerlRun

        m = d.num_minibatches
        fwd = [VerlRun(m, t0=t0, label=f"d{i}") for i in range(2)]
        upd = VerlRun(m, iters_per_token, batch, tag, t0, first_ask, "d2", self.record_rows)
        return fwd, upd

    def _dispatch(self, built: Built, d: PassData, t0: float, iters_per_token: float, batch: int, tag: int,
                  first_ask: float | None) -> tuple[object, int, int]:
        """The two forward dispatches (blocking) and the update's TensorDict; returns it and the bytes (all,
        pixels) of the three dispatches."""
        from baselines.verl_worker import payload_nbytes, pixel_nbytes

        fwd, upd = self._runs(d, t0, iters_per_token, batch, tag, first_ask)
        a = self._forward(built, fwd[0], ref=False)
        b = self._forward(built, fwd[1], ref=True)
        td = self._update_td(built, d, upd)
        return td, a[0] + b[0] + payload_nbytes(td), a[1] + b[1] + pixel_nbytes(td)

    def _drain(self) -> list:
        """Every rank's update traces since the last drain, one list per call (rank order); the rows and, traced,
        the ranks' side of the pass's events."""
        out = self.wg.drain_traces()
        self.received = [row for _, _, rows in out for row in rows]
        if self._traced:
            self._rank_events([c for _, calls, _ in out for c in calls])
        return [[tr] for traces, _, _ in out for tr in traces]

    def _rank_events(self, calls: list) -> None:
        """Per dispatch and rank, the chunk's pull (verl's put ended -> the rank's method started) and the rank's
        work; after a forward dispatch, the return (the slowest rank's end -> the collect returned)."""
        place = self.layout.placement
        for c in calls:
            key, node = f"{c.label}/r{c.rank}", place.rank_nodes[c.rank]
            self._events += [FlowEvent("scatter", place.driver_node, node, c.nbytes, self._ser[c.label].t_end,
                                       c.t_start, key),
                             CpuEvent("tail", node, c.t_start, c.t_end, key)]
        for label, t in self._t_ret.items():
            last = max(c.t_end for c in calls if c.label == label)
            self._events.append(CpuEvent("ret", place.driver_node, min(last, t), t, label))

    def run_raw(self, batch: PassData) -> PassResult:
        refs = self.stage(batch)
        self._events, self._ser, self._t_ret = [], {}, {}
        t0 = time.perf_counter()
        built = self.build(refs, batch)
        td, moved, pixels = self._dispatch(built, batch, t0, 0.0, 0, batch.batch_id, t0)
        self._call("update_actor", td, "d2")
        self._t_ret.pop("d2", None)  # the pass ends when the ranks hold their shares, not when the update returns
        res = finish_raw(merge_traces(self._drain()), t0, built.gather_bytes + moved)
        res = dataclasses.replace(res, pixel_nbytes=pixels)
        return dataclasses.replace(res, trace=tuple(self._events), t0=t0) if self._traced else res

    def run_steady(self, batches: Sequence[PassData], iters_per_token: float) -> PassResult:
        refs = [self.stage(d) for d in batches]  # written while generating, before t0 (as for every system)
        m, tag = batches[0].num_minibatches, batches[0].batch_id
        self.layout.check(len(batches), m)
        wait = actor_wait(self.session.signals)
        t0: dict[int, float] = {}
        running: concurrent.futures.Future | None = None
        moved = pixels = 0
        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="verl-update") as trainer:
            for b, d in enumerate(batches):
                if b:  # batch b completes while batch b-1 trains
                    wait(step_key(tag, b - 1, m - self.layout.lead_steps))
                t0[b] = time.perf_counter()
                ahead = b == 0 or self.overlap is CentralOverlap.BUILD_AHEAD
                built = self.build(refs[b], d) if ahead else None
                if running is not None:
                    running.result()  # the driver's step waits for batch b-1's update_actor
                if built is None:
                    built = self.build(refs[b], d)
                # the first batch's ranks are ready since t0; later ones since their previous update ended
                td, moved, pixels = self._dispatch(built, d, t0[b], iters_per_token, b, tag, t0[b] if b == 0 else None)
                moved += built.gather_bytes
                running = trainer.submit(self.wg.update_actor, td)
                del built, td
            running.result()
        res = finish_steady(merge_traces(self._drain()), t0, self.layout.warmup_batches, moved)
        return dataclasses.replace(res, pixel_nbytes=pixels)

    def close(self) -> None:
        for w in getattr(self.wg, "workers", []):
            ray.kill(w)
        pgs = getattr(getattr(self.wg, "resource_pool", None), "pgs", None) or []
        from ray.util.placement_group import remove_placement_group

        for pg in pgs:
            remove_placement_group(pg)
        self.wg = None
