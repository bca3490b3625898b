"""Shared pytest set-up: fixture modules per component live in tests/fixtures/."""

pytest_plugins = [
    "fixtures.models",
    "fixtures.net",
    "fixtures.dataflow",
    "fixtures.weights",
    "fixtures.trainer",
    "fixtures.raas",
    "fixtures.workflows",
]


def pytest_collection_finish(session: object) -> None:
    """In-process torch work in tests runs on one thread: the tensors are tiny, and on a busy
    2-core machine torch's default of one thread per core spins against other processes
    (a tiny GRPO step was ~30x slower with two threads at load average 20). Processes the
    tests start choose their own threads."""
    import sys

    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(1)
