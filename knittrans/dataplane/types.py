"""Typed messages and errors of the data plane: schemas, placement records, shares, packed tensors.

Vocabulary (used in every module of ``knittrans.dataplane``):

- A **field** is one named tensor per trajectory (``input_ids``, ``old_logprobs`` ...). A *ragged* field's first
  dimension varies per trajectory (its length); the remaining dimensions (``tail``) are fixed by the schema.
- A **storage unit** holds field tensors for the trajectories its producers wrote; it lives on a **node**.
- The **controller** holds metadata only: which unit holds each trajectory, which fields were produced, which
  mini-batches are admitted, how each is split into per-rank **shares**, and which (mini-batch, rank, field)
  has been consumed. It never touches tensor bytes.
- A **share** is the part of an admitted mini-batch that one trainer rank consumes.

Every error is a subclass of ``DataPlaneError`` (a ``ValueError``) whose message names the offending id or
field; an operation that raises leaves every store and every piece of metadata as it was (nothing corrupted,
nothing lost).
"""

from __future__ import annotations

from dataclasses import dataclass, field
import functools
from functools import cached_property
import math
import sys
import uuid
from typing import TYPE_CHECKING, Mapping, NamedTuple, Sequence

import numpy as np

from knittrans.types import Trajectory

if TYPE_CHECKING:  # torch is imported only where tensors are built: unit and controller processes never load it
    import torch


class DataPlaneError(ValueError):
    """A request the data plane rejects; no state was changed."""


class SchemaMismatchError(DataPlaneError):
    """A put whose fields, dtypes or shapes do not match the trajectory schema."""


class DuplicatePutError(DataPlaneError):
    """A field of a trajectory written twice (every field is produced exactly once)."""


class UnknownMiniBatchError(DataPlaneError):
    """A fetch or claim for a mini-batch that was never admitted."""


class FieldNotProducedError(DataPlaneError):
    """A fetch of a field the schema does not declare, or that some trajectory of the share never produced."""


class AlreadyConsumedError(DataPlaneError):
    """A second fetch of a (mini-batch, rank, field) share: delivery is exactly once."""


class AdmissionStateError(DataPlaneError):
    """An admission the controller cannot accept (unknown trajectory, trajectory admitted twice ...)."""


class UnitLostError(DataPlaneError):
    """A storage unit is gone (its process died, or a fault plan took it): what it held must be re-put."""

    def __init__(self, unit_id: str, detail: str = "") -> None:
        super().__init__(unit_id, detail)  # both in args: the error pickles across Ray actors
        self.unit_id = unit_id
        self.detail = detail

    def __str__(self) -> str:
        return (f"storage unit {self.unit_id} is lost{': ' + self.detail if self.detail else ''}; "
                f"re-put its trajectories to a live unit")


class DataLostError(DataPlaneError):
    """A fetch of a share whose trajectories were on a lost unit and have not been re-put yet; nothing was
    claimed (a partial share is never handed to training)."""


class CorruptPayloadError(DataPlaneError):
    """A field's bytes do not match the checksum its producer computed (corrupted in transit or in storage);
    the message names the trajectory and the field, and nothing stored or claimed was changed."""


class ShareTooLargeError(DataPlaneError):
    """A share whose packed rows overflow the int32 ``cu_seqlens`` of the varlen kernels."""


class FencedError(DataPlaneError):
    """A claim or ack from a rank incarnation that ``recover_rank`` superseded (a zombie prefetcher of the crashed
    rank): refused, so it can never take or release the new incarnation's mini-batch."""


class ReadTimeoutError(DataPlaneError):
    """A unit did not answer a read within its deadline; the claim was undone (retry, or report the unit lost)."""


class ResolveStalledError(ReadTimeoutError):
    """A share's sources (the units' objects) did not map within ``ray_transport.RESOLVE_TIMEOUT_S`` while their
    units are alive: the client reads the share through its units instead (``DataPlaneClient.resolve_fallbacks``)."""


class ControllerLostError(DataPlaneError):
    """The controller (on Ray: its actor) died and was not restarted: built without a journal
    (``build_ray`` or ``build_mm_ray`` with ``controller_restarts=0``) or its restarts are used up. A controller with a
    journal is restarted and rebuilt instead (``knittrans.dataplane.recovery``, docs/reliability.md)."""


class DataPlaneClosedError(RuntimeError):
    """The data plane was closed while a caller waited on it."""


class EndOfStream(DataPlaneClosedError):
    """Every mini-batch of every announced batch has been admitted and the stream is sealed: there is no
    ``seq``-th mini-batch to wait for (a consumer's iteration ends)."""


@functools.lru_cache(maxsize=None)
def _np_dtype(name: str) -> np.dtype:
    return np.dtype(name)


@functools.lru_cache(maxsize=None)
def _row_nbytes(dtype: str, tail: tuple[int, ...]) -> int:
    return np.dtype(dtype).itemsize * math.prod(tail)


@dataclass(frozen=True, slots=True)
class FieldSpec:
    """One per-trajectory tensor. ``dtype`` is a numpy dtype name; ``ragged`` fields have a per-trajectory
    first dimension; ``tail`` is the fixed shape after it (or the whole shape when not ragged)."""

    name: str
    dtype: str
    ragged: bool = True
    tail: tuple[int, ...] = ()
    finite: bool = False  # reject NaN/inf values (log-probs, advantages, rewards); one pass over the field

    def __post_init__(self) -> None:
        if not self.name or not isinstance(self.name, str):
            raise SchemaMismatchError(f"FieldSpec.name must be a non-empty str, got {self.name!r}")
        try:
            np.dtype(self.dtype)
        except TypeError as e:
            raise SchemaMismatchError(f"FieldSpec {self.name}: unknown dtype {self.dtype!r}") from e

    @property
    def np_dtype(self) -> np.dtype:
        return _np_dtype(self.dtype)

    @property
    def row_nbytes(self) -> int:
        """Bytes of one row (one element of the first axis of a ragged field; the whole value of a fixed one)."""
        return _row_nbytes(self.dtype, self.tail)

    def check(self, traj_id: int, value: np.ndarray) -> None:
        """Raise ``SchemaMismatchError`` unless ``value`` is an array of this field's dtype and shape. (Called for
        every field of every put: the dtype and row size are cached per spec, no numpy reduction per call.)"""
        if value.dtype != _np_dtype(self.dtype):
            raise SchemaMismatchError(f"trajectory {traj_id}: field {self.name!r} has dtype {value.dtype}, "
                                      f"schema says {self.dtype}")
        tail = self.tail
        shape = value.shape
        if len(shape) != len(tail) + (1 if self.ragged else 0) or (tail and shape[len(shape) - len(tail):] != tail):
            lead = "(n, " if self.ragged else "("
            raise SchemaMismatchError(f"trajectory {traj_id}: field {self.name!r} has shape {shape}, schema says "
                                      f"{lead}{', '.join(map(str, self.tail))})")
        if self.finite and value.dtype.kind == "f" and not np.logical_and.reduce(np.isfinite(value), axis=None):
            bad = np.flatnonzero(~np.isfinite(value.reshape(-1)))
            raise SchemaMismatchError(f"trajectory {traj_id}: field {self.name!r} holds {bad.size} non-finite "
                                      f"value(s) (first {value.reshape(-1)[bad[0]]} at flat index {bad[0]})")


@dataclass(frozen=True)
class TrajectorySchema:
    """The fields every trajectory may carry. ``token_field`` is the ragged field whose length counts a
    trajectory's tokens (what trainer compute scales with, and what shares are balanced on)."""

    fields: tuple[FieldSpec, ...]
    token_field: str
    same_length: tuple[tuple[str, ...], ...] = ()
    """Groups of ragged fields that must have the same length within one trajectory (e.g. per-response-token
    log-probs, advantages and loss mask); checked among the fields a put carries together."""
    response_field: str | None = None
    """A ragged field with one row per response token (e.g. ``old_logprobs``): a trajectory's admission metadata
    (``Trajectory.num_tokens``, the response length that token budgets and records count) must equal its length, and
    so must every field of its ``same_length`` group (``check_num_tokens``). None: only the token field bounds it."""

    def __post_init__(self) -> None:
        names = [f.name for f in self.fields]
        if self.response_field is not None and (self.response_field not in names
                                                or not self.get(self.response_field).ragged):
            raise SchemaMismatchError(f"TrajectorySchema.response_field {self.response_field!r} must name a ragged "
                                      f"field of {names}")
        for group in self.same_length:
            if any(n not in names or not self.get(n).ragged for n in group):
                raise SchemaMismatchError(f"TrajectorySchema.same_length group {group} must name ragged fields of "
                                          f"{names}")
        if len(set(names)) != len(names):
            raise SchemaMismatchError(f"TrajectorySchema: duplicate field names in {names}")
        spec = self.get(self.token_field) if self.token_field in names else None
        if spec is None or not spec.ragged:
            raise SchemaMismatchError(f"TrajectorySchema.token_field {self.token_field!r} must name a ragged field "
                                      f"of {names}")

    @cached_property
    def names(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.fields)

    @cached_property
    def _by_name(self) -> dict[str, FieldSpec]:  # looked up per field of every put and fetch
        return {f.name: f for f in self.fields}

    @cached_property
    def row_layouts(self) -> dict[str, tuple[FieldSpec, np.dtype, int]]:
        """Per field: its spec, numpy dtype and bytes per row (``client.pack_runs`` reads them per share: worked
        out there, they cost ~30 us of numpy calls for four fields, a tenth of the share's copy)."""
        return {f.name: (f, np.dtype(f.dtype), np.dtype(f.dtype).itemsize * int(np.prod(f.tail, dtype=np.int64)))
                for f in self.fields}

    def get(self, name: str) -> FieldSpec:
        f = self._by_name.get(name)
        if f is not None:
            return f
        raise FieldNotProducedError(f"field {name!r} is not in the schema (fields: {list(self.names)})")

    @cached_property
    def response_fields(self) -> tuple[str, ...]:
        """The fields with one row per response token: ``response_field`` and its ``same_length`` group."""
        r = self.response_field
        if r is None:
            return ()
        return next((g for g in self.same_length if r in g), (r,))

    def check_num_tokens(self, traj_id: int, num_tokens: int, lengths: Mapping[str, int]) -> None:
        """Raise ``SchemaMismatchError`` naming the trajectory if its metadata's ``num_tokens`` (response tokens)
        disagrees with its tensors: ``lengths`` (field -> rows, the fields known so far) must give every response
        field exactly ``num_tokens`` rows, and the token field (prompt + response) at least that many. Where a
        field is not known yet (put later), nothing is checked for it."""
        for name in self.response_fields:
            n = lengths.get(name)
            if n is not None and n != num_tokens:
                raise SchemaMismatchError(f"trajectory {traj_id}: Trajectory.num_tokens={num_tokens} disagrees with "
                                          f"its tensors: field {name!r} has {n} rows (one per response token); "
                                          f"num_tokens is the response length")
        n = lengths.get(self.token_field)
        if n is not None and n < num_tokens:
            raise SchemaMismatchError(f"trajectory {traj_id}: Trajectory.num_tokens={num_tokens} disagrees with its "
                                      f"tensors: token field {self.token_field!r} has only {n} rows (prompt + "
                                      f"response); num_tokens is the response length")

    def rows_of(self, name: str, nbytes: int) -> int:
        """Rows of field ``name`` that ``nbytes`` bytes hold (what the controller derives lengths from)."""
        row = self.get(name).row_nbytes
        return nbytes // row if row else 0


def as_numpy(traj_id: int, name: str, value: object) -> np.ndarray:
    """A CPU numpy view of ``value`` (no copy for numpy arrays and CPU tensors)."""
    if isinstance(value, np.ndarray):
        return value
    torch = sys.modules.get("torch")  # a tensor can only exist if torch is already imported
    if torch is not None and isinstance(value, torch.Tensor):
        if value.is_meta:
            raise SchemaMismatchError(f"trajectory {traj_id}: field {name!r} is a meta-device tensor (shape only, no "
                                      f"data); put the materialised tensor")
        if value.dtype == torch.bfloat16:
            raise SchemaMismatchError(f"trajectory {traj_id}: field {name!r} has dtype torch.bfloat16, which numpy "
                                      f"cannot hold; cast it to float32 before the put (casts back to bf16 happen "
                                      f"on the trainer: PrepareConfig.casts)")
        try:
            return value.detach().cpu().numpy()
        except (TypeError, RuntimeError) as e:
            raise SchemaMismatchError(f"trajectory {traj_id}: field {name!r} ({value.dtype} on {value.device}) "
                                      f"cannot be read as a numpy array: {e}") from None
    raise SchemaMismatchError(f"trajectory {traj_id}: field {name!r} must be a numpy array or torch tensor, "
                              f"got {type(value).__name__}")


@dataclass(frozen=True)
class TrajectoryPayload:
    """What a producer writes for one trajectory: some (or all) schema fields, each exactly once."""

    traj_id: int
    tensors: Mapping[str, np.ndarray]
    checksums: Mapping[str, int] | None = None
    """Producer-side checksum per field (``knittrans.dataplane.faults.field_checksum``), or None: verified by
    the unit on receipt and by the rank on fetch, so a corrupted message is caught at both ends."""
    meta: Trajectory | None = None
    """Admission metadata (group, batch, response tokens, ``v_gen``): the put that carries it completes the
    trajectory, and a controller with an admission policy hands it to the policy (``knittrans.handoff``). Put
    every other field of the trajectory before, or with, this one."""


@dataclass(frozen=True, slots=True)
class FieldMeta:
    """Size of one produced field of one trajectory (metadata the controller keeps; never the bytes)."""

    name: str
    nbytes: int
    length: int
    checksum: int | None = None  # the producer's checksum of the bytes, when the put carried one


@dataclass(frozen=True)
class PutRecord:
    """A unit's report that it now holds ``fields`` of ``traj_id``."""

    traj_id: int
    unit_id: str
    fields: tuple[FieldMeta, ...]
    num_tokens: int | None  # length of the token field, if this put carried it
    meta: Trajectory | None = None  # the payload's admission metadata, forwarded to the controller
    repeated: tuple[str, ...] = ()
    """Fields the unit already held with identical bytes (a retried put): the controller registers them only if
    the first reply was lost, and a rollback never drops them (they belong to the first put)."""
    source: object = None
    """Where the unit keeps this put's bytes, as a reader resolves it: the put's stored arrays (in process: a tuple
    of contiguous arrays, one per field) or the Ray object-store object holding them (an ``ObjectRef`` owned by the
    unit). Every record of one put names the same source. None: the unit keeps no readable source (a small Ray put,
    a multimodal or fault-injecting unit): its rows are read through the unit (``UnitAPI.get``)."""
    where: tuple[tuple[int, int, int] | None, ...] = ()
    """Per entry of ``fields``: (array of ``source``, first byte, end byte) of that field's row, or None where the
    field is not a plain run of ``source`` (then the share is read through the unit). () when ``source`` is None."""


@dataclass(frozen=True)
class ControllerStats:
    """Counts for reports and tests."""

    trajectories: int
    admitted: int
    claims: int
    released_minibatches: int
    missing: int = 0  # trajectories lost with a unit and not re-put yet
    units_lost: int = 0
    completed: int = 0  # trajectories whose completing put (with meta) arrived
    planned_minibatches: int = 0  # M per announced batch
    held: int = 0  # trajectories with live metadata (not yet released): what controller memory scales with
    held_minibatches: int = 0  # admitted, not yet released
    released_id_ranges: int = 0  # released ids are kept as ranges (one per run of consecutive ids)
    discarded: int = 0  # orphans forgotten by ``discard``
    restarts: int = 0  # times this controller was rebuilt from its journal and the units (``restore``)
    held_groups: int = 0  # announced groups whose batch still has unreleased trajectories


@dataclass(frozen=True, slots=True, order=True)
class MiniBatchKey:
    """Identifies an admitted mini-batch: the ``index``-th mini-batch of training batch ``batch_id``."""

    batch_id: int
    index: int


@dataclass(frozen=True)
class AdmittedMiniBatch:
    """An admitted mini-batch and its split into shares: ``shares[r]`` are the trajectory ids rank ``r``
    consumes. ``seq`` is the admission order (the order trainer ranks consume mini-batches in)."""

    key: MiniBatchKey
    seq: int
    traj_ids: tuple[int, ...]
    shares: tuple[tuple[int, ...], ...]
    share_tokens: tuple[int, ...]
    local_fraction: float  # fraction of trajectories whose rank sits on the node of the unit that holds them
    group_ids: tuple[int, ...] = ()  # the groups the mini-batch consumes (as admission committed them)


@dataclass(frozen=True)
class ShareLocation:
    """The controller's answer to a claim: where each trajectory of a rank's share lives."""

    key: MiniBatchKey
    rank: int
    traj_ids: tuple[int, ...]
    unit_ids: tuple[str, ...]  # unit_ids[i] holds traj_ids[i]
    fields: tuple[str, ...]
    nbytes: int  # payload bytes of the requested fields (what the rank receives)
    checksums: tuple[tuple[int | None, ...], ...] = ()  # checksums[f][i]: field f of traj_ids[i]; () when none
    seq: int = -1  # the mini-batch's admission order (its training step), -1 when unknown
    group_ids: tuple[int, ...] = ()  # every group of the mini-batch (all ranks' shares together)
    epoch: int = -1  # the rank incarnation that claimed it (``Controller.rank_epoch``); -1: unfenced
    waited_s: float = 0.0
    """How long ``claim_next`` waited in the controller for the admission (and any re-put) before it claimed: time
    the fetch spent waiting for data to exist, not moving it (``FetchTiming`` keeps the two apart)."""
    admitted_at: float = math.nan
    """When the mini-batch was admitted, on the controller's ``time.perf_counter`` (NaN: not known -- restored from a
    journal); comparable with a reader's own clock only where ``clock`` equals the reader's ``CLOCK_DOMAIN``."""
    clock: str = ""
    """The ``CLOCK_DOMAIN`` of the process that stamped ``admitted_at``."""
    runs: "ShareRuns | None" = None
    """The share's bytes as runs of its units' sources (``ShareRuns``): the rank resolves the sources once and copies
    each run into its buffer, no unit call. None: some row has no readable source; the rank reads through the units."""


def _clock_domain() -> str:
    """Processes whose ``time.perf_counter`` values are comparable share this id: on Linux perf_counter is
    CLOCK_MONOTONIC, one clock per boot of a machine (every process and every raylet of a one-machine cluster);
    elsewhere, or unreadable, this process alone."""
    import uuid

    if sys.platform.startswith("linux"):
        try:
            with open("/proc/sys/kernel/random/boot_id") as f:
                return "boot:" + f.read().strip()
        except OSError:
            pass
    return "proc:" + uuid.uuid4().hex


CLOCK_DOMAIN = _clock_domain()
"""This process's clock domain (``ShareLocation.clock``)."""


class Retired(NamedTuple):
    """Sources retired since a reader's position in the controller's log (``SourceTable.retired_since``): their ids
    (``ObjectRef.binary()``), the reader's new position, and whether it must reset (its position was not in the
    log)."""

    ids: tuple[bytes, ...]
    cursor: tuple[str, int] | None
    reset: bool


class Polled(NamedTuple):
    """A long poll's answer (``Controller.poll``): the incarnation it was fenced by, the shares it claimed, in
    admission order (none: nothing was admitted within the poll's timeout), and the sources retired since the
    poller's last answer (``Retired``)."""

    epoch: int
    locs: tuple[ShareLocation, ...]
    retired: Retired = Retired((), None, False)


class InlineSource:
    """A small put's source that rides with its registration instead of being an object of its unit
    (``ray_transport.ControllerHost.register_inline``): its arrays, one per field, as ``PutRecord.source`` holds
    them in process, and an id that names it as ``ObjectRef.binary()`` names an object (a reader's
    ``client.SourceCache`` keys and the controller's retirements use it). A claim hands it to the rank with its
    bytes: nothing to map, no pull."""

    __slots__ = ("arrays", "_id")

    def __init__(self, arrays: Sequence[np.ndarray], source_id: bytes | None = None) -> None:
        self.arrays = tuple(arrays)
        self._id = source_id if source_id is not None else uuid.uuid4().bytes

    def binary(self) -> bytes:
        return self._id

    def __reduce__(self):  # noqa: ANN204
        return (InlineSource, (self.arrays, self._id))

    def __repr__(self) -> str:
        return f"InlineSource({self._id.hex()[:8]}, {sum(int(a.nbytes) for a in self.arrays)} bytes)"


@dataclass(frozen=True)
class ShareRuns:
    """Where a share's bytes lie, as a reader copies them: ``sources[s]`` is a put's source (``PutRecord.source``:
    arrays in process, an ``ObjectRef`` on Ray) held by unit ``source_units[s]``; per requested field ``f``,
    ``runs[f]`` is an ``int64`` array of rows (source, array, first byte, end byte), consecutive rows of the share
    that lie back to back in one array merged into one run, in the share's order; ``nbytes[f]`` is each
    trajectory's byte count of that field (its row count follows from the schema: what ``cu_seqlens`` is built
    from). The share of field ``f`` is the concatenation of its runs, in the schema's dtype."""

    sources: tuple
    source_units: tuple[str, ...]
    runs: tuple[np.ndarray, ...]
    nbytes: tuple[np.ndarray, ...]


@dataclass(frozen=True)
class UnitChunk:
    """A unit's answer to a get: field ``fields[f]`` of every trajectory in ``traj_ids``, in one of two forms.

    - **rows** (what ``StorageUnit.get`` returns): ``values[f]`` is a tuple of per-trajectory arrays, the unit's
      read-only stored copies themselves. In process that moves no byte; on Ray a rank on the unit's node gets
      the same rows as views of the unit's own object-store objects (``ray_transport.StoredChunk``: zero-copy),
      and a rank elsewhere gets the packed form. The rank then copies every row once, into its packed share
      (``pack_share``).
    - **packed**: ``values[f]`` is one array with every trajectory back to back (ragged: ``lengths[f][i]`` rows
      each; fixed: stacked, lengths None). What a hand-built chunk or a rewritten field (multimodal
      ``image_index``) uses.

    ``rows(f)`` reads either form as per-trajectory arrays (views, no copy)."""

    unit_id: str
    traj_ids: tuple[int, ...]
    fields: tuple[str, ...]
    values: tuple[np.ndarray | tuple[np.ndarray, ...], ...]
    lengths: tuple[np.ndarray | None, ...]

    def rows(self, f: int) -> Sequence[np.ndarray]:
        """Field ``fields[f]`` of each trajectory in ``traj_ids`` order (views of ``values[f]``, no copy)."""
        vals = self.values[f]
        if isinstance(vals, (tuple, list)):
            return vals
        lens = self.lengths[f]
        if lens is None:
            return [vals[i] for i in range(len(self.traj_ids))]
        offs = np.zeros(len(self.traj_ids) + 1, dtype=np.int64)
        np.cumsum(lens, out=offs[1:])
        return [vals[offs[i]:offs[i + 1]] for i in range(len(self.traj_ids))]


@dataclass(frozen=True)
class PackedField:
    """One field of a share, ready to use: ragged fields are packed back to back (``values`` is
    ``[sum(len), *tail]``, sequence i is ``values[cu_seqlens[i]:cu_seqlens[i+1]]``, the varlen layout of
    flash-attention); fixed fields are stacked (``[n, *tail]``, ``cu_seqlens`` None)."""

    name: str
    values: torch.Tensor
    cu_seqlens: torch.Tensor | None


@dataclass(frozen=True)
class PackedShare:
    """What ``fetch`` hands a trainer rank: its trajectories' requested fields, packed, cast and (with a GPU)
    pinned. ``nbytes`` counts the payload as received, before casts."""

    key: MiniBatchKey
    rank: int
    traj_ids: tuple[int, ...]
    fields: Mapping[str, PackedField] = field(repr=False)
    nbytes: int = 0
    num_tokens: int = 0
    seq: int = -1
    """The mini-batch's admission order: the policy version of the step that trains on it (``v_train``)."""
    group_ids: tuple[int, ...] = ()
    """Every group of the mini-batch (all ranks' shares): what a step's completion releases from flow control."""
    epoch: int = -1
    """The rank incarnation that claimed it (-1: unfenced); its ack carries it."""

    def __getitem__(self, name: str) -> torch.Tensor:
        try:
            return self.fields[name].values
        except KeyError:
            raise FieldNotProducedError(f"share {self.key} rank {self.rank} does not carry field {name!r} "
                                        f"(it carries {sorted(self.fields)})") from None


TEXT_SCHEMA = TrajectorySchema(
    fields=(FieldSpec("input_ids", "int64"), FieldSpec("old_logprobs", "float32", finite=True),
            FieldSpec("advantages", "float32", finite=True), FieldSpec("loss_mask", "bool")),
    token_field="input_ids", same_length=(("old_logprobs", "advantages", "loss_mask"),),
    response_field="old_logprobs")
"""A GRPO text trajectory: ``input_ids`` is prompt + response (it counts a trajectory's tokens); the
response-length fields are the behaviour log-probs, the per-token advantages and the loss mask. The prompt is the
first ``len(input_ids) - len(old_logprobs)`` ids."""
