"""``kill -9`` of a trainer process, then a restart: it resumes from its last checkpoint with
the same optimizer state and publishes the next version; versions never repeat."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

from astraflow.dataflow.client import DataflowClient
from astraflow.trainer import TrainerConfig
from astraflow.trainer.backends.local import LocalBackend
from astraflow.trainer.checkpoint import latest_checkpoint
from astraflow.trainer.runtime import build_runtime
from fixtures.dataflow import make_config
from fixtures.trainer import ScriptedProducer, trainer_config_dict


def _start(cfg: Path, log: Path, *extra: str) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "astraflow", "train", "--config", str(cfg), *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    with log.open("ab") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)


def _wait_for(check: Callable[[], bool], proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 90
    while not check():
        assert proc.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.05)


def test_kill_9_then_restart_resumes_with_next_version(
    tmp_path: Path, dataflow_factory: Callable[..., str], weight_root: Path, tiny_tokenizer: Any
) -> None:
    from astraflow.weights import WeightClient

    policies = {"solver": {"vocab_size": 64, "max_staleness": 4, "max_buffered": 8}}
    url = dataflow_factory(make_config(tmp_path / "dataflow", policies=policies))
    data = trainer_config_dict(
        tmp_path, policy="solver", dataflow_url=url, weights=str(weight_root),
        publish_dtype="bfloat16", optimizer={"lr": 1e-2},
        batch={"min_samples": 2, "max_samples": 2, "take_timeout_s": 1.0},
    )  # fmt: skip
    cfg_path = tmp_path / "trainer.yaml"
    cfg_path.write_text(json.dumps(data))  # JSON is YAML
    config = TrainerConfig.model_validate(data)
    log = tmp_path / "trainer.log"
    store = WeightClient(str(weight_root))
    producer = ScriptedProducer(url, tiny_tokenizer).start()
    try:
        proc = _start(cfg_path, log)
        _wait_for(lambda: (store.latest("solver") or 0) >= 3, proc, log)
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(30) == -signal.SIGKILL

        ckpt = latest_checkpoint(config.checkpoint_dir)
        assert ckpt is not None
        saved = json.loads((ckpt / "meta.json").read_text())["version"]
        published = store.latest("solver")
        assert published is not None and published >= 3 and saved >= published - 1

        # a resumed state: the checkpoint's weights are what was published at that version,
        # and its optimizer state is the checkpointed one, Adam step count = updates made
        rt = build_runtime(config, LocalBackend("cpu"))
        assert rt.resumed and rt.version == saved
        at_saved = store.load("solver", saved)
        for name, tensor in rt.model.state_dict().items():
            assert torch.equal(tensor.to(torch.bfloat16), at_saved[name]), name
        full = StateDictOptions(full_state_dict=True)
        mine = get_optimizer_state_dict(rt.model, rt.optimizer, options=full)["state"]
        on_disk = torch.load(ckpt / "optimizer.pt", weights_only=True)["state"]
        assert mine.keys() == on_disk.keys()
        for name, state in on_disk.items():
            assert float(mine[name]["step"]) == float(state["step"]) == saved
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(mine[name][key], state[key]), (name, key)

        # the line of a step whose version the kill kept from being published (its publish
        # runs in the background), then a line torn by the kill: both go on the restart
        metrics = Path(config.run_dir) / "metrics.jsonl"
        with metrics.open("a") as f:
            f.write(json.dumps({"version": published + 1, "lost": 1.0}) + "\n")
            f.write('{"version": ')
        target = published + 2
        proc = _start(cfg_path, log, "--set", f"max_steps={target}")
        assert proc.wait(120) == 0, log.read_text()[-3000:]
    finally:
        producer.stop()
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)

    assert store.latest("solver") == target
    with DataflowClient(url) as dataflow:
        assert dataflow.versions()["solver"].version == target
    lines = (Path(config.run_dir) / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(x) for x in lines]
    versions = [int(r["version"]) for r in records]
    assert versions[-2:] == [published + 1, published + 2]  # the next version, then one more
    assert versions == sorted(set(versions))  # no version twice, none after a later one
    assert not any("lost" in r for r in records)  # the unpublished step's line is gone
    store.close()


def test_sigterm_finishes_the_step_and_checkpoints(
    tmp_path: Path, dataflow_factory: Callable[..., str], weight_root: Path, tiny_tokenizer: Any
) -> None:
    from astraflow.weights import WeightClient

    policies = {"solver": {"vocab_size": 64, "max_staleness": 4, "max_buffered": 8}}
    url = dataflow_factory(make_config(tmp_path / "dataflow", policies=policies))
    data = trainer_config_dict(
        tmp_path, policy="solver", dataflow_url=url, weights=str(weight_root),
        checkpoint={"every": 0},  # only at start and at a graceful stop
        batch={"min_samples": 2, "max_samples": 2, "take_timeout_s": 1.0},
    )  # fmt: skip
    cfg_path = tmp_path / "trainer.yaml"
    cfg_path.write_text(json.dumps(data))
    log = tmp_path / "trainer.log"
    store = WeightClient(str(weight_root))
    producer = ScriptedProducer(url, tiny_tokenizer).start()
    try:
        proc = _start(cfg_path, log)
        _wait_for(lambda: (store.latest("solver") or 0) >= 2, proc, log)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, log.read_text()[-3000:]
    finally:
        producer.stop()
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    ckpt = latest_checkpoint(TrainerConfig.model_validate(data).checkpoint_dir)
    assert ckpt is not None
    assert json.loads((ckpt / "meta.json").read_text())["version"] == store.latest("solver")
    with DataflowClient(url) as dataflow:
        assert dataflow.report().policies["solver"].served_samples == 0  # its batch was acked
    store.close()
