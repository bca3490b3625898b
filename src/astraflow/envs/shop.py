"""Shop (stands in for WebShop): find and buy the product an instruction describes.

Pages and actions, as in WebShop's text mode::

    search page   search[query]                 BM25 over the generated catalogue
    results page  click[<asin>] click[next >] click[< prev] click[back to search]
    item page     click[<option>] click[buy now] click[< prev] click[back to search]

Buying ends the episode with WebShop's reward (:func:`score_purchase`): attributes, options
and price matched against the instruction; success means reward 1. The catalogue is generated
from ``catalogue_seed`` (:mod:`astraflow.envs.shop_catalog`), identical on every node.
"""

from __future__ import annotations

import random
import re
from typing import Any

from pydantic import Field

from astraflow.config import ConfigModel
from astraflow.envs.holdout import choose, split_of
from astraflow.envs.protocol import INVALID_ACTION, StepResult
from astraflow.envs.registry import ENVS
from astraflow.envs.shop_catalog import Instruction, Product, build_catalogue, score_purchase
from astraflow.envs.turns import TurnLimitedEnv

__all__ = ["Shop"]

_ACTION = re.compile(r"^\s*(search|click)\[(.*)\]\s*$", re.DOTALL)
_PER_PAGE = 10
_MAX_RESULTS = 50


class ShopConfig(ConfigModel):
    """Catalogue and episode limits."""

    catalogue_seed: int = 0
    """Seed of the generated catalogue (the same on every node)."""
    products: int = Field(default=3000, ge=10, le=100000)
    """Products in the catalogue."""
    max_turns: int = Field(default=15, ge=1, le=100)
    """Actions per episode before it is truncated."""
    holdout: float = Field(default=0.0, ge=0.0, lt=1.0)
    """Share of target products kept for ``options={"split": "eval"}`` episodes (0: no split)."""


@ENVS.register("shop")
class Shop(TurnLimitedEnv[ShopConfig]):
    """The shop environment (one episode at a time)."""

    Config = ShopConfig
    label = "shop"

    def __init__(self, config: ShopConfig | None = None, rng: random.Random | None = None):
        super().__init__(config, rng)
        self.catalogue = build_catalogue(self.config.catalogue_seed, self.config.products)
        self.goal: Instruction | None = None
        self.page = "search"
        self.results: list[str] = []
        self.result_page = 0
        self.item: Product | None = None
        self.chosen: dict[str, str] = {}

    def reset(
        self, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[str, dict[str, Any]]:
        """A shopping instruction drawn by ``seed``; the search page."""
        rng = random.Random(f"shop-goal:{seed}" if seed is not None else None)
        products = self.catalogue.products
        target = choose(rng, products, lambda p: p.asin, self.config.holdout, split_of(options))
        self.goal = self.catalogue.instruction(rng, target)
        self.page, self.results, self.result_page, self.item = "search", [], 0, None
        self.chosen = {}
        self._start_episode()
        return self._render(), {}

    def step(self, action: str) -> StepResult:
        """Search, click, or buy."""
        goal = self.goal
        self._take_turn(started=goal is not None)
        assert goal is not None
        m = _ACTION.match(str(action))
        reward, terminated, invalid = 0.0, False, True
        if m is not None and m.group(1) == "search" and self.page == "search":
            invalid = self._search(m.group(2))
        elif m is not None and m.group(1) == "click":
            target = " ".join(m.group(2).strip().lower().split())
            if target == "buy now" and self.page == "item" and self.item is not None:
                reward = score_purchase(
                    goal, self.item, self.chosen.get("color"), self.chosen.get("size")
                )
                terminated, invalid = True, False
            else:
                invalid = not self._click(target)
        info: dict[str, Any] = {INVALID_ACTION: invalid}
        truncated = self._end_turn(terminated, reward >= 1.0, info)
        obs = "Thank you for shopping with us!" if terminated else self._render()
        if invalid:
            obs = f"Invalid action.\n{obs}"
        return obs, reward, terminated, truncated, info

    def state(self) -> dict[str, Any]:
        """Page, open product, chosen options and actions used (``GET /state``)."""
        return {
            "page": self.page,
            "item": self.item.asin if self.item else None,
            "chosen": dict(self.chosen),
            "turns": self.turns,
        }

    # ------------------------------------------------------------------ pages

    def _search(self, query: str) -> bool:
        ids = self.catalogue.index.search(query, _MAX_RESULTS)
        self.results = [self.catalogue.products[i].asin for i in ids]
        self.page, self.result_page = "results", 0
        return False

    def _click(self, target: str) -> bool:
        if target == "back to search":
            self.page, self.item, self.chosen = "search", None, {}
            return True
        if self.page == "results":
            return self._click_results(target)
        if self.page == "item" and self.item is not None:
            if target == "< prev":
                self.page, self.item, self.chosen = "results", None, {}
                return True
            if target in self.item.colors:
                self.chosen["color"] = target
                return True
            if target in self.item.sizes:
                self.chosen["size"] = target
                return True
        return False

    def _click_results(self, target: str) -> bool:
        pages = max(1, -(-len(self.results) // _PER_PAGE))
        if target == "next >" and self.result_page + 1 < pages:
            self.result_page += 1
            return True
        if target == "< prev" and self.result_page > 0:
            self.result_page -= 1
            return True
        shown = self._shown()
        asin = next((a for a in shown if a.lower() == target), None)
        if asin is None:
            return False
        self.page, self.item, self.chosen = "item", self.catalogue.by_asin[asin], {}
        return True

    def _shown(self) -> list[str]:
        start = self.result_page * _PER_PAGE
        return self.results[start : start + _PER_PAGE]

    def _render(self) -> str:
        assert self.goal is not None
        head = f"Instruction: {self.goal.text}\n"
        if self.page == "search":
            return head + "[Search]"
        if self.page == "results":
            lines = [head + "[Back to Search]", f"Page {self.result_page + 1} "
                     f"(Total results: {len(self.results)})"]  # fmt: skip
            if self.result_page > 0:
                lines.append("[< Prev]")
            if (self.result_page + 1) * _PER_PAGE < len(self.results):
                lines.append("[Next >]")
            for asin in self._shown():
                hit = self.catalogue.by_asin[asin]
                lines.append(f"[{asin}] {hit.title} ${hit.price:.2f}")
            return "\n".join(lines)
        p = self.item
        assert p is not None
        chosen = ", ".join(f"{k}: {v}" for k, v in sorted(self.chosen.items())) or "none"
        return (
            f"{head}[Back to Search]\n[< Prev]\n{p.title}\nPrice: ${p.price:.2f}\n"
            f"color: {' '.join(f'[{c}]' for c in p.colors)}\n"
            f"size: {' '.join(f'[{s}]' for s in p.sizes)}\n"
            f"Features: {', '.join(p.attributes)}\nSelected: {chosen}\n[Buy Now]"
        )

    # ------------------------------------------------------------------ scripted agents

    def expert_action(self) -> str:
        """Search the target's title, open it, choose the asked options, buy."""
        goal = self.goal
        assert goal is not None
        target = self.catalogue.by_asin[goal.target]
        if self.page == "search":
            return f"search[{target.title}]"
        if self.page == "results":
            if goal.target in self._shown():
                return f"click[{goal.target}]"
            return "click[next >]" if goal.target in self.results else "click[back to search]"
        if self.item is not None and self.item.asin != goal.target:
            return "click[< prev]"
        if self.chosen.get("color") != goal.color:
            return f"click[{goal.color}]"
        if self.chosen.get("size") != goal.size:
            return f"click[{goal.size}]"
        return "click[buy now]"

    def valid_actions(self) -> list[str]:
        """What a random agent picks from: a search with the instruction, or a shown button."""
        assert self.goal is not None
        if self.page == "search":
            return [f"search[{self.goal.text}]", f"search[{self.goal.category}]"]
        actions = ["click[back to search]"]
        if self.page == "results":
            actions += [f"click[{a}]" for a in self._shown()]
            if (self.result_page + 1) * _PER_PAGE < len(self.results):
                actions.append("click[next >]")
            return actions
        assert self.item is not None
        return (
            actions
            + ["click[< prev]", "click[buy now]"]
            + [f"click[{o}]" for o in self.item.colors + self.item.sizes]
        )
