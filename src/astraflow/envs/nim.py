"""Nim from TextArena: a two-player game, as a match of two players or against a scripted opponent.

Rules (TextArena's ``Nim``): players take turns removing at least one object from one pile,
written ``[pile quantity]``; whoever takes the last object wins. Piles are drawn per seed with a
non-zero nim-sum, so the first player can always force a win.

- :class:`NimMatch` is the two-player adapter: whose turn it is, what that player has seen
  since its last move, its legal moves, and each player's reward at the end. The ``env_players``
  workflow maps its players to policies (each player's actions are its policy's samples).
- ``nim`` (:class:`Nim`) is the single-agent view for the ``env`` workflow: the agent is
  player 0 and a scripted opponent (optimal with probability ``opponent_skill``, else random)
  replies inside ``step``. Reward 1 for a win, 0 for a loss.

TextArena's ``State`` seeds the global RNG when given a seed; Nim needs no randomness, so it
is never given one. Only ``textarena.envs.Nim`` is imported (TextArena's word games call
``nltk.download`` when imported; nothing here reaches them).
"""

from __future__ import annotations

import functools
import random
from typing import Any

from pydantic import Field

from astraflow.config import ConfigModel
from astraflow.envs.holdout import held_out, split_of
from astraflow.envs.players import GAMES
from astraflow.envs.protocol import ADMISSIBLE_ACTIONS, INVALID_ACTION, StepResult
from astraflow.envs.registry import ENVS
from astraflow.envs.turns import TurnLimitedEnv

__all__ = ["Nim", "NimConfig", "NimGame", "NimGameConfig", "NimMatch", "draw_piles", "optimal_move"]


def draw_piles(
    seed: int | None, piles: int, max_pile: int, holdout: float = 0.0, split: str | None = None
) -> list[int]:
    """Pile sizes for ``seed`` with a non-zero nim-sum (a first-player win), in ``split``."""
    rng = random.Random(f"nim:{seed}" if seed is not None else None)
    for _ in range(100_000):
        sizes = [rng.randint(1, max_pile) for _ in range(piles)]
        if functools.reduce(lambda a, b: a ^ b, sizes) == 0:
            continue
        if split is None or holdout <= 0 or held_out(str(sizes), holdout) == (split == "eval"):
            return sizes
    raise ValueError(f"no starting piles fall in split {split!r} (holdout {holdout})")


def optimal_move(piles: list[int]) -> str:
    """A winning move when there is one (nim-sum to zero), else take one from the largest pile."""
    total = functools.reduce(lambda a, b: a ^ b, piles, 0)
    for i, p in enumerate(piles):
        if total and p ^ total < p:
            return f"[{i} {p - (p ^ total)}]"
    i = max(range(len(piles)), key=lambda j: piles[j])
    return f"[{i} 1]"


def legal_moves(piles: list[int]) -> list[str]:
    """Every legal ``[pile quantity]``."""
    return [f"[{i} {q}]" for i, p in enumerate(piles) for q in range(1, p + 1)]


class NimMatch:
    """One game of TextArena Nim between players 0 and 1."""

    players = (0, 1)

    def __init__(self, piles: list[int]) -> None:
        from textarena.envs.Nim.env import NimEnv  # type: ignore[import-untyped]

        self.game: Any = NimEnv(piles=list(piles))
        self.game.reset(num_players=2, seed=None)

    @property
    def piles(self) -> list[int]:
        """Objects left in each pile."""
        return list(self.game.state.game_state["piles"])

    @property
    def current(self) -> int:
        """The player to move."""
        return int(self.game.state.current_player_id)

    @property
    def done(self) -> bool:
        """Whether the game is over."""
        return bool(self.game.state.done)

    def observe(self, player: int) -> str:
        """What ``player`` was told since it last looked (its prompt first)."""
        messages = self.game.state.observations[player]
        self.game.state.observations[player] = []
        return "\n".join(str(m[1]).strip() for m in messages if str(m[1]).strip())

    def play(self, action: str) -> bool:
        """The current player's move; False when it was invalid (the game may end on it)."""
        before = self.piles
        self.game.step(str(action)[:100])
        return self.piles != before

    def rewards(self) -> dict[int, float]:
        """1 for the winner, 0 for the loser (after the game is over)."""
        raw = self.game.state.rewards or {}
        return {p: 1.0 if raw.get(p, 0) > 0 else 0.0 for p in self.players}


class NimGameConfig(ConfigModel):
    """Pile sizes."""

    piles: int = Field(default=3, ge=2, le=6)
    """Number of piles."""
    max_pile: int = Field(default=5, ge=1, le=20)
    """Largest pile size."""


@GAMES.register("nim")
class NimGame:
    """Nim between two players (the multi-player adapter over :class:`NimMatch`)."""

    Config = NimGameConfig
    players = (0, 1)

    def __init__(self, config: NimGameConfig | None = None, rng: random.Random | None = None):
        self.config = config or NimGameConfig()
        self.match: NimMatch | None = None

    def _match(self) -> NimMatch:
        if self.match is None:
            raise RuntimeError("nim: call reset() first")
        return self.match

    def reset(self, seed: int | None = None) -> None:
        """Piles drawn by ``seed`` (player 0 can force a win)."""
        self.match = NimMatch(draw_piles(seed, self.config.piles, self.config.max_pile))

    @property
    def current(self) -> int:
        """The player to move (0 before the first reset)."""
        return self.match.current if self.match is not None else 0

    @property
    def done(self) -> bool:
        """Whether the match is over (False before the first reset)."""
        return self.match.done if self.match is not None else False

    def observe(self, player: int) -> str:
        """What ``player`` was told since it last looked."""
        return self._match().observe(player)

    def legal_actions(self) -> list[str] | None:
        """Every legal move."""
        return legal_moves(self._match().piles)

    def play(self, action: str) -> bool:
        """The current player's move."""
        return self._match().play(action)

    def rewards(self) -> dict[int, float]:
        """1 for the winner, 0 for the loser."""
        return self._match().rewards()

    def close(self) -> None:
        """Nothing to release."""


class NimConfig(NimGameConfig):
    """Pile sizes and the scripted opponent."""

    holdout: float = Field(default=0.0, ge=0.0, lt=1.0)
    """Share of starting piles kept for ``options={"split": "eval"}`` episodes (0: no split)."""
    opponent_skill: float = Field(default=1.0, ge=0.0, le=1.0)
    """Probability that the opponent plays the optimal move (else a random legal one)."""
    max_turns: int = Field(default=32, ge=1, le=200)
    """Agent moves before the game is truncated."""


@ENVS.register("nim")
class Nim(TurnLimitedEnv[NimConfig]):
    """Play Nim as player 0 against a scripted opponent."""

    Config = NimConfig
    label = "nim"
    action_format = "admissible"

    def __init__(self, config: NimConfig | None = None, rng: random.Random | None = None):
        super().__init__(config, rng)
        self.match: NimMatch | None = None
        self.opponent_rng = random.Random(0)

    def reset(
        self, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[str, dict[str, Any]]:
        """A new game with piles drawn by ``seed``; the agent moves first."""
        cfg = self.config
        piles = draw_piles(seed, cfg.piles, cfg.max_pile, cfg.holdout, split_of(options))
        self.match = NimMatch(piles)
        self.opponent_rng = random.Random(f"nim-opponent:{seed}" if seed is not None else None)
        self._start_episode()
        return self.match.observe(0), {ADMISSIBLE_ACTIONS: legal_moves(self.match.piles)}

    def step(self, action: str) -> StepResult:
        """The agent's move, then the opponent's reply."""
        match = self.match
        self._take_turn(started=match is not None)
        assert match is not None
        invalid = not match.play(action)
        if not match.done and match.current == 1:
            match.play(self._opponent_move(match.piles))
        obs = match.observe(0)
        won = match.done and match.rewards()[0] == 1.0
        info: dict[str, Any] = {ADMISSIBLE_ACTIONS: legal_moves(match.piles)}
        info[INVALID_ACTION] = invalid
        truncated = self._end_turn(match.done, won, info)
        return obs, 1.0 if won else 0.0, match.done, truncated, info

    def state(self) -> dict[str, Any]:
        """Piles left and moves made (``GET /state``)."""
        return {"piles": self.match.piles if self.match else [], "turns": self.turns}

    def _opponent_move(self, piles: list[int]) -> str:
        if self.opponent_rng.random() < self.config.opponent_skill:
            return optimal_move(piles)
        return self.opponent_rng.choice(legal_moves(piles))

    def expert_action(self) -> str:
        """The optimal move."""
        assert self.match is not None
        return optimal_move(self.match.piles)

    def valid_actions(self) -> list[str]:
        """Legal moves."""
        assert self.match is not None
        return legal_moves(self.match.piles)
