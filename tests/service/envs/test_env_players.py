"""``env_players`` over real transformers engines: TextArena Nim with each seat a policy."""

from __future__ import annotations

import string
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from astraflow.envs.nim import NimGame
from astraflow.envs.players import GAMES
from astraflow.errors import EnvError
from astraflow.models import TokenizerSpec, build_tokenizer
from astraflow.raas.engines.base import EngineContext, build_engine
from astraflow.raas.policy import NodePolicy
from astraflow.records import Task
from astraflow.workflows.registry import WORKFLOWS
from fixtures.models import tiny_spec
from fixtures.raas import Recording

ALPHABET = string.ascii_letters + string.digits + " []:,.!'()-\n"


def _policy(name: str, tmp: Path, seed: int) -> Recording:
    spec = tiny_spec(max_position_embeddings=4096, seed=seed).model_copy(
        update={"tokenizer": TokenizerSpec(type="char", alphabet=ALPHABET)}
    )
    tok = build_tokenizer(spec)
    context = EngineContext(policy=name, tokenizer=tok, work_dir=tmp, model=spec, seed=seed)
    engine = build_engine({"type": "transformers", "device": "cpu"}, context)
    return Recording(NodePolicy(name, tok, engine, frozen=False, from_store=False))


def _workflow(players: list[str], game: str = "nim") -> Any:
    return WORKFLOWS.build(
        {
            "type": "env_players",
            "game": {"type": game, "piles": 2, "max_pile": 3},
            "players": players,
            "sampling": {"max_new_tokens": 6, "temperature": 1.0, "stop": ["]"]},
            "max_moves": 12,
        },
        seed=0,
    )


def _task(group_size: int) -> Task:
    return Task(task_id="m1", workflow="env_players", payload={"seed": 5}, group_size=group_size)


def _trained_runs(mask: np.ndarray) -> list[tuple[int, int]]:
    runs, start = [], None
    for i, m in enumerate([*mask.tolist(), 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            runs.append((start, i))
            start = None
    return runs


async def test_each_seat_trains_only_its_own_moves(tmp_path: Path) -> None:
    first, second = _policy("first", tmp_path / "a", 1), _policy("second", tmp_path / "b", 2)
    samples = await _workflow(["first", "second"])(_task(2), {"first": first, "second": second}, {})
    by_policy = {p: [s for s in samples if s.policy == p] for p in ("first", "second")}
    assert len(by_policy["first"]) == 2  # player 0 always moves first
    for name, handle in (("first", first), ("second", second)):
        # trained runs are exactly this policy's generations (matches interleave: by content)
        unused = {
            (tuple(g.token_ids.tolist()), tuple(g.logprobs.tolist())) for g in handle.generations
        }
        assert len(unused) == len(handle.generations)
        for sample in by_policy[name]:
            assert sample.meta["role"] == ("player0" if name == "first" else "player1")
            assert sample.group_id == "m1"
            runs = _trained_runs(sample.loss_mask)
            assert len(runs) == sample.meta["turns"] > 0
            for a, b in runs:
                key = (tuple(sample.token_ids[a:b].tolist()), tuple(sample.logprobs[a:b].tolist()))
                unused.remove(key)  # KeyError: a trained run that this policy did not generate
            mask = sample.loss_mask.astype(bool)
            assert not sample.logprobs[~mask].any()
            # what the game told it (rules, the board, the other seat's moves) is context
            text = handle.tokenizer.decode(sample.token_ids[~mask].tolist())
            assert "Nim" in text
        assert not unused  # every generation of the policy was trained, once
    for m in range(2):  # a finished match has exactly one winner
        rewards = [s.reward for s in samples if s.meta["end"] == "finished"][m::2]
        assert sum(rewards) in (0.0, 1.0)


async def test_self_play_keeps_seats_in_separate_groups(tmp_path: Path) -> None:
    policy = _policy("policy", tmp_path, 3)
    samples = await _workflow(["policy", "policy"])(_task(2), {"policy": policy}, {})
    groups = {s.group_id for s in samples}
    assert groups <= {"m1:player0", "m1:player1"}
    assert "m1:player0" in groups


class Exploding(NimGame):
    """Nim whose moves raise after the first."""

    moves = 0

    def play(self, action: str) -> bool:
        Exploding.moves += 1
        if Exploding.moves > 1:
            raise RuntimeError("the game server fell over")
        return super().play(action)


async def test_a_failing_game_fails_the_task(tmp_path: Path) -> None:
    policy = _policy("policy", tmp_path, 4)
    workflow = _workflow(["policy", "policy"], game=f"{__name__}:Exploding")
    with pytest.raises(EnvError, match="fell over"):
        await workflow(_task(1), {"policy": policy}, {})


def test_unknown_game_fails_at_build() -> None:
    with pytest.raises(Exception, match="unknown game"):
        _workflow(["a", "b"], game="chess960")
    assert "nim" in GAMES.names()
