"""The environment protocol: registry building, trait defaults, result checks, async face."""

from __future__ import annotations

import asyncio
import math
import random
from typing import Any

import pytest

from astraflow.envs import ENVS, EnvFactory, as_async, check_reset, check_step, env_traits
from astraflow.envs.gridnav import GridNav
from astraflow.errors import PluginError


class Bare:
    """An environment declaring nothing beyond the three methods."""

    def __init__(self, config: Any, rng: random.Random) -> None:
        self.n = 0

    def reset(self, seed: int | None = None, options: dict[str, Any] | None = None) -> Any:
        return "hi", {}

    def step(self, action: str) -> Any:
        self.n += 1
        return f"echo {action}", 0.5, self.n >= 2, False, {}

    def close(self) -> None:
        pass


def test_builtin_and_import_path_specs() -> None:
    assert "gridnav" in ENVS.names()
    factory = EnvFactory({"type": f"{__name__}:Bare"})
    assert env_traits(factory.cls).max_turns == 32
    assert env_traits(factory.cls).action_format == "text"
    env = factory.create()
    assert check_reset(env.reset(seed=1)) == ("hi", {})  # type: ignore[attr-defined]


def test_bad_kwargs_and_unknown_names_are_named() -> None:
    with pytest.raises(PluginError, match="unknown key 'size'"):
        EnvFactory({"type": "gridnav", "size": 3})
    with pytest.raises(PluginError, match="unknown env 'nope'"):
        EnvFactory("nope")
    with pytest.raises(PluginError, match="min_distance"):
        EnvFactory({"type": "gridnav", "width": 2, "height": 1, "min_distance": 5})


@pytest.mark.parametrize(
    ("result", "problem"),
    [
        (("o", 1.0, False, False), "length 4"),
        (("o", "1", False, False, {}), "reward must be a number"),
        (("o", math.nan, False, False, {}), "finite"),
        ((3, 1.0, False, False, {}), "observation"),
        (("o", 1.0, False, False, {"admissible_actions": "n"}), "list of strings"),
    ],
)
def test_malformed_step_results_are_rejected(result: Any, problem: str) -> None:
    with pytest.raises((TypeError, ValueError), match=problem):
        check_step(result)


def test_chat_observations_pass() -> None:
    obs, _ = check_reset(([{"role": "user", "content": "go"}], None))
    assert obs == [{"role": "user", "content": "go"}]


def test_gridnav_same_seed_same_episode_and_expert_wins() -> None:
    factory = EnvFactory("gridnav")
    a, b = factory.create(), factory.create()
    assert isinstance(a, GridNav) and isinstance(b, GridNav)
    assert a.reset(seed=7) == b.reset(seed=7)
    for _ in range(a.budget):
        _obs, reward, terminated, _truncated, info = a.step(a.expert_action())
        if terminated:
            break
    assert (reward, terminated, info["success"]) == (1.0, True, True)


def test_async_face_runs_a_sync_env() -> None:
    async def play() -> list[Any]:
        env = as_async(Bare(None, random.Random(0)))
        out = [await env.areset(seed=0), await env.astep("a"), await env.astep("b")]
        await env.aclose()
        return out

    assert asyncio.run(play())[2] == ("echo b", 0.5, True, False, {})
