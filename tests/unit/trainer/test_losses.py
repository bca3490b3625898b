"""Each loss piece against values worked out by hand on small tensors."""

from __future__ import annotations

import math

import pytest
import torch

from astraflow.trainer import losses
from astraflow.trainer.losses import PolicyLossSettings


def test_group_advantages_use_each_whole_group() -> None:
    rewards = torch.tensor([1.0, 2.0, 0.0, 2.0, 5.0])
    groups = torch.tensor([0, 1, 0, 1, 1])  # A = {1, 0}; B = {2, 2, 5}
    std = losses.group_advantages(rewards, groups, scale="std", eps=0.0)
    r2 = math.sqrt(2.0)  # B: mean 3, population std sqrt(2); A: mean 0.5, std 0.5
    assert std.tolist() == pytest.approx([1.0, -1 / r2, -1.0, -1 / r2, 2 / r2])
    mean = losses.group_advantages(rewards, groups, scale="mean")
    assert mean.tolist() == pytest.approx([0.5, -1.0, -0.5, -1.0, 2.0])
    raw = losses.group_advantages(rewards, groups, scale="raw")
    assert raw.tolist() == pytest.approx(rewards.tolist())


def test_group_advantages_zero_variance_group_gives_zero() -> None:
    adv = losses.group_advantages(torch.tensor([3.0, 3.0, 3.0]), torch.tensor([0, 0, 0]))
    assert adv.tolist() == [0.0, 0.0, 0.0]
    eps = losses.group_advantages(torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), eps=0.5)
    assert eps.tolist() == pytest.approx([0.5, -0.5])  # 0.5 / (0.5 + 0.5)


def test_token_logprobs_shift_and_temperature() -> None:
    ln3 = math.log(3.0)
    logits = torch.tensor([[[0.0, ln3], [0.0, 0.0], [5.0, -5.0]]])  # [B=1, L=3, V=2]
    ids = torch.tensor([[0, 1, 0]])
    logp = losses.token_logprobs(logits, ids)
    # token 1 from softmax([0, ln 3]) = 3/4; token 0 from softmax([0, 0]) = 1/2
    assert logp.tolist()[0] == pytest.approx([0.0, math.log(0.75), math.log(0.5)])
    hot = losses.token_logprobs(logits, ids, torch.tensor([2.0]))
    s3 = math.sqrt(3.0)  # softmax([0, ln3 / 2]) = [1, sqrt 3] / (1 + sqrt 3)
    assert hot.tolist()[0] == pytest.approx([0.0, math.log(s3 / (1 + s3)), math.log(0.5)])


def test_token_entropy_shift_and_temperature() -> None:
    ln3 = math.log(3.0)
    logits = torch.tensor([[[0.0, ln3], [0.0, 0.0], [5.0, -5.0]]])  # [B=1, L=3, V=2]

    def h(p: float) -> float:  # entropy of a two-way distribution (p, 1 - p), in nats
        return -(p * math.log(p) + (1 - p) * math.log(1 - p))

    every = torch.ones(1, 3)  # the tokens at positions 1 and 2: predicted from (1/4, 3/4), uniform
    assert losses.token_entropy(logits, every).tolist() == pytest.approx([h(0.25), math.log(2)])
    s3 = math.sqrt(3.0)  # at T = 2: softmax([0, ln3 / 2]) = [1, sqrt 3] / (1 + sqrt 3)
    hot = losses.token_entropy(logits, every, torch.tensor([2.0]))
    assert hot.tolist() == pytest.approx([h(1 / (1 + s3)), math.log(2)])
    assert losses.token_entropy(logits, torch.tensor([[1.0, 0.0, 1.0]])).tolist() == pytest.approx(
        [math.log(2)]
    )
    assert not losses.token_entropy(logits.requires_grad_(), every).requires_grad


def test_importance_ratio_token_and_sequence() -> None:
    logp = torch.tensor([[0.0, -1.0, -2.0, -3.0]])
    old = torch.tensor([[0.0, -1.2, -1.6, 0.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0, 0.0]])
    tok = losses.importance_ratio(logp, old, mask, "token")
    assert tok.tolist()[0] == pytest.approx([1.0, math.exp(0.2), math.exp(-0.4), math.exp(-3)])
    seq = losses.importance_ratio(logp, old, mask, "sequence")
    # geometric mean over the masked tokens only: exp((0.2 - 0.4) / 2)
    assert seq.tolist()[0] == pytest.approx([math.exp(-0.1)] * 4)


def test_clipped_surrogate_asymmetric_clip() -> None:
    ratio = torch.tensor([0.5, 0.9, 1.1, 1.5])
    pos, pos_clipped = losses.clipped_surrogate(ratio, torch.tensor(1.0), 0.2, 0.28)
    assert pos.tolist() == pytest.approx([-0.5, -0.9, -1.1, -1.28])
    assert pos_clipped.tolist() == [False, False, False, True]
    neg, neg_clipped = losses.clipped_surrogate(ratio, torch.tensor(-1.0), 0.2, 0.28)
    assert neg.tolist() == pytest.approx([0.8, 0.9, 1.1, 1.5])
    assert neg_clipped.tolist() == [True, False, False, False]


def test_truncated_is_weights_are_capped_and_detached() -> None:
    old = torch.log(torch.tensor([[0.5, 3.0, 1.5]])).requires_grad_(True)
    beh = torch.zeros(1, 3)
    mask = torch.ones(1, 3)
    w, capped = losses.truncated_is_weights(old, beh, mask, cap=2.0)
    assert w.tolist()[0] == pytest.approx([0.5, 2.0, 1.5])
    assert capped.tolist()[0] == [False, True, False]
    assert not w.requires_grad
    seq, _ = losses.truncated_is_weights(old, beh, mask, cap=10.0, level="sequence")
    assert seq.tolist()[0] == pytest.approx([(0.5 * 3.0 * 1.5) ** (1 / 3)] * 3)


def test_m2po_masks_largest_squared_log_ratios_until_under_threshold() -> None:
    # squared log-ratios 0.01, 0.01, 0.25, 0.04, 1.0 and one untrained token (mask 0)
    old = torch.tensor([[0.1, -0.1, 0.5, 0.2, 1.0, 9.0]])
    beh = torch.zeros(1, 6)
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0, 1.0, 0.0]])
    # mean 0.262; without 1.0 it is 0.0775 > 0.05; without 1.0 and 0.25 it is 0.02 <= 0.05
    keep = losses.m2po_keep_mask(old, beh, mask, threshold=0.05)
    assert keep.tolist()[0] == [True, True, False, True, False, False]
    assert losses.m2po_cutoff(torch.tensor([0.01, 0.01, 0.25, 0.04, 1.0]), 0.05) == 0.25
    assert losses.m2po_cutoff(torch.tensor([0.01, 0.04]), 0.05) is None
    loose = losses.m2po_keep_mask(old, beh, mask, threshold=0.3)
    assert loose.tolist()[0] == [True, True, True, True, True, False]


def test_kl_k3() -> None:
    logp = torch.log(torch.tensor([0.5, 0.3]))
    ref = torch.log(torch.tensor([0.25, 0.3]))
    kl = losses.kl_k3(logp, ref)
    assert kl.tolist() == pytest.approx([0.5 - math.log(0.5) - 1.0, 0.0])


def test_sft_token_loss() -> None:
    assert losses.sft_token_loss(torch.tensor([-0.5, -2.0])).tolist() == [0.5, 2.0]


def test_policy_loss_value_and_gradient_with_tis_and_kl() -> None:
    logp = torch.tensor([[0.0, math.log(0.5)]], requires_grad=True)
    old = logp.detach()  # one update per batch: old = current weights
    beh = torch.tensor([[0.0, math.log(0.5) - 0.3]])  # stale behaviour: ratio exp(0.3)
    ref = torch.tensor([[0.0, math.log(0.25)]])
    mask = torch.tensor([[0.0, 1.0]])
    settings = PolicyLossSettings(tis_cap=1.2, kl_coef=0.1)
    terms = losses.policy_token_loss(logp, old, beh, torch.tensor([2.0]), mask, settings, ref)
    k3 = 0.5 - math.log(0.5) - 1.0
    # pg = -ratio * A = -2; TIS weight min(exp(0.3), 1.2) = 1.2
    assert float(terms.loss[0, 1].detach()) == pytest.approx(1.2 * -2.0 + 0.1 * k3)
    assert bool(terms.is_capped[0, 1]) and float(terms.is_weight[0, 1]) == pytest.approx(1.2)
    (terms.loss * mask).sum().backward()
    assert logp.grad is not None
    # d/dlogp: -A * w (ratio = 1) + kl_coef * (1 - exp(ref - logp)) = -2.4 + 0.1 * 0.5
    assert float(logp.grad[0, 1]) == pytest.approx(-2.4 + 0.05)


def test_sequence_level_gradient_per_token_equals_advantage_at_ratio_one() -> None:
    logp = torch.tensor([[0.0, -0.7, -1.2, -0.1]], requires_grad=True)
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0]])
    settings = PolicyLossSettings(ratio_level="sequence")
    terms = losses.policy_token_loss(
        logp, logp.detach(), logp.detach(), torch.tensor([1.5]), mask, settings
    )
    (terms.loss * mask).sum().backward()
    assert logp.grad is not None
    assert logp.grad.tolist()[0] == pytest.approx([0.0, -1.5, -1.5, -1.5])


def test_clip_blocks_gradient_beyond_the_trust_region() -> None:
    logp = torch.tensor([[0.0, 0.5]], requires_grad=True)  # ratio e^0.5 > 1 + 0.28
    old = torch.zeros(1, 2)
    mask = torch.tensor([[0.0, 1.0]])
    terms = losses.policy_token_loss(
        logp, old, old, torch.tensor([1.0]), mask, PolicyLossSettings(eps_high=0.28)
    )
    (terms.loss * mask).sum().backward()
    assert logp.grad is not None and float(logp.grad[0, 1]) == 0.0
    assert bool(terms.clipped[0, 1])
