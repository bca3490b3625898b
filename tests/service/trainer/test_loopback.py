"""A trainer against a real dataflow service and weight store on loopback, fed by a scripted
producer: every version it publishes is announced, its batches are acked, and a reader
pulling the versions over HTTP gets bit-exactly the trainer's weights. Its steps run through a
``trainer.update`` plug-in that wraps the built-in update (the loop calls the plug-in)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from astraflow.dataflow.client import DataflowClient
from astraflow.models import build_model
from astraflow.trainer import Trainer, TrainerConfig
from fixtures.dataflow import make_config
from fixtures.models import tiny_spec
from fixtures.trainer import ScriptedProducer, trainer_config_dict


def test_trainer_publishes_versions_a_reader_applies_bit_exactly(
    tmp_path: Path,
    dataflow_factory: Callable[..., str],
    weight_root: Path,
    weight_server: str,
    tiny_tokenizer: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from astraflow.trainer import runtime
    from astraflow.weights import WeightClient

    at_warmup: list[tuple[int | None, list[str]]] = []  # what a node finds as the warm-up starts
    warmup = runtime.sft_warmup

    def watched_warmup(*args: Any, **kwargs: Any) -> None:
        with WeightClient(weight_server) as client:
            files = client.fetch_assets("solver", tmp_path / "early-assets")
            at_warmup.append((client.latest("solver"), sorted(p.name for p in files.iterdir())))
        warmup(*args, **kwargs)

    monkeypatch.setattr(runtime, "sft_warmup", watched_warmup)

    # a small buffer cap (backpressure) keeps the producer just ahead of the trainer
    policies = {"solver": {"vocab_size": 64, "max_staleness": 2, "max_buffered": 8}}
    url = dataflow_factory(make_config(tmp_path / "dataflow", policies=policies))
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"prompt": f"{i}+1=", "completion": str(i + 1)}) + "\n"
                             for i in range(9)))  # fmt: skip
    config = TrainerConfig.model_validate(trainer_config_dict(
        tmp_path, policy="solver", dataflow_url=url, weights=str(weight_root),
        publish_dtype="bfloat16", max_steps=3, optimizer={"lr": 1e-2},
        batch={"min_samples": 2, "max_samples": 4, "take_timeout_s": 2.0},
        warmup={"pairs": str(pairs), "steps": 5, "lr": 1e-2, "batch_size": 4},
        update={"type": "fixtures.trainer:FirstGroupsUpdate", "groups": 1000},  # whole batch
    ))  # fmt: skip
    published: dict[int, dict[str, torch.Tensor]] = {}

    def snapshot(version: int) -> None:
        state = trainer.runtime.model.state_dict()
        published[version] = {k: v.detach().to(torch.bfloat16).clone() for k, v in state.items()}

    trainer = Trainer(config, on_step=lambda record: snapshot(int(record["version"])))
    producer = ScriptedProducer(url, tiny_tokenizer).start()
    try:
        trainer.start()
        snapshot(0)
        assert trainer.run() == 3
    finally:
        trainer.close()
        producer.stop()

    # the assets were out before the warm-up (nodes build their engines meanwhile); no version
    assert len(at_warmup) == 1 and at_warmup[0][0] is None, at_warmup
    assert "config.json" in at_warmup[0][1] and "tokenizer_config.json" in at_warmup[0][1]
    with DataflowClient(url) as dataflow:
        latest = dataflow.versions()["solver"]
        report = dataflow.report().policies["solver"]
    assert (latest.version, latest.manifest) == (3, "solver/v00000003/manifest.json")
    assert report.served_samples == 0 and report.acked_samples >= 3 * 2  # every batch acked

    lines = (Path(config.run_dir) / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert [r["version"] for r in records] == [1, 2, 3]
    assert all(r["samples"] >= 2 and r["loss"] is not None for r in records)
    assert [r["wrapped_calls"] for r in records] == [1, 2, 3]  # each step ran the plug-in

    with WeightClient(weight_server) as client:
        assert client.latest("solver") == 3
        assets = client.fetch_assets("solver", tmp_path / "assets")
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(assets))
        reader = {k: v.detach().clone() for k, v in model.state_dict().items()}
        assert {t.dtype for t in reader.values()} == {torch.bfloat16}  # config carries it
        have = None
        for version in range(4):
            client.pull("solver", reader, have, version)
            have = version
            for name, tensor in published[version].items():
                assert torch.equal(reader[name], tensor), (version, name)
    assert not torch.equal(published[0]["lm_head.weight"], published[3]["lm_head.weight"])
    # version 0 is the warmed-up model, not the random init
    init = build_model(tiny_spec(), tiny_tokenizer).state_dict()["lm_head.weight"]
    assert not torch.equal(published[0]["lm_head.weight"], init.to(torch.bfloat16))
