"""One optimizer update on a tiny real model: direction, invariances and the statistics."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from astraflow.trainer.backends.local import LocalBackend
from astraflow.trainer.batching import Packing
from astraflow.trainer.config import LossConfig, OptimizerConfig
from astraflow.trainer.losses import token_logprobs
from astraflow.trainer.optim import build_optimizer
from astraflow.trainer.step import PolicyUpdate
from fixtures.trainer import text_sample, with_model_logprobs


def _update(model: torch.nn.Module, loss: LossConfig, budget: int = 4096, lr: float = 1e-2,
            ref: torch.nn.Module | None = None, sgd: bool = False) -> PolicyUpdate:  # fmt: skip
    backend = LocalBackend("cpu")
    model = backend.wrap(model)
    opt = (
        torch.optim.SGD(model.parameters(), lr=lr)
        if sgd  # linear in the gradient: Adam would amplify fp32 noise where |g| ~ eps
        else build_optimizer(model, OptimizerConfig(lr=lr))
    )
    return PolicyUpdate(backend, model, opt, loss, Packing(budget, 0), ref_model=ref)


def _scored(model: torch.nn.Module, tok: Any, rows: list[tuple[str, str, float, str]]) -> list[Any]:
    """On-policy samples (the model's own logprobs) of ``(prompt, completion, reward, group)``."""
    return [
        with_model_logprobs(model, text_sample(tok, p, c, reward=r, group=g)) for p, c, r, g in rows
    ]


def _assert_same_weights(model: torch.nn.Module, twin: torch.nn.Module, atol: float = 0.0) -> None:
    """Every parameter equal (``atol`` 0: bit for bit), named when one differs."""
    for (name, p), q in zip(model.named_parameters(), twin.parameters(), strict=True):
        assert torch.equal(p, q) if atol == 0 else torch.allclose(p, q, atol=atol), name


def _completion_logp(model: torch.nn.Module, tok: Any, prompt: str, completion: str) -> float:
    ids = tok.encode(prompt + completion, add_special_tokens=False)
    x = torch.tensor([ids])
    with torch.no_grad():
        logp = token_logprobs(model(input_ids=x).logits, x)
    return float(logp[0, len(ids) - len(completion) :].sum())


def test_grpo_step_raises_rewarded_and_lowers_penalised(
    tiny_model: torch.nn.Module, tiny_tokenizer: Any
) -> None:
    tok = tiny_tokenizer
    batch = [
        with_model_logprobs(tiny_model, text_sample(tok, "1+2=", "3", reward=1.0)),
        with_model_logprobs(tiny_model, text_sample(tok, "1+2=", "5", reward=0.0)),
    ]
    good0 = _completion_logp(tiny_model, tok, "1+2=", "3")
    bad0 = _completion_logp(tiny_model, tok, "1+2=", "5")
    update = _update(tiny_model, LossConfig(type="grpo"), lr=3e-3)
    x = torch.tensor([tok.encode("1+2=3", add_special_tokens=False)])
    with torch.no_grad():  # the policy's entropy where it chose the answer (before the update)
        before = torch.distributions.Categorical(logits=tiny_model(input_ids=x).logits[0, -2])
    stats = update.run(batch)
    assert stats["is_ratio_mean"] == pytest.approx(1.0, abs=1e-5)  # on-policy data
    assert stats["trained_tokens"] == 2 and stats["reward_mean"] == 0.5
    assert stats["entropy"] == pytest.approx(float(before.entropy()), rel=1e-4)
    good1 = _completion_logp(tiny_model, tok, "1+2=", "3")
    bad1 = _completion_logp(tiny_model, tok, "1+2=", "5")
    assert good1 > good0 + 1e-3
    assert bad1 < bad0 - 1e-3


def test_micro_batching_equals_one_big_batch(
    tiny_model: torch.nn.Module, tiny_tokenizer: Any
) -> None:
    rows = [("12+3=", "15", 1.0, "a"), ("12+3=", "16", 0.0, "a"), ("4+4=", "8", 1.0, "b"),
            ("4+4=", "9999", 0.5, "b"), ("4+4=", "0", 0.0, "b")]  # fmt: skip
    batch = _scored(tiny_model, tiny_tokenizer, rows)
    twin = copy.deepcopy(tiny_model)
    big = _update(tiny_model, LossConfig(tis_cap=2.0), budget=4096, lr=0.5, sgd=True)
    small = _update(twin, LossConfig(tis_cap=2.0), budget=9, lr=0.5, sgd=True)
    for _ in range(2):
        a, b = big.run(batch), small.run(batch)
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
    _assert_same_weights(tiny_model, twin, atol=1e-6)


def test_behaviour_logprobs_at_a_temperature_are_matched(
    tiny_model: torch.nn.Module, tiny_tokenizer: Any
) -> None:
    s = text_sample(tiny_tokenizer, "7+1=", "8", reward=1.0)
    t = text_sample(tiny_tokenizer, "7+1=", "9", reward=0.0)
    batch = [with_model_logprobs(tiny_model, x, temperature=0.7) for x in (s, t)]
    stats = _update(tiny_model, LossConfig()).run(batch)
    assert stats["is_ratio_max"] == pytest.approx(1.0, abs=1e-5)
    assert stats["is_ratio_min"] == pytest.approx(1.0, abs=1e-5)
    # the same logprobs read at temperature 1 would not match
    cold = [x.model_copy(update={"meta": {}}) for x in batch]
    assert _update(copy.deepcopy(tiny_model), LossConfig()).run(cold)["is_ratio_max"] != (
        pytest.approx(1.0, abs=1e-3)
    )


def test_stale_samples_get_tis_and_m2po(tiny_model: torch.nn.Module, tiny_tokenizer: Any) -> None:
    tok = tiny_tokenizer
    fresh = with_model_logprobs(tiny_model, text_sample(tok, "2+2=", "4444", reward=1.0))
    stale = fresh.model_copy(update={"logprobs": fresh.logprobs - 1.5 * fresh.loss_mask})
    other = with_model_logprobs(tiny_model, text_sample(tok, "2+2=", "5555", reward=0.0))
    loss = LossConfig(tis_cap=2.0, m2po_threshold=0.2)
    stats = _update(tiny_model, loss).run([stale, other], trainer_version=1)
    # stale tokens: ratio e^1.5 > 2; squared log-ratio 2.25: masking 3 of the 4 leaves a
    # mean of 2.25 / 5 > 0.2, so all 4 go (and no kept token is capped)
    assert stats["is_ratio_max"] == pytest.approx(float(torch.tensor(1.5).exp()), rel=1e-4)
    assert stats["m2po_masked_frac"] == pytest.approx(0.5)
    assert stats["trained_tokens"] == 4 and stats["is_capped_frac"] == 0.0
    assert stats["staleness_mean"] == 1.0


def test_kl_to_reference_starts_at_zero_and_grows(
    tiny_model: torch.nn.Module, tiny_tokenizer: Any
) -> None:
    ref = copy.deepcopy(tiny_model).requires_grad_(False)
    batch = [
        with_model_logprobs(tiny_model, text_sample(tiny_tokenizer, "3+3=", "6", reward=1.0)),
        with_model_logprobs(tiny_model, text_sample(tiny_tokenizer, "3+3=", "7", reward=0.0)),
    ]
    update = _update(tiny_model, LossConfig(kl_coef=0.1), ref=ref)
    assert update.run(batch)["kl"] == pytest.approx(0.0, abs=1e-7)
    assert update.run(batch)["kl"] > 1e-6


def test_sft_lowers_nll(tiny_model: torch.nn.Module, tiny_tokenizer: Any) -> None:
    batch = [text_sample(tiny_tokenizer, "5+5=", "10"), text_sample(tiny_tokenizer, "1+1=", "2")]
    update = _update(tiny_model, LossConfig(type="sft"), lr=1e-2)
    first = update.run(batch)["loss"]
    for _ in range(20):
        last = update.run(batch)["loss"]
    assert last < first * 0.5


def _rows_seen(model: torch.nn.Module) -> list[int]:
    """Rows each forward of ``model`` computed (a hook on its input embeddings)."""
    seen: list[int] = []
    embed = model.get_input_embeddings()  # type: ignore[operator]
    embed.register_forward_hook(lambda _m, args, _out: seen.append(int(args[0].shape[0])))
    return seen


def test_rows_with_zero_advantage_are_not_computed_and_the_update_is_the_same(
    tiny_model: torch.nn.Module, tiny_tokenizer: Any
) -> None:
    rows = [("12+3=", "15", 1.0, "mixed"), ("12+3=", "16", 0.0, "mixed"),
            ("4+4=", "8", 1.0, "solved"), ("4+4=", "8", 1.0, "solved"),
            ("9+9=", "1", 0.0, "failed"), ("9+9=", "17", 0.0, "failed"),
            ("9+9=", "0", 0.0, "failed")]  # fmt: skip
    batch = _scored(tiny_model, tiny_tokenizer, rows)
    twin = copy.deepcopy(tiny_model)
    skips = _update(tiny_model, LossConfig(tis_cap=2.0), lr=0.5, sgd=True)
    computes = _update(twin, LossConfig(tis_cap=2.0, skip_zero_advantage=False), lr=0.5, sgd=True)
    rows_skipping, rows_computing = _rows_seen(tiny_model), _rows_seen(twin)
    for _ in range(2):
        a, b = skips.run(batch), computes.run(batch)
        # the objective and its gradient are those of the whole batch
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
        assert a["trained_tokens"] == b["trained_tokens"] == sum(s.num_generated for s in batch)
        assert a["zero_advantage_frac"] == pytest.approx(5 / 7)
        assert b["zero_advantage_frac"] == 0.0
    assert rows_skipping == [2, 2] and rows_computing == [7, 7]
    _assert_same_weights(tiny_model, twin, atol=1e-6)


def test_a_batch_with_no_advantage_still_steps_the_optimizer(
    tiny_model: torch.nn.Module, tiny_tokenizer: Any
) -> None:
    """Adam moves the weights on its momentum after a zero gradient: skipping every row must
    not skip that step."""
    tok = tiny_tokenizer
    mixed = _scored(tiny_model, tok, [("2+5=", "7", 1.0, "m"), ("2+5=", "8", 0.0, "m")])
    flat = _scored(tiny_model, tok, [("3+1=", "4", 1.0, "f")] * 3)
    twin = copy.deepcopy(tiny_model)
    skips = _update(tiny_model, LossConfig(), lr=1e-2)
    computes = _update(twin, LossConfig(skip_zero_advantage=False), lr=1e-2)
    rows = _rows_seen(tiny_model)
    skips.run(mixed), computes.run(mixed)
    before = [p.detach().clone() for p in tiny_model.parameters()]
    stats = skips.run(flat)
    computes.run(flat)
    assert stats["zero_advantage_frac"] == pytest.approx(2 / 3) and stats["grad_norm"] == 0.0
    assert rows == [2, 1]  # one row kept so the step runs
    moved = zip(tiny_model.parameters(), before, strict=True)
    assert any(not torch.equal(p, b) for p, b in moved)
    _assert_same_weights(tiny_model, twin)


def test_zero_advantage_rows_are_computed_when_a_term_needs_every_token(
    tiny_model: torch.nn.Module, tiny_tokenizer: Any
) -> None:
    rows = [("6+1=", "7", 1.0, "a"), ("6+1=", "7", 1.0, "a"), ("6+2=", "8", 1.0, "b"),
            ("6+2=", "9", 0.0, "b")]  # fmt: skip
    batch = _scored(tiny_model, tiny_tokenizer, rows)
    ref = copy.deepcopy(tiny_model).requires_grad_(False)
    with_kl = _update(copy.deepcopy(tiny_model), LossConfig(kl_coef=0.1), ref=ref).run(batch)
    m2po = _update(copy.deepcopy(tiny_model), LossConfig(m2po_threshold=0.5)).run(batch)
    assert with_kl["zero_advantage_frac"] == 0.0 and m2po["zero_advantage_frac"] == 0.0
