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
