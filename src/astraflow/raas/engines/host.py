"""A host copy of a policy's weights, for engines whose own weights live out of reach.

vLLM (on CPU its sparse patch API fails) and SGLang (another process) cannot be updated
in place from here, so those engines keep the published tensors in host memory, apply
each delta to them with ``WeightSource.pull``, and hand the result over as a model
directory (``write``): HF config + tokenizer files + one ``model.safetensors``.

    load(tensors, v) ─┐                        ┌─► write(dir) ─► engine reloads from dir
                      ├─► host tensors @ v ───►┤
    pull(source, w) ──┘   (verified in place)  └─► version
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from astraflow.errors import UNCHANGED_BY_FAILED_PULL
from astraflow.raas.engines.base import WeightSource
from astraflow.records import NO_VERSION

if TYPE_CHECKING:
    import torch

__all__ = ["HostWeights", "write_model_dir"]

WEIGHTS_FILE = "model.safetensors"


class HostWeights:
    """Published tensors of one policy in host memory, at one version."""

    def __init__(self, policy: str) -> None:
        self.policy = policy
        self.tensors: dict[str, torch.Tensor] = {}
        self.version = NO_VERSION

    def load(self, tensors: Mapping[str, torch.Tensor], version: int) -> None:
        """Hold ``tensors`` (on the CPU) as ``version``."""
        self.tensors = {name: t.detach().to("cpu") for name, t in tensors.items()}
        self.version = version

    def pull(self, source: WeightSource, want: int) -> None:
        """Bring the host copy to ``want``: a delta pull, or a full load when empty."""
        if self.version < 0 or not self.tensors:
            self.load(source.load(self.policy, want), want)
            return
        have, self.version = self.version, NO_VERSION
        try:
            source.pull(self.policy, self.tensors, have, want)
        except UNCHANGED_BY_FAILED_PULL:
            self.version = have  # left as they were: the next pull is a delta on them again
            raise
        except Exception:
            self.tensors = {}  # may be half-written: the next pull reloads in full
            raise
        self.version = want


def write_model_dir(
    tensors: Mapping[str, torch.Tensor], dest: Path, *, assets: Path | None, tokenizer: Any
) -> Path:
    """Write a loadable HF model directory: assets (or the tokenizer) + one safetensors file.

    Tensors that share memory (tied embeddings) are written as separate copies. A config
    without ``architectures`` (saved from a config, not a model) gets the causal-LM class of
    its ``model_type``, which servers need to pick the model.
    """
    from safetensors.torch import save_file

    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    if assets is not None:
        for item in assets.iterdir():
            if item.is_file():
                shutil.copy2(item, tmp / item.name)
    elif tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    seen: set[int] = set()
    flat: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        t = tensor.detach().to("cpu").contiguous()
        ptr = t.data_ptr()
        flat[name] = t.clone() if ptr in seen else t
        seen.add(ptr)
    save_file(flat, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
    _name_architecture(tmp / "config.json")
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    return dest


def _name_architecture(config_path: Path) -> None:
    if not config_path.is_file():
        return
    config = json.loads(config_path.read_text())
    if config.get("architectures") or "model_type" not in config:
        return
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config["model_type"])
    if name is not None:
        config["architectures"] = [name]
        config_path.write_text(json.dumps(config, indent=2))
