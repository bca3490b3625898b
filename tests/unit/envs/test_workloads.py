"""The shipped workloads: solvable by a scripted expert, not solved by a random valid agent.

Every environment is built through the registry (as a run builds it), played for 50 seeded
episodes by its scripted expert (``expert_action``: reward 1 on >= 95%) and by a random agent
choosing among valid actions (``valid_actions``: success on <= 20%). Every reset/step result
passes the protocol's checks (JSON-serialisable info, 5-tuple steps).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from astraflow.envs import ENVS, EnvFactory, check_reset, check_step
from astraflow.envs.household_worlds import generate_worlds

EPISODES = 50
HOUSEHOLD_WORLDS = 4

SPECS: dict[str, dict[str, Any]] = {
    "textcraft": {"type": "textcraft"},
    "shop": {"type": "shop"},
    "search_agent": {"type": "search_agent"},
    "nim": {"type": "nim"},
    "household": {"type": "household", "worlds": HOUSEHOLD_WORLDS},
}


@pytest.fixture(scope="session")
def household_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Worlds compiled once for the session (about 3 s each)."""
    cache = tmp_path_factory.mktemp("household")
    generate_worlds(cache, HOUSEHOLD_WORLDS)
    return cache


def _factory(name: str, request: pytest.FixtureRequest) -> EnvFactory:
    spec = dict(SPECS[name])
    if name == "household":
        spec["cache_dir"] = str(request.getfixturevalue("household_cache"))
    return EnvFactory(spec)


def _play(env: Any, seed: int, choose: Any) -> tuple[float, bool, int]:
    """One episode; returns (return, success, steps)."""
    obs, info = check_reset(env.reset(seed=seed))
    assert obs
    json.dumps(info)
    total, steps = 0.0, 0
    while True:
        obs, reward, terminated, truncated, info = check_step(env.step(choose(env)))
        json.dumps(info)
        total += reward
        steps += 1
        assert steps <= env.max_turns
        if terminated or truncated:
            return total, bool(info["success"]), steps


WORKLOADS = [
    pytest.param(name, marks=pytest.mark.slow) if name == "household" else name for name in SPECS
]


@pytest.mark.parametrize("name", WORKLOADS)
def test_expert_solves_random_does_not(name: str, request: pytest.FixtureRequest) -> None:
    factory = _factory(name, request)
    env: Any = factory.create()
    expert = [_play(env, seed, lambda e: e.expert_action()) for seed in range(EPISODES)]
    solved = sum(r == 1.0 and ok for r, ok, _ in expert)
    assert solved >= 0.95 * EPISODES, f"{name}: expert solved {solved}/{EPISODES}"
    rng = random.Random(0)
    randoms = [
        _play(env, 10_000 + seed, lambda e: rng.choice(e.valid_actions()))
        for seed in range(EPISODES)
    ]
    won = sum(ok for _, ok, _ in randoms)
    assert won <= 0.2 * EPISODES, f"{name}: a random agent solved {won}/{EPISODES}"
    env.close()


@pytest.mark.parametrize("name", WORKLOADS)
def test_same_seed_same_episode(name: str, request: pytest.FixtureRequest) -> None:
    factory = _factory(name, request)
    a: Any = factory.create()
    b: Any = factory.create()
    first = [a.reset(seed=s)[0] for s in range(5)]
    assert first == [b.reset(seed=s)[0] for s in range(5)]
    assert len(set(first)) > 1  # seeds draw different episodes
    for env in (a, b):
        env.reset(seed=3)
    for _ in range(3):
        action = a.expert_action()
        assert a.step(action)[:4] == b.step(action)[:4]


@pytest.mark.parametrize("name", WORKLOADS)
def test_garbage_actions_are_invalid_not_errors(name: str, request: pytest.FixtureRequest) -> None:
    env: Any = _factory(name, request).create()
    env.reset(seed=1)
    for action in ["", "x" * 100_000, "craft using", "search[", "click[]", "[99 99]", "\x00\n;"]:
        _, reward, terminated, truncated, info = check_step(env.step(action))
        assert reward == 0.0
        assert info["invalid_action"] is True
        if terminated or truncated:
            break
    else:
        env.close()
        return
    with pytest.raises(RuntimeError, match="reset"):
        env.step("anything")


def test_all_workloads_are_registered() -> None:
    assert set(SPECS) <= set(ENVS.names())


def test_household_without_generated_worlds_names_the_command(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="python -m astraflow.envs.household_worlds"):
        EnvFactory({"type": "household", "cache_dir": str(tmp_path / "none")}).create()


def test_bad_config_is_rejected_by_name() -> None:
    from astraflow.errors import PluginError

    with pytest.raises(PluginError, match="max_pile"):
        EnvFactory({"type": "nim", "max_pile": 0})
    with pytest.raises(PluginError, match="colour"):
        EnvFactory({"type": "shop", "colour": "red"})
    with pytest.raises(ValueError, match="min_depth"):
        EnvFactory({"type": "textcraft", "min_depth": 3, "max_depth": 2}).create()


CONTENT = {
    "textcraft": lambda env: env.goal,
    "shop": lambda env: env.goal.target,
    "search_agent": lambda env: env.question.text,
    "nim": lambda env: str(env.match.piles),
    "household": lambda env: (env.world.name, env.task),
}


@pytest.mark.parametrize("name", WORKLOADS)
def test_holdout_keeps_eval_contents_out_of_training(
    name: str, request: pytest.FixtureRequest
) -> None:
    factory = _factory(name, request)
    spec = {**factory.spec.kwargs, "type": name, "holdout": 0.3}
    env: Any = EnvFactory(spec).create()
    seen: dict[str, set[Any]] = {"train": set(), "eval": set()}
    for split in seen:
        for seed in range(40):
            env.reset(seed=seed, options={"split": split})
            seen[split].add(CONTENT[name](env))
    assert seen["train"] and seen["eval"]
    assert not seen["train"] & seen["eval"]
    with pytest.raises(ValueError, match="split"):
        env.reset(seed=1, options={"split": "test"})
    env.close()


@pytest.mark.parametrize("name", WORKLOADS)
def test_state_is_json(name: str, request: pytest.FixtureRequest) -> None:
    env: Any = _factory(name, request).create()
    env.reset(seed=2)
    env.step(env.expert_action())
    state = json.loads(json.dumps(env.state()))
    assert state["turns"] == 1
    env.close()
