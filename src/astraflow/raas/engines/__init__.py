"""Engines behind one protocol (``base.Engine``): transformers, vllm, sglang, openai."""
