"""``search_agent_sft``: SFT warm-up turns for the example OpenAI search agent.

Each ``search_qa`` question gives two (prompt, completion) rows, rendered exactly as the
agent's endpoint renders the conversation for a char model (the SIMPLE chat template): the
search call with the city as query (always right), then the final answer after the tool
snippet (the agent's own observation), right with probability ``correct_prob`` and otherwise
another name in the snippet (the city, or the other fact of a founding sentence). Every
demonstration copies from the context; RL has to learn which part the question asks for.
With ``demos`` > 1 each question is demonstrated that many times, each with its own answer
draw, so the warm-up leaves several answers per question likely instead of memorising one
(a memorised answer makes every episode of a GRPO group agree: no learning signal).
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from typing import Any

from pydantic import Field

from astraflow.config import ConfigModel
from astraflow.plugins import Configured
from astraflow.workflows.chat_format import render_simple
from astraflow.workflows.corpus import build_corpus
from astraflow.workflows.tasks import GENERATORS
from astraflow.workflows.tasks.search_qa import SearchQA, SearchQAConfig
from astraflow.workflows.tools import SearchTool

__all__ = ["SearchAgentSFT"]


class SearchAgentSFTConfig(ConfigModel):
    """Config of ``search_agent_sft``."""

    questions: SearchQAConfig = Field(default_factory=SearchQAConfig)
    """The questions (their corpus must be the agent's search tool's)."""
    search: SearchTool.Config = Field(default_factory=lambda: SearchTool.Config(k=1))
    """The agent's search tool (results must read as they will at rollout)."""
    correct_prob: float = Field(default=0.3, ge=0.0, le=1.0)
    """Probability that a demonstrated final answer is right."""
    demos: int = Field(default=1, ge=1)
    """Demonstrated episodes per question, each with its own answer draw: with several, the
    warm-up learns a spread of answers per question instead of memorising one."""
    eos: str = "<eos>"
    """The char tokenizer's EOS token text (closes assistant turns in the template)."""
    seed: int = 0
    """Seed of the answer noise."""


@GENERATORS.register("search_agent_sft")
class SearchAgentSFT(Configured[SearchAgentSFTConfig]):
    """Rows ``{prompt, completion, correct}``: the agent's two turns per demonstration."""

    Config = SearchAgentSFTConfig

    def rows(self) -> Iterator[dict[str, Any]]:
        """Two rows per demonstration: the search call, then the (noisy) answer."""
        from astraflow.examples.openai_search_agent import TOOLS, first_messages, snippet

        cfg = self.config
        corpus = build_corpus(cfg.questions.corpus_seed, cfg.questions.corpus_size)
        titles = {d.doc_id: d.title for d in corpus.documents}
        facts: dict[str, list[str]] = {}
        for qa in corpus.questions:
            facts.setdefault(qa.doc_id, []).append(qa.answer)
        tool = SearchTool(cfg.search)
        for row in SearchQA(cfg.questions).rows():
            rng = random.Random(f"agent-sft:{cfg.seed}:{row['id']}")
            messages = first_messages(row["prompt"])
            args = json.dumps({"query": titles[row["doc_id"]]})
            call = '<tool_call>{"name": "search", "arguments": ' + args + "}</tool_call>"
            call_row = {
                "id": f"{row['id']}-call" + ("" if cfg.demos == 1 else "-0"),
                "prompt": render_simple(messages, TOOLS, cfg.eos, generation_prompt=True),
                "completion": call,
                "correct": True,
            }
            yield call_row
            messages += [
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [{"id": "c", "function": {"name": "search", "arguments": args}}],
                },
                {
                    "role": "tool",
                    "content": snippet(
                        tool.search(titles[row["doc_id"]]), row["prompt"], titles[row["doc_id"]]
                    ),
                },
            ]
            seen = str(messages[-1]["content"])
            # wrong answers are other names in the snippet (the city, the other fact of a
            # founding sentence): every demonstration copies from the context, 30% the right part
            others = sorted(
                f
                for f in {titles[row["doc_id"]], *facts[row["doc_id"]]}
                if f != row["answer"] and f in seen
            )
            answer_prompt = render_simple(messages, TOOLS, cfg.eos, generation_prompt=True)
            for k in range(cfg.demos):
                suffix = "" if cfg.demos == 1 else f"-{k}"
                if k:  # every demonstration is a whole episode: the call, then the answer
                    yield {**call_row, "id": f"{row['id']}-call{suffix}"}
                right = rng.random() < cfg.correct_prob or not others
                yield {
                    "id": f"{row['id']}-answer{suffix}",
                    "prompt": answer_prompt,
                    "completion": row["answer"] if right else rng.choice(others),
                    "correct": right,
                }
