"""The ``/v1`` endpoint table, and the OpenAPI document generated from it and the records.

``ENDPOINTS`` is what ``app.py`` builds its routes from, so the published document
(``GET /openapi.json``) lists exactly the routes served, each with its role, its request
record and its reply; request and reply schemas are the records' own JSON schemas
(ranges, patterns, required fields), so they cannot drift from what the service validates.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from astraflow import records as r

__all__ = ["ENDPOINTS", "Endpoint", "openapi_document"]

_REF: Final = "#/components/schemas/{model}"


@dataclass(frozen=True)
class Endpoint:
    """One route: method, path, who may call it, what it takes and answers."""

    name: str
    """Handler name in the app."""
    method: Literal["GET", "POST"]
    path: str
    role: r.Role | None
    """r.Role whose token may call it (admin may call all; None: any valid token)."""
    request: type[BaseModel] | None
    reply: type[BaseModel] | Literal["versions", "object", "text"] | None
    summary: str
    public: bool = False
    """Needs no token even when tokens are configured."""
    msgpack_reply: bool = False
    """The reply is msgpack (or 204 when there is nothing)."""


ENDPOINTS: Final[tuple[Endpoint, ...]] = (
    Endpoint("health", "GET", "/v1/health", None, None, "object", "Liveness", public=True),
    Endpoint("lease", "POST", "/v1/lease", "node", r.LeaseRequest, r.LeaseReply, "Lease tasks"),
    Endpoint("renew", "POST", "/v1/renew", "node", r.RenewRequest, r.RenewReply, "Renew leases"),
    Endpoint("submit", "POST", "/v1/submit", "node", r.SubmitRequest, r.SubmitReply,
             "Submit a task's samples (idempotent on task_id, attempt)"),
    Endpoint("submit_many", "POST", "/v1/submit/many", "node", r.SubmitManyRequest,
             r.SubmitManyReply, "Submit several tasks' samples, each as by /v1/submit (one "
             "outcome each, in order: its reply or its error)"),
    Endpoint("fail", "POST", "/v1/fail", "node", r.FailRequest, r.FailReply,
             "Report a failed task"),
    Endpoint("release", "POST", "/v1/release", "node", r.ReleaseRequest, r.ReleaseReply,
             "Hand leases back"),
    Endpoint("take", "POST", "/v1/batches/take", "trainer", r.TakeBatchRequest, r.Batch,
             "Long-poll for a batch (msgpack; 204 when the wait timed out)", msgpack_reply=True),
    Endpoint("ack", "POST", "/v1/batches/ack", "trainer", r.AckRequest, "object", "Ack a batch"),
    Endpoint("hand_back", "POST", "/v1/batches/release", "trainer", r.HandBackRequest,
             r.HandBackReply, "Give back the batches a stopping trainer took and will not "
             "train (buffered again at once; its waiting takes end)"),
    Endpoint("announce", "POST", "/v1/versions", "trainer", r.PolicyVersion, r.AnnounceReply,
             "Announce a published policy version"),
    Endpoint("versions", "GET", "/v1/versions", None, None, "versions", "Latest versions"),
    Endpoint("watch_versions", "POST", "/v1/versions/watch", None, r.WatchVersionsRequest,
             "versions", "Long-poll: the latest versions once a policy in `known` has a newer "
             "one, or at the timeout (a caller that hangs up ends it)"),
    Endpoint("report", "GET", "/v1/report", None, None, r.DataflowReport, "The pool report"),
    Endpoint("pool_sizes", "GET", "/v1/admin/pools", "admin", None, r.PoolSizes,
             "Desired, observed and target node counts per pool"),
    Endpoint("set_pool_size", "POST", "/v1/admin/pools", "admin", r.PoolSizeRequest, r.PoolSize,
             "Set a pool's desired node count"),
    Endpoint("metrics", "GET", "/metrics", None, None, "text", "The report as Prometheus text"),
    Endpoint("post_metrics", "POST", "/v1/admin/metrics", "admin", r.MetricPoints, "object",
             "Metric points the dashboard plots beside the report (held-out accuracy ...)"),
)  # fmt: skip

_ERROR: Final[dict[str, Any]] = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["code", "message"],
            "properties": {
                "code": {"type": "string"},
                "message": {"type": "string"},
                "field": {"type": "string"},
                "retry_after_s": {"type": "number", "minimum": 0},
            },
        }
    },
}

_STATUSES: Final = {
    "400": "Invalid request (the message names the field)",
    "401": "No valid bearer token",
    "403": "The token's role may not call this route, or the lease is not the caller's",
    "404": "Unknown policy, task, attempt or batch",
    "409": "The request contradicts stored state (lease lost, older version)",
    "413": "Body over the size limit",
    "503": "Busy: retry after error.retry_after_s",
}


def _reply_schema(ep: Endpoint, refs: Mapping[type[BaseModel], dict[str, Any]]) -> Any:
    if ep.reply == "versions":
        return {"type": "object", "additionalProperties": refs[r.PolicyVersion]}
    if ep.reply == "object":
        return {"type": "object"}
    if ep.reply == "text":
        return {"type": "string"}
    assert ep.reply is not None and not isinstance(ep.reply, str)
    return refs[ep.reply]


def _operation(ep: Endpoint, refs: Mapping[type[BaseModel], dict[str, Any]]) -> dict[str, Any]:
    media = "text/plain" if ep.reply == "text" else r.JSON_MEDIA_TYPE
    media = r.MSGPACK_MEDIA_TYPE if ep.msgpack_reply else media
    responses: dict[str, Any] = {
        "200": {"description": "OK", "content": {media: {"schema": _reply_schema(ep, refs)}}}
    }
    if ep.msgpack_reply:
        responses["204"] = {"description": "Nothing to serve within the timeout"}
    error = {"content": {r.JSON_MEDIA_TYPE: {"schema": {"$ref": _REF.format(model="Error")}}}}
    for status, text in _STATUSES.items():
        if ep.request is not None or status in ("401", "403", "503"):
            responses[status] = {"description": text, **error}
    op: dict[str, Any] = {
        "operationId": ep.name,
        "summary": ep.summary,
        "responses": responses,
        "x-role": ep.role or "any",
    }
    if ep.public:
        op["security"] = []
    if ep.request is not None:
        schema = refs[ep.request]
        content = {r.JSON_MEDIA_TYPE: {"schema": schema}, r.MSGPACK_MEDIA_TYPE: {"schema": schema}}
        op["requestBody"] = {"required": True, "content": content}
    return op


def openapi_document() -> dict[str, Any]:
    """The OpenAPI 3.1 document of the ``/v1`` API, from :data:`ENDPOINTS` and the records."""
    models = sorted(
        {m for ep in ENDPOINTS for m in (ep.request, ep.reply) if isinstance(m, type)}
        | {r.PolicyVersion},
        key=lambda m: m.__name__,
    )
    keyed, top = models_json_schema(
        [(m, "validation") for m in models], ref_template=_REF, title="astraflow dataflow /v1"
    )
    refs = {m: keyed[(m, "validation")] for m in models}
    schemas: dict[str, Any] = {**top.get("$defs", {}), "Error": _ERROR}
    paths: dict[str, dict[str, Any]] = {}
    for ep in ENDPOINTS:
        paths.setdefault(ep.path, {})[ep.method.lower()] = _operation(ep, refs)
    return {
        "openapi": "3.1.0",
        "info": {"title": "astraflow dataflow service", "version": r.WIRE_VERSION},
        "paths": paths,
        "components": {
            "schemas": schemas,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        "security": [{"bearer": []}],
    }
