"""The gymnasium adapter: text observations, Discrete actions by name, Text actions as is."""

from __future__ import annotations

import pytest

from astraflow.envs import EnvFactory, check_reset, check_step
from astraflow.errors import ConfigError, PluginError


def _play(env: object, actions: list[str]) -> list[tuple[str, float, bool]]:
    out = []
    for action in actions:
        obs, reward, terminated, _, _ = check_step(env.step(action))  # type: ignore[attr-defined]
        out.append((str(obs), reward, terminated))
    return out


def test_discrete_actions_by_name_and_unknown_names_are_invalid() -> None:
    spec = {"type": "gymnasium", "entry_point": "fixtures.envs:HotCold",
            "action_names": ["lower", "higher", "stay"], "max_turns": 12}  # fmt: skip
    factory = EnvFactory(spec)
    env = factory.create()
    obs, info = check_reset(env.reset(seed=3))  # type: ignore[attr-defined]
    assert obs == "guess 5" and info["admissible_actions"] == ["lower", "higher", "stay"]
    assert env.max_turns == 12 and env.action_format == "admissible"  # type: ignore[attr-defined]
    (first,) = _play(env, ["higher"])
    assert first[0].startswith("guess 6")
    _, _, _, _, info = check_step(env.step("sideways"))  # type: ignore[attr-defined]
    assert info["invalid_action"] is True
    hint = first[0].split()[-1]
    target_side = "higher" if hint == "higher" else "lower"
    for _ in range(10):
        obs, reward, terminated, _, _ = check_step(env.step(target_side))  # type: ignore[attr-defined]
        if terminated:
            break
        if "won" not in str(obs) and str(obs).split()[-1] != target_side:
            target_side = str(obs).split()[-1]
    assert terminated and reward == 1.0


def test_text_actions_pass_through_and_same_seed_same_episode() -> None:
    spec = {"type": "gymnasium", "entry_point": "fixtures.envs:HotCold",
            "kwargs": {"text_actions": True}}  # fmt: skip
    a, b = EnvFactory(spec).create(), EnvFactory(spec).create()
    assert a.reset(seed=11) == b.reset(seed=11)  # type: ignore[attr-defined]
    digits = [str(d) for d in range(10)]
    assert _play(a, digits) == _play(b, digits)
    assert any(won for _, _, won in _play(a, digits)), "one of the digits is the target"


def test_bad_specs_are_named() -> None:
    with pytest.raises(PluginError, match="exactly one of 'id' or 'entry_point'"):
        EnvFactory({"type": "gymnasium"})
    with pytest.raises(ConfigError, match="Discrete\\(3\\).*3 action_names"):
        EnvFactory({"type": "gymnasium", "entry_point": "fixtures.envs:HotCold"}).create()
