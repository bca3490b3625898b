"""``astraflow config check`` and the plan-time checks: every section typed, every plug-in
spec resolved and validated before anything starts, each problem naming its key path."""

from __future__ import annotations

from pathlib import Path

import pytest

from astraflow.cli.main import main
from astraflow.config import ConfigModel, load_config
from astraflow.errors import ConfigError
from astraflow.launch.checks import check_run
from astraflow.launch.config import RunConfig
from astraflow.launch.plan import make_plan, node_config, sync_round_tasks
from astraflow.workflows.registry import WORKFLOWS, PolicyName

ROOT = Path(__file__).resolve().parents[3]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
QUICKSTART = ROOT / "examples" / "quickstart.yaml"


def _check(capsys: pytest.CaptureFixture[str], config: Path, *overrides: str) -> tuple[int, str]:
    args = ["config", "check", "--config", str(config)]
    for item in overrides:
        args += ["--set", item]
    code = main(args)
    captured = capsys.readouterr()
    return code, captured.out + captured.err


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_every_example_checks_clean(example: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out = _check(capsys, example)
    assert code == 0, out
    assert "ok" in out


# (section, --set override with a misspelt key, the key path reported, a key listed as allowed)
MISSPELT = [
    ("trainer", "policies.policy.trainer.max_step=3", "", "max_steps"),
    ("trainer nested", "policies.policy.trainer.optimizer.learning_rate=1", "", "grad_clip"),
    ("rollout", "policies.policy.rollout.refreshh=eager", "", "refresh"),
    ("rollout engine", "policies.policy.rollout.engine.max_batch=4", "", "max_batch_size"),
    ("pool node", "pools.0.node.lease_wait=1", "", "lease_wait_s"),
    ("pool policies", "pools.0.policies.policy.enigne={type: vllm}", "", "engine"),
    ("pool policy engine", "pools.0.policies.policy.engine.thread=2", "", "threads"),
    ("workflows", "workflows.rlvr.sampling.temprature=0.5", "", "temperature"),
    (
        "workflow reward",
        "workflows.rlvr.reward={type: synthetic_exact, strp: 1}",
        "workflows.rlvr.reward.strp",
        "strip",
    ),
    ("tools", "tools.calculator.max_char=10", "", "max_chars"),
    ("weights", "weights.full_evry=3", "", "full_every"),
    ("warmup", "policies.policy.warmup.stepz=3", "", "steps"),
    ("warmup generator", "policies.policy.warmup.generator.correct_p=0.5", "", "correct_prob"),
    ("warmup generator task", "policies.policy.warmup.generator.task.sise=5", "", "size"),
    ("source generator", "sources.0.generator.sise=5", "", "size"),
    ("source", "sources.0.group_sise=5", "", "group_size"),
    ("eval", "eval.0.every=3", "", "every_s"),
    ("eval generator", "eval.0.generator.splt=eval", "", "split"),
    ("dataflow", "dataflow.leas={ttl_s: 3}", "", "lease"),
    ("dataflow regulation", "dataflow.regulation.window=3", "", "window_s"),
    (
        "dataflow sampler",
        "dataflow.sampler={type: replay, ration: 0.5}",
        "dataflow.sampler.ration",
        "ratio",
    ),
    (
        "dataflow filters",
        "dataflow.filters=[{type: length, max_tokns: 3}]",
        "dataflow.filters.0.max_tokns",
        "",
    ),
    ("autoscale", "autoscale.interval=3", "", "interval_s"),
    ("ray", "ray.place_timeout=3", "", "place_timeout_s"),
    ("top level", "max_time=3", "", "max_time_s"),
]


@pytest.mark.parametrize(
    ("override", "path", "allowed"), [m[1:] for m in MISSPELT], ids=[m[0] for m in MISSPELT]
)
def test_a_misspelt_key_fails_naming_its_path(
    override: str, path: str, allowed: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out = _check(capsys, QUICKSTART, override)
    assert code == 1, out
    assert f"unknown key '{path or override.split('=', 1)[0]}'" in out, out
    assert "(allowed: " in out and allowed in out, out


def test_an_unknown_plugin_names_its_path_and_the_known_ones(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out = _check(capsys, QUICKSTART, "sources.0.workflow=rlvx")
    assert code == 1 and "workflows.rlvx.type: unknown workflow 'rlvx'" in out, out
    assert "rlvr" in out and "solver_verifier" in out  # the registry's names, not a copy
    code, out = _check(capsys, QUICKSTART, "policies.policy.rollout.engine.type=vlm")
    assert code == 1 and "policies.policy.rollout.engine.type: unknown engine 'vlm'" in out
    code, out = _check(capsys, QUICKSTART, "workflows.rlvr.reward=exactt")
    assert code == 1 and "workflows.rlvr.reward.type: unknown reward 'exactt'" in out


def test_a_workflow_role_must_name_a_policy_of_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out = _check(capsys, QUICKSTART, "workflows.rlvr.policy=solver")
    assert code == 1 and "workflows.rlvr.policy: policy 'solver' is not in policies" in out
    # defaults count too: a built-in workflow left unconfigured calls policy 'policy'
    bare = tmp_path / "bare.yaml"
    bare.write_text(
        "policies: {p: {model: {model_type: qwen3, tokenizer: {type: char}}}}\n"
        "sources: [{name: s, type: generator, generator: add1, workflow: rlvr, policies: [p]}]\n"
    )
    code, out = _check(capsys, bare)
    assert code == 1 and "workflows.rlvr.policy: policy 'policy' is not in policies (p)" in out


def test_a_bad_file_exits_non_zero(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("policies: [\n")
    code, out = _check(capsys, bad)
    assert code == 1 and "not valid YAML" in out


class _ProbeConfig(ConfigModel):
    judge: PolicyName = "judge"
    """A role."""
    rounds: int = 1
    """Something."""


@WORKFLOWS.register("probe_from_a_test")
class _Probe:
    """A workflow registered by someone else: checked by its own Config, no list edited."""

    Config = _ProbeConfig

    def __init__(self, config: _ProbeConfig, rng: object) -> None:
        self.config = config


def test_a_plugin_registered_elsewhere_is_checked_by_its_config() -> None:
    config = load_config(
        RunConfig,
        QUICKSTART,
        ["workflows.extra={type: probe_from_a_test, judge: policy, roundz: 2}"],
    )
    assert check_run(config) == ["unknown key 'workflows.extra.roundz' (allowed: judge, rounds)"]
    config = load_config(RunConfig, QUICKSTART, ["workflows.extra={type: probe_from_a_test}"])
    assert check_run(config) == [
        "workflows.extra.judge: policy 'judge' is not in policies (policy)"
    ]


def test_the_plan_checks_before_it_builds_or_writes(tmp_path: Path) -> None:
    config = load_config(
        RunConfig,
        QUICKSTART,
        [f"run_dir={tmp_path / 'run'}", "workflows.rlvr.sampling.temprature=0.5"],
    )
    with pytest.raises(ConfigError, match=r"workflows\.rlvr\.sampling\.temprature"):
        make_plan(config, port=1)
    assert not (tmp_path / "run").exists()


def test_pool_overrides_replace_only_the_keys_they_give(tmp_path: Path) -> None:
    config = load_config(
        RunConfig,
        QUICKSTART,
        [
            f"run_dir={tmp_path}",
            "policies.policy.rollout={refresh: lazy, engine: {type: transformers, threads: 2}}",
            "pools.0.policies.policy.engine={type: transformers, threads: 1}",
            "pools.0.node.grace_s=3",
        ],
    )
    plan = make_plan(config, port=1)
    node = node_config(plan, config.pools[0], node_id="n1")
    rollout = node.policies["policy"]
    assert rollout.refresh == "lazy"  # from the policy
    assert rollout.engine.kwargs == {"threads": 1}  # from the pool
    assert node.grace_s == 3 and node.capacity == 16 and node.node_id == "n1"
    assert node.workflows["rlvr"].kwargs["sampling"] == {"max_new_tokens": 3, "temperature": 1.0}
    assert plan.trainers["policy"].weights_options == config.weights


def test_sync_round_size_is_decided_once_for_dataflow_and_trainer(tmp_path: Path) -> None:
    config = load_config(RunConfig, QUICKSTART, [f"run_dir={tmp_path}", "mode=sync"])
    plan = make_plan(config, port=1)
    # 128 samples per batch / 8 per group = 16 tasks per round
    assert plan.sync_round_tasks == 16
    assert plan.dataflow.regulation.mode == "sync"
    assert plan.dataflow.regulation.sync_round_tasks == 16
    assert plan.trainers["policy"].batch.max_samples == 16 * 8
    assert plan.dataflow.policies["policy"].max_staleness == 0
    config = load_config(
        RunConfig, QUICKSTART, [f"run_dir={tmp_path}", "mode=sync", "sync_round_tasks=5"]
    )
    plan = make_plan(config, port=1)
    assert plan.dataflow.regulation.sync_round_tasks == 5
    assert plan.trainers["policy"].batch.max_samples == 40
    asynchronous = make_plan(load_config(RunConfig, QUICKSTART, [f"run_dir={tmp_path}"]), port=1)
    assert asynchronous.sync_round_tasks is None
    assert asynchronous.dataflow.regulation.mode == "async"
    assert asynchronous.trainers["policy"].batch.max_samples == 128


def test_a_sync_round_holds_a_batch_for_every_trainer(tmp_path: Path) -> None:
    example = ROOT / "examples" / "solver_verifier.yaml"
    config = load_config(RunConfig, example, [f"run_dir={tmp_path}", "mode=sync"])
    # one source feeds both trainers (128-sample batches, groups of 8): 16 tasks fill both
    assert sync_round_tasks(config) == 16
    one = config.sources[0]

    def split(solver: float, verifier: float) -> int | None:
        sources = [one.model_copy(update={"name": "a", "policies": ["solver"], "weight": solver}),
                   one.model_copy(update={"name": "b", "policies": ["verifier"],
                                          "weight": verifier})]  # fmt: skip
        return sync_round_tasks(config.model_copy(update={"sources": sources}))

    assert split(1, 1) == 32  # a source per trainer: the round holds both batches
    assert split(3, 1) == 64  # the verifier's source gets a quarter of the round's tasks
