"""``search_qa``: questions answered by the local document collection of the search tool.

Rows are questions about the generated city documents (``workflows.corpus``); the search tool
built with the same ``corpus_seed`` and ``corpus_size`` finds the answering document. Train
and eval splits are disjoint by document (every ``holdout``-th document's questions are
eval), so an eval question is never about a city seen in training.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Literal

from pydantic import Field

from astraflow.config import ConfigModel
from astraflow.plugins import Configured
from astraflow.workflows.corpus import build_corpus
from astraflow.workflows.tasks import GENERATORS

__all__ = ["SearchQA"]


class SearchQAConfig(ConfigModel):
    """Config of ``search_qa``."""

    corpus_seed: int = 0
    """Seed of the document collection (the search tool's ``seed``)."""
    corpus_size: int = Field(default=200, ge=1)
    """Documents in the collection (the search tool's ``size``)."""
    split: Literal["train", "eval"] = "train"
    """Which documents' questions."""
    holdout: int = Field(default=10, ge=2)
    """Every holdout-th document is eval-only."""
    size: int | None = Field(default=None, ge=1)
    """At most this many rows (None: every question of the split)."""
    reward: Literal["qa_f1", "exact_match"] = "qa_f1"
    """Reward name put on every row."""


@GENERATORS.register("search_qa")
class SearchQA(Configured[SearchQAConfig]):
    """Questions over the local document collection, with short answers."""

    Config = SearchQAConfig

    def rows(self) -> Iterator[dict[str, Any]]:
        """Questions of this split, in collection order."""
        cfg = self.config
        corpus = build_corpus(cfg.corpus_seed, cfg.corpus_size)
        count = 0
        for index, qa in enumerate(corpus.questions):
            doc_index = int(qa.doc_id.rsplit("-", 1)[1])
            if (doc_index % cfg.holdout == 0) != (cfg.split == "eval"):
                continue
            if cfg.size is not None and count >= cfg.size:
                return
            count += 1
            yield {
                "id": f"search_qa-{cfg.corpus_seed}-{index}",
                "prompt": qa.question,
                "answer": qa.answer,
                "doc_id": qa.doc_id,
                "reward": cfg.reward,
            }
