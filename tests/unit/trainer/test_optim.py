"""The optimizer: torch's fused AdamW kernel for CPU parameters, the default elsewhere."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from astraflow.trainer.config import OptimizerConfig
from astraflow.trainer.optim import build_optimizer


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 16))


def _steps(model: nn.Module, opt: torch.optim.Optimizer, n: int) -> None:
    data = torch.Generator().manual_seed(1)
    for _ in range(n):
        ids = torch.randint(0, 16, (4, 5), generator=data)
        loss = nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()


def test_cpu_parameters_are_stepped_by_the_fused_kernel_as_adamw_would() -> None:
    config = OptimizerConfig(lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1)
    fused_model = _model()
    reference = copy.deepcopy(fused_model)
    opt = build_optimizer(fused_model, config)
    assert opt.defaults["fused"] is True
    ref_opt = torch.optim.AdamW(
        reference.parameters(), lr=1e-2, betas=(0.9, 0.99), eps=config.eps, weight_decay=0.1,
        foreach=False,
    )  # fmt: skip
    _steps(fused_model, opt, 20)
    _steps(reference, ref_opt, 20)
    for (name, got), want in zip(
        fused_model.named_parameters(), reference.parameters(), strict=True
    ):
        assert not torch.equal(got, _model().state_dict()[name])  # it moved
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    state = opt.state_dict()  # the same checkpoint format: loads into the unfused one
    ref_opt.load_state_dict(state)


def test_parameters_off_the_cpu_keep_torchs_default() -> None:
    model = _model().to("meta")
    opt = build_optimizer(model, OptimizerConfig(lr=1e-3))
    assert not opt.defaults["fused"]


@pytest.mark.parametrize("frozen", ["0", "1"])
def test_only_trainable_parameters_are_optimised(frozen: str) -> None:
    model = _model()
    for p in model[int(frozen)].parameters():
        p.requires_grad_(False)
    opt = build_optimizer(model, OptimizerConfig(lr=1e-3))
    optimised = {id(p) for g in opt.param_groups for p in g["params"]}
    assert optimised == {id(p) for p in model.parameters() if p.requires_grad}
