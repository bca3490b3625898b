"""Per-call cost of the code sandbox: kernel isolation vs the process-only mode vs bare python.

Each row runs the same short HumanEval-style program ``--calls`` times, one after another,
and prints the median and p90 wall time per call. The baselines are measured in the same
run: a bare ``python -I -S -c`` start (the floor of any subprocess sandbox) and
``isolation='process'`` (rlimits + pids cgroup + audit hook, no namespaces or jail).

    .venv/bin/python benchmarks/sandbox_overhead.py            # 30 calls per mode
    .venv/bin/python benchmarks/sandbox_overhead.py --calls 10
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

from astraflow.workflows.sandbox import Sandbox, SandboxConfig

PROGRAM = (
    "def add(a, b):\n    return a + b\n\n"
    "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n\n"
    "check(add)\n"
)


def _timed(fn: Callable[[], None], calls: int) -> list[float]:
    fn()  # warm caches (probe, page cache)
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def _sandbox(isolation: str) -> Callable[[], None]:
    sandbox = Sandbox(SandboxConfig(isolation=isolation))  # type: ignore[arg-type]

    def call() -> None:
        result = sandbox.run_sync(PROGRAM)
        assert result.passed, result.stderr

    return call


def _bare() -> None:
    subprocess.run([sys.executable, "-I", "-S", "-B", "-c", PROGRAM], check=True)


def main() -> None:
    """Print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=30, help="calls per mode")
    args = parser.parse_args()
    rows = [
        ("bare python -I -S (baseline)", _bare),
        ("isolation=process (baseline)", _sandbox("process")),
        ("isolation=kernel", _sandbox("kernel")),
    ]
    print(f"{'mode':32} {'median ms':>10} {'p90 ms':>8} {'vs process':>11}")
    base = None
    for name, fn in rows:
        times = sorted(_timed(fn, args.calls))
        median = statistics.median(times) * 1000
        p90 = times[int(0.9 * (len(times) - 1))] * 1000
        if name.startswith("isolation=process"):
            base = median
        ratio = f"{median / base:.2f}x" if base else "-"
        print(f"{name:32} {median:10.1f} {p90:8.1f} {ratio:>11}")


if __name__ == "__main__":
    main()
