"""A character-level tokenizer shipped in the package, for offline runs and tests.

It is a real ``transformers`` fast tokenizer (``tokenizer.json`` + config), so it saves and
loads like any other, vLLM can serve a model that uses it, and trainer and rollout nodes
build the identical vocabulary from the same alphabet: ids 0-3 are ``<pad> <bos> <eos> <unk>``,
then one id per character of the alphabet, in order.
"""

from __future__ import annotations

from typing import Any

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")
DEFAULT_ALPHABET = "0123456789+-*=>?,.:;()[] abcdefghijklmnopqrstuvwxyz"

# Concatenate message contents; the char tokenizer has no roles.
_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}{% endif %}"
)
ROLELESS_CHAT_TEMPLATE = _CHAT_TEMPLATE
"""The char tokenizer's chat template: contents only, no roles (chat endpoints use their own)."""


def build_char_tokenizer(alphabet: str = DEFAULT_ALPHABET) -> Any:
    """A ``PreTrainedTokenizerFast`` with one token per character of ``alphabet``."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if len(set(alphabet)) != len(alphabet):
        dup = sorted({c for c in alphabet if alphabet.count(c) > 1})
        raise ValueError(f"alphabet has repeated characters: {dup}")
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in alphabet:
        vocab[ch] = len(vocab)
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    # every character, newlines included ("." alone skips them in Oniguruma)
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
        clean_up_tokenization_spaces=False,
    )
    tok.chat_template = _CHAT_TEMPLATE
    tok.padding_side = "left"
    return tok
