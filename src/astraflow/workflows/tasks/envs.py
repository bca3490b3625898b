"""Task rows for environment episodes, and SFT warm-up pairs played by a scripted expert.

``env_episodes``: one row per episode, ``{"id", "seed", "options"}``; train and eval seeds are
disjoint streams (even / odd), and ``options.split`` lets an environment with a content
holdout (``gridnav``'s ``holdout``) keep eval layouts out of training.

``env_sft``: plays ``size`` training episodes with the environment's scripted expert
(``env.expert_action()``), taking the expert's action with probability ``correct_prob`` and a
random admissible action otherwise, and yields one ``{prompt, completion}`` pair per turn:
the plain-text episode so far (rendered exactly as the ``env`` workflow renders it) and the
action plus ``action_suffix`` (the stop string the workflow samples up to).
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator
from typing import Annotated, Any, Literal

from pydantic import Field

from astraflow.config import ConfigModel
from astraflow.envs.protocol import ADMISSIBLE_ACTIONS, check_reset, check_step
from astraflow.envs.registry import EnvFactory
from astraflow.errors import ConfigError
from astraflow.plugins import ENV_SPEC, Configured, PluginSpec
from astraflow.workflows.env import plain_turn
from astraflow.workflows.tasks import GENERATORS

__all__ = ["EnvEpisodes", "EnvSFT", "episode_seeds"]


def episode_seeds(seed: int, split: str, size: int) -> list[int]:
    """Seeds of ``size`` episodes: even numbers for train, odd for eval (never shared)."""
    base = 2 * seed * 10_000_000
    return [base + 2 * i + (1 if split == "eval" else 0) for i in range(size)]


class EnvEpisodesConfig(ConfigModel):
    """Config of ``env_episodes``."""

    size: int = Field(default=10_000, ge=1)
    """Episodes (rows)."""
    seed: int = Field(default=0, ge=0, le=10_000)
    """Seed stream."""
    split: Literal["train", "eval"] = "train"
    """Which split (passed to the environment as ``options.split``)."""
    options: dict[str, Any] = Field(default_factory=dict)
    """Extra reset options of every episode."""


@GENERATORS.register("env_episodes")
class EnvEpisodes(Configured[EnvEpisodesConfig]):
    """Rows ``{"id", "seed", "options"}`` for the ``env`` workflow."""

    Config = EnvEpisodesConfig

    def rows(self) -> Iterable[dict[str, Any]]:
        """One row per episode."""
        cfg = self.config
        options = {**cfg.options, "split": cfg.split}
        for i, seed in enumerate(episode_seeds(cfg.seed, cfg.split, cfg.size)):
            yield {"id": f"{cfg.split}-{i}", "seed": seed, "options": options}


class EnvSFTConfig(ConfigModel):
    """Config of ``env_sft``."""

    env: Annotated[PluginSpec, ENV_SPEC]
    """The environment (it must have ``expert_action()`` and admissible actions)."""
    size: int = Field(default=1000, ge=1)
    """Episodes played."""
    correct_prob: float = Field(default=0.5, ge=0.0, le=1.0)
    """Probability of the expert's action at each turn (else a random admissible one)."""
    seed: int = Field(default=0, ge=0, le=10_000)
    """Seed stream of the episodes (train split) and of the noise."""
    system: str | None = None
    """As the ``env`` workflow's ``system`` (plain text before the first observation)."""
    observation_template: str = "{observation}"
    """As the ``env`` workflow's ``observation_template``."""
    action_suffix: str = "\n"
    """Text after each action: the workflow's stop string."""
    max_turns: int | None = Field(default=None, ge=1)
    """Most turns per episode (default: the environment's)."""


@GENERATORS.register("env_sft")
class EnvSFT:
    """Rows ``{id, prompt, completion, correct}``: one per turn of noisy-expert episodes."""

    Config = EnvSFTConfig

    def __init__(self, config: EnvSFTConfig, rng: random.Random | None = None) -> None:
        self.config = config
        self.factory = EnvFactory(config.env, seed=config.seed)
        if not callable(getattr(self.factory.cls, "expert_action", None)):
            raise ConfigError(f"env_sft: env {config.env.type!r} has no expert_action()")

    def rows(self) -> Iterator[dict[str, Any]]:
        """The pairs, episode after episode."""
        cfg = self.config
        max_turns = cfg.max_turns or self.factory.traits.max_turns
        env: Any = self.factory.create()
        try:
            for e, seed in enumerate(episode_seeds(cfg.seed, "train", cfg.size)):
                rng = random.Random(f"env_sft:{cfg.seed}:{e}")
                obs, info = check_reset(env.reset(seed=seed, options={"split": "train"}))
                text = plain_turn(cfg.observation_template, obs, 0, cfg.system)
                for turn in range(max_turns):
                    expert = str(env.expert_action())
                    action = expert
                    if rng.random() >= cfg.correct_prob:
                        choices = info.get(ADMISSIBLE_ACTIONS)
                        if not choices:
                            raise ConfigError("env_sft: noisy actions need admissible actions")
                        action = rng.choice(list(choices))
                    yield {
                        "id": f"{e}-{turn}",
                        "prompt": text,
                        "completion": action + cfg.action_suffix,
                        "correct": action == expert,
                    }
                    obs, _, terminated, truncated, info = check_step(env.step(action))
                    if terminated or truncated:
                        break
                    text += action + cfg.action_suffix
                    text += plain_turn(cfg.observation_template, obs, turn + 1)
        finally:
            env.close()
