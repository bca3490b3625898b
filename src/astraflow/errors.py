"""The one error tree of astraflow.

Every error is also a stdlib kind (``ValueError``, ``LookupError``, ...) so callers that do not
know astraflow can still catch it, and carries a stable ``code`` that travels on the wire:
a service answers ``{"error": {"code", "message", "field"}}`` and a client raises the class
registered for that code (:func:`error_from_wire`). HTTP status per class lives in one table,
in the transport layer (``dataflow/app.py``), not here.
"""

from __future__ import annotations

from typing import Any, ClassVar

__all__ = [
    "UNCHANGED_BY_FAILED_PULL",
    "AstraflowError",
    "AuthError",
    "ChecksumError",
    "ConfigError",
    "ConflictError",
    "EnvError",
    "ForbiddenError",
    "LeaseForbiddenError",
    "LeaseLostError",
    "MethodNotAllowedError",
    "NotFoundError",
    "PayloadTooLargeError",
    "PluginError",
    "RewardError",
    "SandboxError",
    "ServiceBusyError",
    "ServiceUnavailableError",
    "StaleWeightsError",
    "TransferError",
    "TransferTimeoutError",
    "ValidationError",
    "WorkflowError",
    "error_from_wire",
]


class AstraflowError(Exception):
    """Base of every astraflow error: a message, a stable code, and the field or id at fault."""

    code: ClassVar[str] = "internal"
    _by_code: ClassVar[dict[str, type[AstraflowError]]] = {}

    def __init__(self, message: str, *, field: str | None = None, **context: Any) -> None:
        super().__init__(message)
        self.message = message
        self.field = field
        self.context = context

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "code" in cls.__dict__:
            AstraflowError._by_code.setdefault(cls.code, cls)

    def __str__(self) -> str:
        return self.message

    def to_wire(self) -> dict[str, Any]:
        """Encode as the JSON error body every service answers with."""
        body: dict[str, Any] = {"code": self.code, "message": self.message}
        if self.field is not None:
            body["field"] = self.field
        return {"error": body}


class ConfigError(AstraflowError, ValueError):
    """A configuration file, key or value is wrong; the message names it."""

    code = "config"


class PluginError(ConfigError):
    """A plug-in spec names an unknown plug-in, a bad import path, or wrong arguments."""

    code = "plugin"


class ValidationError(AstraflowError, ValueError):
    """Input on a wire edge is malformed; ``field`` names the offending field."""

    code = "invalid"


class PayloadTooLargeError(ValidationError):
    """A request body is bigger than the service accepts."""

    code = "too_large"


class NotFoundError(AstraflowError, LookupError):
    """A policy, batch, task, version or file does not exist."""

    code = "not_found"


class ConflictError(AstraflowError, ValueError):
    """A request contradicts stored state (e.g. announcing an older version)."""

    code = "conflict"


class LeaseLostError(ConflictError):
    """The lease this request relies on expired or was handed to another node."""

    code = "lease_lost"


class MethodNotAllowedError(NotFoundError):
    """The path exists but does not take this HTTP method (HTTP 405, with ``Allow``)."""

    code = "method_not_allowed"


class StaleWeightsError(ConflictError):
    """A node's weights are too old for the work it asks for; it must refresh first."""

    code = "stale_weights"


class AuthError(AstraflowError, PermissionError):
    """No valid bearer token was presented (HTTP 401)."""

    code = "unauthorized"


class ForbiddenError(AuthError):
    """The token is valid but its role may not call this endpoint (HTTP 403)."""

    code = "forbidden"


class LeaseForbiddenError(ForbiddenError):
    """The request names a lease without its lease secret: only its holder may touch it."""

    code = "lease_forbidden"


class ServiceUnavailableError(AstraflowError, ConnectionError):
    """A service could not be reached or answered 5xx after all retries."""

    code = "unavailable"


class ServiceBusyError(ServiceUnavailableError):
    """The service is at a capacity limit now (HTTP 503); try again after ``retry_after_s``."""

    code = "busy"

    def __init__(
        self, message: str, *, retry_after_s: float = 1.0, field: str | None = None
    ) -> None:
        super().__init__(message, field=field)
        self.retry_after_s = retry_after_s

    def to_wire(self) -> dict[str, Any]:
        """The error body, with ``retry_after_s``."""
        body = super().to_wire()
        body["error"]["retry_after_s"] = self.retry_after_s
        return body


class TransferError(AstraflowError, ConnectionError):
    """A weight pull failed; the message names the source, the version and the file."""

    code = "transfer"


class TransferTimeoutError(TransferError, TimeoutError):
    """A weight pull made no progress within its bound."""

    code = "transfer_timeout"


class ChecksumError(AstraflowError, ValueError):
    """Data failed checksum verification (corrupt or truncated); it is never applied."""

    code = "checksum"


#: What a failed weight pull (``WeightClient.pull``) raises with the tensors as they were (a
#: delta's changes undone, a full snapshot refused before it writes): a version not served
#: (collected, or a relay gone past it), a transfer, a check. The caller's tensors still hold
#: the version they held; anything else may have left them half-written.
UNCHANGED_BY_FAILED_PULL: tuple[type[AstraflowError], ...] = (
    NotFoundError,
    TransferError,
    ChecksumError,
    ValidationError,
)


class WorkflowError(AstraflowError, RuntimeError):
    """A workflow raised, timed out, or returned invalid samples for a task."""

    code = "workflow"


class EnvError(WorkflowError):
    """An agent environment raised, timed out, broke its protocol or could not be reached."""

    code = "env"


class RewardError(WorkflowError):
    """A reward function failed (crashed, timed out) for a task."""

    code = "reward"


class SandboxError(AstraflowError, RuntimeError):
    """Running untrusted code failed for a reason other than the code's own failure."""

    code = "sandbox"


def error_from_wire(body: Any, *, default_message: str) -> AstraflowError:
    """Rebuild the error a service sent as ``{"error": {...}}``; unknown codes give the base."""
    err = body.get("error") if isinstance(body, dict) else None
    if not isinstance(err, dict):
        return AstraflowError(default_message)
    cls = AstraflowError._by_code.get(str(err.get("code", "")), AstraflowError)
    field = err.get("field")
    return cls(str(err.get("message", default_message)), field=field if field else None)
