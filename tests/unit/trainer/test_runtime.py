"""The trainer state: a fresh start keeps the KL reference; a resume restores it all."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from astraflow.trainer.backends.local import LocalBackend
from astraflow.trainer.config import TrainerConfig
from astraflow.trainer.runtime import build_runtime
from fixtures.trainer import text_sample, trainer_config_dict


def test_fresh_then_resume_restores_model_reference_and_version(
    tmp_path: Path, tiny_tokenizer: Any
) -> None:
    config = TrainerConfig.model_validate(
        trainer_config_dict(tmp_path, loss={"kl_coef": 0.1}, optimizer={"lr": 1e-2})
    )
    rt = build_runtime(config, LocalBackend("cpu"))
    assert not rt.resumed and rt.version == 0
    assert (config.checkpoint_dir / "reference.safetensors").is_file()
    batch = [
        text_sample(tiny_tokenizer, "2+5=", "7", reward=1.0),
        text_sample(tiny_tokenizer, "2+5=", "8", reward=0.0),
    ]
    for _ in range(2):
        stats = rt.update.run(batch, rt.version)
        rt.version += 1
    assert stats["kl"] > 0
    rt.last_batch_id = "b-2"
    rt.save()

    again = build_runtime(config, LocalBackend("cpu"))
    assert again.resumed and again.version == 2 and again.last_batch_id == "b-2"
    ref_a, ref_b = rt.update.ref_model, again.update.ref_model
    assert ref_a is not None and ref_b is not None
    for (name, a), b in zip(ref_a.state_dict().items(), ref_b.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    for (name, a), b in zip(rt.model.state_dict().items(), again.model.state_dict().values(),
                            strict=True):  # fmt: skip
        assert torch.equal(a, b), name
    # the next update is the same from the resumed state as from the live one
    assert again.update.run(batch, 2)["loss"] == rt.update.run(batch, 2)["loss"]
