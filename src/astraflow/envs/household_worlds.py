"""Household worlds for the ``household`` environment, compiled with TextWorld ahead of time.

A world is a few connected rooms (kitchen, bedroom, ...), each with receptacles (containers
that open and close, supporters) and portable objects placed in or on them. It is built with
TextWorld's ``GameMaker`` and compiled by the Inform 7 compiler bundled in the ``textworld``
wheel, about 5 s per world, so worlds are generated once into a cache directory::

    python -m astraflow.envs.household_worlds --cache-dir CACHE --worlds 8

and every episode loads a compiled world (``world-<seed>.z8`` and TextWorld's ``.json``, plus
``world-<seed>.layout.json`` with the layout the expert plans on). Episodes draw a
pick-and-place task in a world: any object, any receptacle it is not already in.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["World", "generate_world", "generate_worlds", "load_worlds"]

_ROOMS: dict[str, tuple[tuple[str, str], ...]] = {
    # room: receptacles (name, "c" container | "s" supporter)
    "kitchen": (("fridge", "c"), ("cabinet", "c"), ("countertop", "s"), ("dining table", "s")),
    "bedroom": (("dresser", "c"), ("nightstand", "s"), ("bed", "s"), ("wardrobe", "c")),
    "bathroom": (("medicine cabinet", "c"), ("sink counter", "s"), ("laundry basket", "c")),
    "living room": (("sofa", "s"), ("coffee table", "s"), ("bookshelf", "s"), ("chest", "c")),
    "office": (("desk", "s"), ("drawer", "c"), ("filing cabinet", "c"), ("armchair", "s")),
    "pantry": (("shelf", "s"), ("bin", "c"), ("crate", "c")),
}
_OBJECTS = (
    "apple", "mug", "book", "towel", "soap bar", "key", "pen", "candle", "plate", "remote",
    "pillow", "spoon", "lettuce", "watch", "cellphone", "vase", "newspaper", "bowl",
)  # fmt: skip
_DIRECTIONS = (("east", "west"), ("north", "south"), ("west", "east"), ("south", "north"))


@dataclass(frozen=True)
class World:
    """A compiled world: its game file and layout."""

    path: str
    rooms: dict[str, dict[str, str]]
    """Room → {direction: neighbouring room}."""
    receptacles: dict[str, tuple[str, str]]
    """Receptacle → (room, "c" container or "s" supporter)."""
    objects: tuple[str, ...]
    places: dict[str, str]
    """Object → where it starts (a receptacle, or ``floor:<room>``)."""

    @property
    def name(self) -> str:
        """The world's file name (its identity in task keys)."""
        return Path(self.path).stem


def _layout(seed: int) -> dict[str, Any]:
    rng = random.Random(f"household:{seed}")
    rooms = rng.sample(sorted(_ROOMS), rng.randint(2, 3))
    exits: dict[str, dict[str, str]] = {r: {} for r in rooms}
    for i, room in enumerate(rooms[1:], 1):
        while True:
            other = rng.choice(rooms[:i])
            there, back = rng.choice(_DIRECTIONS)
            if there not in exits[other] and back not in exits[room]:
                exits[other][there], exits[room][back] = room, other
                break
    receptacles: dict[str, list[Any]] = {}
    for room in rooms:
        for name, kind in rng.sample(_ROOMS[room], 2):
            receptacles[name] = [room, kind, kind == "c" and rng.random() < 0.7]
    places = sorted(receptacles) + [f"floor:{r}" for r in rooms]
    objects = {o: rng.choice(places) for o in rng.sample(_OBJECTS, rng.randint(3, 5))}
    return {"rooms": exits, "receptacles": receptacles, "objects": objects, "seed": seed}


def _compile(layout: dict[str, Any], path: Path) -> None:
    from textworld import GameMaker  # type: ignore[import-untyped]

    maker = GameMaker()
    rooms = {name: maker.new_room(name) for name in layout["rooms"]}
    for room, exits in layout["rooms"].items():
        for direction, other in exits.items():
            if direction in ("east", "north"):
                back = _opposite(direction)
                maker.connect(getattr(rooms[room], direction), getattr(rooms[other], back))
    maker.set_player(rooms[next(iter(layout["rooms"]))])
    things: dict[str, Any] = {}
    for name, (room, kind, closed) in layout["receptacles"].items():
        things[name] = maker.new(type=kind, name=name)
        rooms[room].add(things[name])
        if kind == "c":
            maker.add_fact("closed" if closed else "open", things[name])
    for name, place in layout["objects"].items():
        obj = maker.new(type="o", name=name)
        (rooms[place[6:]] if place.startswith("floor:") else things[place]).add(obj)
    maker.compile(str(path))


def _opposite(direction: str) -> str:
    return dict(_DIRECTIONS)[direction]


def generate_world(seed: int, cache_dir: str | Path) -> Path:
    """Compile world ``seed`` into ``cache_dir`` (skipped when already there)."""
    cache = Path(cache_dir)
    cache.mkdir(parents=True, exist_ok=True)
    game, meta = cache / f"world-{seed}.z8", cache / f"world-{seed}.layout.json"
    if game.is_file() and meta.is_file():
        return game
    layout = _layout(seed)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        _compile(layout, Path(tmp) / f"world-{seed}.z8")
        for part in sorted(Path(tmp).iterdir()):  # the game file and TextWorld's game.json
            os.replace(part, cache / part.name)
    meta.write_text(json.dumps(layout, indent=1, sort_keys=True))
    return game


def generate_worlds(cache_dir: str | Path, worlds: int, first_seed: int = 0) -> list[Path]:
    """Compile worlds ``first_seed .. first_seed + worlds - 1`` into ``cache_dir``."""
    return [generate_world(s, cache_dir) for s in range(first_seed, first_seed + worlds)]


def load_worlds(cache_dir: str | Path, worlds: int, first_seed: int = 0) -> list[World]:
    """The compiled worlds, or an error naming the command that generates the missing ones."""
    cache = Path(cache_dir)
    out: list[World] = []
    for seed in range(first_seed, first_seed + worlds):
        game, meta = cache / f"world-{seed}.z8", cache / f"world-{seed}.layout.json"
        if not (game.is_file() and meta.is_file()):
            raise FileNotFoundError(
                f"household world {seed} is not in {cache}: generate the worlds ahead with "
                f"`python -m astraflow.envs.household_worlds --cache-dir {cache} "
                f"--worlds {worlds} --first-seed {first_seed}`"
            )
        layout = json.loads(meta.read_text())
        receptacles = {k: (str(v[0]), str(v[1])) for k, v in layout["receptacles"].items()}
        places = {str(k): str(v) for k, v in layout["objects"].items()}
        out.append(World(str(game), layout["rooms"], receptacles, tuple(sorted(places)), places))
    return out


def main(argv: list[str] | None = None) -> int:
    """Generate worlds into a cache directory."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cache-dir", required=True, help="where the compiled worlds go")
    parser.add_argument("--worlds", type=int, default=8, help="how many worlds")
    parser.add_argument("--first-seed", type=int, default=0, help="seed of the first world")
    args = parser.parse_args(argv)
    for path in generate_worlds(args.cache_dir, args.worlds, args.first_seed):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
