"""``env``: drive any registered text environment with a policy over many turns.

    reset(seed) ──obs──► render (context, mask 0) ──► generate (trained, mask 1) ──► parse action
         ▲                                                                              │
         └──────────── obs ◄── step(action) ── reward, terminated, truncated, info ◄────┘
    until terminated / truncated / max_turns / context full ──► one sample per episode

``task.group_size`` episodes run concurrently from the task's ``payload['seed']`` (the same
episode for the whole group, so advantages compare actions, not luck of the draw). The trained
reward is the episode return (``reward: final`` / ``success`` to change it), minus
``invalid_penalty`` per invalid action. An environment that raises, times out or breaks the
protocol fails the whole task with :class:`~astraflow.errors.EnvError` (the dataflow
re-queues it): a broken environment never becomes a zero-reward sample.
Per-episode figures go to ``sample.meta`` and, as floats, to ``sample.meta['metrics']``
(averaged into the trainer's metrics file as ``env/<name>``).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import zlib
from collections.abc import Awaitable, Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, Protocol, TypeVar

from pydantic import Field, field_validator

from astraflow.config import ConfigModel
from astraflow.envs.protocol import (
    ADMISSIBLE_ACTIONS,
    INVALID_ACTION,
    SUCCESS,
    AsyncEnvironment,
    Observation,
    check_reset,
    check_step,
    env_traits,
)
from astraflow.envs.registry import EnvFactory
from astraflow.errors import EnvError, ValidationError
from astraflow.plugins import ENV_SPEC, PluginSpec
from astraflow.records import Sample, Task
from astraflow.workflows.api import PolicyHandle, SamplingParams, Tool, Trajectory
from astraflow.workflows.env_turns import (
    ActionConfig,
    ActionParser,
    observation_messages,
    observation_text,
)
from astraflow.workflows.prompts import fill, get_policy
from astraflow.workflows.registry import WORKFLOWS, PolicyName, SinglePolicy

__all__ = [
    "EnvWorkflow",
    "EnvWorkflowConfig",
    "ObservationStyle",
    "add_observation",
    "episode_seed",
    "plain_turn",
]

T = TypeVar("T")


class EnvWorkflowConfig(ConfigModel):
    """Config of the ``env`` workflow."""

    policy: PolicyName = "policy"
    """Name of the policy that acts (and is trained)."""
    env: Annotated[PluginSpec, ENV_SPEC] = Field(default_factory=lambda: PluginSpec(type="gridnav"))
    """The environment: ``ENVS`` name or ``module:Class`` plus its kwargs, or ``remote``."""
    sampling: SamplingParams = Field(default_factory=lambda: SamplingParams(max_new_tokens=64))
    """Sampling of every turn (``max_new_tokens`` bounds the tokens of one action)."""
    system: str | None = None
    """System prompt: a system message with ``chat``, else text before the first observation."""
    chat: bool = False
    """Render turns with the policy's chat template (observation = user, action = assistant);
    off: plain text, each observation through ``observation_template`` (char/base models)."""
    observation_template: str = "{observation}"
    """Plain-text rendering of each observation (fields: observation, turn)."""
    action: ActionConfig = Field(default_factory=ActionConfig)
    """How the action is parsed from a reply."""
    max_turns: int | None = Field(default=None, ge=1, le=1024)
    """Most actions per episode (default: the environment's ``max_turns``)."""
    max_context_tokens: int = Field(default=4096, ge=8)
    """The episode ends when the next turn could exceed this many tokens in total."""
    reward: Literal["return", "final", "success"] = "return"
    """Trained reward: sum of step rewards, the last step's reward, or 1/0 success."""
    invalid_penalty: float = Field(default=0.0, ge=0.0)
    """Subtracted from the trained reward per invalid action (shaping; 0: off)."""
    env_timeout_s: float = Field(default=60.0, gt=0)
    """Longest reset/step/close call; longer fails the task."""

    @field_validator("env", mode="before")
    @classmethod
    def _env_name(cls, value: Any) -> Any:
        return {"type": value} if isinstance(value, str) else value


def episode_seed(task: Task) -> int:
    """``payload['seed']``, or a stable hash of the task id when the payload has none."""
    seed = task.payload.get("seed")
    if seed is None:
        return zlib.crc32(task.task_id.encode())
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValidationError(f"payload 'seed' must be an int, got {seed!r}", field="seed")
    return seed


def plain_turn(template: str, obs: Observation, turn: int, system: str | None = None) -> str:
    """The plain text appended for one observation (the first one after ``system``)."""
    text = fill(template, {"observation": observation_text(obs), "turn": turn})
    return f"{system}{text}" if system and turn == 0 else text


class ObservationStyle(Protocol):
    """How an environment workflow's config renders observations."""

    @property
    def chat(self) -> bool:
        """Chat messages (else plain text through ``observation_template``)."""
        ...

    @property
    def system(self) -> str | None:
        """System prompt before the first observation."""
        ...

    @property
    def observation_template(self) -> str:
        """Plain-text template of one observation."""
        ...


def add_observation(traj: Trajectory, obs: Observation, turn: int, style: ObservationStyle) -> None:
    """Append one observation to ``traj``: plain text, or chat messages (the first turn opens
    the prompt, after the system message)."""
    if not style.chat:
        traj.add_text(plain_turn(style.observation_template, obs, turn, style.system))
    elif turn == 0:
        head = [{"role": "system", "content": style.system}] if style.system else []
        traj.add_prompt([*head, *observation_messages(obs)])
    else:
        traj.add_messages(observation_messages(obs))


@dataclass
class EpisodeResult:
    """What one episode produced beyond its tokens."""

    rewards: list[float] = field(default_factory=list)
    invalid: int = 0
    success: bool = False
    end: str = "max_turns"


@WORKFLOWS.register("env")
class EnvWorkflow(SinglePolicy[EnvWorkflowConfig]):
    """A policy plays ``group_size`` episodes of an environment; one sample per episode."""

    Config = EnvWorkflowConfig

    def __init__(self, config: EnvWorkflowConfig, rng: random.Random) -> None:
        self.config = config
        self.factory = EnvFactory(config.env, seed=rng.randrange(2**31))
        self.parser = ActionParser(config.action, config.sampling.stop)

    async def __call__(
        self, task: Task, policies: Mapping[str, PolicyHandle], tools: Mapping[str, Tool]
    ) -> list[Sample]:
        """Run the group's episodes; any environment failure fails the task."""
        policy = get_policy(policies, self.config.policy, "env")
        seed = episode_seed(task)
        options = task.payload.get("options")
        if options is not None and not isinstance(options, dict):
            raise ValidationError("payload 'options' must be a mapping", field="options")
        runs = [
            asyncio.ensure_future(self.episode(task, policy, seed, options))
            for _ in range(task.group_size)
        ]
        try:
            return list(await asyncio.gather(*runs))
        except BaseException:
            for run in runs:
                run.cancel()
            await asyncio.gather(*runs, return_exceptions=True)
            raise

    async def _env(self, call: Awaitable[T], what: str) -> T:
        """One environment call under the timeout; every failure becomes ``EnvError``."""
        try:
            return await asyncio.wait_for(call, self.config.env_timeout_s)
        except TimeoutError:
            raise EnvError(
                f"env {self.factory.name!r}: {what} took longer than {self.config.env_timeout_s}s"
            ) from None
        except EnvError:
            raise
        except Exception as exc:  # the environment's own failure: fail the task, not the node
            raise EnvError(
                f"env {self.factory.name!r}: {what} failed: {type(exc).__name__}: {exc}"
            ) from exc

    async def episode(
        self, task: Task, policy: PolicyHandle, seed: int, options: dict[str, Any] | None
    ) -> Sample:
        """One episode from ``seed``, as a sample."""
        async with self.factory.gate():
            env = await self._env(self.factory.acreate(), "create")
            try:
                traj, result = await self._play(env, policy, seed, options)
            finally:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(env.aclose(), self.config.env_timeout_s)
        return self._sample(task, traj, result, seed)

    async def _play(
        self,
        env: AsyncEnvironment,
        policy: PolicyHandle,
        seed: int,
        options: dict[str, Any] | None,
    ) -> tuple[Trajectory, EpisodeResult]:
        cfg = self.config
        obs, info = check_reset(await self._env(env.areset(seed=seed, options=options), "reset"))
        max_turns = cfg.max_turns or env_traits(getattr(env, "env", env)).max_turns
        traj = Trajectory(policy)
        add_observation(traj, obs, 0, self.config)
        result = EpisodeResult()
        for turn in range(max_turns):
            if len(traj.token_ids) + cfg.sampling.max_new_tokens > cfg.max_context_tokens:
                result.end = "context"
                break
            gen = await traj.generate(cfg.sampling)
            action = self.parser(gen.text)
            admissible = info.get(ADMISSIBLE_ACTIONS)
            step = await self._env(env.astep(action or gen.text.strip()), f"step {turn + 1}")
            obs, reward, terminated, truncated, info = self._checked(step, turn)
            result.rewards.append(reward)
            if (
                action is None
                or info.get(INVALID_ACTION)
                or (admissible is not None and action not in admissible)
            ):
                result.invalid += 1
            if terminated or truncated:
                result.end = "terminated" if terminated else "truncated"
                break
            add_observation(traj, obs, turn + 1, self.config)
        result.success = bool(info.get(SUCCESS, sum(result.rewards) > 0))
        return traj, result

    def _checked(self, step: Any, turn: int) -> Any:
        try:
            return check_step(step)
        except (TypeError, ValueError) as exc:
            raise EnvError(f"env {self.factory.name!r}: step {turn + 1}: {exc}") from exc

    def _sample(self, task: Task, traj: Trajectory, result: EpisodeResult, seed: int) -> Sample:
        cfg = self.config
        ret = sum(result.rewards)
        if cfg.reward == "return":
            reward = ret
        elif cfg.reward == "final":
            reward = result.rewards[-1] if result.rewards else 0.0
        else:
            reward = float(result.success)
        reward -= cfg.invalid_penalty * result.invalid
        metrics = {
            "return": ret,
            "success": float(result.success),
            "turns": float(traj.turns),
            "invalid_actions": float(result.invalid),
        }
        meta = {
            "role": "policy",
            "env": self.factory.name,
            "seed": seed,
            "end": result.end,
            "success": result.success,
            "return": ret,
            "invalid_actions": result.invalid,
            "metrics": {f"env/{k}": v for k, v in metrics.items()},
        }
        return traj.to_sample(task, reward, meta=meta)
