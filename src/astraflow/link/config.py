"""``LinkConfig``: the shape of an emulated WAN link (delay, bandwidth, jitter, loss)."""

from __future__ import annotations

from pydantic import Field, model_validator

from astraflow.config import ConfigModel

__all__ = ["LinkConfig"]


class LinkConfig(ConfigModel):
    """One emulated WAN link; both directions get the same shape, each its own capacity."""

    delay_ms: float = Field(default=0.0, ge=0, le=60_000)
    """One-way delay added to every byte (RTT = 2 x delay_ms)."""
    rate_mbit: float | None = Field(default=None, gt=0)
    """Bandwidth per direction in Mbit/s (10^6 bit/s), shared by every connection on the
    link; None: unlimited."""
    burst_kib: float = Field(default=16.0, ge=0)
    """Token-bucket depth in KiB: bytes that may leave back to back after an idle spell."""
    jitter_ms: float = Field(default=0.0, ge=0)
    """Each chunk's delay varies uniformly in [delay - jitter, delay + jitter] (order kept)."""
    loss: float = Field(default=0.0, ge=0, lt=1)
    """Packet loss probability per 1448-byte segment: a loss stalls the stream for one
    retransmission timeout (``rto_ms``), as TCP would, and loses no byte."""
    rto_ms: float | None = Field(default=None, gt=0)
    """Retransmission stall per loss (default: max(200 ms, 2 x RTT))."""
    buffer_kib: float | None = Field(default=None, gt=0)
    """Bytes held per connection and direction before the sender is pushed back (default:
    twice the bandwidth-delay product, at least 1 MiB)."""
    chunk_kib: int = Field(default=64, ge=1, le=4096)
    """Read size of the relay: the granularity of delay and pacing."""
    seed: int = 0
    """Seed of the jitter and loss draws."""
    realtime: bool = True
    """Run the link's thread at the lowest real-time priority (SCHED_RR 1) where the OS
    allows it (root): on a loaded machine an ordinary thread's timers fire milliseconds late,
    which a millisecond-scale delay cannot absorb. Ignored where not permitted."""

    @model_validator(mode="after")
    def _jitter_within_delay(self) -> LinkConfig:
        if self.jitter_ms > self.delay_ms:
            raise ValueError(
                f"jitter_ms ({self.jitter_ms}) must not exceed delay_ms ({self.delay_ms})"
            )
        return self

    @property
    def rate_bytes_s(self) -> float | None:
        """Bandwidth per direction in bytes per second (None: unlimited)."""
        return None if self.rate_mbit is None else self.rate_mbit * 1e6 / 8

    @property
    def rtt_s(self) -> float:
        """Configured round-trip time in seconds."""
        return 2 * self.delay_ms / 1000

    @property
    def rto_s(self) -> float:
        """Stall per lost segment in seconds."""
        return (self.rto_ms / 1000) if self.rto_ms is not None else max(0.2, 2 * self.rtt_s)

    @property
    def buffer_bytes(self) -> int:
        """Bytes held per connection and direction before the sender is pushed back."""
        if self.buffer_kib is not None:
            return int(self.buffer_kib * 1024)
        rate = self.rate_bytes_s
        bdp = 0.0 if rate is None else rate * (self.delay_ms + self.jitter_ms) / 1000
        return max(1 << 20, int(2 * bdp))
