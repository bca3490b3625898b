"""Registers the built-in engines with ``ENGINES`` (imported on the registry's first lookup).

Each adapter module imports its heavy backend (torch, vLLM) only where it needs it, so
resolving ``openai`` never loads vLLM.
"""

from astraflow.raas.engines import openai, sglang, transformers, vllm

__all__ = ["openai", "sglang", "transformers", "vllm"]
