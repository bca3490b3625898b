"""The openai and sglang engines against a real HTTP server on loopback.

The server here stands in for remote servers (a vLLM server takes a minute to start on
CPU; SGLang needs CUDA and cannot run here at all): a small Starlette app over a real tiny
transformers model that implements ``/v1/completions`` (OpenAI; ids when asked with vLLM's
``return_tokens_as_token_ids``) and SGLang's ``/generate`` (``return_logprob``) and
``/update_weights_from_disk``, reporting ``log_softmax(logits / T)`` of every token. A test
against a real SGLang server runs only where SGLang and CUDA are installed.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from astraflow.errors import ConfigError, ServiceUnavailableError, ValidationError
from astraflow.raas.engines.base import EngineContext, GenerationRequest, build_engine
from fixtures.models import tiny_spec
from fixtures.openai_server import CompletionsServer
from fixtures.raas import recompute_logprobs


@pytest.fixture(scope="module")
def completions_server() -> Iterator[CompletionsServer]:
    """The stand-in server, shared by this module's tests."""
    server = CompletionsServer(tiny_spec(seed=4))
    yield server
    server.stop()


async def test_openai_engine_samples_with_ids_and_logprobs(
    tmp_path: Path, completions_server: CompletionsServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TINY_KEY", "secret-key")
    server = completions_server
    context = EngineContext(policy="judge", tokenizer=server.tokenizer, work_dir=tmp_path)
    engine = build_engine(
        {
            "type": "openai",
            "url": server.url + "/v1",
            "model": "tiny",
            "api_key_env": "TINY_KEY",
            "max_concurrency": 4,
        },
        context,
    )
    prompt = tuple(server.tokenizer.encode("1+2="))
    try:
        requests = [
            GenerationRequest(prompt, max_new_tokens=6, temperature=0.7, seed=i, stop=(";",))
            for i in range(6)
        ]
        outputs = await engine.generate(requests)
        assert engine.version == 0 and len(outputs) == 6
        for out in outputs:
            assert out.version == 0 and 1 <= len(out.token_ids) <= 6
            ref = recompute_logprobs(server.model, prompt, out.token_ids.tolist(), 0.7)
            np.testing.assert_allclose(out.logprobs, ref, atol=1e-4)
        sent = server.seen[-1]
        assert sent["prompt"] == list(prompt) and sent["return_tokens_as_token_ids"] is True
        assert sent["stop"] == [";"] and sent["logprobs"] == 1 and "seed" in sent
        assert server.headers[-1] == "Bearer secret-key"
        with pytest.raises(ConfigError, match="frozen"):
            await engine.apply(object(), "judge", 1)  # type: ignore[arg-type]
        with pytest.raises(ServiceUnavailableError, match="500"):
            await engine.generate([GenerationRequest(prompt, max_new_tokens=999)])
    finally:
        await engine.close()


async def test_openai_engine_errors_name_the_server_and_the_cause(
    tmp_path: Path, completions_server: CompletionsServer
) -> None:
    server = completions_server
    context = EngineContext(policy="judge", tokenizer=server.tokenizer, work_dir=tmp_path)
    prompt = tuple(server.tokenizer.encode("2+2="))
    wrong_model = build_engine({"type": "openai", "url": server.url, "model": "other"}, context)
    no_ids = build_engine(
        {
            "type": "openai",
            "url": server.url,
            "model": "tiny",
            "extra_body": {"return_tokens_as_token_ids": False},
        },
        context,
    )
    retok = build_engine(
        {"type": "openai", "url": server.url, "model": "tiny", "token_ids": "retokenize"}, context
    )
    dead = build_engine(
        {"type": "openai", "url": "http://127.0.0.1:9", "model": "tiny", "timeout_s": 2}, context
    )
    try:
        with pytest.raises(ValidationError, match="404"):
            await wrong_model.generate([GenerationRequest(prompt, max_new_tokens=2)])
        with pytest.raises(ValidationError, match="did not return token ids"):
            await no_ids.generate([GenerationRequest(prompt, max_new_tokens=3)])
        (out,) = await retok.generate([GenerationRequest(prompt, max_new_tokens=3, temperature=0)])
        assert len(out.token_ids) == len(out.logprobs) >= 1  # char tokenizer: text round-trips
        with pytest.raises(ServiceUnavailableError, match="127.0.0.1:9"):
            await dead.generate([GenerationRequest(prompt, max_new_tokens=2)])
    finally:
        for engine in (wrong_model, no_ids, retok, dead):
            await engine.close()


async def test_sglang_adapter_generates_and_swaps_weights(
    tmp_path: Path, completions_server: CompletionsServer, weight_root: Path
) -> None:
    """Against the stand-in (SGLang itself needs CUDA): generation parses ids and logprobs;
    a delta from a real weight store is applied to the host copy and pushed by directory."""
    from astraflow.weights import WeightClient
    from fixtures.raas import PolicyStore

    server = completions_server
    store = PolicyStore(weight_root, seed=4)  # the server's model is version 0
    store.publish_perturbed(1, fraction=0.3)
    context = EngineContext(
        policy="policy", tokenizer=server.tokenizer, work_dir=tmp_path, model=store.spec
    )
    engine = build_engine({"type": "sglang", "url": server.url}, context)
    prompt = tuple(server.tokenizer.encode("1+1="))
    client = WeightClient(weight_root)
    try:
        (before,) = await engine.generate([GenerationRequest(prompt, max_new_tokens=5)])
        assert before.version == 0
        np.testing.assert_allclose(
            before.logprobs,
            recompute_logprobs(store.model_at(0), prompt, before.token_ids.tolist(), 1.0),
            atol=1e-4,
        )
        await engine.apply(client, "policy", 1)
        assert engine.version == 1 and server.weight_versions[-1] == "1"
        for name, tensor in store.states[1].items():
            assert bool((server.model.state_dict()[name] == tensor).all()), name
        (after,) = await engine.generate([GenerationRequest(prompt, max_new_tokens=5)])
        assert after.version == 1
        np.testing.assert_allclose(
            after.logprobs,
            recompute_logprobs(store.model_at(1), prompt, after.token_ids.tolist(), 1.0),
            atol=1e-4,
        )
        store.publish_perturbed(2, seed=5)  # now a delta on the host copy held at v1
        await engine.apply(client, "policy", 2)
        assert engine.version == 2 and server.weight_versions[-2:] == ["1", "2"]
        for name, tensor in store.states[2].items():
            assert bool((server.model.state_dict()[name] == tensor).all()), name
    finally:
        server.model.load_state_dict(store.states[0])
        await engine.close()
        client.close()
        store.close()


def _sglang_available() -> bool:
    import importlib.util

    import torch

    return importlib.util.find_spec("sglang") is not None and torch.cuda.is_available()


@pytest.mark.gpu
@pytest.mark.skipif(
    not _sglang_available(),
    reason="SGLang is CUDA-only (it has no CPU build): needs sglang and a GPU",
)
async def test_sglang_engine_against_a_real_server(tmp_path: Path, weight_root: Path) -> None:
    """A real SGLang server on a tiny model: tempered logprobs and a delta weight push."""
    import subprocess
    import sys

    import httpx

    from astraflow.raas.engines.host import write_model_dir
    from astraflow.weights import WeightClient
    from fixtures.net import free_port
    from fixtures.raas import PolicyStore

    store = PolicyStore(weight_root, hidden=64, head_dim=32, dtype="bfloat16")
    store.publish_perturbed(1, fraction=0.3)
    model_dir = write_model_dir(
        store.states[0], tmp_path / "v0", assets=None, tokenizer=store.tokenizer
    )
    store.model.config.save_pretrained(model_dir)
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "sglang.launch_server",
            "--model-path",
            str(model_dir),
            "--port",
            str(port),
            "--dtype",
            "bfloat16",
        ]
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(1)
        context = EngineContext(
            policy="policy", tokenizer=store.tokenizer, work_dir=tmp_path, model=store.spec
        )
        engine = build_engine({"type": "sglang", "url": url}, context)
        prompt = tuple(store.tokenizer.encode("1+1="))
        with WeightClient(weight_root) as client:
            await engine.apply(client, "policy", 1)
        (out,) = await engine.generate(
            [GenerationRequest(prompt, max_new_tokens=8, temperature=0.8)]
        )
        assert out.version == 1
        ref = recompute_logprobs(store.model_at(1).float(), prompt, out.token_ids.tolist(), 0.8)
        np.testing.assert_allclose(out.logprobs, ref, atol=0.05)  # bf16 kernels
        await engine.close()
    finally:
        proc.terminate()
        proc.wait(60)
        store.close()
