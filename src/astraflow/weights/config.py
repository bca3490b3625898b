"""``WeightStoreConfig``: how a weight store writes and keeps versions (no torch here)."""

from __future__ import annotations

from pydantic import Field

from astraflow.config import ConfigModel

__all__ = ["WeightStoreConfig"]


class WeightStoreConfig(ConfigModel):
    """How the store writes and keeps versions."""

    full_every: int = Field(default=10, ge=1)
    """Write a full snapshot every this many versions (bounds the delta chain length)."""
    keep: int = Field(default=20, ge=1)
    """Keep at least the newest this many versions (plus what their chains need)."""
    keep_first: bool = True
    """Never collect version 0, the weights a run starts from (a full snapshot): an evaluator
    that starts after the trainer has moved ``keep`` versions on still scores the start, and
    a run can be compared with or reset to it. False frees its disk once it is ``keep``
    versions old."""
    zstd_level: int = Field(default=1, ge=1, le=22)
    """zstd level of delta blobs (1 is fastest; higher gains little on deltas)."""
    compress_deltas: bool = True
    """Encode each changed tensor as a compressed bit-exact difference (the smallest of the
    delta encodings). False stores a changed tensor's new bytes as they are (``raw``): no
    diff or zstd work for the trainer's writer nor for the nodes that apply it, at the cost of
    bytes. Worth it where bytes are cheap and most values change every step anyway (fp32
    weights read from a local disk: the deltas of the quickstart's 1.6 MB compress only to
    1.0 MB)."""
    max_pending: int = Field(default=2, ge=1)
    """Publishes queued at once; a further publish() waits (each holds a host copy)."""
