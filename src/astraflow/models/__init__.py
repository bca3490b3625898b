"""How a policy's model and tokenizer are specified and built, shared by trainers and nodes.

A ``ModelSpec`` names a Hugging Face causal LM (hub name, local directory, or a GGUF file
inside one) or describes one to build from a config with seeded random init, plus the
tokenizer (HF, or the shipped character tokenizer). Trainer and rollout node build the same
architecture from the same spec; the weights then come from the weight store.
torch and transformers are imported only inside the builders.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, model_validator

from astraflow.config import ConfigModel
from astraflow.errors import ConfigError

if TYPE_CHECKING:
    import torch

__all__ = [
    "ComputeDType",
    "ModelSpec",
    "TokenizerSpec",
    "build_model",
    "build_tokenizer",
    "compute_dtype",
    "torch_dtype",
]

DType = Literal["float32", "bfloat16", "float16"]
ComputeDType = Literal["auto", "published", "float32", "bfloat16", "float16"]


class TokenizerSpec(ConfigModel):
    """A tokenizer: the shipped character tokenizer, or a Hugging Face one."""

    type: Literal["char", "hf"] = "hf"
    """'char': one token per character of ``alphabet``; 'hf': load ``name_or_path``."""
    name_or_path: str | None = None
    """Hub name or local directory (type 'hf'); defaults to the model's."""
    gguf_file: str | None = None
    """GGUF file inside ``name_or_path`` to read the tokenizer from."""
    alphabet: str | None = None
    """Characters of the char tokenizer (type 'char'); defaults to digits, letters, operators."""


class ModelSpec(ConfigModel):
    """A causal LM: from a hub name / local path, or built from a config (random init)."""

    name_or_path: str | None = None
    """Hub name or local directory of a pretrained model."""
    gguf_file: str | None = None
    """GGUF file inside ``name_or_path`` (loaded and dequantized by transformers)."""
    model_type: str | None = None
    """Architecture to build from a config instead, e.g. 'qwen3' or 'llama'."""
    config: dict[str, Any] = Field(default_factory=dict)
    """Architecture config values (hidden_size, num_hidden_layers ...) for ``model_type``."""
    tokenizer: TokenizerSpec = Field(default_factory=TokenizerSpec)
    """The tokenizer; by default the one stored with ``name_or_path``."""
    dtype: DType = "float32"
    """Parameter dtype of the loaded model."""
    seed: int = 0
    """Seed of the random init when built from a config."""
    trust_remote_code: bool = False
    """Allow model code from the hub (off by default)."""

    @model_validator(mode="after")
    def _one_source(self) -> ModelSpec:
        if (self.name_or_path is None) == (self.model_type is None):
            raise ValueError("give exactly one of name_or_path (pretrained) or model_type (build)")
        if (
            self.model_type is not None
            and self.tokenizer.type == "hf"
            and self.tokenizer.name_or_path is None
        ):
            raise ValueError(
                "a model built from a config needs tokenizer: {type: char} "
                "or tokenizer.name_or_path"
            )
        return self


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype for ``'float32' | 'bfloat16' | 'float16'``."""
    import torch

    try:
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[
            name
        ]
    except KeyError:
        raise ConfigError(f"unknown dtype {name!r} (float32, bfloat16, float16)") from None


def compute_dtype(choice: str, published: torch.dtype, device: Any) -> torch.dtype:
    """The dtype a node's engine or an evaluator runs a model published in ``published`` in.

    'auto': float32 on a CPU for weights published in bfloat16 or float16 (most CPUs have no
    fast half-precision matmul: SmolLM2-135M generated 4.4x slower in bfloat16 than in float32
    on this project's 2-core machine; float32 holds every half value exactly, so the weights
    are the published ones), else ``published``. 'published': always ``published``; or a
    dtype by name.
    """
    import torch

    if choice == "published":
        return published
    if choice != "auto":
        return torch_dtype(choice)
    on_cpu = torch.device(device).type == "cpu"
    half = published in (torch.bfloat16, torch.float16)
    return torch.float32 if on_cpu and half else published


def build_tokenizer(spec: ModelSpec) -> Any:
    """The tokenizer described by ``spec`` (char tokenizer or Hugging Face)."""
    tspec = spec.tokenizer
    if tspec.type == "char":
        from astraflow.models.tokenizers import DEFAULT_ALPHABET, build_char_tokenizer

        return build_char_tokenizer(tspec.alphabet or DEFAULT_ALPHABET)
    from transformers import AutoTokenizer

    path = tspec.name_or_path or spec.name_or_path
    gguf = tspec.gguf_file if tspec.name_or_path else (tspec.gguf_file or spec.gguf_file)
    kwargs: dict[str, Any] = {"trust_remote_code": spec.trust_remote_code}
    if gguf:
        kwargs["gguf_file"] = gguf
    try:
        return AutoTokenizer.from_pretrained(path, **kwargs)
    except OSError as exc:
        raise ConfigError(f"cannot load tokenizer {path!r}: {exc}") from exc


def build_model(spec: ModelSpec, tokenizer: Any | None = None) -> torch.nn.Module:
    """The model described by ``spec``, in eval mode, on CPU, in ``spec.dtype``.

    Built-from-config models get ``vocab_size`` and special-token ids from the tokenizer when
    the config does not set them, and a seeded init that leaves the global RNG untouched.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    dtype = torch_dtype(spec.dtype)
    if spec.name_or_path is not None:
        kwargs: dict[str, Any] = {"dtype": dtype, "trust_remote_code": spec.trust_remote_code}
        if spec.gguf_file:
            kwargs["gguf_file"] = spec.gguf_file
        try:
            model = AutoModelForCausalLM.from_pretrained(spec.name_or_path, **kwargs)
        except OSError as exc:
            raise ConfigError(f"cannot load model {spec.name_or_path!r}: {exc}") from exc
        return model.eval()  # type: ignore[no-any-return]
    tok = tokenizer if tokenizer is not None else build_tokenizer(spec)
    values = dict(spec.config)
    values.setdefault("vocab_size", len(tok))
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
        token_id = getattr(tok, key, None)
        if token_id is not None:
            values.setdefault(key, token_id)
    try:
        config = AutoConfig.for_model(str(spec.model_type), **values)
    except (ValueError, KeyError) as exc:
        raise ConfigError(f"cannot build a {spec.model_type!r} config: {exc}") from exc
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()  # type: ignore[no-any-return]
