"""Build polymorphic parts (plug-ins, engines, backends) from a config spec.

A spec names a part by registry name (``fifo``) or import path (``my_pkg.mod:MyClass``) and
carries its keyword arguments beside ``type``::

    sampler: {type: replay, ratio: 0.25}
    sampler: my_pkg.samplers:Freshest        # string shorthand, no arguments

Each class declares a pydantic ``Config`` (unknown keys are rejected, naming them) and is built
as ``cls(config, rng)`` with its own ``random.Random`` seeded from ``(seed, point, name)``, so
nothing touches global RNG and a run is reproducible.
"""

from __future__ import annotations

import importlib
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Generic, TypeVar, cast

import pydantic
from pydantic import BaseModel, BeforeValidator, ConfigDict

from astraflow.errors import PluginError

__all__ = [
    "ENGINE_SPEC",
    "ENV_SPEC",
    "FILTER_SPEC",
    "GENERATOR_SPEC",
    "REWARD_SPEC",
    "SAMPLER_SPEC",
    "SELECTOR_SPEC",
    "TOOL_SPEC",
    "WORKFLOW_SPEC",
    "Configured",
    "NamedSpecs",
    "PluginOf",
    "PluginSpec",
    "Registry",
    "plugin_rng",
    "validate_config",
]

T = TypeVar("T")
C = TypeVar("C", bound=type)
ConfigT = TypeVar("ConfigT", bound=BaseModel)


class PluginSpec(BaseModel):
    """``type`` (registry name or ``module:Class``) plus the part's own keyword arguments."""

    model_config = ConfigDict(extra="allow", frozen=True)

    type: str
    """Registry name or ``package.module:Class``."""

    @property
    def kwargs(self) -> dict[str, Any]:
        """Everything beside ``type``."""
        return dict(self.model_extra or {})

    @classmethod
    def coerce(cls, spec: PluginSpec | str | Mapping[str, Any]) -> PluginSpec:
        """Accept a spec, a bare name, or a mapping with ``type``."""
        if isinstance(spec, PluginSpec):
            return spec
        if isinstance(spec, str):
            return cls(type=spec)
        if not isinstance(spec, Mapping) or "type" not in spec:
            raise PluginError(f"a plug-in spec needs a 'type' key, got {spec!r}")
        return cls.model_validate(dict(spec))


def _type_from_key(value: Any) -> Any:
    """``{name: {kwargs}}`` → ``{name: {type: name, **kwargs}}`` (an explicit type wins)."""
    if not isinstance(value, Mapping):
        return value
    out: dict[Any, Any] = {}
    for name, spec in value.items():
        if spec is None:
            spec = {}
        if isinstance(spec, Mapping) and "type" not in spec:
            spec = {"type": name, **spec}
        out[name] = spec
    return out


NamedSpecs = Annotated[dict[str, PluginSpec], BeforeValidator(_type_from_key)]
"""Plug-ins by the name they are used under; ``type`` defaults to that name."""


@dataclass(frozen=True)
class PluginOf:
    """Field metadata: the field holds a spec (a list of specs) of the registry ``registry``.

    ``registry`` is the registry's import path, ``package.module:NAME``; config checks resolve
    and validate such fields without building anything (``Annotated[PluginSpec, PluginOf(..)]``).
    """

    registry: str

    def resolve(self) -> Registry[Any]:
        """The registry object."""
        module_name, _, attr = self.registry.partition(":")
        registry = getattr(importlib.import_module(module_name), attr, None)
        if not isinstance(registry, Registry):
            raise PluginError(f"{self.registry!r} does not name a plug-in registry")
        return registry


# The built-in plug-in points, for config fields: ``Annotated[PluginSpec, WORKFLOW_SPEC]``.
WORKFLOW_SPEC = PluginOf("astraflow.workflows.registry:WORKFLOWS")
TOOL_SPEC = PluginOf("astraflow.workflows.tools:TOOLS")
REWARD_SPEC = PluginOf("astraflow.workflows.rewards:REWARDS")
ENGINE_SPEC = PluginOf("astraflow.raas.engines.base:ENGINES")
GENERATOR_SPEC = PluginOf("astraflow.workflows.tasks:GENERATORS")
SELECTOR_SPEC = PluginOf("astraflow.data_algorithms:SELECTORS")
FILTER_SPEC = PluginOf("astraflow.data_algorithms:FILTERS")
SAMPLER_SPEC = PluginOf("astraflow.data_algorithms:SAMPLERS")
ENV_SPEC = PluginOf("astraflow.envs.registry:ENVS")


def plugin_rng(seed: int, point: str, name: str) -> random.Random:
    """A private RNG for one plug-in, reproducible from the run seed."""
    return random.Random(f"{seed}:{point}:{name}")


class Registry(Generic[T]):
    """Named implementations of one Protocol; built-ins register on first lookup.

    Declare it with its protocol as the type argument, ``REG: Registry[Proto] = Registry("p",
    Proto)``: ``protocol`` is the runtime-checkable Protocol every built part must satisfy
    (typed ``type``, not ``type[T]``: a Protocol class is not a concrete ``type[T]``).
    """

    def __init__(self, point: str, protocol: type, builtin_modules: tuple[str, ...] = ()):
        self.point = point
        self.protocol = protocol
        self._builtin_modules = builtin_modules
        self._classes: dict[str, type] = {}
        self._loaded = False

    def register(self, name: str) -> Callable[[C], C]:
        """Class decorator: make ``cls`` buildable as ``name``."""

        def deco(cls: C) -> C:
            other = self._classes.get(name)
            if other is not None and other is not cls:
                raise PluginError(f"{self.point} plug-in name {name!r} is already taken by {other}")
            self._classes[name] = cls
            return cls

        return deco

    def names(self) -> list[str]:
        """Registered names, sorted."""
        self._load_builtins()
        return sorted(self._classes)

    def resolve(self, type_name: str) -> type[T]:
        """The class for a registry name or ``module:Class`` path (checked when built)."""
        self._load_builtins()
        if ":" in type_name:
            module_name, _, attr = type_name.partition(":")
            try:
                module = importlib.import_module(module_name)
            except ImportError as exc:
                raise PluginError(
                    f"cannot import {self.point} plug-in {type_name!r}: {exc}"
                ) from exc
            cls = getattr(module, attr, None)
            if not isinstance(cls, type):
                raise PluginError(f"{type_name!r} does not name a class in {module_name}")
            return cast("type[T]", cls)
        try:
            return cast("type[T]", self._classes[type_name])
        except KeyError:
            raise PluginError(
                f"unknown {self.point} {type_name!r}; known: {', '.join(self.names())} "
                "(or give 'package.module:Class')"
            ) from None

    def build(self, spec: PluginSpec | str | Mapping[str, Any], *, seed: int = 0) -> T:
        """Validate the spec's arguments against the class's ``Config`` and build it with its
        own RNG (``cls(config, rng)``)."""
        spec = PluginSpec.coerce(spec)
        return self.construct(spec, plugin_rng(seed, self.point, spec.type))

    def construct(self, spec: PluginSpec, context: object) -> T:
        """Build ``spec`` as ``cls(config, context)``; check it implements the protocol."""
        cls = self.resolve(spec.type)
        config = validate_config(cls, spec.kwargs, f"{self.point} {spec.type!r}")
        obj = cast("Callable[[BaseModel, object], T]", cls)(config, context)
        if not isinstance(obj, self.protocol):
            raise PluginError(
                f"{spec.type!r} does not implement {self.protocol.__name__} "
                f"(the {self.point} protocol)"
            )
        return obj

    def _load_builtins(self) -> None:
        if not self._loaded:
            self._loaded = True
            for module in self._builtin_modules:
                importlib.import_module(module)


class Configured(Generic[ConfigT]):
    """Base of a plug-in whose behaviour is its validated config alone: ``cls(config, rng)``
    keeps ``config`` and leaves the injected RNG unused (subclasses still declare ``Config``)."""

    def __init__(self, config: ConfigT, rng: random.Random | None = None) -> None:
        self.config = config


class _NoArguments(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def validate_config(cls: type, kwargs: Mapping[str, Any], what: str) -> BaseModel:
    """``cls.Config(**kwargs)``, with unknown or wrong keys reported by name."""
    config_cls = getattr(cls, "Config", None)
    if config_cls is None:
        if kwargs:
            raise PluginError(f"{what} takes no arguments, got {sorted(kwargs)}")
        return _NoArguments()
    if not (isinstance(config_cls, type) and issubclass(config_cls, BaseModel)):
        raise PluginError(f"{what}: Config must be a pydantic model")
    try:
        return config_cls.model_validate(dict(kwargs))
    except pydantic.ValidationError as exc:
        problems = []
        for err in exc.errors(include_url=False):
            loc = ".".join(str(p) for p in err["loc"])
            if err["type"] == "extra_forbidden":
                allowed = ", ".join(config_cls.model_fields) or "none"
                problems.append(f"unknown key {loc!r} (allowed: {allowed})")
            else:
                problems.append(f"{loc}: {err['msg']}")
        raise PluginError(f"bad arguments for {what}: " + "; ".join(problems)) from exc
