"""``torchrun --nproc-per-node 2 -m astraflow train`` with the FSDP2 backend (gloo, CPU)
against a real dataflow service and weight store: rank 0 does the I/O, both ranks train."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from astraflow.dataflow.client import DataflowClient
from astraflow.trainer.checkpoint import latest_checkpoint
from fixtures.dataflow import make_config
from fixtures.net import free_port
from fixtures.trainer import ScriptedProducer, trainer_config_dict


@pytest.mark.slow
def test_torchrun_fsdp2_trainer_publishes_and_announces(
    tmp_path: Path, dataflow_factory: Callable[..., str], weight_root: Path, tiny_tokenizer: Any
) -> None:
    from astraflow.weights import WeightClient

    policies = {"solver": {"vocab_size": 64, "max_staleness": 2, "max_buffered": 8}}
    url = dataflow_factory(make_config(tmp_path / "dataflow", policies=policies))
    data = trainer_config_dict(
        tmp_path, policy="solver", dataflow_url=url, weights=str(weight_root),
        backend="fsdp2", device="cpu", publish_dtype="bfloat16", max_steps=2,
        batch={"min_samples": 4, "max_samples": 4, "take_timeout_s": 1.0},
    )  # fmt: skip
    cfg = tmp_path / "trainer.yaml"
    cfg.write_text(json.dumps(data))
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
        "-m", "astraflow", "train", "--config", str(cfg),
    ]  # fmt: skip
    producer = ScriptedProducer(url, tiny_tokenizer).start()
    try:
        env = dict(os.environ, OMP_NUM_THREADS="1")
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=170)
    finally:
        producer.stop()
    assert proc.returncode == 0, proc.stderr[-4000:]

    with WeightClient(str(weight_root)) as store:
        assert store.latest("solver") == 2
        v0, v2 = store.load("solver", 0), store.load("solver", 2)
    assert any(not (v0[k] == v2[k]).all() for k in v0)  # the two ranks did train
    with DataflowClient(url) as dataflow:
        assert dataflow.versions()["solver"].version == 2
        assert dataflow.report().policies["solver"].served_samples == 0  # all acked
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["version"] for x in lines] == [1, 2]  # rank 0 only
    ckpt = latest_checkpoint(tmp_path / "run" / "checkpoints")
    assert ckpt is not None and json.loads((ckpt / "meta.json").read_text())["world_size"] == 2
    assert sorted(p.name for p in (ckpt / "rng").iterdir()) == ["rank0.json", "rank1.json"]
