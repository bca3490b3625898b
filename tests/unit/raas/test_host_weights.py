"""The host copy of the published tensors that the vLLM and SGLang engines load from: a
failed pull that changed nothing keeps it (the next pull is a delta); any other failure drops
it (the next pull is a full load)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from astraflow.errors import NotFoundError
from astraflow.raas.engines.host import HostWeights
from astraflow.weights import WeightClient
from fixtures.raas import PolicyStore, RecordedPulls


def _holds(host: HostWeights, store: PolicyStore, version: int) -> None:
    assert host.version == version
    for name, tensor in store.states[version].items():
        assert torch.equal(host.tensors[name], tensor), (version, name)


def test_a_version_not_served_keeps_the_host_copy_for_a_delta(
    policy_store: PolicyStore,
) -> None:
    source = RecordedPulls(WeightClient(policy_store.root))
    host = HostWeights("policy")
    host.pull(source, 0)  # empty: a full load
    policy_store.publish_perturbed(1, seed=1)
    with pytest.raises(NotFoundError, match="v00000009"):
        host.pull(source, 9)
    _holds(host, policy_store, 0)
    host.pull(source, 1)
    _holds(host, policy_store, 1)
    assert source.pulls == [(0, 9, "not found"), (0, 1, "chain")]
    source.client.close()


def test_a_failure_that_may_have_written_drops_the_host_copy(
    policy_store: PolicyStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = WeightClient(policy_store.root)
    host = HostWeights("policy")
    host.pull(client, 0)
    policy_store.publish_perturbed(1, seed=1)

    def broken_mid_pull(
        policy: str, tensors: Any, have: int | None, want: int | None = None
    ) -> Any:
        next(iter(tensors.values())).add_(1.0)  # written, then an error not of the client's
        raise RuntimeError("out of memory")

    with monkeypatch.context() as patch:
        patch.setattr(client, "pull", broken_mid_pull)
        with pytest.raises(RuntimeError, match="out of memory"):
            host.pull(client, 1)
    assert host.tensors == {} and host.version < 0
    host.pull(client, 1)  # a full load of version 1
    _holds(host, policy_store, 1)
    client.close()
