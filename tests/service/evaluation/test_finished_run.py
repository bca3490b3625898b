"""Evaluation and export of a finished tiny run: ``astraflow eval --run-dir`` (avg@k, pass@k
for k = 1, 4, 8), milestones while a policy trains, the Hugging Face export round trip
(transformers loads identical weights and tokenizer) and bad input naming the problem."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from astraflow.cli.main import main
from astraflow.evaluation.runner import Evaluator
from astraflow.launch.rundir import RunDir
from astraflow.models import build_model, build_tokenizer
from astraflow.weights import WeightClient, WeightStore, WeightStoreConfig
from fixtures.finished_run import make_finished_run
from fixtures.launch import reduced_quickstart

K4_SET = "[{name: k4, generator: {type: add1, split: eval, size: 40}, k: 4, greedy: false}]"


class Finished:
    def __init__(self, root: Path) -> None:
        self.dir = root / "run"
        self.tensors = make_finished_run(self.dir, f"eval.0.sets={K4_SET}")
        self.spec = reduced_quickstart(self.dir).policies["policy"].model


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> Finished:
    return Finished(tmp_path_factory.mktemp("finished"))


@pytest.fixture(autouse=True)
def _keep_torch_threads() -> Any:
    """The evaluator sets its process's torch threads (its config's ``threads``): restore."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_eval_of_a_finished_run_reports_avg_and_pass_at_k(
    finished: Finished, capsys: pytest.CaptureFixture[str]
) -> None:
    out = finished.dir / "eval" / "policy.jsonl"
    before = len(records(out))
    code = main(["eval", "--run-dir", str(finished.dir), "--version", "2", "--set", "k=8",
                 "--set", "pass_at=[1, 4, 8]", "--log-level", "WARNING"])  # fmt: skip
    assert code == 0
    rec = records(out)[-1]
    assert len(records(out)) == before + 1 and rec["version"] == 2
    assert f"policy v2: accuracy {rec['accuracy']:.3f}" in capsys.readouterr().out
    # the main set: greedy accuracy, then 8 samples per task; the k4 set: 4 samples per task
    assert rec["n"] == 40 and rec["k"] == 8 and rec["k4/n"] == 40 and "k4/accuracy" not in rec
    main_set = [rec["pass@1"], rec["pass@4"], rec["pass@8"]]
    assert 0 < main_set[0] <= main_set[1] <= main_set[2] <= 1
    assert main_set[2] > main_set[0] + 0.05, "some tasks are solved by only a few samples"
    # binary rewards: the unbiased pass@1 is the mean success of all samples, i.e. avg@k
    assert rec["pass@1"] == pytest.approx(rec["avg@8"], abs=1e-9)
    assert rec["k4/pass@1"] == pytest.approx(rec["k4/avg@4"], abs=1e-9)
    assert 0 <= rec["k4/pass@1"] <= rec["k4/pass@2"] <= rec["k4/pass@4"] <= 1
    # k = 1: one sample per task; pass@1 = avg@1
    code = main(["eval", "--run-dir", str(finished.dir), "--set", "k=1", "--set", "sets=[]",
                 "--log-level", "WARNING"])  # fmt: skip
    rec1 = records(out)[-1]
    assert code == 0 and rec1["version"] == 2, "the newest version by default"
    assert rec1["k"] == 1 and rec1["pass@1"] == pytest.approx(rec1["avg@1"])
    assert rec1["accuracy"] == rec["accuracy"], "greedy decoding is deterministic"


def test_evaluator_scores_milestones_and_the_final_version(
    finished: Finished, tmp_path: Path
) -> None:
    config = RunDir(finished.dir).eval_config(
        "policy",
        [f"weights={tmp_path / 'w'}", f"out={tmp_path / 'eval.jsonl'}", "every_versions=2",
         "sets=[]", "generator.size=10"],
    )  # fmt: skip
    with WeightStore(tmp_path / "w") as store:
        store.publish_assets("policy", WeightClient(finished.dir / "weights").fetch_assets(
            "policy", tmp_path / "assets"))  # fmt: skip
        evaluator = Evaluator(config)
        seen = []
        for version in range(4):
            store.publish("policy", version, finished.tensors).result()
            record = evaluator.step()
            seen.append(None if record is None else record["version"])
        final = evaluator.step(final=True)
    assert seen == [0, None, 2, None], "every second version is a milestone"
    assert final is not None and final["version"] == 3, "the final version is always scored"
    assert [r["version"] for r in records(tmp_path / "eval.jsonl")] == [0, 2, 3]


def test_a_fresh_evaluator_builds_from_assets_early_and_scores_version_0_first(
    finished: Finished, tmp_path: Path
) -> None:
    """The trainer publishes assets before its warm-up: the evaluator builds its model then.
    Started late (versions 0-3 out), a fresh one scores version 0 first, then the newest; a
    restarted one (its policy already has records) goes to the newest at once."""
    out = tmp_path / "eval.jsonl"
    config = RunDir(finished.dir).eval_config(
        "policy", [f"weights={tmp_path / 'w'}", f"out={out}", "sets=[]", "generator.size=10"]
    )
    with WeightStore(tmp_path / "w") as store:
        evaluator = Evaluator(config)
        assert evaluator.step() is None and evaluator.model is None  # nothing out yet
        store.publish_assets("policy", WeightClient(finished.dir / "weights").fetch_assets(
            "policy", tmp_path / "assets"))  # fmt: skip
        assert evaluator.step() is None, "no version yet"
        early = evaluator.model
        assert early is not None and early.dtype == torch.float32  # from the assets alone
        for version in range(4):
            store.publish("policy", version, finished.tensors).result()
        first, second = evaluator.step(), evaluator.step()
        assert evaluator.model is early, "the early model is the one loaded"
        restarted = Evaluator(config)
        third = restarted.step()
    assert first is not None and first["version"] == 0
    assert second is not None and second["version"] == 3
    assert third is not None and third["version"] == 3, "a restart does not go back to 0"
    assert [r["version"] for r in records(out)] == [0, 3, 3]


def test_export_round_trip_gives_identical_logits_and_tokens(
    finished: Finished, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

    out = tmp_path / "hf"
    code = main(["export", "--run-dir", str(finished.dir), "--out", str(out)])
    assert code == 0 and f"exported policy v2 (float32) to {out}" in capsys.readouterr().out
    for name in ("model.safetensors", "config.json", "generation_config.json", "tokenizer.json"):
        assert (out / name).is_file(), name
    exported = AutoModelForCausalLM.from_pretrained(out).eval()
    trained = build_model(finished.spec)  # the trainer's architecture, with its v2 tensors
    trained.load_state_dict(finished.tensors)
    assert exported.dtype == torch.float32
    ours = build_tokenizer(finished.spec)
    theirs = AutoTokenizer.from_pretrained(out)
    assert isinstance(theirs, PreTrainedTokenizerFast)
    text = "3+4=7"
    ids = theirs.encode(text, add_special_tokens=False)
    assert ids == ours.encode(text, add_special_tokens=False) and theirs.decode(ids) == text
    assert (theirs.eos_token_id, theirs.pad_token_id) == (ours.eos_token_id, ours.pad_token_id)
    batch = torch.tensor([ids, theirs.encode("9+9=1", add_special_tokens=False)])
    with torch.inference_mode():
        assert torch.equal(exported(batch).logits, trained(batch).logits)
    assert exported.generation_config.eos_token_id == ours.eos_token_id


def _eval_config(finished: Finished, tmp_path: Path, *overrides: str) -> Any:
    """The run's evaluator config, reading the store under ``tmp_path / 'w'``."""
    return RunDir(finished.dir).eval_config(
        "policy", [f"weights={tmp_path / 'w'}", f"out={tmp_path / 'eval.jsonl'}", "sets=[]",
                   "generator.size=10", *overrides],
    )  # fmt: skip


@contextlib.contextmanager
def _bf16_store(
    finished: Finished, tmp_path: Path
) -> Iterator[Callable[[int], dict[str, torch.Tensor]]]:
    """A store under ``tmp_path / 'w'`` with the run's assets, open for the block. Yields
    ``publish(version)``: it publishes the run's tensors with 5% of the elements moved, in
    bfloat16 (the embeddings tied to the head, as a trainer's are), and returns the values
    published."""
    gen = torch.Generator().manual_seed(0)
    with WeightStore(tmp_path / "w") as store:
        store.publish_assets("policy", WeightClient(finished.dir / "weights").fetch_assets(
            "policy", tmp_path / "assets"))  # fmt: skip

        def publish(version: int) -> dict[str, torch.Tensor]:
            tensors = {name: t + (torch.rand(t.shape, generator=gen) < 0.05) * 0.25 * version
                       for name, t in finished.tensors.items()}  # fmt: skip
            if "lm_head.weight" in tensors:
                tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
            store.publish("policy", version, tensors, dtype=torch.bfloat16).result()
            return {k: v.to(torch.bfloat16) for k, v in tensors.items()}

        yield publish


@pytest.mark.parametrize(("choice", "computes"), [("auto", torch.float32),
                                                  ("published", torch.bfloat16)])  # fmt: skip
def test_bf16_versions_are_evaluated_in_float32_holding_the_published_values(
    finished: Finished, tmp_path: Path, choice: str, computes: torch.dtype
) -> None:
    """A bfloat16 publication: by default the evaluator (on the CPU) computes in float32,
    with exactly the published values, version after version (delta pulls apply to a copy in
    bfloat16); ``dtype: published`` computes in bfloat16."""
    published: dict[int, dict[str, torch.Tensor]] = {}
    with _bf16_store(finished, tmp_path) as publish:
        evaluator = Evaluator(_eval_config(finished, tmp_path, f"dtype={choice}"))
        for version in range(3):
            published[version] = publish(version)
            record = evaluator.step()
            assert record is not None and record["version"] == version
            assert evaluator.model.dtype == computes
            state = evaluator.model.state_dict()
            for name, value in published[version].items():
                assert torch.equal(state[name], value.to(computes)), (version, name)
    delta = WeightClient(tmp_path / "w").manifest("policy", 2)
    assert delta.base is not None, "version 2 is a delta: the evaluator applied it"


def test_a_failed_pull_keeps_the_bf16_copy_for_the_next_delta(
    finished: Finished, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A pull that fails because a file is not served changes nothing: the evaluator's bf16
    copy still holds the version before, and the next try is a delta on it again."""
    from astraflow.errors import NotFoundError
    from astraflow.weights.manifest import DELTA_FILE, version_dir

    published: dict[int, dict[str, torch.Tensor]] = {}
    with _bf16_store(finished, tmp_path) as publish:
        evaluator = Evaluator(_eval_config(finished, tmp_path))
        for version in range(3):
            published[version] = publish(version)
            if version < 2:
                assert evaluator.step() is not None
        delta = tmp_path / "w" / version_dir("policy", 2) / DELTA_FILE
        delta.rename(delta.with_suffix(".away"))
        with pytest.raises(NotFoundError, match=DELTA_FILE):
            evaluator.step()
        delta.with_suffix(".away").rename(delta)
        with caplog.at_level("INFO", logger="astraflow.weights.client"):
            record = evaluator.step()
    assert record is not None and record["version"] == 2
    pulls = [r.getMessage() for r in caplog.records if r.getMessage().startswith("pulled")]
    assert len(pulls) == 1 and "have=1 want=2 path=chain" in pulls[0], pulls
    assert evaluator.model.dtype == torch.float32
    state = evaluator.model.state_dict()
    for name, value in published[2].items():
        assert torch.equal(state[name], value.to(torch.float32)), name


def test_export_keeps_a_bf16_publication_bf16(finished: Finished, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from astraflow.export import export_version

    with WeightStore(tmp_path / "w") as store:
        store.publish_assets("policy", WeightClient(finished.dir / "weights").fetch_assets(
            "policy", tmp_path / "assets"))  # fmt: skip
        store.publish("policy", 5, finished.tensors, dtype=torch.bfloat16).result()
    done = export_version(tmp_path / "w", "policy", 5, tmp_path / "hf")
    assert done.dtype == "bfloat16"
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    # how a rollout node runs a bf16 publication: built in bf16, the published tensors loaded
    trained = build_model(finished.spec.model_copy(update={"dtype": "bfloat16"}))
    trained.load_state_dict({k: v.to(torch.bfloat16) for k, v in finished.tensors.items()})
    assert exported.dtype == torch.bfloat16
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.inference_mode():
        assert torch.equal(exported(ids).logits, trained(ids).logits)


@pytest.mark.parametrize(
    ("args", "problem"),
    [
        (["eval", "--run-dir", "{missing}"], "run directory {missing} does not exist"),
        (["eval", "--run-dir", "{run}", "--version", "7"],
         "policy 'policy' has no version 7 in its weight store (kept: 0, 1, 2)"),
        (["eval", "--run-dir", "{run}", "--policy", "critic"],
         "has no policy 'critic' (policies: policy)"),
        (["eval", "--run-dir", "{run}", "--set", "k=2", "--set", "pass_at=[4]"],
         "pass_at values [4] must lie in 1..k (k=2)"),
        (["export", "--run-dir", "{missing}", "--out", "{out}"],
         "run directory {missing} does not exist"),
        (["export", "--run-dir", "{run}", "--version", "9", "--out", "{out}"],
         "has no version 9"),
        (["export", "--run-dir", "{run}", "--policy", "critic", "--out", "{out}"],
         "has no policy 'critic'"),
        (["export", "--run-dir", "{run}", "--out", "{run}"], "exists and is not empty"),
    ],
)  # fmt: skip
def test_bad_input_names_the_problem_and_writes_nothing(
    finished: Finished,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    args: list[str],
    problem: str,
) -> None:
    paths = {"missing": str(tmp_path / "nope"), "run": str(finished.dir),
             "out": str(tmp_path / "out")}  # fmt: skip
    eval_file = finished.dir / "eval" / "policy.jsonl"
    before = eval_file.read_bytes() if eval_file.exists() else b""
    code = main([a.format(**paths) for a in args])
    err = capsys.readouterr().err
    assert code == 2 and problem.format(**paths) in err, err
    assert (eval_file.read_bytes() if eval_file.exists() else b"") == before
    assert not (tmp_path / "out").exists()


def test_push_to_hub_without_the_network_names_the_repo(
    finished: Finished,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "hf"
    code = main(["export", "--run-dir", str(finished.dir), "--out", str(out),
                 "--push-to-hub", "someone/tiny"])  # fmt: skip
    assert code == 2 and "cannot push to 'someone/tiny'" in capsys.readouterr().err
    assert (out / "model.safetensors").is_file(), "the export itself is kept"


def test_evaluator_moves_on_when_its_version_was_collected_before_the_pull(
    finished: Finished, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The trainer outran a slow evaluator: the version it read as newest is collected by the
    time it pulls. It scores the newest version instead of crashing (a crash restarted it
    into the same race and failed the whole run)."""
    config = RunDir(finished.dir).eval_config(
        "policy",
        [f"weights={tmp_path / 'w'}", f"out={tmp_path / 'eval.jsonl'}", "sets=[]",
         "generator.size=10"],
    )  # fmt: skip
    with WeightStore(
        tmp_path / "w", WeightStoreConfig(keep=2, full_every=1, keep_first=False)
    ) as store:
        store.publish_assets("policy", WeightClient(finished.dir / "weights").fetch_assets(
            "policy", tmp_path / "assets"))  # fmt: skip
        evaluator = Evaluator(config)
        store.publish("policy", 0, finished.tensors).result()
        real_latest = evaluator.client.latest
        answers = iter([0])  # what `latest` said just before the trainer published 1-5
        monkeypatch.setattr(evaluator.client, "latest", lambda p: next(answers, real_latest(p)))
        for version in range(1, 6):
            store.publish("policy", version, finished.tensors).result()
        assert store.files.versions("policy") == [4, 5], "the store kept the newest two"
        record = evaluator.step()
    assert record is not None and record["version"] == 5
    assert [r["version"] for r in records(tmp_path / "eval.jsonl")] == [5]
