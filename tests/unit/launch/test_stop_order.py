"""How a launcher stops a run's components: nodes and trainers together, each asked once."""

from __future__ import annotations

from dataclasses import dataclass, field

from astraflow.launch.processes import ComponentGroup


@dataclass
class FakeComponent:
    """A component that ends when asked (``ends``) or never (killed at its time-out)."""

    name: str
    kind: str
    events: list[str]
    ends: bool = True
    restart: bool = True
    max_restarts: int = 3
    restarts: int = 0
    exit_code: int | None = None
    stopping: bool = False
    code: int | None = field(default=None)

    def start(self) -> None:
        self.events.append(f"start {self.name}")

    def poll(self) -> int | None:
        return self.code

    def terminate(self) -> None:
        self.events.append(f"term {self.name}")
        if self.ends:
            self.code = 0

    def kill(self) -> None:
        self.events.append(f"kill {self.name}")
        self.code = -9

    def wait(self, timeout_s: float | None) -> int | None:
        self.events.append(f"wait {self.name}")
        return self.code

    def tail(self, lines: int = 20) -> str:
        return ""


def test_stop_together_asks_every_group_once_before_waiting_for_any() -> None:
    events: list[str] = []
    group = ComponentGroup()
    node = group.add(FakeComponent("node-a", "node", events))
    trainer = group.add(FakeComponent("trainer-p", "trainer", events, ends=False))
    events.clear()
    group.stop_together([([node], 25.0), ([trainer], 0.0)])
    assert events[:2] == ["term node-a", "term trainer-p"]  # neither waits for the other
    assert events.count("term trainer-p") == 1  # a second SIGTERM would end it at once
    assert events[-1] == "wait trainer-p" and "kill trainer-p" in events  # past its time-out
    assert node.exit_code == 0 and trainer.exit_code == -9
    assert node.stopping and trainer.stopping
