"""The live view of ``astraflow run`` (rich on a terminal, a plain line every 10 s otherwise)."""

from __future__ import annotations

import time
from types import TracebackType
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table

from astraflow.launch.status import RunStatus

__all__ = ["RunView"]


def _fmt(value: float | None, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


class RunView:
    """Renders ``RunStatus`` snapshots; library code never prints, this does."""

    def __init__(
        self, config: Any, plain_every_s: float = 10.0, console: Console | None = None
    ) -> None:
        self.console = console or Console(stderr=False)
        if not self.console.is_terminal:  # a log: one line per print however long (rich would
            self.console.soft_wrap = True  # wrap at 80 columns), read and grepped by line
        self.config = config
        self.live: Live | None = None
        self.plain_every_s = plain_every_s
        self._last_plain = 0.0

    def __enter__(self) -> RunView:
        if self.console.is_terminal:
            self.live = Live(console=self.console, refresh_per_second=2, transient=False)
            self.live.start()
        self.console.print(f"[bold]astraflow run[/] → {self.config.run_dir}  (Ctrl-C stops)")
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self.live is not None:
            self.live.stop()

    def dashboard(self, link: tuple[str, str | None] | None) -> None:
        """Print the live dashboard's address. The token rides in the link on a terminal only
        (the page trades it for a cookie at once); logs get the bare address."""
        if link is None:
            return
        url, token = link
        if token is None:
            self.console.print(f"dashboard: {url}", highlight=False)
        elif self.console.is_terminal:
            self.console.print(f"dashboard: {url}?token={token}", highlight=False)
        else:
            self.console.print(
                f"dashboard: {url} (the page asks for a token: any of the run's, e.g. "
                "$ASTRAFLOW_READ_TOKEN)", highlight=False,
            )  # fmt: skip

    def update(self, status: RunStatus) -> None:
        """Show a new snapshot."""
        if self.live is not None:
            self.live.update(self._render(status))
            return
        now = time.monotonic()
        if now - self._last_plain >= self.plain_every_s:
            self._last_plain = now
            self.console.print(self._line(status), highlight=False)

    def _render(self, status: RunStatus) -> Group:
        pol = Table(title=f"astraflow · {status.elapsed_s:.0f}s", title_justify="left")
        for col in ("policy", "version", "reward", "held-out acc", "tok/s", "waiting", "buffered"):
            pol.add_column(col, justify="right" if col != "policy" else "left")
        for name, p in status.policies.items():
            pol.add_row(
                name, str(p.version), _fmt(p.reward), _fmt(p.eval_accuracy),
                _fmt(p.tokens_per_s, ".0f"), _fmt(p.waiting, ".0%"), str(p.buffered),
            )  # fmt: skip
        pools = Table()
        for col in ("pool", "nodes", "samples/s"):
            pools.add_column(col, justify="right" if col != "pool" else "left")
        for name, (nodes, rate) in status.pools.items():
            pools.add_row(name, str(nodes), f"{rate:.1f}")
        return Group(pol, pools)

    def _line(self, status: RunStatus) -> str:
        parts = [f"[{status.elapsed_s:6.0f}s]"]
        for name, p in status.policies.items():
            parts.append(
                f"{name}: v{p.version} reward {_fmt(p.reward)} acc {_fmt(p.eval_accuracy)} "
                f"wait {_fmt(p.waiting, '.0%')}"
            )
        for name, (nodes, rate) in status.pools.items():
            parts.append(f"pool {name}: {nodes} nodes {rate:.1f} samples/s")
        return " | ".join(parts)

    def final(self, result: Any) -> None:
        """Print how the run ended and where its outputs are."""
        status: RunStatus | None = result.status
        self.console.print(
            f"run {result.reason} after {result.elapsed_s:.0f}s; outputs in {result.run_dir}"
        )
        if status is not None:
            self.console.print(self._line(status), highlight=False)
        if result.failed:
            self.console.print(
                f"[red]failed components: {', '.join(result.failed)} (logs in "
                f"{result.run_dir}/logs)[/]"
            )
