"""The trainer's losses: pure functions on tensors, no model, no I/O.

Per-token arrays are ``[B, L]`` and aligned with a sample's ``token_ids``: position ``t`` holds
the log-probability of token ``t`` given tokens ``< t`` (position 0 has none and is never
trained). The policy loss for a token with advantage ``A`` is::

    r    = exp(logp - logp_old)                       (token)   or
           exp(mean_t(logp - logp_old))               (sequence, GSPO-like, one r per sample)
    pg   = -min(r * A, clip(r, 1 - eps_low, 1 + eps_high) * A)
    w    = min(exp(logp_old - logp_behaviour), tis_cap)      detached (truncated IS, stale data)
    loss = w * pg + kl_coef * k3(logp, logp_ref)

and a batch's loss is the sum over trained tokens divided by their count in the WHOLE batch
(all micro-batches, all ranks), so accumulation and sharding equal one big batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from astraflow.trainer.config import AdvantageScale, LossConfig

__all__ = [
    "PolicyLossSettings",
    "PolicyLossTerms",
    "clipped_surrogate",
    "group_advantages",
    "importance_ratio",
    "kl_k3",
    "m2po_cutoff",
    "m2po_keep_mask",
    "policy_token_loss",
    "sft_token_loss",
    "token_entropy",
    "token_logprobs",
    "truncated_is_weights",
]

RatioLevel = Literal["token", "sequence"]


def group_advantages(
    rewards: Tensor,
    group_index: Tensor,
    *,
    scale: AdvantageScale = "std",
    eps: float = 1e-6,
) -> Tensor:
    """Per-sample advantages normalised within each group (one GRPO group per index).

    ``std``: ``(r - mean_g) / (std_g + eps)`` with the population std of the group;
    ``mean``: ``r - mean_g`` (Dr.GRPO, no std); ``raw``: ``r`` unchanged.
    """
    rewards = rewards.to(torch.float64)
    if scale == "raw":
        return rewards.float()
    n_groups = int(group_index.max()) + 1 if group_index.numel() else 0
    counts = torch.zeros(n_groups, dtype=torch.float64).index_add_(
        0, group_index, torch.ones_like(rewards)
    )
    mean = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, group_index, rewards) / counts
    centred = rewards - mean[group_index]
    if scale == "mean":
        return centred.float()
    var = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, group_index, centred**2)
    std = (var / counts).sqrt()
    return (centred / (std[group_index] + eps)).float()


def token_logprobs(logits: Tensor, token_ids: Tensor, temperature: Tensor | float = 1.0) -> Tensor:
    """``[B, L]`` log-probs of each token under ``softmax(logits / T)`` of the position before.

    ``logits`` is ``[B, L, V]`` (position ``t`` predicts token ``t + 1``); ``temperature`` is
    a scalar or one value per row. Position 0 gets 0.
    """
    logits = logits[:, :-1].float()
    if isinstance(temperature, Tensor):
        logits = logits / temperature.to(logits.dtype).view(-1, 1, 1)
    elif temperature != 1.0:
        logits = logits / temperature
    targets = token_ids[:, 1:].unsqueeze(-1)
    picked = logits.gather(-1, targets).squeeze(-1)
    logp = picked - torch.logsumexp(logits, dim=-1)
    return torch.nn.functional.pad(logp, (1, 0))


@torch.no_grad()
def token_entropy(logits: Tensor, mask: Tensor, temperature: Tensor | float = 1.0) -> Tensor:
    """Entropies (nats) of ``softmax(logits / T)`` at the positions that predict the tokens
    where ``mask`` (``[B, L]``, aligned like :func:`token_logprobs`) is non-zero, in row-major
    order: 1-D, one per such token. No gradient; only those positions are computed."""
    picked = mask[:, 1:] != 0
    chosen = logits[:, :-1][picked].float()  # [N, V]
    if isinstance(temperature, Tensor):
        rows = temperature.to(chosen.dtype).view(-1, 1).expand(picked.shape)
        chosen = chosen / rows[picked].unsqueeze(-1)
    elif temperature != 1.0:
        chosen = chosen / temperature
    return torch.logsumexp(chosen, dim=-1) - (chosen.softmax(dim=-1) * chosen).sum(dim=-1)


def _sequence_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Per-row mean over masked positions (0 for a row with no masked position), ``[B]``."""
    count = mask.sum(dim=-1)
    return (values * mask).sum(dim=-1) / count.clamp(min=1)


def importance_ratio(
    logp: Tensor, logp_old: Tensor, mask: Tensor, level: RatioLevel = "token"
) -> Tensor:
    """``[B, L]`` ratio ``pi / pi_old``: per token, or per row as the geometric mean."""
    log_ratio = logp - logp_old
    if level == "token":
        return log_ratio.exp()
    seq = _sequence_mean(log_ratio, mask).exp()
    return seq.unsqueeze(-1).expand_as(logp)


def clipped_surrogate(
    ratio: Tensor, advantages: Tensor, eps_low: float, eps_high: float
) -> tuple[Tensor, Tensor]:
    """PPO-clip loss per token, and where the clip is active (the min picked the clipped term).

    ``advantages`` broadcasts against ``ratio`` (``[B, 1]`` or ``[B, L]``).
    """
    unclipped = ratio * advantages
    clipped = ratio.clamp(1.0 - eps_low, 1.0 + eps_high) * advantages
    loss = -torch.minimum(unclipped, clipped)
    return loss, clipped < unclipped


def truncated_is_weights(
    logp_old: Tensor,
    logp_behaviour: Tensor,
    mask: Tensor,
    cap: float,
    level: RatioLevel = "token",
) -> tuple[Tensor, Tensor]:
    """Detached TIS weights ``min(pi_old / pi_behaviour, cap)``, and where they were capped."""
    log_ratio = (logp_old - logp_behaviour).detach()
    if level == "sequence":
        log_ratio = _sequence_mean(log_ratio, mask).unsqueeze(-1).expand_as(logp_old)
    raw = log_ratio.exp()
    return raw.clamp(max=cap), raw > cap


def m2po_cutoff(squared_log_ratios: Tensor, threshold: float) -> float | None:
    """Smallest value to mask so the mean of the values left is at most ``threshold``.

    Sort descending; mask the top ``k`` for the smallest ``k`` that brings the mean of the rest
    under the threshold. Returns the k-th largest value (mask every value ``>=`` it), or None
    when nothing needs masking. Works on the values of a whole batch (all ranks gathered).
    """
    values = squared_log_ratios.detach().flatten().to(torch.float64)
    n = values.numel()
    if n == 0 or float(values.mean()) <= threshold:
        return None
    ordered, _ = values.sort(descending=True)
    rest_sums = ordered.sum() - ordered.cumsum(0)  # sum after masking the top k+1
    rest_counts = torch.arange(n - 1, -1, -1, dtype=torch.float64)
    rest_means = rest_sums / rest_counts.clamp(min=1)
    ok = (rest_means <= threshold).nonzero()
    k = int(ok[0]) if ok.numel() else n - 1  # masking everything leaves an empty mean of 0
    return float(ordered[k])


def m2po_keep_mask(
    logp_old: Tensor, logp_behaviour: Tensor, mask: Tensor, threshold: float
) -> Tensor:
    """M2PO second-moment trust region on one batch: ``mask`` minus the masked-out tokens."""
    sq = (logp_old - logp_behaviour).detach() ** 2
    keep = mask.bool()
    cutoff = m2po_cutoff(sq[keep], threshold)
    if cutoff is None:
        return keep
    return keep & (sq < cutoff)


def kl_k3(logp: Tensor, logp_ref: Tensor) -> Tensor:
    """Per-token k3 estimate of KL(pi || ref): ``exp(d) - d - 1`` with ``d = logp_ref - logp``."""
    d = logp_ref - logp
    return d.exp() - d - 1.0


def sft_token_loss(logp: Tensor) -> Tensor:
    """Per-token negative log-likelihood."""
    return -logp


@dataclass
class PolicyLossTerms:
    """One micro-batch's per-token loss and the per-token signals the metrics are built from."""

    loss: Tensor
    """``[B, L]`` loss per token (multiply by the mask, sum, divide by the batch token count)."""
    ratio: Tensor
    """PPO ratio ``pi / pi_old``."""
    clipped: Tensor
    """Where the PPO clip is active."""
    is_weight: Tensor
    """TIS weight (ones when TIS is off)."""
    is_capped: Tensor
    """Where the TIS weight hit its cap."""
    kl: Tensor | None
    """k3 KL to the reference, when a reference was given."""


@dataclass(frozen=True)
class PolicyLossSettings:
    """Knobs of :func:`policy_token_loss` (``LossConfig`` has the same fields)."""

    ratio_level: RatioLevel = "token"
    eps_low: float = 0.2
    eps_high: float = 0.2
    tis_cap: float | None = None
    kl_coef: float = 0.0


def policy_token_loss(
    logp: Tensor,
    logp_old: Tensor,
    logp_behaviour: Tensor,
    advantages: Tensor,
    mask: Tensor,
    settings: PolicyLossSettings | LossConfig,
    logp_ref: Tensor | None = None,
) -> PolicyLossTerms:
    """The clipped surrogate with TIS correction and an optional KL penalty, per token.

    ``advantages`` is ``[B]`` (one per sample) or ``[B, L]``; the KL term is added only when
    ``logp_ref`` is given.
    """
    s = settings
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)
    ratio = importance_ratio(logp, logp_old, mask, s.ratio_level)
    pg, clipped = clipped_surrogate(ratio, advantages, s.eps_low, s.eps_high)
    if s.tis_cap is not None:
        weight, capped = truncated_is_weights(logp_old, logp_behaviour, mask, s.tis_cap,
                                              s.ratio_level)  # fmt: skip
    else:
        weight, capped = torch.ones_like(pg), torch.zeros_like(pg, dtype=torch.bool)
    loss = weight * pg
    kl = None
    if logp_ref is not None:
        kl = kl_k3(logp, logp_ref)
        loss = loss + s.kl_coef * kl
    return PolicyLossTerms(loss, ratio.detach(), clipped, weight, capped, kl)
