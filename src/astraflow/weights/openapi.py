"""The weight server's route table and the OpenAPI 3.1 document generated from it.

Each :class:`Endpoint` names its path, method, role, path-parameter model and reply model;
the server builds its Starlette routes from the same table and validates parameters with the
same models, so ``/openapi.json`` cannot drift from what the server does.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import Response

from astraflow.weights.access import WeightRole
from astraflow.weights.wire import ErrorReply

__all__ = ["Endpoint", "openapi_document"]

_REF = "#/components/schemas/{model}"
_ERRORS = {400: "bad path or parameter", 404: "no such policy, version, chain or file",
           405: "method not allowed (the Allow header lists the allowed ones)"}  # fmt: skip
_AUTH_ERRORS = {401: "no or unknown bearer token", 403: "the token's role may not call this"}


@dataclass(frozen=True)
class Endpoint:
    """One route of the weight server."""

    route: str
    """Starlette path, relative to the mount (``/files/{path:path}``)."""
    handler: Callable[[Request, Any], Awaitable[Response]]
    """The handler, called with the validated parameters (auth and errors wrapped around)."""
    summary: str
    """One line for the document."""
    role: WeightRole | None = "read"
    """Role the bearer token must hold (None: public)."""
    params: type[BaseModel] | None = None
    """Model of the path parameters (validated before the handler runs)."""
    reply: type[BaseModel] | None = None
    """Model of the JSON reply (None with ``binary``: a file)."""
    binary: bool = False
    """The reply is a store file (application/octet-stream, Range requests answer 206)."""
    methods: tuple[str, ...] = ("GET",)
    """HTTP methods (GET also answers HEAD)."""

    @property
    def path(self) -> str:
        """The OpenAPI path (converters stripped)."""
        return re.sub(r"\{(\w+):\w+\}", r"{\1}", self.route)


def openapi_document(
    endpoints: Sequence[Endpoint], *, prefix: str, title: str, version: str
) -> dict[str, Any]:
    """The OpenAPI 3.1 document of ``endpoints`` mounted at ``prefix``."""
    schemas: dict[str, Any] = {}
    paths: dict[str, Any] = {}
    for ep in endpoints:
        ops = paths.setdefault(prefix + ep.path, {})
        for method in ep.methods:
            ops[method.lower()] = _operation(ep, method, schemas)
    return {
        "openapi": "3.1.0",
        "info": {"title": title, "version": version},
        "paths": paths,
        "components": {
            "schemas": schemas,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }


def _ref(model: type[BaseModel], schemas: dict[str, Any]) -> dict[str, str]:
    schema = model.model_json_schema(ref_template=_REF, mode="serialization")
    for name, sub in schema.pop("$defs", {}).items():
        schemas[name] = sub
    schemas[model.__name__] = schema
    return {"$ref": _REF.format(model=model.__name__)}


def _parameters(ep: Endpoint) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if ep.params is not None:
        props = ep.params.model_json_schema()["properties"]
        for name in re.findall(r"\{(\w+)\}", ep.path):
            out.append({"name": name, "in": "path", "required": True, "schema": props[name]})
    if ep.binary:
        out.append({
            "name": "Range", "in": "header", "required": False,
            "schema": {"type": "string", "pattern": r"^bytes=\d*-\d*$"},
        })  # fmt: skip
    return out


def _operation(ep: Endpoint, method: str, schemas: dict[str, Any]) -> dict[str, Any]:
    error = {"application/json": {"schema": _ref(ErrorReply, schemas)}}
    responses: dict[str, Any] = {}
    if ep.binary:
        octets = {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}
        responses["200"] = {"description": "the whole file", "content": octets}
        responses["206"] = {"description": "the requested byte range", "content": octets}
    else:
        body = _ref(ep.reply, schemas) if ep.reply is not None else {"type": "object"}
        responses["200"] = {"description": "OK", "content": {"application/json": {"schema": body}}}
    failures = {**_ERRORS, **(_AUTH_ERRORS if ep.role is not None else {})}
    if ep.params is None and not ep.binary:
        failures.pop(400)
    for status, why in sorted(failures.items()):
        responses[str(status)] = {"description": why, "content": error}
    op: dict[str, Any] = {
        "operationId": f"{method.lower()}_{ep.handler.__name__}",
        "summary": ep.summary,
        "parameters": _parameters(ep),
        "responses": responses,
        "security": [{"bearer": []}] if ep.role is not None else [],
    }
    if ep.role is not None:
        op["x-role"] = ep.role
    return op
