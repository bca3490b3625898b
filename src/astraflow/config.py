"""Config plumbing shared by every component: the base model, YAML loading, ``--set`` overrides.

Each component owns its config model (``dataflow/config.py``, ...); ``launch`` composes them into
the run config. All are ``ConfigModel``s: unknown keys are rejected with the allowed ones
listed, values are immutable, and each field's docstring is its ``--help`` text.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, TypeVar, get_args, get_origin

import pydantic
import yaml
from pydantic import BaseModel, ConfigDict, SecretStr

from astraflow.errors import ConfigError

__all__ = [
    "ConfigModel",
    "apply_overrides",
    "dump_config",
    "env_secret",
    "fields_of",
    "load_config",
    "read_jsonl",
    "read_yaml",
    "role_tokens",
]

M = TypeVar("M", bound=BaseModel)
RoleT = TypeVar("RoleT", bound=str)


class ConfigModel(BaseModel):
    """Base of every config: strict keys, frozen, field docstrings as descriptions."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


def fields_of(model: BaseModel, part: type[BaseModel]) -> dict[str, Any]:
    """The values ``model`` holds for the fields of ``part`` (a base of its class), e.g. the
    settings a run-config section shares with the component config it becomes."""
    return {name: getattr(model, name) for name in part.model_fields}


def env_secret(*names: str) -> Callable[[], SecretStr | None]:
    """A field default: the secret in the first of the environment variables ``names`` that is
    set (None: none is). Secrets are read here, once, when a config is built; components get
    them as ``SecretStr`` fields (declared ``exclude=True``: never written to a config file)."""

    def read() -> SecretStr | None:
        value = next((v for n in names if (v := os.environ.get(n, ""))), "")
        return SecretStr(value) if value else None

    return read


def role_tokens(config: BaseModel, env_names: Mapping[RoleT, str]) -> dict[RoleT, str]:
    """Bearer token per role of a service's auth config: its ``SecretStr | None`` field named
    like the role, else the role's environment variable; roles with neither are left out."""
    out: dict[RoleT, str] = {}
    for role, env in env_names.items():
        secret: SecretStr | None = getattr(config, role)
        value = secret.get_secret_value() if secret is not None else os.environ.get(env, "")
        if value:
            out[role] = value
    return out


def read_jsonl(path: str | Path) -> list[tuple[int, dict[str, Any]]]:
    """The JSON objects of a JSONL data file a config names, with their line numbers (blank
    lines skipped).

    Raises ``ConfigError`` naming the file and line of the first line that is not an object.
    """
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"file not found: {p}")
    rows: list[tuple[int, dict[str, Any]]] = []
    with p.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"{p}:{n}: not valid JSON: {exc}") from exc
            if not isinstance(row, dict):
                raise ConfigError(f"{p}:{n}: each line must be a JSON object")
            rows.append((n, row))
    return rows


def read_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML mapping, with errors that name the file."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file not found: {p}")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"{p}: not valid YAML: {exc}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: the top level must be a mapping, got {type(data).__name__}")
    return data


def apply_overrides(data: Mapping[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Apply ``dotted.key=value`` overrides (values parsed as YAML scalars) to a copy."""
    out: dict[str, Any] = json.loads(json.dumps(data, default=str))
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set expects dotted.key=value, got {item!r}")
        try:
            value = yaml.safe_load(raw) if raw else ""
        except yaml.YAMLError as exc:
            raise ConfigError(f"--set {item!r}: value is not valid YAML: {exc}") from exc
        node: Any = out
        parts = key.split(".")
        for part in parts[:-1]:
            node = _child(node, part, item)
        if isinstance(node, list):
            node[_index(node, parts[-1], item)] = value
        else:
            node[parts[-1]] = value
    return out


def _child(node: Any, part: str, item: str) -> Any:
    """Step into a mapping (creating it) or a list (by index) for an override."""
    if isinstance(node, list):
        return node[_index(node, part, item)]
    child = node.setdefault(part, {})
    if not isinstance(child, (dict, list)):
        raise ConfigError(f"--set {item!r}: {part!r} is not a mapping or list")
    return child


def _index(node: list[Any], part: str, item: str) -> int:
    if not part.isdigit() or int(part) >= len(node):
        raise ConfigError(f"--set {item!r}: {part!r} is not an index of a list of {len(node)}")
    return int(part)


def load_config(
    cls: type[M],
    path: str | Path | None = None,
    overrides: Sequence[str] = (),
    base: Mapping[str, Any] | None = None,
) -> M:
    """Build ``cls`` from an optional YAML file, a base mapping and ``--set`` overrides."""
    data: dict[str, Any] = dict(base or {})
    if path is not None:
        data.update(read_yaml(path))
    data = apply_overrides(data, overrides)
    return validate(cls, data, source=str(path) if path else cls.__name__)


def validate(cls: type[M], data: Mapping[str, Any], *, source: str) -> M:
    """Validate a mapping as ``cls``; every problem is listed with its dotted key."""
    try:
        return cls.model_validate(dict(data))
    except pydantic.ValidationError as exc:
        raise ConfigError(f"{source}: " + "; ".join(describe(exc, cls))) from exc


def describe(exc: pydantic.ValidationError, root: type[BaseModel], prefix: str = "") -> list[str]:
    """One line per pydantic error, naming the dotted key (after ``prefix``, the path of
    ``root`` in a larger config); unknown keys list the allowed ones."""
    lines = []
    for err in exc.errors(include_url=False):
        loc = ".".join([prefix, *map(str, err["loc"])] if prefix else map(str, err["loc"]))
        if err["type"] == "extra_forbidden":
            allowed = _allowed_keys(root, err["loc"][:-1])
            hint = f" (allowed: {', '.join(allowed)})" if allowed else ""
            lines.append(f"unknown key {loc!r}{hint}")
        else:
            lines.append(f"{loc}: {str(err['msg']).removeprefix('Value error, ')}")
    return lines


def _allowed_keys(root: type[BaseModel], loc: Sequence[int | str]) -> list[str]:
    annotation: Any = root
    for part in loc:
        annotation = _step(annotation, str(part))
        if annotation is None:
            return []
    model = _model_of(annotation)
    return list(model.model_fields) if model is not None else []


def _step(annotation: Any, part: str) -> Any:
    """The annotation of ``part`` inside a value of ``annotation`` (None: unknown)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        field = annotation.model_fields.get(part)
        return None if field is None else field.annotation
    args = get_args(annotation)
    origin = get_origin(annotation)
    if origin is Annotated:
        return _step(args[0], part)
    if origin in (dict, Mapping) and len(args) == 2:
        return args[1]  # part is a key
    if origin in (list, tuple, Sequence) and args:
        return args[0]  # part is an index
    for arg in args:  # a union: the first member that has ``part``
        found = _step(arg, part)
        if found is not None:
            return found
    return None


def _model_of(annotation: Any) -> Any:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()):
        found = _model_of(arg)
        if found is not None:
            return found
    return None


def dump_config(config: BaseModel, path: str | Path) -> Path:
    """Write the resolved config as JSON (secrets stay masked), atomically."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(p.suffix + ".tmp")
    tmp.write_text(config.model_dump_json(indent=2) + "\n")
    tmp.replace(p)
    return p
