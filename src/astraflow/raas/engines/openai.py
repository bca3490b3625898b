"""The ``openai`` engine: any OpenAI-compatible ``/v1/completions`` endpoint, frozen weights.

For policies that are not trained here (judges, tools, a frozen opponent): the node only
samples from them. Prompts are sent as token ids; each request is one HTTP call (the
server batches), at most ``max_concurrency`` at a time, each with a timeout. Generated
token ids come from the server when it can return them (``return_tokens_as_token_ids``,
vLLM's extension, sent by default), or from re-tokenizing the text
(``token_ids: retokenize``). Logprobs are the server's: vLLM servers report tempered ones
only when started with ``--logprobs-mode processed_logprobs``. The version is always 0;
``load`` and ``apply`` refuse.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import httpx
import numpy as np
from pydantic import Field, SecretStr, model_validator

from astraflow.config import ConfigModel
from astraflow.errors import ConfigError, ServiceUnavailableError, ValidationError
from astraflow.raas.engines.base import (
    ENGINES,
    EngineContext,
    EngineOutput,
    GenerationRequest,
    WeightSource,
)

__all__ = ["OpenAIEngine", "RemoteEngine"]

_TOKEN_PREFIX = "token_id:"


class RemoteEngine:
    """Shared plumbing of engines that call a server: one client, bounded concurrency."""

    def __init__(self, url: str, timeout_s: float, max_concurrency: int, policy: str) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.policy = policy
        self._slots = asyncio.Semaphore(max_concurrency)
        self._client: httpx.AsyncClient | None = None
        self._headers: dict[str, str] = {}
        self._requests = self._in_flight = 0
        self._busy_s, self._busy_since = 0.0, 0.0

    async def post(self, path: str, body: Mapping[str, Any]) -> Any:
        """POST JSON, return the decoded reply; errors name the server and the status."""
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=self.timeout_s, headers=self._headers)
        where = f"{self.url}{path}"
        async with self._slots:
            self._busy(+1)
            try:
                reply = await self._client.post(where, json=dict(body))
            except httpx.HTTPError as exc:
                raise ServiceUnavailableError(
                    f"policy {self.policy!r}: {where} failed: {exc!r}"
                ) from exc
            finally:
                self._busy(-1)
        if reply.status_code >= 500:
            raise ServiceUnavailableError(
                f"policy {self.policy!r}: {where} answered {reply.status_code}: {reply.text[:300]}"
            )
        if reply.status_code >= 400:
            raise ValidationError(
                f"policy {self.policy!r}: {where} refused the request "
                f"({reply.status_code}): {reply.text[:300]}"
            )
        return reply.json()

    def _busy(self, change: int) -> None:
        now = time.monotonic()
        if change > 0:
            self._requests += 1
            if self._in_flight == 0:
                self._busy_since = now
        self._in_flight += change
        if self._in_flight == 0:
            self._busy_s += now - self._busy_since

    def metrics(self) -> dict[str, float]:
        """Requests sent and the seconds with one in flight (``busy_s``)."""
        return {"requests": float(self._requests), "busy_s": self._busy_s}

    async def close(self) -> None:
        """Close the HTTP client."""
        if self._client is not None:
            await self._client.aclose()
            self._client = None


@ENGINES.register("openai")
class OpenAIEngine(RemoteEngine):
    """Samples from an OpenAI-compatible completions endpoint (no weight updates)."""

    class Config(ConfigModel):
        """Options of the ``openai`` engine."""

        url: str
        """Server base URL, e.g. http://host:8000 (``/v1/completions`` is appended)."""
        model: str
        """Model name sent with every request."""
        api_key_env: str | None = "OPENAI_API_KEY"
        """Environment variable the API key is read from when the config is built."""
        api_key: SecretStr | None = Field(default=None, exclude=True, repr=False)
        """The API key, sent as a bearer token (default: from ``api_key_env``; never dumped)."""
        timeout_s: float = Field(default=300.0, gt=0)
        """Per-request timeout."""
        max_concurrency: int = Field(default=64, ge=1)
        """Requests in flight at once."""
        token_ids: Literal["server", "retokenize"] = "server"
        """'server': ask for ids (vLLM's return_tokens_as_token_ids); 'retokenize' the text."""
        extra_body: dict[str, Any] = Field(default_factory=dict)
        """Additional request fields passed through unchanged."""

        @model_validator(mode="before")
        @classmethod
        def _key_from_env(cls, data: Any) -> Any:
            """Read the key from ``api_key_env`` once, here, unless it is given."""
            if isinstance(data, Mapping) and data.get("api_key") is None:
                env = data.get("api_key_env", "OPENAI_API_KEY")
                if env and (value := os.environ.get(env)):
                    return {**data, "api_key": value}
            return data

    def __init__(self, config: OpenAIEngine.Config, context: EngineContext) -> None:
        base = config.url.rstrip("/").removesuffix("/v1")
        super().__init__(base, config.timeout_s, config.max_concurrency, context.policy)
        self.config = config
        self.context = context
        if config.api_key is not None:
            self._headers["Authorization"] = f"Bearer {config.api_key.get_secret_value()}"

    @property
    def version(self) -> int:
        """Always 0: a frozen policy."""
        return 0

    async def generate(self, requests: Sequence[GenerationRequest]) -> list[EngineOutput]:
        """One completions call per request, concurrently."""
        return list(await asyncio.gather(*(self._one(r) for r in requests)))

    async def load(self, tensors: Mapping[str, Any], version: int) -> None:
        """Refused: the weights live on the remote server."""
        raise ConfigError(f"policy {self.context.policy!r} uses the openai engine: frozen weights")

    async def apply(self, source: WeightSource, policy: str, want: int) -> None:
        """Refused: the weights live on the remote server."""
        raise ConfigError(f"policy {policy!r} uses the openai engine: frozen weights")

    async def _one(self, request: GenerationRequest) -> EngineOutput:
        if not request.prompt_ids:
            raise ValidationError("the prompt is empty", field="prompt_ids")
        body: dict[str, Any] = {
            "model": self.config.model,
            "prompt": list(request.prompt_ids),
            "max_tokens": request.max_new_tokens,
            "temperature": request.temperature,
            "top_p": request.top_p,
            "logprobs": 1,
            "n": 1,
        }
        if request.top_k > 0:
            body["top_k"] = request.top_k
        if request.min_new_tokens > 0:  # vLLM / SGLang extension of the completions API
            body["min_tokens"] = min(request.min_new_tokens, request.max_new_tokens)
        if request.seed is not None:
            body["seed"] = request.seed
        if request.stop:
            body["stop"] = list(request.stop)
            body["include_stop_str_in_output"] = True
        if self.config.token_ids == "server":
            body["return_tokens_as_token_ids"] = True
        body.update(self.config.extra_body)
        started = time.monotonic()
        reply = await self.post("/v1/completions", body)
        return self._parse(reply, time.monotonic() - started)

    def _parse(self, reply: Any, latency: float) -> EngineOutput:
        try:
            choice = reply["choices"][0]
            text = str(choice.get("text", ""))
            logprobs = [float(x) for x in choice["logprobs"]["token_logprobs"]]
            tokens = [str(t) for t in choice["logprobs"]["tokens"]]
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise ValidationError(
                f"policy {self.context.policy!r}: {self.url} sent a completion without "
                f"per-token logprobs ({exc!r})"
            ) from exc
        ids = self._token_ids(text, tokens)
        if len(ids) != len(logprobs):
            raise ValidationError(
                f"policy {self.context.policy!r}: {len(ids)} token ids but {len(logprobs)} "
                "logprobs from the server (use token_ids: server with a server that returns ids)"
            )
        reason = choice.get("finish_reason")
        return EngineOutput(
            token_ids=np.asarray(ids, dtype=np.int32),
            logprobs=np.asarray(logprobs, dtype=np.float32),
            finish_reason=reason if reason in ("stop", "length") else "abort",
            version=0,
            latency_s=latency,
        )

    def _token_ids(self, text: str, tokens: list[str]) -> list[int]:
        if self.config.token_ids == "server":
            if not all(t.startswith(_TOKEN_PREFIX) for t in tokens):
                raise ValidationError(
                    f"policy {self.context.policy!r}: {self.url} did not return token ids "
                    "(return_tokens_as_token_ids); set token_ids: retokenize"
                )
            return [int(t.removeprefix(_TOKEN_PREFIX)) for t in tokens]
        return list(self.context.tokenizer.encode(text, add_special_tokens=False))
