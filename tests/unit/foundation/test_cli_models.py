"""The CLI stays light; the shared model builders are deterministic."""

from __future__ import annotations

import subprocess
import sys

import torch

from astraflow.models import build_model, build_tokenizer
from fixtures.models import tiny_spec


def test_help_does_not_import_torch() -> None:
    code = (
        "import sys\n"
        "from astraflow.cli.main import build_parser\n"
        "build_parser().format_help()\n"
        "import astraflow.records, astraflow.plugins, astraflow.config\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
    out = subprocess.run(
        [sys.executable, "-m", "astraflow.cli.main", "--help"], capture_output=True, text=True
    )
    assert out.returncode == 0 and "dataflow" in out.stdout


def test_char_tokenizer_round_trip() -> None:
    tok = build_tokenizer(tiny_spec())
    ids = tok("12+3=").input_ids
    assert tok.decode(ids) == "12+3="
    assert ids[0] >= 4  # after <pad> <bos> <eos> <unk>
    assert tok.eos_token_id == 2 and tok.pad_token_id == 0


def test_seeded_build_is_reproducible_and_leaves_global_rng() -> None:
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    a = build_model(tiny_spec(seed=5))
    assert torch.equal(torch.random.get_rng_state(), before)
    b = build_model(tiny_spec(seed=5))
    c = build_model(tiny_spec(seed=6))
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not all(torch.equal(sa[k], sc[k]) for k in sa)
    assert a.config.vocab_size == len(build_tokenizer(tiny_spec()))


def test_char_tokenizer_keeps_newlines() -> None:
    from astraflow.models.tokenizers import build_char_tokenizer

    tok = build_char_tokenizer("ab\n")
    ids = tok("a\n\nb").input_ids
    assert len(ids) == 4 and tok.unk_token_id not in ids
    assert tok.decode(ids) == "a\n\nb"
