"""Records of the weight server's HTTP API: path parameters and JSON replies.

The server validates every path parameter with these models (bad input: 400 naming the field)
and builds its OpenAPI document from the same models, so the rules and the document agree:
a policy name, a version in range, a store file path of safe segments.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "MAX_VERSION",
    "ErrorBody",
    "ErrorReply",
    "FileParams",
    "HealthReply",
    "LatestReply",
    "MergedParams",
    "PolicyParams",
    "VersionsReply",
]

#: Largest version the server accepts in a path (a JSON-safe integer).
MAX_VERSION = 2**53 - 1
_SEGMENT = r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}"

PolicyName = Annotated[
    str,
    Field(
        pattern=rf"^{_SEGMENT}$",
        min_length=1,
        max_length=128,
        description="letters, digits, '.', '_', '-'; not 'files' or 'health'; no '..'",
    ),
]
Version = Annotated[int, Field(ge=0, le=MAX_VERSION, description="a weight version")]
StorePath = Annotated[
    str,
    Field(
        pattern=rf"^{_SEGMENT}(/{_SEGMENT}){{1,7}}$",
        max_length=1024,
        description="<policy>/<dir>/.../<file>: safe segments, no hidden or temporary files",
    ),
]


class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class PolicyParams(_Record):
    """Path of ``/{policy}/latest`` and ``/{policy}/versions``."""

    policy: PolicyName


class MergedParams(_Record):
    """Path of ``/{policy}/merged/{have}/{want}``."""

    policy: PolicyName
    have: Version
    want: Version


class FileParams(_Record):
    """Path of ``/files/{path}``."""

    path: StorePath


class HealthReply(_Record):
    """The server is up."""

    status: Literal["ok"] = "ok"


class LatestReply(_Record):
    """The newest version of a policy (null: none published)."""

    policy: str
    version: Version | None


class VersionsReply(_Record):
    """Every published version of a policy, ascending."""

    policy: str
    versions: list[Version]


class ErrorBody(_Record):
    """What went wrong: a stable code, a message naming the field or the id."""

    code: str
    message: str
    field: str | None = None


class ErrorReply(_Record):
    """Every error answer."""

    error: ErrorBody
