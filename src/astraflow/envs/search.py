"""Multi-hop search agent (stands in for Search-R1): answer a question by searching a corpus.

The knowledge base is generated from a seed: countries, cities (each in a country, with a
river), people (each born in a city, with a profession) and companies (each founded by a
person, headquartered in a city), one document per entity. A question needs 2 or 3 hops::

    In which country was the founder of Dravel Works born?
      search[Dravel Works]  -> "... founded by Mira Tolsen ..."
      search[Mira Tolsen]   -> "... born in Karvo ..."
      search[Karvo]         -> "... a city in Ostrel ..."
      answer[Ostrel]        -> reward 1 (exact match after normalisation), episode ends

``search[query]`` shows the ``top_k`` BM25 documents; anything else is an invalid action.
"""

from __future__ import annotations

import functools
import random
import re
import string
from dataclasses import dataclass
from typing import Any

from pydantic import Field

from astraflow.config import ConfigModel
from astraflow.envs.bm25 import Bm25Index
from astraflow.envs.holdout import choose, split_of
from astraflow.envs.protocol import INVALID_ACTION, StepResult
from astraflow.envs.registry import ENVS
from astraflow.envs.turns import TurnLimitedEnv

__all__ = ["KnowledgeBase", "SearchAgent", "build_knowledge_base", "normalize_answer"]

_ACTION = re.compile(r"^\s*(search|answer)\[(.*)\]\s*$", re.DOTALL)
_ONSETS = ("b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "dr", "st")
_VOWELS = ("a", "e", "i", "o", "u", "ae", "io")
_CODAS = ("", "n", "r", "l", "s", "th", "v", "nd", "x")
_PROFESSIONS = (
    "painter", "chemist", "sailor", "architect", "poet", "engineer", "judge", "baker",
    "astronomer", "merchant", "composer", "physician",
)  # fmt: skip
_SUFFIXES = ("Works", "Industries", "Trading", "Labs", "Foundry", "Holdings", "Mills", "Group")


@dataclass(frozen=True)
class Question:
    """A question, its answer and the documents an expert searches, in order."""

    text: str
    answer: str
    hops: tuple[str, ...]


@dataclass(frozen=True)
class KnowledgeBase:
    """Documents (title, text), their BM25 index and the questions they answer."""

    titles: tuple[str, ...]
    texts: tuple[str, ...]
    questions: tuple[Question, ...]
    index: Bm25Index


def normalize_answer(text: str) -> str:
    """Lower case, no punctuation, no articles, single spaces (SQuAD-style exact match)."""
    text = text.lower().translate(str.maketrans("", "", string.punctuation))
    return " ".join(w for w in text.split() if w not in ("a", "an", "the"))


class _Names:
    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.used: set[str] = set()

    def make(self, syllables: int) -> str:
        while True:
            name = "".join(
                self.rng.choice(_ONSETS) + self.rng.choice(_VOWELS) + self.rng.choice(_CODAS)
                for _ in range(syllables)
            ).capitalize()
            if name not in self.used:
                self.used.add(name)
                return name


@functools.cache
def build_knowledge_base(seed: int = 0, people: int = 400) -> KnowledgeBase:
    """The knowledge base for ``seed`` with ``people`` persons (cached per process)."""
    rng = random.Random(f"search-kb:{seed}")
    names = _Names(rng)
    countries = [names.make(3) for _ in range(max(4, people // 25))]
    cities = {names.make(2): rng.choice(countries) for _ in range(max(8, people // 4))}
    rivers = {city: names.make(2) for city in cities}
    city_list = sorted(cities)
    persons = {f"{names.make(2)} {names.make(2)}": rng.choice(city_list) for _ in range(people)}
    person_list = sorted(persons)
    companies = {
        f"{names.make(2)} {rng.choice(_SUFFIXES)}": (rng.choice(person_list), rng.choice(city_list))
        for _ in range(people // 2)
    }
    titles: list[str] = []
    texts: list[str] = []
    for country in countries:
        capital = next((c for c in city_list if cities[c] == country), None)
        titles.append(country)
        tail = f" whose capital is {capital}." if capital else "."
        texts.append(f"{country} is a country{tail}")
    for city in city_list:
        titles.append(city)
        river = rivers[city]
        texts.append(f"{city} is a city in {cities[city]}. The river {river} flows through it.")
    for person in person_list:
        job = rng.choice(_PROFESSIONS)
        titles.append(person)
        article = "an" if job[0] in "aeiou" else "a"
        texts.append(f"{person} is {article} {job} who was born in {persons[person]}.")
    questions: list[Question] = []
    for company, (founder, hq) in sorted(companies.items()):
        titles.append(company)
        texts.append(f"{company} is a company founded by {founder}. Its headquarters are in {hq}.")
        born = persons[founder]
        questions += [
            Question(
                f"In which country was the founder of {company} born?",
                cities[born],
                (company, founder, born),
            ),
            Question(
                f"Which river flows through the city where the founder of {company} was born?",
                rivers[born],
                (company, founder, born),
            ),
            Question(
                f"In which country are the headquarters of {company}?", cities[hq], (company, hq)
            ),
            Question(f"Which river flows through the birthplace of {founder}?", rivers[born],
                     (founder, born)),
        ]  # fmt: skip
    docs = [f"{t}. {x}" for t, x in zip(titles, texts, strict=True)]
    return KnowledgeBase(tuple(titles), tuple(texts), tuple(questions), Bm25Index(docs))


class SearchAgentConfig(ConfigModel):
    """Knowledge base and episode limits."""

    kb_seed: int = 0
    """Seed of the generated knowledge base (the same on every node)."""
    people: int = Field(default=400, ge=20, le=20000)
    """Persons in the knowledge base (countries, cities and companies scale with it)."""
    top_k: int = Field(default=3, ge=1, le=10)
    """Documents shown per search."""
    max_turns: int = Field(default=6, ge=1, le=50)
    """Actions per episode (searches and the answer)."""
    holdout: float = Field(default=0.0, ge=0.0, lt=1.0)
    """Share of questions kept for ``options={"split": "eval"}`` episodes (0: no split)."""


@ENVS.register("search_agent")
class SearchAgent(TurnLimitedEnv[SearchAgentConfig]):
    """Answer a multi-hop question with ``search[...]`` and ``answer[...]``."""

    Config = SearchAgentConfig
    label = "search"

    def __init__(
        self, config: SearchAgentConfig | None = None, rng: random.Random | None = None
    ) -> None:
        super().__init__(config, rng)
        self.kb = build_knowledge_base(self.config.kb_seed, self.config.people)
        self.question = self.kb.questions[0]
        self.seen: list[str] = []

    def reset(
        self, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[str, dict[str, Any]]:
        """A question drawn by ``seed``."""
        rng = random.Random(f"search:{seed}" if seed is not None else None)
        self.question = choose(
            rng, self.kb.questions, lambda q: q.text, self.config.holdout, split_of(options)
        )
        self._start_episode()
        self.seen = [self.question.text]
        obs = (
            f"Question: {self.question.text}\n"
            "Actions: search[query] shows matching documents; answer[text] ends the episode."
        )
        return obs, {}

    def step(self, action: str) -> StepResult:
        """Run a search or check an answer."""
        self._take_turn()
        m = _ACTION.match(str(action))
        info: dict[str, Any] = {INVALID_ACTION: m is None}
        reward, terminated = 0.0, False
        if m is None:
            obs = "Invalid action. Use search[query] or answer[text]."
        elif m.group(1) == "search":
            obs = self._search(m.group(2))
        else:
            terminated = True
            reward = float(normalize_answer(m.group(2)) == normalize_answer(self.question.answer))
            obs = "Correct." if reward else "Wrong."
        truncated = self._end_turn(terminated, reward == 1.0, info)
        return obs, reward, terminated, truncated, info

    def state(self) -> dict[str, Any]:
        """The question and actions used (``GET /state``)."""
        return {"question": self.question.text, "turns": self.turns}

    def _search(self, query: str) -> str:
        ids = self.kb.index.search(query, self.config.top_k)
        if not ids:
            return "No documents found."
        lines = [f"[{n}] {self.kb.titles[i]}: {self.kb.texts[i]}" for n, i in enumerate(ids, 1)]
        self.seen += [self.kb.texts[i] for i in ids]
        return "\n".join(lines)

    # ------------------------------------------------------------------ scripted agents

    def expert_action(self) -> str:
        """Search each hop's document in turn, then answer."""
        searches = self.turns
        if searches < len(self.question.hops):
            return f"search[{self.question.hops[searches]}]"
        return f"answer[{self.question.answer}]"

    def valid_actions(self) -> list[str]:
        """Searches and answers over the capitalised names seen so far."""
        names = sorted(
            {n for text in self.seen for n in re.findall(r"[A-Z][a-z]+(?: [A-Z][a-z]+)?", text)}
        )
        return [f"search[{n}]" for n in names] + [f"answer[{n}]" for n in names]
