"""The ``/v1`` messages between nodes, trainers and the dataflow, and their codec.

Arrays (tokens, mask, logprobs, versions) travel in msgpack as little-endian bytes; every
record checks lengths, ranges and finiteness when it is built (see the package docstring).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Sequence
from typing import Annotated, Any, Final, Literal, TypeVar

import msgpack
import numpy as np
import numpy.typing as npt
import pydantic
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
)

from astraflow.errors import ValidationError
from astraflow.records.validators import exactly_one, ordered_fields

WIRE_VERSION: Final = "v1"
MSGPACK_MEDIA_TYPE: Final = "application/msgpack"
JSON_MEDIA_TYPE: Final = "application/json"

#: A version number meaning "no weights yet" (a node that has pulled nothing).
NO_VERSION: Final = -1

NAME_PATTERN: Final = r"^[A-Za-z0-9][A-Za-z0-9_.:/@+-]{0,127}$"
"""Names of policies, nodes, pools, workflows, sources and trainers."""

Name = Annotated[str, Field(pattern=NAME_PATTERN)]
Id = Annotated[str, Field(min_length=1, max_length=256)]

MAX_WIRE_INT: Final = 2**53 - 1
"""Largest integer a record field holds: exact in every JSON reader, and fits SQLite's int64."""
MAX_META_INT: Final = 2**63 - 1
"""Largest magnitude of an integer inside free-form ``payload`` / ``meta`` (msgpack, SQLite)."""

Count = Annotated[int, Field(ge=0, le=MAX_WIRE_INT)]
"""A non-negative integer (counts, attempts, versions, rounds)."""
HeldVersion = Annotated[int, Field(ge=-1, le=MAX_WIRE_INT)]
"""A version a node holds (-1: nothing loaded yet)."""

LEASE_SECRET_PATTERN: Final = r"^[0-9a-f]{32}$"
LeaseSecret = Annotated[str, Field(pattern=LEASE_SECRET_PATTERN)]
"""Proof of holding one lease: returned by ``lease``, required by renew/submit/fail/release."""


def _check_json_value(value: Any, where: str, depth: int = 0) -> None:
    if depth > 32:
        raise ValueError(f"{where}: nested more than 32 levels deep")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{where}: must be finite, got {value}")
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_META_INT:
        raise ValueError(f"{where}: integer {value} is outside the 64-bit range")
    if isinstance(value, dict):
        for k, v in value.items():
            _check_json_value(v, f"{where}.{k}", depth + 1)
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _check_json_value(v, f"{where}.{i}", depth + 1)


def _plainly_json(value: Any, depth: int = 0) -> bool:
    """True when ``value`` passes ``_check_json_value`` for sure: built-in containers of
    strings, booleans, None, finite floats and 64-bit ints, at most 32 levels deep. Checked
    with no path strings (a sample's meta is validated on every hop); anything else, good or
    bad, is left to the full check, which names what is wrong."""
    if depth >= 32:  # its items would sit deeper than 32: the full check decides
        return False
    kind = type(value)
    if kind is dict:
        items: Iterable[Any] = value.values()
    elif kind is list or kind is tuple:
        items = value
    else:
        return False
    for v in items:
        kind = type(v)
        if kind is str or kind is bool or v is None:
            continue
        if kind is float:
            if not math.isfinite(v):
                return False
        elif kind is int:
            if not -MAX_META_INT <= v <= MAX_META_INT:
                return False
        elif not (kind is dict or kind is list or kind is tuple) or not _plainly_json(v, depth + 1):
            return False
    return True


def _json_object(value: dict[str, Any]) -> dict[str, Any]:
    if not _plainly_json(value):
        _check_json_value(value, "value")
    return value


JsonObject = Annotated[dict[str, Any], AfterValidator(_json_object)]
"""Free-form JSON object: finite numbers, 64-bit integers, at most 32 levels deep."""

# --------------------------------------------------------------------------- arrays


def _array_validator(dtype: str) -> BeforeValidator:
    wire = np.dtype(dtype).newbyteorder("<")

    target = np.dtype(dtype)

    native = wire == target  # a little-endian machine: the wire bytes are the array's own

    def convert(value: Any) -> npt.NDArray[Any]:
        if isinstance(value, np.ndarray) and value.dtype == target and value.ndim == 1:
            return value.copy()  # built in process with the right dtype: in range already
        if isinstance(value, (bytes, bytearray, memoryview)):
            raw = value if type(value) is bytes else bytes(value)
            if len(raw) % wire.itemsize:
                raise ValueError(
                    f"packed array of {len(raw)} bytes is not a multiple of {wire.itemsize} "
                    f"({dtype})"
                )
            packed = np.frombuffer(raw, dtype=wire)
            # a copy either way: the record owns its arrays, never the caller's buffer
            return packed.copy() if native else packed.astype(dtype)
        arr = np.asarray(value)
        if arr.ndim != 1:
            raise ValueError(f"expected a 1-D array, got shape {arr.shape}")
        if arr.size and arr.dtype.kind not in "iufb":
            raise ValueError(f"expected numbers, got dtype {arr.dtype}")
        if target.kind in "iu" and arr.size:
            if arr.dtype.kind == "f" and not (
                np.all(np.isfinite(arr)) and np.all(arr == np.round(arr))
            ):
                raise ValueError("expected integers")
            info = np.iinfo(target)
            if arr.min() < info.min or arr.max() > info.max:
                raise ValueError(f"has a value outside the {dtype} range")
        if target.kind == "f" and arr.size and arr.dtype != target:
            finite = arr[np.isfinite(arr)]
            if finite.size and float(np.abs(finite).max()) > float(np.finfo(target).max):
                raise ValueError(f"has a value outside the {dtype} range")
        return arr.astype(dtype, copy=True)

    return BeforeValidator(convert)


def _array_serializer(dtype: str) -> PlainSerializer:
    wire = np.dtype(dtype).newbyteorder("<")

    def serialize(value: npt.NDArray[Any], info: pydantic.SerializationInfo) -> Any:
        if info.mode == "json":
            return value.tolist()
        return value.astype(wire, copy=False).tobytes()

    return PlainSerializer(serialize)


def _array_schema(dtype: str, item: dict[str, Any]) -> WithJsonSchema:
    return WithJsonSchema(
        {
            "description": f"1-D {dtype} array: a JSON list, or little-endian bytes in msgpack",
            "anyOf": [{"type": "array", "items": item}, {"type": "string", "format": "binary"}],
        }
    )


Int32Array = Annotated[
    npt.NDArray[np.int32],
    _array_validator("int32"),
    _array_serializer("int32"),
    _array_schema("int32", {"type": "integer"}),
]
Float32Array = Annotated[
    npt.NDArray[np.float32],
    _array_validator("float32"),
    _array_serializer("float32"),
    _array_schema("float32", {"type": "number"}),
]
MaskArray = Annotated[
    npt.NDArray[np.uint8],
    _array_validator("uint8"),
    _array_serializer("uint8"),
    _array_schema("uint8", {"type": "integer", "minimum": 0, "maximum": 1}),
]


#: Arrays up to this long are checked as Python lists: a numpy reduction costs ~2 us of call
#: overhead, several times what a short list costs, and a sample's arrays are checked on every
#: hop (built in the node, decoded by the dataflow, decoded by the trainer).
_SHORT = 64


def _lowest(v: npt.NDArray[Any]) -> int:
    """The smallest value of a non-empty integer array."""
    return int(min(v.tolist())) if v.shape[0] <= _SHORT else int(v.min())


def _highest(v: npt.NDArray[Any]) -> int:
    """The largest value of a non-empty integer array."""
    return int(max(v.tolist())) if v.shape[0] <= _SHORT else int(v.max())


def _all_finite(v: npt.NDArray[Any]) -> bool:
    """No NaN and no infinity in a float array."""
    if v.shape[0] <= _SHORT:
        return all(map(math.isfinite, v.tolist()))
    return bool(np.isfinite(v).all())


class Record(BaseModel):
    """Base of every wire record: strict keys, immutable after validation."""

    model_config = ConfigDict(
        extra="forbid",
        frozen=True,
        arbitrary_types_allowed=True,
        use_attribute_docstrings=True,
        allow_inf_nan=False,  # NaN / inf never cross a wire edge (they poison reports)
    )

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return _equal(self.__dict__, other.__dict__)

    __hash__ = None  # type: ignore[assignment]  # records hold arrays and dicts: not hashable


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return (
            isinstance(a, np.ndarray)
            and isinstance(b, np.ndarray)
            and a.dtype == b.dtype
            and np.array_equal(a, b)
        )
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def _finite(value: float, field: str) -> float:
    if not math.isfinite(value):
        raise ValueError(f"{field} must be finite, got {value}")
    return value


# --------------------------------------------------------------------------- tasks


class Task(Record):
    """One unit of rollout work: a prompt (or environment seed) and how to run it."""

    task_id: Id
    """Stable id: the same source row always gets the same id (epochs add a suffix)."""
    workflow: Name
    """Registry name of the workflow that runs this task (a node must declare it can)."""
    payload: JsonObject = Field(default_factory=dict)
    """Prompt/messages, reference answer, tests ... whatever the workflow reads."""
    group_size: int = Field(default=1, ge=1, le=1024)
    """Samples per policy the workflow should produce for this task (one GRPO group)."""
    attempt: Count = 0
    """Delivery attempt; an expired or handed-back lease re-queues the task as attempt + 1."""
    source: Name = "default"
    """Name of the task source this task came from (used by mixing samplers and reports)."""
    meta: JsonObject = Field(default_factory=dict)
    """Free-form annotations (epoch, difficulty, curriculum level ...)."""


class LeaseRef(Record):
    """Names one leased delivery of a task, ``(task_id, attempt)``, with its lease secret."""

    task_id: Id
    attempt: Count
    secret: LeaseSecret
    """The secret ``lease`` returned for this delivery: only its holder can renew or release."""


# --------------------------------------------------------------------------- samples


class Sample(Record):
    """One policy's trajectory for training: every token, which were generated, and by what.

    Arrays have one entry per token of ``token_ids`` (prompt, all turns, tool output). Tokens the
    policy generated have ``loss_mask == 1``, their behaviour ``logprobs`` and the weight
    ``versions`` that produced them; all other tokens have mask 0, logprob 0 and version -1.
    """

    policy: Name
    task_id: Id
    group_id: Id
    """Samples with the same policy and group_id are normalised together (one GRPO group)."""
    token_ids: Int32Array
    loss_mask: MaskArray
    logprobs: Float32Array
    versions: Int32Array
    reward: float
    meta: JsonObject = Field(default_factory=dict)
    """Node, pool, timings, turn count, finish reason, task type ..."""

    @field_validator("token_ids")
    @classmethod
    def _check_tokens(cls, v: npt.NDArray[np.int32]) -> npt.NDArray[np.int32]:
        if v.shape[0] == 0:
            raise ValueError("token_ids is empty")
        if _lowest(v) < 0:
            raise ValueError("token_ids has a negative id")
        return v

    @field_validator("loss_mask", "logprobs", "versions")
    @classmethod
    def _check_aligned(cls, v: npt.NDArray[Any], info: ValidationInfo) -> npt.NDArray[Any]:
        tokens = info.data.get("token_ids")
        if tokens is not None and v.shape[0] != tokens.shape[0]:
            raise ValueError(f"has {v.shape[0]} entries but token_ids has {tokens.shape[0]}")
        if not v.size:
            return v
        field = info.field_name
        if field == "loss_mask" and _highest(v) > 1:
            raise ValueError("must hold only 0 and 1")
        if field == "logprobs" and not _all_finite(v):
            raise ValueError("has a non-finite value")
        if field == "versions" and _lowest(v) < NO_VERSION:
            raise ValueError("must be >= -1")
        return v

    @field_validator("reward")
    @classmethod
    def _check_reward(cls, v: float) -> float:
        return _finite(v, "reward")

    @property
    def num_tokens(self) -> int:
        """Total tokens (prompt, all turns)."""
        return int(self.token_ids.shape[0])

    @property
    def num_generated(self) -> int:
        """Tokens this policy generated and will be trained on."""
        return int(self.loss_mask.sum())

    @property
    def behaviour_version(self) -> int:
        """Oldest weight version that produced a trained token (-1 when none)."""
        versions = self.versions
        if versions.shape[0] <= _SHORT:
            return min((v for v in versions.tolist() if v >= 0), default=NO_VERSION)
        produced = versions[versions >= 0]
        return int(produced.min()) if produced.size else NO_VERSION

    def staleness(self, trainer_version: int) -> int:
        """Trainer updates between the weights that made this sample and ``trainer_version``.

        The single definition of staleness: counted in optimizer steps of this sample's policy.
        """
        produced = self.behaviour_version
        return 0 if produced < 0 else max(0, trainer_version - produced)

    def check_vocab(self, vocab_size: int) -> None:
        """Raise ``ValidationError`` when a token id is outside ``[0, vocab_size)``."""
        top = _highest(self.token_ids)
        if top >= vocab_size:
            raise ValidationError(
                f"token id {top} is outside the vocabulary of policy {self.policy!r} "
                f"(size {vocab_size})",
                field="token_ids",
            )


# --------------------------------------------------------------------------- versions


class PolicyVersion(Record):
    """A published weight version: what a trainer announces and nodes refresh to."""

    policy: Name
    version: Count
    """Trainer version: the number of optimizer updates behind these weights."""
    manifest: str = Field(min_length=1, max_length=1024)
    """Reference to the weight manifest in the weight store (path relative to its root)."""
    created_at: float = Field(default_factory=time.time)
    final: bool = False
    """The trainer stops after this version (it reached its last step): the dataflow stops
    buffering the policy's samples, and the policy no longer throttles leases or holds back
    lock-step rounds, so the other policies' trainers go on. A later version re-activates it."""


class WatchVersionsRequest(Record):
    """Long-poll for new versions: answered with the latest versions (as ``GET /v1/versions``)
    once a policy named in ``known`` has one newer than the version given for it, or at the
    timeout. A node holds one open to start pulling a version as it is announced, while it
    still generates with the one before (it would otherwise hear of it only at its next
    lease or heartbeat)."""

    known: dict[Name, int] = Field(default_factory=dict, max_length=256)
    """Policy -> the newest version the caller knows of (-1: none yet). Empty: answered at
    once."""
    timeout_s: float = Field(default=30.0, ge=0, le=600)
    """Wait up to this long (the service caps it at ``limits.max_take_timeout_s``)."""

    @field_validator("known")
    @classmethod
    def _versions_in_range(cls, known: dict[str, int]) -> dict[str, int]:
        for policy, version in known.items():
            if not -1 <= version <= MAX_WIRE_INT:
                raise ValueError(
                    f"known[{policy!r}] is {version}: a version is -1 (none yet) to {MAX_WIRE_INT}"
                )
        return known


# --------------------------------------------------------------------------- node <-> dataflow


class NodeStats(Record):
    """What a node reports about itself with each heartbeat."""

    samples_per_s: float = Field(default=0.0, ge=0)
    tokens_per_s: float = Field(default=0.0, ge=0)
    in_flight: Count = 0
    """Tasks the node is running now."""
    completed: Count = 0
    failed: Count = 0
    mean_task_latency_s: float = Field(default=0.0, ge=0)
    hardware: str = ""
    """Free text: e.g. 'cpu x2', 'H100 80GB'."""
    extra: dict[str, float] = Field(default_factory=dict)


class LeaseRequest(Record):
    """A node asks for up to ``capacity`` tasks of the workflows it can run."""

    node_id: Name
    pool: Name = "default"
    capacity: int = Field(ge=0, le=4096)
    workflows: list[Name] = Field(min_length=1)
    versions: dict[Name, HeldVersion] = Field(default_factory=dict)
    """Weight version the node holds per policy (-1: nothing loaded yet)."""
    stats: NodeStats = Field(default_factory=NodeStats)
    incarnation: Id | None = None
    """A random id the node process draws when it starts. A lease from another incarnation
    than the one the node's open leases were granted to means that process is gone (it
    crashed and the node came back under the same id): those leases are re-queued at once
    instead of at their deadline. None: not tracked (older nodes)."""


class LeaseReply(Record):
    """Tasks granted (possibly none), how long the lease lasts, and what to refresh."""

    tasks: list[Task]
    lease_ttl_s: float = Field(gt=0)
    """Seconds until these leases expire unless renewed (relative: node clocks may differ)."""
    versions: dict[Name, PolicyVersion] = Field(default_factory=dict)
    """Latest announced version per policy."""
    refresh: dict[Name, str] = Field(default_factory=dict)
    """Policies the node must refresh before it gets tasks that need them, with the reason."""
    reason: str = ""
    """Why fewer tasks than asked were granted (backpressure, staleness, queue empty)."""
    retry_after_s: float = Field(default=0.0, ge=0)
    """When no task was granted: how long to wait before asking again."""
    secrets: dict[Id, LeaseSecret] = Field(default_factory=dict)
    """The lease secret of each granted task, by task_id: renew, submit, fail and release of
    that delivery must present it (a node can touch only the leases it was granted)."""


class RenewRequest(Record):
    """Heartbeat: extend every lease the node holds, and report its stats."""

    node_id: Name
    pool: Name = "default"
    leases: list[LeaseRef] = Field(default_factory=list)
    versions: dict[Name, HeldVersion] = Field(default_factory=dict)
    stats: NodeStats = Field(default_factory=NodeStats)


class RenewReply(Record):
    """Leases extended, leases lost (expired and re-queued, or already done), latest versions."""

    lease_ttl_s: float = Field(gt=0)
    lost: list[LeaseRef] = Field(default_factory=list)
    versions: dict[Name, PolicyVersion] = Field(default_factory=dict)


class SubmitRequest(Record):
    """A task's trajectories: every sample the workflow produced, all policies.

    Idempotent on ``(task_id, attempt)``: a repeated submit is accepted once.
    """

    node_id: Name
    task_id: Id
    attempt: Count
    secret: LeaseSecret
    """The lease secret of this delivery (from ``LeaseReply.secrets``)."""
    samples: list[Sample] = Field(min_length=1)


class SubmitReply(Record):
    """What happened to a submission."""

    accepted: bool
    """Samples were stored (False for a duplicate or a lost lease)."""
    duplicate: bool = False
    kept: dict[Name, int] = Field(default_factory=dict)
    """Samples buffered per policy after the trajectory filters."""
    dropped: dict[Name, str] = Field(default_factory=dict)
    """Policies whose group a filter dropped, with the filter's reason."""


#: Most submissions one ``/v1/submit/many`` request carries.
MAX_SUBMITS: Final = 1024


class SubmitManyRequest(Record):
    """Several tasks' submissions in one request: each is handled exactly as its own
    ``/v1/submit`` would be (authorised, deduplicated, stored), one after the other; one that
    fails does not stop the others. A node whose tasks finish together (one engine batch)
    sends one request instead of one per task."""

    submits: list[SubmitRequest] = Field(min_length=1, max_length=MAX_SUBMITS)


class SubmitOutcome(Record):
    """What happened to one submission of a ``SubmitManyRequest``: its reply, or the error
    body its own ``/v1/submit`` would have answered with (``{"code", "message", ...}``)."""

    reply: SubmitReply | None = None
    error: dict[str, Any] | None = None

    _one = exactly_one("reply", "error", "an outcome holds exactly one of 'reply' or 'error'")


class SubmitManyReply(Record):
    """One outcome per submission, in the request's order."""

    outcomes: list[SubmitOutcome]


class FailRequest(Record):
    """A node reports that a task could not be completed."""

    node_id: Name
    task_id: Id
    attempt: Count
    secret: LeaseSecret
    """The lease secret of this delivery (from ``LeaseReply.secrets``)."""
    error: str = Field(max_length=4096)
    retryable: bool = True
    """False for errors that will repeat (e.g. a malformed task): fail it without retrying."""


class FailReply(Record):
    """Whether the task was re-queued (attempt + 1) or is now failed for good."""

    requeued: bool
    failed: bool


class ReleaseRequest(Record):
    """A stopping node hands leases back so the tasks are re-queued at once."""

    node_id: Name
    leases: list[LeaseRef]


class ReleaseReply(Record):
    """How many handed-back leases were re-queued."""

    requeued: int = Field(ge=0)


# --------------------------------------------------------------------------- trainer <-> dataflow


class TakeBatchRequest(Record):
    """A trainer asks for a batch of whole groups for its policy (long-poll)."""

    policy: Name
    trainer_id: Name = "trainer"
    trainer_version: Count
    """The version the trainer's next update will start from; bounds staleness."""
    min_samples: int = Field(default=1, ge=1, le=MAX_WIRE_INT)
    max_samples: int = Field(default=256, ge=1, le=MAX_WIRE_INT)
    timeout_s: float = Field(default=30.0, ge=0, le=600)
    """Long-poll: wait up to this long for ``min_samples`` to be available."""
    holding: list[Id] = Field(default_factory=list, max_length=8)
    """Batches this trainer took and has not acked yet (a prefetch, an ack in flight): kept
    open; every other open batch of this trainer and policy goes back to the buffer."""

    _check_sizes = ordered_fields("min_samples", "max_samples")


class HandBackRequest(Record):
    """A stopping trainer gives back the batches it took and will not train: their groups are
    buffered again at once (not at their ack deadline), and its takes still waiting end."""

    policy: Name
    trainer_id: Name = "trainer"
    holding: list[Id] = Field(default_factory=list, max_length=8)
    """Batches it still holds (an ack in flight): kept open."""


class HandBackReply(Record):
    """How many open batches went back to the buffer."""

    batches: int = Field(ge=0)


class Batch(Record):
    """Samples of one policy, whole groups, served for ``trainer_version``; ack when done."""

    batch_id: Id
    policy: Name
    trainer_version: Count
    samples: list[Sample] = Field(min_length=1)
    ack_deadline_s: float = Field(gt=0)
    """Seconds until an un-acked batch is served again."""

    @property
    def num_groups(self) -> int:
        """Distinct groups in this batch."""
        return len({s.group_id for s in self.samples})


class AckRequest(Record):
    """The trainer committed its step on this batch: never serve it again."""

    batch_id: Id
    trainer_id: Name = "trainer"


class AnnounceReply(Record):
    """The version now recorded as latest for the policy."""

    latest: PolicyVersion


# --------------------------------------------------------------------------- wire codec

RecordT = TypeVar("RecordT", bound=BaseModel)


def _msgpack_default(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"cannot encode {type(value).__name__} in msgpack")


def pack(record: BaseModel) -> bytes:
    """Encode a record as msgpack; arrays become little-endian bytes."""
    data: bytes = msgpack.packb(
        record.model_dump(mode="python"), default=_msgpack_default, use_bin_type=True
    )
    return data


def unpack(cls: type[RecordT], data: bytes | bytearray) -> RecordT:
    """Decode and validate msgpack bytes as ``cls``; raise ``ValidationError`` naming the field."""
    try:
        raw = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise ValidationError(f"body is not valid msgpack: {exc}", field="body") from exc
    return parse(cls, raw)


def parse(cls: type[RecordT], raw: Any) -> RecordT:
    """Validate already-decoded data as ``cls``, converting pydantic errors to ours."""
    try:
        return cls.model_validate(raw)
    except pydantic.ValidationError as exc:
        raise validation_error(exc, cls.__name__) from exc


def parse_json(cls: type[RecordT], data: bytes | bytearray | str) -> RecordT:
    """Decode and validate JSON as ``cls``."""
    try:
        return cls.model_validate_json(data)
    except pydantic.ValidationError as exc:
        raise validation_error(exc, cls.__name__) from exc


def validation_error(exc: pydantic.ValidationError, what: str) -> ValidationError:
    """Turn pydantic's error into one ``ValidationError`` that names the first bad field."""
    first = exc.errors(include_url=False)[0]
    loc = ".".join(str(p) for p in first.get("loc", ())) or what
    msg = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    if first.get("type") == "finite_number":
        msg = f"must be a finite number, got {first.get('input')}"
    more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
    return ValidationError(f"invalid {what}: {loc}: {msg}{more}", field=loc)


def groups_of(samples: Sequence[Sample]) -> dict[tuple[str, str], list[Sample]]:
    """Samples keyed by ``(policy, group_id)``, in first-seen order."""
    out: dict[tuple[str, str], list[Sample]] = {}
    for s in samples:
        out.setdefault((s.policy, s.group_id), []).append(s)
    return out


Role = Literal["node", "trainer", "admin", "read"]
"""Bearer-token roles; ``read`` opens only the read-only routes (report, versions, metrics,
dashboard)."""
