"""Plan-time checks of a run config: every plug-in spec resolved and validated, none built.

``RunConfig`` validation checks the shape of every section; what it cannot see are the
plug-ins' own arguments (a workflow's ``sampling.temprature``, an engine's options, a nested
reward or task generator). Here each field marked ``Annotated[..., PluginOf(registry)]`` is
resolved in its registry and its arguments validated against the plug-in's ``Config``,
recursively (a workflow's reward, a wrapped workflow, a generator's task), and every policy
a workflow config names (fields marked ``PolicyRole``, defaults included) must be one the
run has. A plug-in registered by anyone is checked the same way: nothing here lists names.

    check_run(config) ─► [problem, ...]   each naming the dotted key path
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pydantic
from pydantic import BaseModel

from astraflow.config import describe
from astraflow.errors import AstraflowError, ConfigError
from astraflow.launch.config import RunConfig
from astraflow.plugins import WORKFLOW_SPEC, PluginOf, PluginSpec
from astraflow.workflows.registry import PolicyRole

__all__ = ["check_run", "raise_problems", "workflow_names", "workflow_spec"]


@dataclass
class _Found:
    """What a walk over validated configs collects besides problems."""

    problems: list[str] = field(default_factory=list)
    roles: list[tuple[str, str]] = field(default_factory=list)
    """(key path, policy name) of every field marked ``PolicyRole``."""


def workflow_names(config: RunConfig) -> list[str]:
    """Every workflow a node of the run builds: those tasks name and those configured."""
    return sorted({src.workflow for src in config.sources} | set(config.workflows))


def workflow_spec(config: RunConfig, name: str) -> PluginSpec:
    """The spec of workflow ``name`` (a bare registry name when not configured)."""
    return config.workflows.get(name) or PluginSpec(type=name)


def check_run(config: RunConfig) -> list[str]:
    """Every problem with the run's plug-in specs, each naming its key path."""
    found = _Found()
    _walk(config, "", found)
    for name in sorted(set(workflow_names(config)) - set(config.workflows)):
        _check_spec(WORKFLOW_SPEC, workflow_spec(config, name), f"workflows.{name}", found)
    for i, ev in enumerate(config.eval):
        used = [(f"eval.{i}.workflow", ev.workflow)]
        used += [(f"eval.{i}.sets.{j}.workflow", s.workflow) for j, s in enumerate(ev.sets)
                 if s.workflow is not None]  # fmt: skip
        for path, name in used:
            if name not in workflow_names(config):
                _check_spec(WORKFLOW_SPEC, PluginSpec(type=name), path, found)
    found.problems += _placement_problems(config)
    known = set(config.policies)
    found.problems += [
        f"{path}: policy {policy!r} is not in policies ({', '.join(sorted(known))})"
        for path, policy in found.roles
        if policy not in known
    ]
    return found.problems


def _placement_problems(config: RunConfig) -> list[str]:
    """CPUs named in ``placement`` that this process may not run on (this machine's)."""
    try:
        usable = os.sched_getaffinity(0)
    except (AttributeError, OSError):  # not Linux: affinity is not applied there
        return []
    return [
        f"placement.{kind}: CPU {cpu} is not available here (usable: {sorted(usable)})"
        for kind, cpus in config.placement.items()
        for cpu in cpus
        if cpu not in usable
    ]


def raise_problems(problems: list[str], source: str) -> None:
    """Raise one ``ConfigError`` listing ``problems`` (nothing when there are none)."""
    if problems:
        raise ConfigError(f"{source}: " + "; ".join(problems))


def _walk(model: BaseModel, path: str, found: _Found) -> None:
    """Check the plug-in fields and collect the policy roles of ``model``, recursively."""
    for name, info in type(model).model_fields.items():
        value = getattr(model, name)
        where = f"{path}.{name}" if path else name
        marks = info.metadata
        for mark in marks:
            if isinstance(mark, PluginOf):
                for key, spec in _items(value, where):
                    _check_spec(mark, spec, key, found)
            elif isinstance(mark, PolicyRole):
                found.roles += [(key, str(v)) for key, v in _items(value, where)]
        if any(isinstance(m, PluginOf) for m in marks):
            continue
        for key, item in _items(value, where):
            if isinstance(item, BaseModel) and not isinstance(item, PluginSpec):
                _walk(item, key, found)


def _items(value: Any, path: str) -> Iterator[tuple[str, Any]]:
    """(key path, item) of a value, a list's items or a mapping's values; None: nothing."""
    if value is None:
        return
    if isinstance(value, dict):
        for key, item in value.items():
            yield f"{path}.{key}", item
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield f"{path}.{i}", item
    else:
        yield path, value


def _check_spec(mark: PluginOf, raw: Any, path: str, found: _Found) -> None:
    """Resolve one spec in its registry and validate its arguments; never build it."""
    try:
        spec = PluginSpec.coerce(raw)
        registry = mark.resolve()
        cls = registry.resolve(spec.type)
    except AstraflowError as exc:
        found.problems.append(f"{path}.type: {exc}")
        return
    config_cls = getattr(cls, "Config", None)
    if config_cls is None:
        if spec.kwargs:
            found.problems.append(
                f"{path}: {registry.point} {spec.type!r} takes no arguments, got "
                f"{sorted(spec.kwargs)}"
            )
        return
    if not (isinstance(config_cls, type) and issubclass(config_cls, BaseModel)):
        found.problems.append(f"{path}: {registry.point} {spec.type!r}: Config is not a model")
        return
    try:
        validated = config_cls.model_validate(spec.kwargs)
    except pydantic.ValidationError as exc:
        found.problems += describe(exc, config_cls, prefix=path)
        return
    _walk(validated, path, found)
