"""What a node measures about itself and reports with every lease and heartbeat.

Rates are over a sliding window: samples/s from completed tasks, tokens/s from the
policies' cumulative generated-token counters sampled at each report.
"""

from __future__ import annotations

import os
import time
from collections import deque
from functools import cache

from astraflow.records import NodeStats

__all__ = ["NodeMeter", "detect_hardware"]


@cache
def detect_hardware() -> str:
    """'<GPU name> xN' when CUDA devices are visible, else 'cpu xN' (usable cores)."""
    try:
        import torch

        if torch.cuda.is_available():
            count = torch.cuda.device_count()
            return f"{torch.cuda.get_device_name(0)} x{count}"
    except ImportError:  # a node without torch (openai engines only) is still a CPU node
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"cpu x{cores or 1}"


class NodeMeter:
    """Counts completions and failures; turns them into ``NodeStats``."""

    def __init__(self, window_s: float, hardware: str) -> None:
        self.window_s = window_s
        self.hardware = hardware
        self.completed = 0
        self.failed = 0
        self.lost = 0
        self.refreshes = 0
        self._started = time.monotonic()
        self._done: deque[tuple[float, int, float]] = deque()  # (time, samples, latency)
        self._done_samples = 0  # sums over ``_done``, kept as it changes (a snapshot with
        self._done_latency = 0.0  # every lease must not walk a minute of completions)
        self._tokens: deque[tuple[float, int]] = deque()  # (time, cumulative tokens)

    def task_done(self, samples: int, latency_s: float) -> None:
        """A task's samples were accepted."""
        self.completed += 1
        self._done.append((time.monotonic(), samples, latency_s))
        self._done_samples += samples
        self._done_latency += latency_s

    def task_failed(self) -> None:
        """A task failed (reported to the dataflow)."""
        self.failed += 1

    def snapshot(self, in_flight: int, tokens_total: int) -> NodeStats:
        """Stats now; ``tokens_total`` is the cumulative count of generated tokens."""
        now = time.monotonic()
        horizon = now - self.window_s
        while self._done and self._done[0][0] < horizon:
            _, samples_gone, latency_gone = self._done.popleft()
            self._done_samples -= samples_gone
            self._done_latency -= latency_gone
        if not self._done:  # no float residue once the window is empty
            self._done_samples, self._done_latency = 0, 0.0
        self._tokens.append((now, tokens_total))
        while len(self._tokens) > 2 and self._tokens[1][0] < horizon:
            self._tokens.popleft()
        first_t, first_n = self._tokens[0]
        span = now - first_t
        tokens_per_s = (tokens_total - first_n) / span if span > 0 else 0.0
        samples = self._done_samples
        window = min(self.window_s, now - self._started)
        latency = max(0.0, self._done_latency) / len(self._done) if self._done else 0.0
        return NodeStats(
            samples_per_s=samples / window if window > 0 else 0.0,
            tokens_per_s=max(0.0, tokens_per_s),
            in_flight=in_flight,
            completed=self.completed,
            failed=self.failed,
            mean_task_latency_s=latency,
            hardware=self.hardware,
            extra={"lost_leases": float(self.lost), "refreshes": float(self.refreshes)},
        )
