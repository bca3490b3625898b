"""``agent``: any agent program written against the OpenAI API, run unchanged as a workflow.

``entry: package.module:function`` names ``async def run(task: dict, client, **kw)`` returning
a reward (float) or ``{"reward": float, **metrics}``. For every episode (``group_size`` per
task) the node's OpenAI-compatible endpoint opens a session with its own API key; the agent
gets a client bound to it (``openai.AsyncOpenAI``, or the base URL with ``client: base_url``;
every episode's SDK client shares the node's one HTTP client, ``transport: in_process`` by
default: calls go straight into the endpoint's app, no sockets; with ``workers: N`` the agent
runs in N worker processes of its own, over loopback HTTP: ``workflows.agent_worker``)
and, when its signature asks
for them, ``model`` (the first policy's name), ``tools`` (name -> ``async (str) -> str``) and
the config's ``kwargs``. Every call is recorded token-exactly
(``workflows.capture``); the episode's segments become samples, all in the task's group.

    task ─► gateway.open(policies) ─► run(task, client) ─► reward
                 │ /v1/chat/completions ─► PolicyHandle.generate (batched) ─► recorded
                 └─► recorder.samples(reward) ─► one group per task; an agent that raises
                                                  fails the task (re-queued)
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import math
import random
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, Protocol, runtime_checkable

from pydantic import Field

from astraflow.config import ConfigModel
from astraflow.errors import ConfigError, WorkflowError
from astraflow.plugins import TOOL_SPEC, PluginSpec
from astraflow.records import Name, Sample, Task
from astraflow.workflows.agent_worker import AgentWorkers, WorkerSpec
from astraflow.workflows.api import PolicyHandle, Tool
from astraflow.workflows.capture import EpisodeRecorder
from astraflow.workflows.chat_format import ChatFormat, TemplateKind
from astraflow.workflows.registry import POLICY_ROLE, WORKFLOWS
from astraflow.workflows.tools import TOOLS

__all__ = ["AgentConfig", "AgentGateway", "AgentSession", "AgentWorkflow", "GatewayUser"]

_ENTRY = r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$"


class AgentConfig(ConfigModel):
    """Config of ``agent``."""

    entry: str = Field(default="astraflow.examples.openai_search_agent:run", pattern=_ENTRY)
    """The agent: ``package.module:function`` (an async function of task and client);
    default: the shipped example search agent."""
    policies: Annotated[list[Name], POLICY_ROLE] = Field(
        default_factory=lambda: ["policy"], min_length=1
    )
    """Policies the agent may call (its ``model`` names); each is trained on its own tokens."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Extra keyword arguments for the agent function."""
    tools: Annotated[list[str | PluginSpec], TOOL_SPEC] = Field(default_factory=list)
    """Tools handed to the agent as ``tools`` (``TOOLS`` names or specs; the node's own
    tools of the same name take precedence)."""
    client: Literal["openai", "base_url"] = "openai"
    """What the agent gets as ``client``: an ``openai.AsyncOpenAI`` or the base URL."""
    max_tokens: int = Field(default=256, ge=1)
    """Tokens generated per call when the request sets no ``max_tokens``."""
    max_tokens_limit: int = Field(default=4096, ge=1)
    """A request asking for more tokens than this gets a 400."""
    template: TemplateKind = "auto"
    """Chat template: the tokenizer's own ('hf'), SIMPLE, or 'auto' (own if it has one)."""
    tool_parser: Literal["hermes"] = "hermes"
    """How tool calls are read from generated text (hermes: <tool_call>{json}</tool_call>)."""
    request_timeout_s: float = Field(default=600.0, gt=0)
    """Timeout of the client's requests (over ``loopback``)."""
    transport: Literal["in_process", "loopback"] = "in_process"
    """How the ``openai`` client reaches the node's endpoint: straight into its app in this
    process (no sockets: the cheapest path), or HTTP over loopback; both share one pooled
    HTTP client per node instead of one per episode. (With ``workers`` > 0: loopback.)"""
    workers: int = Field(default=0, ge=0, le=64)
    """Processes the agent runs in. 0: the node's own (the agent shares its interpreter
    with the engine). N > 0: N worker processes of its own (``workflows.agent_worker``),
    started on first use and restarted when one dies; the agent's client reaches the
    endpoint over loopback HTTP, so its CPU (the SDK's ~1.3 ms a call, its own logic) runs
    beside the engine instead of taking turns with it, and a crashing or blocking agent
    cannot stall the node. The task's payload, ``kwargs`` and what the agent returns must
    then be JSON; tools run in the node (the worker gets proxies)."""


@dataclass
class AgentSession:
    """One episode's view of the endpoint: its key, its policies and its recorder."""

    api_key: str
    policies: Mapping[str, PolicyHandle]
    formats: Mapping[str, ChatFormat]
    config: AgentConfig
    recorder: EpisodeRecorder = field(default_factory=EpisodeRecorder)
    base_url: str = ""
    """The session's OpenAI base URL, set by the gateway (the key is part of it)."""


@runtime_checkable
class AgentGateway(Protocol):
    """The node's OpenAI-compatible endpoint, as the ``agent`` workflow uses it."""

    def open(self, session: AgentSession) -> AgentSession:
        """Register ``session`` under a fresh API key; returns it with key and URL set."""
        ...

    def close(self, session: AgentSession) -> None:
        """Revoke the session's key (later requests get 401)."""
        ...

    def http_client(self, transport: Literal["in_process", "loopback"]) -> Any:
        """The shared HTTP client SDK clients reach the gateway with (closed with it)."""
        ...

    def on_close(self, closer: Callable[[], Awaitable[None]]) -> None:
        """Await ``closer`` when the gateway stops (before its sessions are dropped)."""
        ...


@runtime_checkable
class GatewayUser(Protocol):
    """A workflow that needs the node's endpoint (the node binds it after building)."""

    def bind_gateway(self, gateway: AgentGateway) -> None:
        """Use ``gateway`` for every episode from now on."""
        ...


AgentFn = Callable[..., Awaitable[Any]]


def resolve_entry(entry: str) -> AgentFn:
    """The async function ``entry`` names; ``ConfigError`` naming the problem otherwise."""
    module_name, _, attr = entry.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"agent entry {entry!r}: cannot import {module_name}: {exc}") from exc
    fn = getattr(module, attr, None)
    if fn is None or not inspect.iscoroutinefunction(fn):
        raise ConfigError(f"agent entry {entry!r} is not an async function")
    return fn  # type: ignore[no-any-return]  # checked above


def _accepts(fn: AgentFn, name: str) -> bool:
    params = inspect.signature(fn).parameters
    return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def reward_of(result: Any) -> tuple[float, dict[str, float]]:
    """``(reward, metrics)`` from what an agent returned; ``WorkflowError`` if unusable."""
    metrics: dict[str, float] = {}
    value = result
    if isinstance(result, Mapping):
        value = result.get("reward")
        metrics = {
            str(k): float(v)
            for k, v in result.items()
            if k != "reward" and isinstance(v, (int, float)) and not isinstance(v, bool)
        }
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise WorkflowError(f"the agent returned {type(value).__name__}, expected a reward")
    if not math.isfinite(float(value)):
        raise WorkflowError("the agent returned a reward that is not finite")
    return float(value), metrics


@WORKFLOWS.register("agent")
class AgentWorkflow:
    """Runs an OpenAI-API agent program per episode; its recorded calls are the samples."""

    Config = AgentConfig

    def __init__(self, config: AgentConfig, rng: random.Random) -> None:
        self.config = config
        self.fn = resolve_entry(config.entry)
        self.tools: dict[str, Tool] = {}
        for spec in config.tools:
            tool = TOOLS.build(spec, seed=rng.randrange(2**31))
            self.tools[tool.name] = tool
        self._gateway: AgentGateway | None = None
        self._formats: dict[str, ChatFormat] = {}
        self._workers: AgentWorkers | None = None

    @property
    def policies(self) -> Sequence[str]:
        """The policies the agent may call."""
        return tuple(self.config.policies)

    def bind_gateway(self, gateway: AgentGateway) -> None:
        """Serve episodes through ``gateway`` (the node's endpoint)."""
        self._gateway = gateway

    @property
    def workers(self) -> AgentWorkers | None:
        """The agent's worker processes (``workers`` > 0, once the first episode ran)."""
        return self._workers

    def _worker_pool(self) -> AgentWorkers:
        if self._workers is None:
            assert self._gateway is not None
            spec = WorkerSpec(self.config.entry, self.config.request_timeout_s)
            self._workers = AgentWorkers(spec, self.config.workers)
            self._gateway.on_close(self._close_workers)
        return self._workers

    async def _close_workers(self) -> None:
        workers, self._workers = self._workers, None
        if workers is not None:
            await workers.aclose()

    async def __call__(
        self, task: Task, policies: Mapping[str, PolicyHandle], tools: Mapping[str, Tool]
    ) -> list[Sample]:
        """Run ``group_size`` episodes concurrently; all their segments form one group."""
        if self._gateway is None:
            raise WorkflowError("the agent workflow runs only on a node with an agent endpoint")
        missing = [p for p in self.config.policies if p not in policies]
        if missing:
            raise WorkflowError(f"agent policies {missing} are not hosted here")
        available = {**self.tools, **{k: v for k, v in tools.items() if k in self.tools}}
        episodes = [self._episode(task, policies, available, i) for i in range(task.group_size)]
        groups = await asyncio.gather(*episodes)
        return [s for group in groups for s in group]

    def _format(self, handle: PolicyHandle) -> ChatFormat:
        fmt = self._formats.get(handle.name)
        if fmt is None:
            fmt = ChatFormat(
                handle.tokenizer, template=self.config.template, tool_parser=self.config.tool_parser
            )
            self._formats[handle.name] = fmt
        return fmt

    async def _episode(
        self,
        task: Task,
        policies: Mapping[str, PolicyHandle],
        tools: Mapping[str, Tool],
        index: int,
    ) -> list[Sample]:
        assert self._gateway is not None
        handles = {p: policies[p] for p in self.config.policies}
        formats = {p: self._format(h) for p, h in handles.items()}
        session = self._gateway.open(AgentSession("", handles, formats, self.config))
        client: Any = session.base_url
        try:
            extra: dict[str, Any] = dict(self.config.kwargs)
            if _accepts(self.fn, "model"):
                extra.setdefault("model", self.config.policies[0])
            calls = {name: tool.__call__ for name, tool in tools.items()}
            wants_tools = _accepts(self.fn, "tools") and "tools" not in extra
            payload = {**task.payload, "task_id": task.task_id}
            if self.config.workers:
                result = await self._worker_pool().run(
                    payload,
                    base_url=session.base_url,
                    api_key=session.api_key,
                    client=self.config.client,
                    extra=extra,
                    tools=calls if wants_tools else None,
                )
            else:
                if self.config.client == "openai":
                    client = _openai_client(session, self.config, self._gateway)
                if wants_tools:
                    extra["tools"] = calls
                result = await self.fn(payload, client, **extra)
        except Exception as exc:  # the agent's failure is the task's failure
            raise WorkflowError(f"agent {self.config.entry} raised {exc!r}") from exc
        finally:
            self._gateway.close(session)  # the shared HTTP client stays open for the next
        reward, metrics = reward_of(result)
        recorder = session.recorder
        if recorder.calls == 0:
            raise WorkflowError(f"agent {self.config.entry} made no model call")
        meta = {"episode": index, **{f"agent.{k}": v for k, v in metrics.items()}}
        return recorder.samples(task, reward, group_id=task.task_id, meta=meta)


def _openai_client(session: AgentSession, config: AgentConfig, gateway: AgentGateway) -> Any:
    try:
        import openai
    except ImportError as exc:
        raise ConfigError(
            "the agent workflow needs the 'openai' package: pip install openai"
        ) from exc
    return openai.AsyncOpenAI(
        base_url=session.base_url,
        api_key=session.api_key,
        max_retries=0,
        timeout=config.request_timeout_s,
        http_client=gateway.http_client(config.transport),
    )
