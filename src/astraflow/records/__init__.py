"""Shared records: the ``/v1`` wire vocabulary every component speaks (no torch here).

Control messages travel as JSON; anything carrying samples travels as msgpack, with token,
mask, logprob and version arrays packed as little-endian bytes (``pack`` / ``unpack``). Every
record validates itself on construction, so decoding at a wire edge *is* validation: lengths,
value ranges and finiteness are checked here once, for every component.

    Task ──lease──► node ──workflow──► Sample* ──submit──► buffer[policy] ──take──► Batch
                                          (one group per task and policy)

``wire``: the messages and their codec; ``report``: the report and admin records;
``validators``: cross-field rules (``ordered_fields``, ``exactly_one``) for records and configs.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import ModuleType
from typing import Any

from astraflow.records import report, wire
from astraflow.records.report import (
    MAX_POINT_VALUES,
    MAX_POINTS,
    MAX_POOL_NODES,
    STALENESS_BINS,
    DataflowReport,
    MetricPoint,
    MetricPoints,
    NodeReport,
    PolicyReport,
    PoolReport,
    PoolSize,
    PoolSizeRequest,
    PoolSizes,
    PoolTarget,
    RoundTiming,
    SyncReport,
    TaskQueueReport,
    TrainerReport,
)
from astraflow.records.validators import exactly_one, ordered_fields
from astraflow.records.wire import (
    JSON_MEDIA_TYPE,
    MAX_WIRE_INT,
    MSGPACK_MEDIA_TYPE,
    NAME_PATTERN,
    NO_VERSION,
    WIRE_VERSION,
    AckRequest,
    AnnounceReply,
    Batch,
    FailReply,
    FailRequest,
    Float32Array,
    HandBackReply,
    HandBackRequest,
    Id,
    Int32Array,
    LeaseRef,
    LeaseReply,
    LeaseRequest,
    LeaseSecret,
    MaskArray,
    Name,
    NodeStats,
    PolicyVersion,
    Record,
    RecordT,
    ReleaseReply,
    ReleaseRequest,
    RenewReply,
    RenewRequest,
    Role,
    Sample,
    SubmitManyReply,
    SubmitManyRequest,
    SubmitOutcome,
    SubmitReply,
    SubmitRequest,
    TakeBatchRequest,
    Task,
    WatchVersionsRequest,
    groups_of,
    pack,
    parse,
    parse_json,
    unpack,
    validation_error,
)

__all__ = [
    "JSON_MEDIA_TYPE",
    "MAX_POINTS",
    "MAX_POINT_VALUES",
    "MAX_POOL_NODES",
    "MAX_WIRE_INT",
    "MSGPACK_MEDIA_TYPE",
    "NAME_PATTERN",
    "NO_VERSION",
    "STALENESS_BINS",
    "WIRE_VERSION",
    "AckRequest",
    "AnnounceReply",
    "Batch",
    "DataflowReport",
    "FailReply",
    "FailRequest",
    "Float32Array",
    "HandBackReply",
    "HandBackRequest",
    "Id",
    "Int32Array",
    "LeaseRef",
    "LeaseReply",
    "LeaseRequest",
    "LeaseSecret",
    "MaskArray",
    "MetricPoint",
    "MetricPoints",
    "Name",
    "NodeReport",
    "NodeStats",
    "PolicyReport",
    "PolicyVersion",
    "PoolReport",
    "PoolSize",
    "PoolSizeRequest",
    "PoolSizes",
    "PoolTarget",
    "Record",
    "RecordT",
    "ReleaseReply",
    "ReleaseRequest",
    "RenewReply",
    "RenewRequest",
    "Role",
    "RoundTiming",
    "Sample",
    "SubmitManyReply",
    "SubmitManyRequest",
    "SubmitOutcome",
    "SubmitReply",
    "SubmitRequest",
    "SyncReport",
    "TakeBatchRequest",
    "Task",
    "TaskQueueReport",
    "TrainerReport",
    "WatchVersionsRequest",
    "exactly_one",
    "groups_of",
    "ordered_fields",
    "pack",
    "parse",
    "parse_json",
    "unpack",
    "validation_error",
    "wire_schemas",
]


def _records(module: ModuleType) -> list[type[Record]]:
    return [
        v
        for v in vars(module).values()
        if isinstance(v, type)
        and issubclass(v, Record)
        and v is not Record
        and v.__module__ == module.__name__
    ]


def wire_schemas() -> Mapping[str, dict[str, Any]]:
    """JSON schema of every ``/v1`` record (each ``Record`` class of ``wire`` and ``report``),
    keyed by name (snapshotted by contract tests)."""
    return {
        m.__name__: m.model_json_schema(mode="validation") for mod in (wire, report)
        for m in _records(mod)
    }  # fmt: skip
