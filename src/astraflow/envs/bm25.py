"""A BM25 index over a list of texts (``bm25s``), shared by the shop and search environments."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["Bm25Index"]

_MAX_QUERY_CHARS = 500


class Bm25Index:
    """Ranks ``texts`` against a query; ids are positions in ``texts``."""

    def __init__(self, texts: Sequence[str]) -> None:
        import bm25s  # type: ignore[import-untyped]  # ships no types

        if not texts:
            raise ValueError("a BM25 index needs at least one text")
        self._bm25s: Any = bm25s
        self._index: Any = bm25s.BM25()
        tokens = bm25s.tokenize(list(texts), stopwords="en", show_progress=False)
        self._index.index(tokens, show_progress=False)
        self.size = len(texts)

    def search(self, query: str, k: int) -> list[int]:
        """Ids of the ``k`` best texts with a positive score, best first (ties: lower id)."""
        words = self._bm25s.tokenize(
            [query[:_MAX_QUERY_CHARS]], stopwords="en", return_ids=False, show_progress=False
        )
        if not words or not words[0]:
            return []
        k = max(1, min(k, self.size))
        ids, scores = self._index.retrieve(words, k=k, show_progress=False, n_threads=1)
        ranked = sorted(
            ((float(s), int(i)) for i, s in zip(ids[0], scores[0], strict=True) if s > 0),
            key=lambda p: (-p[0], p[1]),
        )
        return [i for _, i in ranked]
