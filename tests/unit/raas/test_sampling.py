"""Per-row sampling: tempered logprobs, top-k / top-p restriction, greedy rows, seeds."""

from __future__ import annotations

import torch

from astraflow.raas.engines.decoding import sample_next


def _params(b: int, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0):
    return (
        torch.full((b,), temperature),
        torch.full((b,), top_k, dtype=torch.long),
        torch.full((b,), top_p),
    )


def test_logprobs_are_of_the_tempered_distribution_even_when_top_k_restricts() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 50, generator=gen)
    tokens, lps = sample_next(logits, *_params(4, 0.7, top_k=3), [None] * 4, gen)
    expected = torch.log_softmax(logits / 0.7, dim=-1).gather(-1, tokens[:, None])[:, 0]
    assert torch.allclose(lps, expected)
    top3 = logits.topk(3, dim=-1).indices
    assert all(int(t) in top3[i].tolist() for i, t in enumerate(tokens))


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    # probabilities 0.5, 0.3, 0.15, 0.05: top_p 0.7 allows the first two only
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(200, 1)
    gen = torch.Generator().manual_seed(1)
    tokens, _ = sample_next(logits, *_params(200, top_p=0.7), [None] * 200, gen)
    assert set(tokens.tolist()) == {0, 1}


def test_greedy_rows_take_the_argmax_and_report_untempered_logprobs() -> None:
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(3, 20, generator=gen)
    temperature = torch.tensor([0.0, 1.0, 0.0])
    tokens, lps = sample_next(
        logits, temperature, torch.zeros(3, dtype=torch.long), torch.ones(3), [None] * 3, gen
    )
    assert tokens[0] == logits[0].argmax() and tokens[2] == logits[2].argmax()
    assert torch.allclose(lps[0], torch.log_softmax(logits[0], -1).max())


def test_a_seeded_row_draws_the_same_tokens_whatever_shares_its_batch() -> None:
    logits = torch.randn(6, 30, generator=torch.Generator().manual_seed(3))
    shared = torch.Generator().manual_seed(4)

    def draw(rows: list[int]) -> list[int]:
        gens: list[torch.Generator | None] = [None] * len(rows)
        gens[0] = torch.Generator().manual_seed(99)
        picked = logits[rows]
        tokens, _ = sample_next(picked, *_params(len(rows)), gens, shared)
        return tokens.tolist()

    first = [draw([0, 1, 2])[0] for _ in range(1)]
    again = [draw([0, 5, 4, 3])[0] for _ in range(1)]
    assert first == again


def test_a_temperature_too_small_to_divide_by_is_greedy_and_spares_the_batch() -> None:
    # 1e-40 is a float32 subnormal: logits / 1e-40 overflow to inf and the draw of every row
    # would fail on NaN probabilities
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 20, generator=gen) * 10
    temperature = torch.tensor([1e-40, 1.0, 1e-6])
    tokens, lps = sample_next(
        logits, temperature, torch.zeros(3, dtype=torch.long), torch.ones(3), [None] * 3, gen
    )
    assert bool(torch.isfinite(lps).all())
    for row in (0, 2):
        assert int(tokens[row]) == int(logits[row].argmax())
        assert torch.isclose(lps[row], torch.log_softmax(logits[row], -1)[tokens[row]])
