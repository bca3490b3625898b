"""A policy's final weights from a finished run's weight store, for the studies' inference
figures (greedy, sampled, majority, judged by a second policy)."""

from __future__ import annotations

from pathlib import Path


class FinalPolicy:
    """A policy's final weights from a finished run's weight store, for sampling."""

    def __init__(self, store: Path, policy: str) -> None:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        from astraflow.weights import WeightClient

        client = WeightClient(store)
        assets = client.fetch_assets(policy, store.parent / f".assets-{policy}")
        self.tok = AutoTokenizer.from_pretrained(assets)
        self.tok.padding_side = "left"
        latest = client.latest(policy)
        assert latest is not None, f"no published version of {policy}"
        dtype = getattr(torch, client.manifest(policy, latest).tensors[0].dtype)
        self.model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(assets),
                                                      dtype=dtype).eval()  # fmt: skip
        client.pull(policy, self.model.state_dict(), None, latest)
        self.version = latest

    def complete(
        self, prompts: list[str], max_new: int, samples: int = 1, *, templated: bool = False
    ) -> list[list[str]]:
        """``samples`` completions per prompt (greedy when 1, else temperature 1), decoded as
        generated; ``templated``: each prompt through the workflows' prompt template first."""
        import torch

        from astraflow.models.padding import left_padded
        from astraflow.workflows.api import encode_prompt
        from astraflow.workflows.prompts import build_prompt

        if templated:
            ids = [list(encode_prompt(self.tok, build_prompt({"prompt": p}))) for p in prompts]
        else:
            ids = [self.tok.encode(p, add_special_tokens=False) for p in prompts]
        pad = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.tok.eos_token_id
        x, mask = left_padded(ids, pad)
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=x, attention_mask=mask, max_new_tokens=max_new, pad_token_id=pad,
                eos_token_id=self.tok.eos_token_id, do_sample=samples > 1,
                temperature=1.0 if samples > 1 else None, top_p=None, top_k=None,
                num_return_sequences=samples,
            )  # fmt: skip
        texts = [self.tok.decode(r[x.shape[1] :], skip_special_tokens=True)
                 for r in out.tolist()]  # fmt: skip
        return [texts[i * samples : (i + 1) * samples] for i in range(len(prompts))]
