"""The pipelined trainer (prefetch of one batch, background publish) against a real dataflow
service and weight store: a ``kill -9`` while it holds batches it took but did not ack loses
no batch and trains none twice; a failed background publish stops it with a clear error."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from astraflow.dataflow.client import DataflowClient
from astraflow.records import TakeBatchRequest
from astraflow.trainer import Trainer, TrainerConfig
from astraflow.trainer.checkpoint import latest_checkpoint
from astraflow.trainer.pipeline import PublishError
from fixtures.dataflow import make_config
from fixtures.trainer import ScriptedProducer, trainer_config_dict

STEP = re.compile(r"step policy=solver version=(\d+) .* batch=([0-9a-f]+)")
POLICIES = {"solver": {"vocab_size": 64, "max_staleness": 8, "max_buffered": 8}}


def _start(cfg: Path, log: Path, *extra: str) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "astraflow", "train", "--config", str(cfg), *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    with log.open("ab") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)


def _steps(log: Path) -> dict[int, str]:
    """version -> batch id of every step the log shows."""
    return {int(m[1]): m[2] for m in STEP.finditer(log.read_text())}


def _batches(db: Path) -> dict[str, tuple[str, list[int]]]:
    """batch id -> (state, fresh group ids), read from the dataflow's own database."""
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as con:
        rows = con.execute("SELECT batch_id, state, fresh FROM batches").fetchall()
    return {b: (state, json.loads(fresh)) for b, state, fresh in rows}


@pytest.mark.slow  # two trainer processes (start-up dominates)
def test_kill_9_with_batches_taken_but_not_acked_trains_each_once(
    tmp_path: Path, dataflow_factory: Callable[..., str], weight_root: Path, tiny_tokenizer: Any
) -> None:
    dataflow_cfg = make_config(tmp_path / "dataflow", policies=POLICIES)
    url = dataflow_factory(dataflow_cfg)
    db = dataflow_cfg.run_dir / "dataflow.sqlite"
    data = trainer_config_dict(
        tmp_path, policy="solver", dataflow_url=url, weights=str(weight_root),
        checkpoint={"every": 1}, batch={"min_samples": 2, "max_samples": 2, "take_timeout_s": 1.0},
    )  # fmt: skip
    cfg_path = tmp_path / "trainer.yaml"
    cfg_path.write_text(json.dumps(data))
    config = TrainerConfig.model_validate(data)
    first, second = tmp_path / "first.log", tmp_path / "second.log"
    producer = ScriptedProducer(url, tiny_tokenizer).start()
    proc = _start(cfg_path, first)
    try:
        deadline = time.monotonic() + 90
        while True:  # a batch taken (prefetched) and not trained yet: kill now
            assert proc.poll() is None and time.monotonic() < deadline, first.read_text()[-3000:]
            trained = set(_steps(first).values())
            open_ids = {b for b, (state, _) in _batches(db).items() if state == "open"}
            if len(trained) >= 3 and open_ids - trained:
                proc.send_signal(signal.SIGKILL)
                break
            time.sleep(0.01)
        assert proc.wait(30) == -signal.SIGKILL
        at_kill = {b: gids for b, (state, gids) in _batches(db).items() if state == "open"}
        ckpt = latest_checkpoint(config.checkpoint_dir)
        assert ckpt is not None
        saved = json.loads((ckpt / "meta.json").read_text())["version"]
        kept = {v: b for v, b in _steps(first).items() if v <= saved}  # in the resumed weights
        untrained = set(at_kill) - set(kept.values())
        assert untrained, "the kill should land while a taken batch is not trained yet"

        proc = _start(cfg_path, second, "--set", f"max_steps={saved + 3}")
        assert proc.wait(120) == 0, second.read_text()[-3000:]
    finally:
        producer.stop()
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)

    resumed = _steps(second)
    assert resumed and min(resumed) > saved
    lineage = list(kept.values()) + list(resumed.values())  # the batches in the final weights
    batches = _batches(db)
    trained_groups = [g for b in lineage for g in batches[b][1]]
    assert len(trained_groups) == len(set(trained_groups))  # no group trained twice
    for b in untrained:  # taken, never trained before the kill: served again, trained once
        for gid in at_kill[b]:
            assert trained_groups.count(gid) == 1, (b, gid)
    assert all(batches[b][0] == "acked" for b in lineage)  # no ack skipped
    assert not [b for b, (state, _) in batches.items() if state == "open"]
    with DataflowClient(url) as dataflow:
        assert dataflow.report().policies["solver"].served_samples == 0


def _solver_trainer(tmp_path: Path, url: str, weight_root: Path, take_timeout_s: float) -> Trainer:
    """A solver trainer of 20 steps taking batches of 2 samples from the dataflow at ``url``."""
    config = TrainerConfig.model_validate(trainer_config_dict(
        tmp_path, policy="solver", dataflow_url=url, weights=str(weight_root), max_steps=20,
        batch={"min_samples": 2, "max_samples": 2, "take_timeout_s": take_timeout_s},
    ))  # fmt: skip
    return Trainer(config)


def test_background_publish_failure_stops_the_trainer_with_a_clear_error(
    tmp_path: Path, dataflow_factory: Callable[..., str], weight_root: Path, tiny_tokenizer: Any
) -> None:
    url = dataflow_factory(make_config(tmp_path / "dataflow", policies=POLICIES))
    trainer = _solver_trainer(tmp_path, url, weight_root, take_timeout_s=1.0)
    producer = ScriptedProducer(url, tiny_tokenizer).start()
    try:
        trainer.start()  # version 0 is published
        shutil.rmtree(weight_root / "solver")
        (weight_root / "solver").write_text("not a directory")  # every later write fails
        with pytest.raises(PublishError, match="publishing version 1 failed"):
            trainer.run()
    finally:
        trainer.close()
        producer.stop()
    with DataflowClient(url) as dataflow:
        assert dataflow.versions()["solver"].version == 0  # nothing announced past the failure
        report = dataflow.report().policies["solver"]
    assert report.acked_samples == 0  # the batch of version 1 was never acked
    assert report.served_samples >= 2  # it stays open: served again after its deadline


def test_a_take_keeps_the_batches_it_names_open_and_releases_the_others(
    tmp_path: Path, dataflow_factory: Callable[..., str], tiny_tokenizer: Any
) -> None:
    url = dataflow_factory(make_config(tmp_path / "dataflow", policies=POLICIES))
    producer = ScriptedProducer(url, tiny_tokenizer).start()
    try:
        with DataflowClient(url) as dataflow:
            take = {"policy": "solver", "trainer_version": 0, "min_samples": 2,
                    "max_samples": 2, "timeout_s": 10.0}  # fmt: skip
            a = dataflow.take_batch(TakeBatchRequest(**take))
            assert a is not None
            b = dataflow.take_batch(TakeBatchRequest(**take, holding=[a.batch_id]))
            assert b is not None and {s.group_id for s in a.samples}.isdisjoint(
                {s.group_id for s in b.samples}
            )  # a stayed open: its groups were not served again
            assert dataflow.report().policies["solver"].served_samples == 4
            c = dataflow.take_batch(TakeBatchRequest(**take, holding=[b.batch_id]))
            assert c is not None  # a was released: back in the buffer
            assert dataflow.report().policies["solver"].served_samples == 4
    finally:
        producer.stop()


def test_a_stop_does_not_wait_out_the_long_poll_in_flight(
    tmp_path: Path,
    dataflow_factory: Callable[..., str],
    weight_root: Path,
    tiny_tokenizer: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("astraflow.trainer.loop._POLL_S", 100.0)  # each take long-polls 100 s
    url = dataflow_factory(make_config(tmp_path / "dataflow", policies=POLICIES))
    trainer = _solver_trainer(tmp_path, url, weight_root, take_timeout_s=100.0)
    stop = threading.Event()
    ended: list[int] = []
    trainer.start()
    runner = threading.Thread(target=lambda: ended.append(trainer.run(stop)), daemon=True)
    runner.start()
    with DataflowClient(url) as dataflow:  # no samples come: the trainer long-polls
        deadline = time.monotonic() + 30
        while "trainer" not in dataflow.report().trainers and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "trainer" in dataflow.report().trainers, "the trainer never took"
    stop.set()
    runner.join(timeout=30)  # far less than the 100 s the take would wait
    closer = threading.Thread(target=trainer.close, daemon=True)
    closer.start()
    closer.join(timeout=30)
    assert not runner.is_alive() and not closer.is_alive(), "the stop waited for the long-poll"
    assert ended == [0]
    assert latest_checkpoint(Path(trainer.config.checkpoint_dir)) is not None
    # the abandoned take was ended at the service too: samples that come now go to another
    # trainer, none is served to the stopped one (its process, and connection, live on)
    producer = ScriptedProducer(url, tiny_tokenizer).start()
    try:
        with DataflowClient(url) as dataflow:
            request = TakeBatchRequest(policy="solver", trainer_id="next", trainer_version=0,
                                       min_samples=2, max_samples=2, timeout_s=10.0)  # fmt: skip
            assert dataflow.take_batch(request) is not None
            assert dataflow.report().trainers["trainer"].batches == 0
    finally:
        producer.stop()
