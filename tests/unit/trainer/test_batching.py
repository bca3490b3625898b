"""Whole-group advantages, token-budget packing, right padding and rank assignment."""

from __future__ import annotations

from typing import Any

import pytest

from astraflow.errors import ValidationError
from astraflow.trainer.batching import assign_to_ranks, collate, pack, prepare_rows
from fixtures.trainer import text_sample


def test_pack_respects_budget_and_is_deterministic() -> None:
    lengths = [5, 9, 3, 7, 2, 9, 4]
    bins = pack(lengths, token_budget=18)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    for b in bins:
        assert len(b) * max(lengths[i] for i in b) <= 18
    assert bins == pack(lengths, token_budget=18)
    assert len(pack(lengths, token_budget=1000)) == 1


def test_pack_puts_an_oversized_row_alone() -> None:
    bins = pack([50, 3, 3], token_budget=10)
    assert [0] in bins and sorted(i for b in bins for i in b) == [0, 1, 2]


def test_assign_to_ranks_gives_equal_counts() -> None:
    bins = [[0], [1], [2]]
    r0, r1 = assign_to_ranks(bins, 0, 2), assign_to_ranks(bins, 1, 2)
    assert r0 == [[0], [2]] and r1 == [[1], []]
    assert assign_to_ranks([], 0, 2) == [[]]


def test_collate_pads_right_with_attention(tiny_tokenizer: Any) -> None:
    a = text_sample(tiny_tokenizer, "1+2=", "3", reward=1.0)
    b = text_sample(tiny_tokenizer, "11+22=", "33", reward=0.0)
    rows = prepare_rows([a, b], trainer_version=0)
    mb = collate(rows, pad_id=0)
    assert mb.input_ids.shape == (2, 8)
    assert mb.attention_mask.tolist()[0] == [1] * 5 + [0] * 3
    assert mb.input_ids.tolist()[0][5:] == [0, 0, 0]
    assert mb.loss_mask.tolist()[0] == [0, 0, 0, 0, 1, 0, 0, 0]
    assert mb.advantages.tolist() == pytest.approx([1.0, -1.0], abs=1e-5)


def test_split_group_keeps_whole_group_advantages(tiny_tokenizer: Any) -> None:
    samples = [
        text_sample(tiny_tokenizer, "1+1=", "2" * (1 + i), reward=float(i), group="g")
        for i in range(4)
    ]
    rows = prepare_rows(samples, trainer_version=0)
    bins = pack([r.length for r in rows], token_budget=8)  # forces one row per micro-batch
    assert len(bins) == 4
    advs = [collate([rows[i] for i in b], 0).advantages.item() for b in bins]
    whole = [-1.3416, -0.4472, 0.4472, 1.3416]  # (r - 1.5) / std([0, 1, 2, 3])
    assert sorted(advs) == pytest.approx(whole, abs=1e-4)


def test_prepare_rows_staleness_mask_and_errors(tiny_tokenizer: Any) -> None:
    s = text_sample(tiny_tokenizer, "", "12", version=3)
    rows = prepare_rows([s], trainer_version=5)
    assert rows[0].staleness == 2
    assert rows[0].loss_mask.tolist() == [0, 1]  # the first token has no prefix
    assert s.loss_mask.tolist() == [1, 1]  # the record itself is untouched
    bad = text_sample(tiny_tokenizer, "1=", "2", temperature=0.0)
    with pytest.raises(ValidationError, match=r"meta\.temperature"):
        prepare_rows([bad], trainer_version=0)
    long = text_sample(tiny_tokenizer, "1" * 10, "2")
    with pytest.raises(ValidationError, match="11 tokens"):
        prepare_rows([long], trainer_version=0, max_length=8)
