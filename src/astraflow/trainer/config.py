"""``TrainerConfig``: everything one trainer (one policy) needs, and nothing of the others.

The tree mirrors the objects it builds: ``loss`` → losses, ``optimizer``/``scheduler`` → the
torch optimizer, ``batch`` → take + micro-batching, ``checkpoint`` → checkpoint.py,
``backend`` → backends/, ``update`` → a plug-in in place of the built-in step (updates.py),
``warmup`` → the SFT warm-up run before version 0. No torch here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, SecretStr

from astraflow.config import ConfigModel, env_secret
from astraflow.models import ModelSpec
from astraflow.plugins import PluginSpec
from astraflow.records import Name, ordered_fields
from astraflow.trainer.updates import UPDATE_SPEC
from astraflow.weights.config import WeightStoreConfig

__all__ = [
    "BatchConfig",
    "CheckpointConfig",
    "LossConfig",
    "MetricsConfig",
    "OptimizerConfig",
    "SchedulerConfig",
    "TrainerConfig",
    "TrainerSettings",
    "WarmupConfig",
    "WarmupSettings",
]

AdvantageScale = Literal["std", "mean", "raw"]
"""How group advantages are scaled (losses.group_advantages)."""
PublishDType = Literal["bfloat16", "float32", "float16"]


class LossConfig(ConfigModel):
    """Which loss, and its knobs (see losses.py for the formulas)."""

    type: Literal["grpo", "ppo", "sft"] = "grpo"
    """'grpo' and 'ppo': clipped surrogate on group advantages (grpo divides by the group std,
    ppo only centres: Dr.GRPO-style); 'sft': negative log-likelihood of the loss-mask tokens."""
    advantage: AdvantageScale | None = None
    """Override the advantage: 'std' (r-mean)/(std+eps), 'mean' r-mean, 'raw' r as given."""
    advantage_eps: float = Field(default=1e-6, gt=0)
    """Added to the group std before dividing."""
    ratio_level: Literal["token", "sequence"] = "token"
    """Importance ratio per token (PPO) or per sample as a geometric mean (GSPO-like)."""
    eps_low: float = Field(default=0.2, ge=0, lt=1)
    """Lower clip: the ratio is clipped below at 1 - eps_low."""
    eps_high: float = Field(default=0.2, ge=0)
    """Upper clip: above at 1 + eps_high (larger than eps_low: 'clip-higher')."""
    tis_cap: float | None = Field(default=2.0, gt=0)
    """Truncated importance sampling: weight min(exp(logp_old - logp_behaviour), cap); None off."""
    kl_coef: float = Field(default=0.0, ge=0)
    """Weight of the k3 KL estimate to a frozen reference model (the version-0 weights)."""
    m2po_threshold: float | None = Field(default=None, gt=0)
    """M2PO: mask the tokens with the largest squared log-ratio until the batch mean of the
    rest is at most this (e.g. 0.04); None off."""
    skip_zero_advantage: bool = True
    """Leave out of the forward and backward the samples whose advantage is exactly 0 (a group
    whose rewards are all equal): with no KL term they carry no gradient, so the update is the
    same, for less compute. Token figures (entropy, IS ratio, clip fraction) then cover the
    samples trained on; ``zero_advantage_frac`` says how many were left out. Not applied with
    ``kl_coef > 0`` or M2PO (both need every token)."""

    @property
    def advantage_scale(self) -> AdvantageScale:
        """The advantage actually used: the override, else the type's default."""
        if self.advantage is not None:
            return self.advantage
        return "mean" if self.type == "ppo" else "std"


class OptimizerConfig(ConfigModel):
    """AdamW on fp32 master weights."""

    lr: float = Field(default=1e-6, gt=0)
    """Peak learning rate."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam betas."""
    eps: float = Field(default=1e-8, gt=0)
    """Adam epsilon."""
    weight_decay: float = Field(default=0.0, ge=0)
    """Decoupled weight decay."""
    grad_clip: float | None = Field(default=1.0, gt=0)
    """Clip the global gradient norm to this (None: no clipping, the norm is still logged)."""


class SchedulerConfig(ConfigModel):
    """Learning-rate schedule over optimizer updates (versions)."""

    type: Literal["constant", "linear", "cosine"] = "constant"
    """Shape after warm-up: constant, linear decay or cosine decay to ``min_lr_ratio``."""
    warmup_steps: int = Field(default=0, ge=0)
    """Linear warm-up from 0 over this many updates."""
    total_steps: int = Field(default=1000, ge=1)
    """Updates over which linear/cosine decay runs."""
    min_lr_ratio: float = Field(default=0.0, ge=0, le=1)
    """Floor of the decay, as a fraction of the peak lr."""


class BatchConfig(ConfigModel):
    """How batches are asked for and cut into micro-batches."""

    min_samples: int = Field(default=1, ge=1)
    """Smallest batch the dataflow may serve (long-poll waits for it)."""
    max_samples: int = Field(default=256, ge=1)
    """Largest batch (whole groups only, so the dataflow may serve fewer)."""
    micro_batch_tokens: int = Field(default=8192, ge=1)
    """Token budget of one micro-batch (padded rows x longest row); gradients accumulate."""
    take_timeout_s: float = Field(default=30.0, ge=0, le=600)
    """Long-poll time of one take_batch call."""

    _check_sizes = ordered_fields("min_samples", "max_samples")


class CheckpointConfig(ConfigModel):
    """Where and how often the trainer checkpoints (model, optimizer, scheduler, version, RNG)."""

    dir: str | None = None
    """Checkpoint directory (default: ``<run_dir>/checkpoints``)."""
    every: int = Field(default=1, ge=0)
    """Checkpoint after every N-th version (0: only at start and at a graceful stop).
    With N > 1 a crash loses up to N - 1 acked updates; 1 loses none."""
    keep: int = Field(default=2, ge=1)
    """How many checkpoints to keep (older ones are deleted after a new one is complete)."""


class WarmupSettings(ConfigModel):
    """How the SFT warm-up trains (what a run config sets beside where its pairs come from)."""

    steps: int = Field(default=300, ge=1)
    """Optimizer steps of SFT."""
    lr: float = Field(default=3e-3, gt=0)
    """Learning rate of the warm-up (its own AdamW, discarded afterwards)."""
    batch_size: int = Field(default=64, ge=1)
    """Pairs per step (sampled with replacement from a seeded RNG)."""
    add_eos: bool = True
    """Append the tokenizer's EOS token to every completion (and train on it)."""


class WarmupConfig(WarmupSettings):
    """SFT warm-up on (prompt, completion) pairs, run before version 0 is published."""

    pairs: str
    """JSONL file, one object per line with string fields ``prompt`` and ``completion``."""


class MetricsConfig(ConfigModel):
    """Where per-step metrics go (the JSONL file is always written)."""

    tensorboard: bool = False
    """Also write TensorBoard events to ``<run_dir>/tensorboard`` (needs tensorboard)."""
    wandb_project: str | None = None
    """Also log to this Weights & Biases project (needs wandb; credentials from its env)."""


class TrainerSettings(ConfigModel):
    """What a run config sets for a trainer: ``TrainerConfig`` without what a launcher fills in
    (policy, ids, model, URLs, weight store, run_dir, seed, warm-up pairs)."""

    dataflow_timeout_s: float = Field(default=30.0, gt=0)
    """Timeout of one dataflow request (take_batch adds its long-poll time)."""
    loss: LossConfig = Field(default_factory=LossConfig)
    """Loss and its knobs."""
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    """AdamW settings."""
    scheduler: SchedulerConfig | None = None
    """Learning-rate schedule (None: constant lr)."""
    batch: BatchConfig = Field(default_factory=BatchConfig)
    """Batch sizes and micro-batch token budget."""
    publish_dtype: PublishDType = "bfloat16"
    """Dtype of published floating-point weights (the master weights stay fp32)."""
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    """Checkpointing and resume."""
    backend: Literal["local", "fsdp2"] = "local"
    """'local': one process, CPU or one GPU; 'fsdp2': one process per rank under torchrun."""
    update: Annotated[PluginSpec | str | None, UPDATE_SPEC] = None
    """A plug-in step in place of the built-in update: ``package.module:Class``, or a mapping
    with ``type`` and its options (it wraps the built-in one: trainer/updates.py); None: the
    built-in update."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Device to train on ('auto': CUDA when available)."""
    bf16: bool = True
    """Compute in bf16 on GPU (autocast locally, FSDP2 mixed precision); CPU stays fp32."""
    max_steps: int | None = Field(default=None, ge=0)
    """Stop once this version is published (None: run until stopped)."""
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    """Extra metric sinks."""


class TrainerConfig(TrainerSettings):
    """One trainer: one policy, one dataflow, one weight store."""

    policy: Name
    """The policy this trainer trains (batches are taken and versions published for it)."""
    trainer_id: Name = "trainer"
    """Name this trainer reports to the dataflow (reports, batch leases)."""
    model: ModelSpec
    """The model to train (pretrained or built from a config); trained in fp32 master weights."""
    dataflow_url: str = "http://127.0.0.1:8600"
    """Base URL of the dataflow service."""
    dataflow_token: SecretStr | None = Field(
        default_factory=env_secret("ASTRAFLOW_TRAINER_TOKEN"), exclude=True, repr=False
    )
    """Bearer token for the dataflow service (default: env ASTRAFLOW_TRAINER_TOKEN; never
    dumped)."""
    weights: str
    """Weight store root: a directory or an fsspec URL."""
    weights_options: WeightStoreConfig = Field(default_factory=WeightStoreConfig)
    """How the weight store writes and keeps versions."""
    run_dir: str = "runs/trainer"
    """Directory for metrics, the resolved config and (by default) checkpoints."""
    seed: int = 0
    """Seed of torch / python / numpy RNGs in the trainer process (rank added)."""
    warmup: WarmupConfig | None = None
    """SFT warm-up before version 0 (only on a fresh start)."""

    @property
    def checkpoint_dir(self) -> Path:
        """The checkpoint directory, resolved against ``run_dir``."""
        if self.checkpoint.dir is not None:
            return Path(self.checkpoint.dir)
        return Path(self.run_dir) / "checkpoints"
