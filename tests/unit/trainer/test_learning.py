"""The quickstart recipe learns, with the trainer's own
warm-up and update code in a plain in-process loop: noisy-label SFT on single-digit addition,
then GRPO (16 prompts x 8 samples, lr 3e-4, betas (0.9, 0.99), clip 1.0, no KL). Sampling is a
small seeded loop over the model's logits, recording behaviour logprobs like a rollout node."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest
import torch

from astraflow.models import build_model
from astraflow.records import Sample
from astraflow.trainer.backends.local import LocalBackend
from astraflow.trainer.batching import Packing
from astraflow.trainer.config import LossConfig, OptimizerConfig
from astraflow.trainer.optim import build_optimizer
from astraflow.trainer.step import PolicyUpdate
from astraflow.trainer.warmup import sft_warmup
from fixtures.models import tiny_spec

MAX_NEW = 3


def _noisy_pairs(rng: random.Random, n: int) -> list[tuple[str, str]]:
    """Single-digit sums whose label is right 30% of the time (else a random 0-18)."""
    out = []
    for _ in range(n):
        a, b = rng.randrange(10), rng.randrange(10)
        label = a + b if rng.random() < 0.3 else rng.randrange(19)
        out.append((f"{a}+{b}=", str(label)))
    return out


@torch.no_grad()
def _rollout(model: Any, tok: Any, prompts: list[tuple[int, int]], group: int,
             gen: torch.Generator, version: int) -> list[Sample]:  # fmt: skip
    """Sample ``group`` completions per prompt; reward 1 for the exact sum before EOS."""
    texts = [f"{a}+{b}=" for a, b in prompts for _ in range(group)]
    ids = torch.tensor([tok.encode(t, add_special_tokens=False) for t in texts])
    plen = ids.shape[1]
    logps = []
    for _ in range(MAX_NEW):
        logits = model(input_ids=ids).logits[:, -1].float()
        dist = torch.log_softmax(logits, dim=-1)
        nxt = torch.multinomial(dist.exp(), 1, generator=gen)
        logps.append(dist.gather(1, nxt))
        ids = torch.cat([ids, nxt], dim=1)
    lp = torch.cat(logps, dim=1)
    samples = []
    for i, row in enumerate(ids.tolist()):
        gen_ids = row[plen:]
        eos = gen_ids.index(tok.eos_token_id) if tok.eos_token_id in gen_ids else None
        n = MAX_NEW if eos is None else eos + 1  # trained: up to and including EOS
        a, b = prompts[i // group]
        reward = float(tok.decode(gen_ids[:eos]) == str(a + b))
        tokens = np.asarray(row[: plen + n], dtype=np.int32)
        mask = np.r_[np.zeros(plen), np.ones(n)].astype(np.uint8)
        samples.append(Sample(
            policy="p", task_id=f"t{i // group}", group_id=f"v{version}-{i // group}",
            token_ids=tokens, loss_mask=mask,
            logprobs=np.r_[np.zeros(plen), lp[i, :n].numpy()].astype(np.float32),
            versions=np.where(mask == 1, version, -1).astype(np.int32), reward=reward,
        ))  # fmt: skip
    return samples


@pytest.mark.slow
def test_noisy_sft_then_grpo_raises_reward() -> None:
    torch.manual_seed(0)
    spec = tiny_spec(hidden=64, layers=2, seed=0)
    from astraflow.models import build_tokenizer

    tok = build_tokenizer(spec)
    model = build_model(spec, tok).float()
    rng = random.Random(0)
    sft_warmup(model, tok, _noisy_pairs(rng, 4000), steps=300, lr=3e-3, batch_size=64, seed=0)
    backend = LocalBackend("cpu")
    opt = build_optimizer(model, OptimizerConfig(lr=3e-4, betas=(0.9, 0.99)))
    update = PolicyUpdate(backend, model, opt, LossConfig(type="grpo"), Packing(4096, 0),
                          grad_clip=1.0)  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    rewards = []
    for step in range(250):
        prompts = [(rng.randrange(10), rng.randrange(10)) for _ in range(16)]
        model.eval()
        batch = _rollout(model, tok, prompts, 8, gen, step)
        stats = update.run(batch, step)
        assert stats["is_ratio_mean"] == pytest.approx(1.0, abs=1e-3)  # on-policy
        rewards.append(stats["reward_mean"])
    first, last = float(np.mean(rewards[:50])), float(np.mean(rewards[-50:]))
    assert first < 0.34  # noisy SFT alone cannot do better than ~0.34 expected reward
    assert last > first + 0.1, (first, last)
