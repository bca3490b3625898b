"""Who may call the weight server: bearer tokens per role, as the dataflow service does.

    read     nodes, evaluators, relays: every GET (versions, manifests, files, merged deltas)
    publish  the trainer (and the launcher): everything ``read`` may, and any route that
             publishes; a ``read`` token on such a route gets 403

With no token configured the server is open (a store on one machine); with any configured,
every route but ``/v1/weights/health`` and ``/openapi.json`` needs ``Authorization: Bearer``.
Tokens come from the config or the environment (``ASTRAFLOW_WEIGHTS_{READ,PUBLISH}_TOKEN``),
never from files; torch-free, so the launcher can import it.
"""

from __future__ import annotations

import hmac
import os
from typing import Literal

from pydantic import SecretStr

from astraflow.config import ConfigModel, role_tokens
from astraflow.errors import AuthError, ForbiddenError

__all__ = ["ENV_WEIGHT_TOKENS", "WeightRole", "WeightsAuth", "WeightsAuthConfig", "client_token"]

WeightRole = Literal["read", "publish"]

#: The environment variable holding each role's token.
ENV_WEIGHT_TOKENS: dict[WeightRole, str] = {
    "read": "ASTRAFLOW_WEIGHTS_READ_TOKEN",
    "publish": "ASTRAFLOW_WEIGHTS_PUBLISH_TOKEN",
}


class WeightsAuthConfig(ConfigModel):
    """Bearer tokens per role of the weight server. With none set, the server is open."""

    read: SecretStr | None = None
    """Token of nodes, evaluators and relays (default: env ASTRAFLOW_WEIGHTS_READ_TOKEN)."""
    publish: SecretStr | None = None
    """Token of the trainer; opens every route (default: env ASTRAFLOW_WEIGHTS_PUBLISH_TOKEN)."""

    def tokens(self) -> dict[WeightRole, str]:
        """Configured tokens per role, falling back to the environment."""
        return role_tokens(self, ENV_WEIGHT_TOKENS)


def client_token() -> str | None:
    """The token a weight client sends: the read token from the environment, else publish."""
    for env in (ENV_WEIGHT_TOKENS["read"], ENV_WEIGHT_TOKENS["publish"]):
        if value := os.environ.get(env, ""):
            return value
    return None


class WeightsAuth:
    """Checks the bearer token of one request against the configured roles."""

    def __init__(self, tokens: dict[WeightRole, str]) -> None:
        self.tokens = {role: token.encode() for role, token in tokens.items()}

    def check(self, authorization: str, path: str, role: WeightRole | None) -> None:
        """Raise 401 / 403 unless ``authorization`` opens ``role`` (None: a public route)."""
        if role is None or not self.tokens:
            return
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise AuthError(f"{path} needs an 'Authorization: Bearer <token>' header")
        held = [r for r, t in self.tokens.items() if hmac.compare_digest(t, token.encode())]
        if not held:
            raise AuthError("the bearer token is not valid for this weight server")
        if role in held or "publish" in held:
            return
        raise ForbiddenError(f"a {held[0]} token may not call {path} (needs {role})")
