"""Multi-player games: the adapter the ``env_players`` workflow maps players to policies through.

A game runs one match at a time; players take turns (``current``), each sees only what it was
told since its last move (``observe``), and the match ends with a reward per player::

    game.reset(seed)
    while not game.done:
        p = game.current
        obs = game.observe(p)          # context for player p's policy
        game.play(action_of(p, obs))   # False: invalid (the game may end on it)
    game.rewards()                     # {0: 1.0, 1: 0.0}

Games are plug-ins like environments (``GAMES``; ``cls(config, rng)`` with a pydantic
``Config``). TextArena two-player games fit this shape directly (``nim`` is one).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from astraflow.plugins import Registry

__all__ = ["GAMES", "MultiPlayerGame"]


@runtime_checkable
class MultiPlayerGame(Protocol):
    """A turn-based game between ``players``."""

    @property
    def players(self) -> tuple[int, ...]:
        """Player ids, in seating order."""
        ...

    @property
    def current(self) -> int:
        """The player to move."""
        ...

    @property
    def done(self) -> bool:
        """Whether the match is over."""
        ...

    def reset(self, seed: int | None = None) -> None:
        """Start a match (the same seed gives the same match)."""
        ...

    def observe(self, player: int) -> str:
        """What ``player`` was told since it last observed (its rules first)."""
        ...

    def legal_actions(self) -> list[str] | None:
        """The current player's valid moves, when finite."""
        ...

    def play(self, action: str) -> bool:
        """The current player's move; False when it was invalid."""
        ...

    def rewards(self) -> dict[int, float]:
        """Each player's reward (once the match is over)."""
        ...

    def close(self) -> None:
        """Release what the game holds."""
        ...


GAMES: Registry[MultiPlayerGame] = Registry(
    "game",
    MultiPlayerGame,
    ("astraflow.envs.nim",),
)
"""Multi-player games by name; register with ``@GAMES.register("name")``."""
