"""One optimizer update on one batch: the same code for every backend.

    samples ─► rows (whole-group advantages) ─► [drop rows with advantage 0: no gradient]
       ─► pack by token budget ─► this rank's share
       ─► [M2PO only: no-grad pass → old logprobs → batch-wide mask]
       ─► per micro-batch: forward → per-token loss → sum / batch token count → backward
       ─► clip grad norm ─► optimizer.step ─► scheduler.step ─► stats (reduced over ranks)

With one update per batch the "old" policy of the PPO ratio is the current weights, so its
logprobs are the detached logprobs of the same forward (a separate pass only for M2PO, whose
mask needs the whole batch first); TIS corrects behaviour → old.

A row whose advantage is exactly 0 (its group's rewards all equal) contributes exactly 0 to
the policy gradient when there is no KL term, so it is not computed at all (``skip_zero_
advantage``); its tokens still count in the batch token count that normalises the loss, so the
gradient, and hence the update, is the one of the whole batch. One row is always kept so that an
all-zero batch still steps the optimizer (Adam's moments decay as with a zero gradient).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections import Counter
from collections.abc import Sequence

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from astraflow.records import Sample
from astraflow.trainer import losses
from astraflow.trainer.backends.base import TrainBackend
from astraflow.trainer.batching import (
    MicroBatch,
    Packing,
    TrainRow,
    assign_to_ranks,
    collate,
    pack,
    prepare_rows,
)
from astraflow.trainer.config import LossConfig

__all__ = ["PolicyUpdate"]

# Per-rank sums reduced once per step, in this order.
_SUMS = (
    "loss",
    "kl",
    "entropy",
    "clipped",
    "is_capped",
    "is_ratio",
    "is_ratio_sq",
    "m2po_masked",
    "ntok",
)
_EXTREMES = ("is_ratio_max", "neg_is_ratio_min")


class PolicyUpdate:
    """Runs one optimizer update per call on the backend's model (all ranks call together)."""

    def __init__(
        self,
        backend: TrainBackend,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        loss: LossConfig,
        packing: Packing,
        *,
        grad_clip: float | None = None,
        scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
        ref_model: nn.Module | None = None,
    ) -> None:
        if loss.kl_coef > 0 and ref_model is None and loss.type != "sft":
            raise ValueError("loss.kl_coef > 0 needs a reference model")
        self.backend = backend
        self.model = model
        self.optimizer = optimizer
        self.loss = loss
        self.packing = packing
        self.grad_clip = grad_clip
        self.scheduler = scheduler
        self.ref_model = ref_model if loss.kl_coef > 0 else None

    def run(self, samples: Sequence[Sample], trainer_version: int = 0) -> dict[str, float]:
        """Train on ``samples`` (the whole batch, identical on every rank); returns metrics."""
        start = time.perf_counter()
        rows = prepare_rows(
            samples,
            trainer_version=trainer_version,
            scale=self.loss.advantage_scale,
            eps=self.loss.advantage_eps,
            max_length=self.packing.max_length,
        )
        use_m2po = self.loss.type != "sft" and self.loss.m2po_threshold is not None
        trained, skipped_tokens = rows, 0.0
        if self._skips_zero_advantage(use_m2po):
            trained = [r for r in rows if r.advantage != 0.0] or rows[:1]
            skipped_tokens = float(sum(int(r.loss_mask.sum()) for r in rows)) - float(
                sum(int(r.loss_mask.sum()) for r in trained)
            )
        bins = pack([r.length for r in trained], self.packing.token_budget)
        mine = assign_to_ranks(bins, self.backend.rank, self.backend.world_size)
        pad = self.packing.pad_id
        mbs = [collate([trained[i] for i in b], pad).to(self.backend.device) for b in mine]
        self.model.train()
        old: list[Tensor | None] = [None] * len(mbs)
        keeps = [mb.loss_mask for mb in mbs]
        if use_m2po:
            recomputed = [self._logprobs(self.model, mb) for mb in mbs]
            keeps = self._m2po_keep(mbs, recomputed)
            old = list(recomputed)
        local_tokens = sum(float(k.sum()) for k in keeps)
        # identical on every rank: the skipped rows' tokens are added after the reduction
        ntok = float(self.backend.all_reduce_sum(torch.tensor([local_tokens]))[0]) + skipped_tokens
        # gradients are averaged over ranks: scale by world size to get the batch sum
        scale = self.backend.world_size / max(ntok, 1.0)
        acc = torch.zeros(len(_SUMS), dtype=torch.float64)
        ext = torch.full((len(_EXTREMES),), -float("inf"), dtype=torch.float64)
        for mb, lo, keep in zip(mbs, old, keeps, strict=True):
            self._micro_step(mb, lo, keep, scale, acc, ext)
        grad_norm = self._clip()
        self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        stats = self._reduce(acc, ext, skipped_tokens)
        stats.update(_batch_stats(samples, rows))
        stats["zero_advantage_frac"] = (len(rows) - len(trained)) / max(1, len(rows))
        stats["grad_norm"] = grad_norm
        stats["lr"] = float(self.optimizer.param_groups[0]["lr"])
        stats["step_s"] = time.perf_counter() - start
        return stats

    # ------------------------------------------------------------------ pieces

    def _skips_zero_advantage(self, use_m2po: bool) -> bool:
        """Whether rows with advantage 0 can be left out without changing the update: a
        policy loss with no KL term (its gradient is proportional to the advantage) and no
        M2PO mask (which is cut over every token of the batch)."""
        return (
            self.loss.skip_zero_advantage
            and self.loss.type != "sft"
            and self.ref_model is None
            and not use_m2po
        )

    def _autocast(self) -> contextlib.AbstractContextManager[None]:
        dtype = self.backend.autocast_dtype
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.backend.device.type, dtype=dtype)

    def _logits(self, model: nn.Module, mb: MicroBatch, grad: bool = False) -> Tensor:
        ctx = contextlib.nullcontext() if grad else torch.no_grad()
        with ctx, self._autocast():
            logits: Tensor = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits
        return logits

    def _logprobs(self, model: nn.Module, mb: MicroBatch) -> Tensor:
        logits = self._logits(model, mb)
        return losses.token_logprobs(logits, mb.input_ids, mb.temperature)

    def _m2po_keep(self, mbs: list[MicroBatch], old: list[Tensor]) -> list[Tensor]:
        """Batch-wide M2PO masks: gather every rank's squared log-ratios, cut once."""
        sq = [((lo - mb.behaviour_logprobs) ** 2) for mb, lo in zip(mbs, old, strict=True)]
        local = torch.cat([s[mb.loss_mask.bool()] for s, mb in zip(sq, mbs, strict=True)])
        gathered = _all_gather_1d(self.backend, local.double())
        threshold = self.loss.m2po_threshold
        assert threshold is not None
        cutoff = losses.m2po_cutoff(gathered, threshold)
        if cutoff is None:
            return [mb.loss_mask for mb in mbs]
        return [mb.loss_mask * (s < cutoff).float() for s, mb in zip(sq, mbs, strict=True)]

    def _micro_step(
        self,
        mb: MicroBatch,
        logp_old: Tensor | None,
        keep: Tensor,
        scale: float,
        acc: Tensor,
        ext: Tensor,
    ) -> None:
        logits = self._logits(self.model, mb, grad=True)
        logp = losses.token_logprobs(logits, mb.input_ids, mb.temperature)
        if self.loss.type == "sft":
            per_token = losses.sft_token_loss(logp)
            kl = None
        else:
            old = logp_old if logp_old is not None else logp.detach()
            ref = self._logprobs(self.ref_model, mb) if self.ref_model is not None else None
            terms = losses.policy_token_loss(
                logp,
                old,
                mb.behaviour_logprobs,
                mb.advantages,
                mb.loss_mask,
                self.loss,
                logp_ref=ref,
            )
            per_token, kl = terms.loss, terms.kl
            _accumulate_policy(acc, ext, terms, old, mb, keep)
        total = (per_token * keep).sum()
        torch.autograd.backward(total * scale)
        with torch.no_grad():
            acc[_SUMS.index("loss")] += float(total.detach())
            acc[_SUMS.index("ntok")] += float(keep.sum())
            entropy = losses.token_entropy(logits.detach(), keep, mb.temperature)
            acc[_SUMS.index("entropy")] += float(entropy.sum())
            if kl is not None:
                acc[_SUMS.index("kl")] += float((kl.detach() * keep).sum())

    def _clip(self) -> float:
        params = [p for p in self.model.parameters() if p.grad is not None]
        max_norm = self.grad_clip if self.grad_clip is not None else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        return float(norm)

    def _reduce(self, acc: Tensor, ext: Tensor, skipped_tokens: float = 0.0) -> dict[str, float]:
        """Batch figures from the per-rank sums. ``loss`` is the batch objective (skipped rows
        add 0 to its sum and their tokens to its count); the token figures cover the tokens
        computed."""
        sums = self.backend.all_reduce_sum(acc).cpu()
        extremes = _all_gather_1d(self.backend, ext).view(-1, len(_EXTREMES)).max(dim=0).values
        s = dict(zip(_SUMS, sums.tolist(), strict=True))
        n = max(s["ntok"], 1.0)
        out = {
            "loss": s["loss"] / max(s["ntok"] + skipped_tokens, 1.0),
            "entropy": s["entropy"] / n,
            "trained_tokens": s["ntok"] + skipped_tokens,
        }
        if self.loss.type != "sft":
            beh = max(s["ntok"] + s["m2po_masked"], 1.0)
            mean = s["is_ratio"] / beh
            out |= {
                "clip_frac": s["clipped"] / n,
                "is_capped_frac": s["is_capped"] / n,
                "is_ratio_mean": mean,
                "is_ratio_std": max(0.0, s["is_ratio_sq"] / beh - mean * mean) ** 0.5,
                "is_ratio_max": float(extremes[0]) if s["is_ratio"] else 1.0,
                "is_ratio_min": -float(extremes[1]) if s["is_ratio"] else 1.0,
                "m2po_masked_frac": s["m2po_masked"] / beh,
            }
            if self.ref_model is not None:
                out["kl"] = s["kl"] / n
        return out


def _accumulate_policy(
    acc: Tensor,
    ext: Tensor,
    terms: losses.PolicyLossTerms,
    old: Tensor,
    mb: MicroBatch,
    keep: Tensor,
) -> None:
    """Add this micro-batch's policy signals to the per-rank sums."""
    with torch.no_grad():
        mask = mb.loss_mask.bool()
        kept = keep.bool()
        is_ratio = (old - mb.behaviour_logprobs).exp()[mask].double()
        acc[_SUMS.index("clipped")] += float(terms.clipped[kept].sum())
        acc[_SUMS.index("is_capped")] += float(terms.is_capped[kept].sum())
        acc[_SUMS.index("is_ratio")] += float(is_ratio.sum())
        acc[_SUMS.index("is_ratio_sq")] += float((is_ratio**2).sum())
        acc[_SUMS.index("m2po_masked")] += float((mask & ~kept).sum())
        if is_ratio.numel():
            ext[0] = max(float(ext[0]), float(is_ratio.max()))
            ext[1] = max(float(ext[1]), -float(is_ratio.min()))


def _all_gather_1d(backend: TrainBackend, local: Tensor) -> Tensor:
    """Concatenate every rank's 1-D tensor (rank order) using only ``all_reduce_sum``."""
    if backend.world_size == 1:
        return local.cpu()
    sizes = torch.zeros(backend.world_size, dtype=torch.float64)
    sizes[backend.rank] = local.numel()
    sizes = backend.all_reduce_sum(sizes).cpu().long()
    width = int(sizes.max())
    buf = torch.zeros(backend.world_size, width, dtype=torch.float64)
    buf[backend.rank, : local.numel()] = local.detach().cpu().double()
    buf = backend.all_reduce_sum(buf).cpu()  # other ranks' rows are zeros: a sum is a gather
    return torch.cat([buf[r, : int(sizes[r])] for r in range(backend.world_size)])


def _batch_stats(samples: Sequence[Sample], rows: Sequence[TrainRow]) -> dict[str, float]:
    """Reward, advantage, size, staleness and per-pool sample figures of the batch (identical
    on all ranks)."""
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float64)
    staleness = Counter(r.staleness for r in rows)
    out = {
        "samples": float(len(samples)),
        "groups": float(len({(s.policy, s.group_id) for s in samples})),
        "tokens": float(sum(s.num_tokens for s in samples)),
        "reward_mean": float(rewards.mean()),
        "reward_std": float(rewards.std(unbiased=False)),
        "advantage_abs_mean": sum(abs(r.advantage) for r in rows) / max(1, len(rows)),
        "staleness_mean": sum(k * v for k, v in staleness.items()) / max(1, len(rows)),
        "staleness_max": float(max(staleness, default=0)),
    }
    for k, v in sorted(staleness.items()):
        out[f"staleness/{k}"] = float(v)
    pools = Counter(str(s.meta.get("pool", "")) for s in samples)  # rollout pool (node label)
    out |= {f"pool/{name}": float(n) for name, n in sorted(pools.items()) if name}
    out |= _sample_metrics(samples)
    return out


def _sample_metrics(samples: Sequence[Sample]) -> dict[str, float]:
    """Means of the per-sample figures workflows put in ``meta['metrics']`` (e.g. ``env/*``)."""
    values: dict[str, list[float]] = {}
    for sample in samples:
        figures = sample.meta.get("metrics")
        if not isinstance(figures, dict):
            continue
        for name, value in figures.items():
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if number and math.isfinite(value):
                values.setdefault(str(name), []).append(float(value))
    return {name: sum(v) / len(v) for name, v in sorted(values.items())}
