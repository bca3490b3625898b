"""Tokens are read from the environment once, where a config is built, into ``SecretStr``
fields that are never written out; components read the field, not the environment."""

from __future__ import annotations

import pytest

from astraflow.raas.config import NodeConfig
from astraflow.raas.engines.openai import OpenAIEngine


def _node() -> NodeConfig:
    return NodeConfig.model_validate(
        {"dataflow_url": "http://df", "weights": "/tmp/store", "policies": {"p": {}}}
    )


def test_node_tokens_come_from_the_environment_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ASTRAFLOW_NODE_TOKEN", "node-s3cret")
    monkeypatch.delenv("ASTRAFLOW_WEIGHTS_READ_TOKEN", raising=False)
    monkeypatch.setenv("ASTRAFLOW_WEIGHTS_PUBLISH_TOKEN", "publish-s3cret")
    config = _node()
    monkeypatch.delenv("ASTRAFLOW_NODE_TOKEN")  # resolved already: the config keeps it
    assert config.dataflow_token is not None
    assert config.dataflow_token.get_secret_value() == "node-s3cret"
    assert config.weights_token is not None  # the read token, else the publish one
    assert config.weights_token.get_secret_value() == "publish-s3cret"
    for text in (config.model_dump_json(), repr(config), str(config.model_dump())):
        assert "s3cret" not in text  # never written to a component config file or a log
    assert _node().dataflow_token is None


def test_the_openai_key_is_read_when_its_config_is_built(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("JUDGE_KEY", "sk-s3cret")
    config = OpenAIEngine.Config(url="http://judge", model="m", api_key_env="JUDGE_KEY")
    assert config.api_key is not None and config.api_key.get_secret_value() == "sk-s3cret"
    assert "s3cret" not in config.model_dump_json()
    monkeypatch.delenv("JUDGE_KEY")
    assert (
        OpenAIEngine.Config(url="http://judge", model="m", api_key_env="JUDGE_KEY").api_key is None
    )
