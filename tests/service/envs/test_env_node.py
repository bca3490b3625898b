"""A rollout node runs the ``env`` workflow against the real dataflow service: an environment
that raises mid-episode fails its task (reported, no sample), the dataflow re-queues it, and
the next attempt's group is the only one trained."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

from astraflow.raas.config import NodeConfig
from astraflow.raas.node import RolloutNode
from astraflow.records import AckRequest, TakeBatchRequest
from fixtures.envs import COUNTDOWN
from fixtures.raas import DataflowHarness, PolicyStore, dataflow_config


async def test_an_env_raising_mid_episode_fails_the_task_which_is_requeued(
    tmp_path: Path, weight_root: Path, weight_server: str
) -> None:
    store = PolicyStore(weight_root, max_position_embeddings=512)
    marker = tmp_path / "fail-once"
    marker.touch()
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"id": str(i), "seed": i}) + "\n" for i in range(3)))
    lease = {"ttl_s": 30, "max_attempts": 3, "retry_after_s": 0.2}
    harness = DataflowHarness(
        dataflow_config(tmp_path / "df", tasks, workflow="env", group_size=2, lease=lease)
    )
    env = {"type": COUNTDOWN, "turns": 5, "raise_at": 3, "fail_once": str(marker)}
    node = RolloutNode(
        NodeConfig.model_validate({
            "dataflow_url": harness.url, "weights": weight_server, "policies": {"policy": {}},
            "workflows": {"env": {"env": env, "sampling": {"max_new_tokens": 3, "stop": [">"]}}},
            "capacity": 1, "node_id": "node-a", "pool": "p", "work_dir": str(tmp_path / "node"),
            "idle_wait_s": 0.1,
        })
    )  # fmt: skip
    client = harness.client()
    runner = asyncio.create_task(node.run())
    try:
        deadline = time.monotonic() + 90
        while client.report().tasks.done < 3:
            assert time.monotonic() < deadline, "tasks did not finish"
            await asyncio.sleep(0.2)
        report = client.report()
        assert (report.tasks.done, report.tasks.failed) == (3, 0)
        assert node.meter.failed == 1, "exactly one attempt broke (the marker is gone after it)"
        assert not marker.exists()
        samples = []
        while len(samples) < 6:
            request = TakeBatchRequest(policy="policy", trainer_version=0, min_samples=1,
                                       max_samples=64, timeout_s=2.0)  # fmt: skip
            batch = await asyncio.to_thread(client.take_batch, request)
            assert batch is not None, f"only {len(samples)} samples were buffered"
            samples += batch.samples
            await asyncio.to_thread(client.ack, AckRequest(batch_id=batch.batch_id))
        assert len(samples) == 6, "one group of 2 per task, nothing from the failed attempt"
        assert all(s.meta["turns"] == 5 and s.meta["end"] == "terminated" for s in samples)
        extra = await asyncio.to_thread(
            client.take_batch,
            TakeBatchRequest(
                policy="policy", trainer_version=0, min_samples=1, max_samples=64, timeout_s=0.5
            ),
        )
        assert extra is None
    finally:
        node.request_stop()
        await asyncio.wait_for(runner, 60)
        client.close()
        harness.stop()
        store.close()
