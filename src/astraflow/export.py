"""Export a published version of a policy as a Hugging Face model folder.

    weight store ──load(policy, version), verified──► tensors ─┐
    <policy>/assets (config, generation config, tokenizer) ────┴─► model ─► save_pretrained
                                                                    ─► <out>/ (renamed last)

The folder holds ``model.safetensors``, ``config.json``, ``generation_config.json`` and the
tokenizer files (the char tokenizer is a ``tokenizers`` WordLevel model, so ``AutoTokenizer``
loads it), in the dtype the trainer published (float32 or bfloat16): loaded with
``AutoModelForCausalLM.from_pretrained`` it computes the published weights' logits exactly.
The folder is written beside ``out`` and renamed into place last, so a failed export leaves
nothing behind.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from astraflow.errors import ConfigError, TransferError, ValidationError
from astraflow.progress import track

__all__ = ["Exported", "export_version", "push_to_hub"]

log = logging.getLogger(__name__)

#: Files every exported folder holds (besides the tokenizer's own).
REQUIRED_FILES = ("config.json", "generation_config.json", "model.safetensors")


@dataclass(frozen=True)
class Exported:
    """What one export wrote."""

    out: Path
    """The folder."""
    policy: str
    """Policy exported."""
    version: int
    """Its version."""
    dtype: str
    """Tensor dtype of the folder (the published one)."""
    files: list[str]
    """File names in the folder."""


def export_version(
    weights: str | Path, policy: str, version: int, out: str | Path, *, overwrite: bool = False
) -> Exported:
    """Write ``policy`` at ``version`` from the weight store ``weights`` to the folder ``out``.

    Raises ``ConfigError`` when ``out`` is a non-empty directory (and not ``overwrite``) or a
    file, ``NotFoundError`` when the store lacks the policy, version or assets,
    ``ValidationError`` when the published tensors do not fit the published config.
    """
    from astraflow.weights import WeightClient

    target = Path(out).resolve()
    _check_out(target, overwrite)
    target.parent.mkdir(parents=True, exist_ok=True)
    with (
        track(f"export {policy} v{version}", total=4) as bar,
        WeightClient(weights) as client,
        tempfile.TemporaryDirectory(prefix=f".{target.name}.", dir=target.parent) as tmp,
    ):
        manifest = client.manifest(policy, version)
        assets = client.fetch_assets(policy, Path(tmp) / "assets")
        bar.advance()
        tensors = client.load(policy, version)
        bar.advance()
        folder = Path(tmp) / "model"
        dtype = _save(assets, tensors, folder, f"policy {policy!r} v{version}")
        _write_card(folder, policy, version, manifest.created_at, dtype)
        bar.advance()
        if target.exists():
            shutil.rmtree(target)
        os.replace(folder, target)
        bar.advance()
    files = sorted(p.name for p in target.iterdir())
    log.info("exported policy=%s version=%d dtype=%s out=%s", policy, version, dtype, target)
    return Exported(out=target, policy=policy, version=version, dtype=dtype, files=files)


def _check_out(target: Path, overwrite: bool) -> None:
    if target.is_file():
        raise ConfigError(f"--out {target} is a file; give a directory")
    if target.is_dir() and any(target.iterdir()) and not overwrite:
        raise ConfigError(f"--out {target} exists and is not empty (use --force to replace it)")


def _save(assets: Path, tensors: dict[str, Any], folder: Path, what: str) -> str:
    """Build the model from the published config, load the tensors, save model + tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    dtypes = {t.dtype for t in tensors.values()}
    if len(dtypes) != 1:
        raise ValidationError(f"{what}: tensors of several dtypes {sorted(map(str, dtypes))}")
    dtype: torch.dtype = dtypes.pop()
    config = AutoConfig.from_pretrained(assets)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    names = set(model.state_dict())
    missing, unexpected = sorted(names - set(tensors)), sorted(set(tensors) - names)
    if missing or unexpected:
        raise ValidationError(
            f"{what}: published tensors do not fit the model config "
            f"(missing {missing[:5]}, unexpected {unexpected[:5]})"
        )
    model.load_state_dict(tensors, strict=True, assign=True)
    model.tie_weights()
    model.eval()
    if (assets / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(assets)
    with _quiet_transformers():  # our own bar reports the export; no tqdm lines in logs
        model.save_pretrained(folder, safe_serialization=True)
    AutoTokenizer.from_pretrained(assets).save_pretrained(folder)
    return str(dtype).removeprefix("torch.")


@contextmanager
def _quiet_transformers() -> Iterator[None]:
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def _write_card(folder: Path, policy: str, version: int, created_at: float, dtype: str) -> None:
    meta = {"policy": policy, "version": version, "created_at": created_at, "dtype": dtype}
    (folder / "astraflow_export.json").write_text(json.dumps(meta, indent=2) + "\n")
    (folder / "README.md").write_text(
        f"# {policy} (version {version})\n\n"
        f"Trained with astraflow; exported from the run's weight store ({dtype}).\n\n"
        "```python\nfrom transformers import AutoModelForCausalLM, AutoTokenizer\n"
        'model = AutoModelForCausalLM.from_pretrained("PATH")\n'
        'tokenizer = AutoTokenizer.from_pretrained("PATH")\n```\n'
    )


def push_to_hub(folder: str | Path, repo: str, *, private: bool = True) -> str:
    """Upload an exported folder to the Hugging Face Hub repo ``repo``; returns its URL.

    Needs the network and a token (``HF_TOKEN`` or ``huggingface-cli login``); raises
    ``TransferError`` naming the repo when the Hub cannot be reached or refuses."""
    from huggingface_hub import HfApi

    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes"):
        raise TransferError(f"cannot push to {repo!r}: HF_HUB_OFFLINE is set")
    api = HfApi()
    try:
        api.create_repo(repo, private=private, exist_ok=True)
        commit = api.upload_folder(repo_id=repo, folder_path=str(folder))
    except Exception as exc:  # the hub client raises its HTTP library's errors and its own
        raise TransferError(
            f"cannot push to the Hugging Face Hub repo {repo!r}: {type(exc).__name__}: {exc}"
        ) from exc
    return str(getattr(commit, "commit_url", f"https://huggingface.co/{repo}"))
