"""Trainer config validation, warm-up pairs, the CLI entry and the component boundary."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from astraflow.config import load_config
from astraflow.errors import ConfigError
from astraflow.trainer.config import LossConfig, SchedulerConfig, TrainerConfig
from astraflow.trainer.optim import lr_factor
from astraflow.trainer.warmup import load_pairs
from fixtures.trainer import trainer_config_dict


def _write(tmp_path: Path, **overrides: object) -> Path:
    path = tmp_path / "trainer.yaml"
    path.write_text(json.dumps(trainer_config_dict(tmp_path, **overrides)))
    return path


def test_config_errors_name_the_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"unknown key 'loss.eps'.*allowed: type, advantage"):
        load_config(TrainerConfig, _write(tmp_path, loss={"eps": 0.2}))
    with pytest.raises(ConfigError, match=r"min_samples \(9\) is larger than max_samples \(4\)"):
        load_config(TrainerConfig, _write(tmp_path, batch={"min_samples": 9, "max_samples": 4}))
    with pytest.raises(ConfigError, match="backend"):
        load_config(TrainerConfig, _write(tmp_path), ["backend=ddp"])
    ok = load_config(TrainerConfig, _write(tmp_path), ["loss.type=ppo", "checkpoint.every=5"])
    assert ok.loss.type == "ppo" and ok.checkpoint_dir == tmp_path / "run" / "checkpoints"


def test_advantage_defaults_per_loss_type() -> None:
    assert LossConfig(type="grpo").advantage_scale == "std"
    assert LossConfig(type="ppo").advantage_scale == "mean"
    assert LossConfig(type="ppo", advantage="raw").advantage_scale == "raw"


def test_lr_schedule_shapes() -> None:
    cos = SchedulerConfig(type="cosine", warmup_steps=2, total_steps=12, min_lr_ratio=0.1)
    assert [round(lr_factor(s, cos), 4) for s in (0, 1, 2, 7, 12, 50)] == [
        0.3333,
        0.6667,
        1.0,
        0.55,
        0.1,
        0.1,
    ]
    lin = SchedulerConfig(type="linear", total_steps=10)
    assert [lr_factor(s, lin) for s in (0, 5, 10)] == [1.0, 0.5, 0.0]


def test_load_pairs_errors_name_file_and_line(tmp_path: Path) -> None:
    good = tmp_path / "pairs.jsonl"
    good.write_text(
        '{"prompt": "1+1=", "completion": "2"}\n\n{"prompt": "2+2=", "completion": "4"}\n'
    )
    assert load_pairs(good) == [("1+1=", "2"), ("2+2=", "4")]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "1+1=", "completion": "2"}\n{"prompt": "x"}\n')
    with pytest.raises(ConfigError, match=r"bad\.jsonl:2: expected string fields"):
        load_pairs(bad)
    with pytest.raises(ConfigError, match="file not found"):
        load_pairs(tmp_path / "nope.jsonl")


def test_cli_reports_bad_config_and_help(tmp_path: Path) -> None:
    missing = subprocess.run(
        [sys.executable, "-m", "astraflow", "train", "--config", str(tmp_path / "none.yaml")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert missing.returncode == 2 and "config file not found" in missing.stderr
    helped = subprocess.run(
        [sys.executable, "-m", "astraflow", "train", "--help"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert helped.returncode == 0 and "torchrun" in helped.stdout


def test_trainer_never_imports_other_components() -> None:
    code = (
        "import sys\n"
        "import astraflow.trainer.loop, astraflow.trainer.io, astraflow.trainer.backends.fsdp2\n"
        "bad = [m for m in sys.modules if m.startswith(('astraflow.raas', 'astraflow.launch'))]\n"
        "assert not bad, bad\n"
        "import astraflow.trainer\n"
        "assert 'torch' in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    light = "import sys, astraflow.trainer\nassert 'torch' not in sys.modules\n"
    subprocess.run([sys.executable, "-c", light], check=True, timeout=60)
