"""Plug-in building and config loading: clear errors naming the bad key."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Protocol, runtime_checkable

import pytest
from pydantic import BaseModel

from astraflow.config import ConfigModel, apply_overrides, load_config
from astraflow.errors import ConfigError, PluginError
from astraflow.plugins import Registry


@runtime_checkable
class Scorer(Protocol):
    def score(self, x: float) -> float: ...


registry: Registry[Scorer] = Registry("scorer", Scorer)


@registry.register("scale")
class Scale:
    class Config(BaseModel, extra="forbid"):
        factor: float = 2.0

    def __init__(self, config: Config, rng: random.Random) -> None:
        self.factor = config.factor
        self.noise = rng.random()

    def score(self, x: float) -> float:
        return x * self.factor


class NotAScorer:
    def __init__(self, config: BaseModel, rng: random.Random) -> None:
        pass


def test_build_by_name_and_path() -> None:
    assert registry.build({"type": "scale", "factor": 3}).score(2) == 6
    assert registry.build("scale").score(2) == 4
    built = registry.build(f"{__name__}:Scale")
    assert isinstance(built, Scale)


def test_plugin_rng_is_seeded_per_run() -> None:
    a = registry.build("scale", seed=1)
    b = registry.build("scale", seed=1)
    c = registry.build("scale", seed=2)
    assert isinstance(a, Scale) and isinstance(b, Scale) and isinstance(c, Scale)
    assert a.noise == b.noise != c.noise


def test_plugin_errors_name_the_problem() -> None:
    with pytest.raises(PluginError, match="unknown key 'facter'.*allowed: factor"):
        registry.build({"type": "scale", "facter": 3})
    with pytest.raises(PluginError, match="unknown scorer 'nope'; known: scale"):
        registry.build("nope")
    with pytest.raises(PluginError, match="does not implement Scorer"):
        registry.build(f"{__name__}:NotAScorer")
    with pytest.raises(PluginError, match="cannot import"):
        registry.build("no_such_module_xyz:Thing")


class Inner(ConfigModel):
    size: int = 1
    """How many."""


class Outer(ConfigModel):
    name: str = "x"
    inner: Inner = Inner()


def test_load_config_with_overrides(tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text("name: y\ninner:\n  size: 2\n")
    cfg = load_config(Outer, f, ["inner.size=5"])
    assert cfg == Outer(name="y", inner=Inner(size=5))
    assert Inner.model_fields["size"].description == "How many."


def test_unknown_config_key_lists_allowed(tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text("inner:\n  sise: 2\n")
    with pytest.raises(ConfigError, match=r"unknown key 'inner.sise' \(allowed: size\)"):
        load_config(Outer, f)
    with pytest.raises(ConfigError, match="not found"):
        load_config(Outer, tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match="dotted.key=value"):
        apply_overrides({}, ["novalue"])
