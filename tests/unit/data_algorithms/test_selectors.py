"""Task selectors: orders, epochs, weights, curriculum advancement, GRESO skipping, state."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Mapping
from typing import Any

import pytest

from astraflow.data_algorithms import SELECTORS, GroupResult, SourceView, TaskRef, TaskSelector
from astraflow.data_algorithms.greso import GresoSelector
from astraflow.errors import PluginError


class Rows:
    """A ``TaskCatalog`` over in-memory rows (id field ``id``)."""

    def __init__(self, sources: dict[str, list[dict[str, Any]]], **views: Any) -> None:
        self.rows = sources
        self.views = {
            name: SourceView(
                name=name,
                size=len(rows),
                epochs=views.get(f"{name}_epochs", 1),
                weight=views.get(f"{name}_weight", 1.0),
                eligible=views.get(f"{name}_eligible", True),
            )
            for name, rows in sources.items()
        }

    @property
    def sources(self) -> Mapping[str, SourceView]:
        return self.views

    def row(self, source: str, index: int) -> Mapping[str, Any]:
        return self.rows[source][index]

    def row_id(self, source: str, index: int) -> str:
        return str(self.rows[source][index]["id"])


def rows(n: int, prefix: str = "r", **fields: Any) -> list[dict[str, Any]]:
    return [{"id": f"{prefix}{i}", "level": i % 3, **fields} for i in range(n)]


def drain(sel: TaskSelector, cat: Rows, n: int = 3) -> list[TaskRef]:
    out: list[TaskRef] = []
    while batch := sel.select(cat, n):
        out += batch
    return out


def test_sequential_walks_rows_epoch_after_epoch() -> None:
    sel = SELECTORS.build("sequential")
    refs = drain(sel, Rows({"a": rows(4)}, a_epochs=2))
    assert [(r.index, r.epoch) for r in refs] == [(i, e) for e in range(2) for i in range(4)]


def test_shuffled_is_a_new_permutation_per_epoch_and_reproducible() -> None:
    cat = Rows({"a": rows(30)}, a_epochs=2)
    refs = drain(SELECTORS.build("shuffled", seed=7), cat)
    e0 = [r.index for r in refs if r.epoch == 0]
    e1 = [r.index for r in refs if r.epoch == 1]
    assert sorted(e0) == sorted(e1) == list(range(30))
    assert e0 != e1 and e0 != list(range(30))
    assert refs == drain(SELECTORS.build("shuffled", seed=7), cat)
    assert refs != drain(SELECTORS.build("shuffled", seed=8), cat)


def test_state_dict_resumes_mid_epoch_and_stays_compact() -> None:
    cat = Rows({"a": rows(50)}, a_epochs=2)
    full = drain(SELECTORS.build("shuffled", seed=3), cat, n=7)
    first = SELECTORS.build("shuffled", seed=3)
    head = first.select(cat, 33)
    state = json.loads(json.dumps(first.state_dict()))
    assert len(json.dumps(state)) < 200  # a seed and positions, not a permutation
    resumed = SELECTORS.build("shuffled", seed=99)  # the saved seed wins over the new one
    resumed.load_state_dict(state)
    assert head + drain(resumed, cat, n=7) == full


def test_sources_interleave_by_weight_and_respect_eligibility() -> None:
    cat = Rows({"a": rows(100, "a"), "b": rows(100, "b")}, a_weight=3.0, b_weight=1.0)
    refs = SELECTORS.build("shuffled").select(cat, 40)
    assert Counter(r.source for r in refs) == {"a": 30, "b": 10}
    only_b = Rows({"a": rows(10), "b": rows(10)}, a_eligible=False)
    assert {r.source for r in SELECTORS.build("sequential").select(only_b, 5)} == {"b"}


def result(row_id: str, rewards: tuple[float, ...], source: str = "a") -> GroupResult:
    return GroupResult(source, row_id, 0, f"{source}/{row_id}@e0", "solver", rewards, True)


def test_curriculum_opens_levels_on_reward() -> None:
    cat = Rows({"a": rows(9)}, a_epochs=None)
    sel = SELECTORS.build({"type": "curriculum", "field": "level", "window": 2, "advance_at": 0.5})
    first = sel.select(cat, 6)
    assert {cat.row("a", r.index)["level"] for r in first} == {0}  # cycles level 0
    sel.feedback(result("r0", (1.0, 0.0)))
    sel.feedback(result("r1", (0.0, 0.0)))  # level 1 row: ignored
    assert sel.metrics()["levels_advanced"] == 0
    sel.feedback(result("r3", (1.0, 1.0)))  # mean of the window (0.5, 1.0) >= 0.5
    assert sel.metrics()["levels_advanced"] == 1
    assert {cat.row("a", r.index)["level"] for r in sel.select(cat, 6)} == {1}
    restored = SELECTORS.build({"type": "curriculum", "field": "level"})
    restored.load_state_dict(json.loads(json.dumps(sel.state_dict())))
    assert {cat.row("a", r.index)["level"] for r in restored.select(cat, 3)} == {1}


def test_curriculum_moves_on_when_a_level_is_used_up_and_descends() -> None:
    cat = Rows({"a": rows(6)}, a_epochs=1)
    asc = drain(SELECTORS.build({"type": "curriculum", "field": "level", "shuffle": False}), cat)
    assert [cat.row("a", r.index)["level"] for r in asc] == [0, 0, 1, 1, 2, 2]
    desc = SELECTORS.build({"type": "curriculum", "field": "level", "descending": True})
    assert [cat.row("a", r.index)["level"] for r in drain(desc, cat)] == [2, 2, 1, 1, 0, 0]


def test_curriculum_names_a_missing_field() -> None:
    cat = Rows({"a": [{"id": "x"}]})
    sel = SELECTORS.build({"type": "curriculum", "field": "difficulty"})
    with pytest.raises(PluginError, match="'difficulty' is missing from row 'x' of source 'a'"):
        sel.select(cat, 0)
    with pytest.raises(PluginError, match="unknown key 'feild'"):
        SELECTORS.build({"type": "curriculum", "feild": "level"})


def test_greso_skip_probability_grows_with_zero_variance_run() -> None:
    sel = SELECTORS.build({"type": "greso", "decay": 0.5, "easy_floor": 0.1, "hard_floor": 0.3})
    assert isinstance(sel, GresoSelector)
    assert sel.offer_probability("a/r0") == 1.0
    probs = []
    for _ in range(5):
        sel.feedback(result("r0", (1.0, 1.0, 1.0)))  # all correct: easy
        probs.append(sel.offer_probability("a/r0"))
    assert probs == [0.5, 0.25, 0.125, 0.1, 0.1]  # decays to the easy floor
    for _ in range(5):
        sel.feedback(result("r1", (0.0, 0.0)))  # all wrong: hard floor
    assert sel.offer_probability("a/r1") == 0.3
    sel.feedback(result("r1", (0.0, 1.0)))  # variance again: streak reset
    assert sel.offer_probability("a/r1") == 1.0
    sel.feedback(result("r0", (0.0, 0.0)))  # kind flips: a new run of 1
    assert sel.offer_probability("a/r0") == 0.5


def test_greso_skips_streaky_prompts_and_survives_restart() -> None:
    cat = Rows({"a": rows(200)}, a_epochs=3)
    spec = {"type": "greso", "easy_floor": 0.05, "hard_floor": 0.05}
    sel = SELECTORS.build(spec, seed=1)
    for i in range(100):  # half the prompts: long all-correct streaks
        for _ in range(6):
            sel.feedback(result(f"r{i}", (1.0, 1.0)))
    state = json.loads(json.dumps(sel.state_dict()))
    refs = drain(sel, cat, n=16)
    offered = Counter(cat.row_id("a", r.index) for r in refs)
    streaky = sum(offered[f"r{i}"] for i in range(100))
    fresh = sum(offered[f"r{i}"] for i in range(100, 200))
    assert fresh == 300  # never skipped: 100 prompts x 3 epochs
    assert streaky < 40  # offered with probability 0.05 each time (expected 15)
    assert sel.metrics()["skipped"] == 600 - len(refs)
    again = SELECTORS.build(spec, seed=2)
    again.load_state_dict(state)
    assert drain(again, cat, n=16) == refs  # same skip decisions after a restart


def test_selectors_satisfy_the_protocol() -> None:
    for name in ("sequential", "shuffled", "greso"):
        assert isinstance(SELECTORS.build(name), TaskSelector)
    assert set(SELECTORS.names()) >= {"sequential", "shuffled", "curriculum", "greso"}
