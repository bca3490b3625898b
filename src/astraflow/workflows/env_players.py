"""``env_players``: a multi-player game where each player is a policy (self-play or two learners).

    players: [first, second]      # player 0 → policy "first", player 1 → policy "second"

Per task, ``group_size`` matches are played from the task's seed. Each player has its own
:class:`Trajectory`: what the game tells it is context (mask 0), its moves are its policy's
samples (mask 1); the other player's moves reach it only as text in those observations. Each
player yields one sample per match with its reward from the game; samples of one player form
a group (``task_id:player<i>`` when a policy plays both seats, so seats are never compared in
one group). A game that raises or breaks its protocol fails the task (:class:`EnvError`).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Mapping, Sequence
from typing import Annotated, Any, TypeVar

from pydantic import Field, field_validator

from astraflow.config import ConfigModel
from astraflow.envs.players import GAMES, MultiPlayerGame
from astraflow.errors import EnvError
from astraflow.plugins import PluginOf, PluginSpec
from astraflow.records import Name, Sample, Task
from astraflow.workflows.api import PolicyHandle, SamplingParams, Tool, Trajectory
from astraflow.workflows.env import add_observation, episode_seed
from astraflow.workflows.env_turns import ActionConfig, ActionParser
from astraflow.workflows.multi_policy import role_group_ids
from astraflow.workflows.prompts import get_policy
from astraflow.workflows.registry import POLICY_ROLE, WORKFLOWS

__all__ = ["EnvPlayers", "EnvPlayersConfig"]

T = TypeVar("T")

GAME_SPEC = PluginOf("astraflow.envs.players:GAMES")


class EnvPlayersConfig(ConfigModel):
    """Config of the ``env_players`` workflow."""

    game: Annotated[PluginSpec, GAME_SPEC] = Field(default_factory=lambda: PluginSpec(type="nim"))
    """The game: a ``GAMES`` name (``nim``) or ``module:Class`` plus its kwargs."""
    players: Annotated[tuple[Name, ...], POLICY_ROLE] = ("first", "second")
    """Policy of each seat, in the game's player order (a name twice: self-play)."""
    sampling: SamplingParams = Field(default_factory=lambda: SamplingParams(max_new_tokens=16))
    """Sampling of every move."""
    chat: bool = False
    """Render turns with each policy's chat template (else plain text)."""
    system: str | None = None
    """System prompt of every player."""
    observation_template: str = "{observation}\n"
    """Plain-text rendering of each observation (fields: observation, turn)."""
    action: ActionConfig = Field(default_factory=ActionConfig)
    """How a move is parsed from a reply."""
    max_moves: int = Field(default=64, ge=1, le=4096)
    """Moves (all players) before a match is cut off (every player then gets reward 0)."""
    game_timeout_s: float = Field(default=30.0, gt=0)
    """Longest single game call; longer fails the task."""

    @field_validator("players")
    @classmethod
    def _two_or_more(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        if len(v) < 2:
            raise ValueError("a multi-player game needs at least two seats")
        return v


@WORKFLOWS.register("env_players")
class EnvPlayers:
    """Plays ``group_size`` matches; one sample per seat per match."""

    Config = EnvPlayersConfig

    def __init__(self, config: EnvPlayersConfig, rng: random.Random) -> None:
        self.config = config
        self.seed = rng.randrange(2**31)
        GAMES.resolve(config.game.type)  # an unknown game fails at build time
        self.parser = ActionParser(config.action, config.sampling.stop)
        self.seats = {f"player{i}": name for i, name in enumerate(config.players)}

    @property
    def policies(self) -> Sequence[str]:
        """Every seat's policy, once each."""
        return tuple(dict.fromkeys(self.config.players))

    async def __call__(
        self, task: Task, policies: Mapping[str, PolicyHandle], tools: Mapping[str, Tool]
    ) -> list[Sample]:
        """All matches of the group; samples grouped by seat."""
        handles = [get_policy(policies, name, "env_players") for name in self.config.players]
        seed = episode_seed(task)
        matches = await asyncio.gather(
            *(self.match(task, handles, seed) for _ in range(task.group_size))
        )
        by_seat: dict[int, list[Sample]] = {}
        for samples in matches:
            for seat, sample in enumerate(samples):
                by_seat.setdefault(seat, []).append(sample)
        return [s for seat in sorted(by_seat) for s in by_seat[seat]]

    async def _call(self, fn: Callable[..., T], *args: Any, what: str) -> T:
        try:
            return await asyncio.wait_for(asyncio.to_thread(fn, *args), self.config.game_timeout_s)
        except TimeoutError:
            raise EnvError(
                f"game {self.config.game.type!r}: {what} took longer than "
                f"{self.config.game_timeout_s}s"
            ) from None
        except Exception as exc:  # the game's own failure fails the task, not the node
            raise EnvError(
                f"game {self.config.game.type!r}: {what} failed: {type(exc).__name__}: {exc}"
            ) from exc

    def _build(self) -> MultiPlayerGame:
        game = GAMES.build(self.config.game, seed=self.seed)
        seats = tuple(game.players)
        if len(seats) != len(self.config.players):
            raise EnvError(
                f"game {self.config.game.type!r} has {len(seats)} players, the workflow maps "
                f"{len(self.config.players)}"
            )
        return game

    async def match(self, task: Task, handles: list[PolicyHandle], seed: int) -> list[Sample]:
        """One match; one sample per seat that moved."""
        game = await self._call(self._build, what="build")
        try:
            await self._call(game.reset, seed, what="reset")
            seats = list(game.players)
            trajs = [Trajectory(h) for h in handles]
            invalid = await self._play(game, seats, trajs)
            finished = await self._call(lambda: game.done, what="done")
            rewards = await self._call(game.rewards, what="rewards") if finished else {}
        finally:
            await self._call(game.close, what="close")
        groups = role_group_ids(task, self.seats)
        out = []
        for seat, player in enumerate(seats):
            if not trajs[seat].generations:
                continue  # the match ended before this seat moved: nothing of it to train
            reward = float(rewards.get(player, 0.0))
            meta = {
                "role": f"player{seat}",
                "seed": seed,
                "end": "finished" if finished else "max_moves",
                "metrics": {
                    f"env/player{seat}_win": float(reward > 0),
                    f"env/player{seat}_invalid_moves": float(invalid[seat]),
                },
            }
            out.append(
                trajs[seat].to_sample(task, reward, group_id=groups[f"player{seat}"], meta=meta)
            )
        return out

    async def _play(
        self, game: MultiPlayerGame, seats: list[int], trajs: list[Trajectory]
    ) -> list[int]:
        """Moves until the match ends or ``max_moves``; invalid moves per seat."""
        invalid = [0] * len(seats)
        for _ in range(self.config.max_moves):
            if await self._call(lambda: game.done, what="done"):
                break
            player = await self._call(lambda: game.current, what="current")
            if player not in seats:
                raise EnvError(f"game {self.config.game.type!r}: unknown player {player!r}")
            seat = seats.index(player)
            obs = await self._call(game.observe, player, what="observe")
            add_observation(trajs[seat], str(obs), trajs[seat].turns, self.config)
            gen = await trajs[seat].generate(self.config.sampling)
            action = self.parser(gen.text)
            ok = await self._call(game.play, action or gen.text.strip(), what="play")
            invalid[seat] += int(action is None or not ok)
        return invalid
