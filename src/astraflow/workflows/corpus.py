"""A local document collection for the search tool and its QA tasks, generated offline.

Each document describes one fictional city (kingdom, founder, year, river, export) in plain
sentences; every fact is also a question with a short answer. The same ``(seed, size)`` always
gives the same collection, so the search tool on a node and the QA task source in the
dataflow service agree without shipping files. Search is BM25 (``rank_bm25``).
"""

from __future__ import annotations

import functools
import random
import re
from dataclasses import dataclass
from typing import Any

__all__ = ["Corpus", "Document", "QAPair", "build_corpus"]

_ONSETS = ("b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "st", "th")
_VOWELS = ("a", "e", "i", "o", "u", "ai", "ou")
_CODAS = ("", "n", "r", "l", "s", "th", "m", "nd")
_EXPORTS = (
    "copper", "salt", "wool", "timber", "glass", "silk", "amber", "tin", "olives", "horses",
    "paper", "cheese", "iron", "honey", "pottery", "spices",
)  # fmt: skip
_WORD = re.compile(r"[a-z0-9]+")


@dataclass(frozen=True)
class Document:
    """One searchable document."""

    doc_id: str
    title: str
    text: str


@dataclass(frozen=True)
class QAPair:
    """A question answered by exactly one document of the collection."""

    question: str
    answer: str
    doc_id: str


def _name(rng: random.Random, syllables: int) -> str:
    parts = [
        rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(syllables)
    ]
    return "".join(parts).capitalize()


def _tokens(text: str) -> list[str]:
    return _WORD.findall(text.lower())


class Corpus:
    """Documents, their questions, and a BM25 index over them."""

    def __init__(self, documents: list[Document], questions: list[QAPair]) -> None:
        self.documents = documents
        self.questions = questions
        self._bm25: Any = None  # built on the first search: task sources never need it

    def search(self, query: str, k: int = 3) -> list[Document]:
        """The ``k`` best-matching documents (none for a query with no known word)."""
        words = _tokens(query)
        if not words:
            return []
        if self._bm25 is None:
            from rank_bm25 import BM25Okapi  # type: ignore[import-untyped]  # ships no types

            self._bm25 = BM25Okapi([_tokens(f"{d.title} {d.text}") for d in self.documents])
        scores = self._bm25.get_scores(words)
        order = sorted(range(len(self.documents)), key=lambda i: (-float(scores[i]), i))
        return [self.documents[i] for i in order[:k] if float(scores[i]) > 0]


def _unique_name(rng: random.Random, used: set[str], syllables: int) -> str:
    while True:
        name = _name(rng, syllables)
        if name not in used:
            used.add(name)
            return name


@functools.cache
def build_corpus(seed: int = 0, size: int = 200) -> Corpus:
    """The collection of ``size`` city documents for ``seed`` (cached per process)."""
    if size < 1:
        raise ValueError("a corpus needs at least one document")
    rng = random.Random(f"corpus:{seed}")
    used: set[str] = set()
    kingdoms = [_unique_name(rng, used, 3) for _ in range(max(2, size // 10))]
    docs: list[Document] = []
    questions: list[QAPair] = []
    for i in range(size):
        city = _unique_name(rng, used, 2)
        river = _unique_name(rng, used, 1 + rng.randint(0, 1))
        founder = f"{_unique_name(rng, used, 2)} {_unique_name(rng, used, 2)}"
        kingdom = rng.choice(kingdoms)
        year = rng.randint(800, 1900)
        export = rng.choice(_EXPORTS)
        doc_id = f"doc-{i:05d}"
        text = (
            f"{city} is a city in the kingdom of {kingdom}. It was founded in {year} by "
            f"{founder}. The river {river} flows through {city}. The main export of {city} "
            f"is {export}."
        )
        docs.append(Document(doc_id, city, text))
        questions += [
            QAPair(f"In which kingdom is the city of {city}?", kingdom, doc_id),
            QAPair(f"In which year was {city} founded?", str(year), doc_id),
            QAPair(f"Who founded the city of {city}?", founder, doc_id),
            QAPair(f"Which river flows through {city}?", river, doc_id),
            QAPair(f"What is the main export of {city}?", export, doc_id),
        ]
    return Corpus(docs, questions)
