"""One reduced quickstart with every tracker on and tokens set: the dashboard in a real
headless Chromium while it runs, then TensorBoard, W&B (offline) and MLflow read back."""

from __future__ import annotations

import os
import shutil
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from astraflow.launch.local import LocalRun, RunResult
from fixtures.launch import ROOT, reduced_quickstart, wait_for
from fixtures.trackers import tensorboard_scalars, wandb_history

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

STEPS = 25
TOKENS = {"node": "node-tok-71", "trainer": "trainer-tok-72", "admin": "admin-tok-73",
          "read": "read-tok-74"}  # fmt: skip
#: Figures every tracker must hold: trainer, eval and dataflow-report ones.
EXPECTED = {
    "trainer/policy/loss", "trainer/policy/reward_mean", "trainer/policy/grad_norm",
    "trainer/policy/step_s", "eval/policy/accuracy", "dataflow/policy/policy/buffered_samples",
    "dataflow/policy/policy/reward_mean", "dataflow/policy/policy/staleness_mean",
    "dataflow/pool/local/samples_per_s", "dataflow/pool/local/target_nodes",
    "dataflow/trainer/trainer-policy/waiting_fraction",
}  # fmt: skip
CHARTS = ("version", "reward", "heldout", "throughput", "pools", "buffers", "waiting", "transfer")


@dataclass
class LiveRun:
    launcher: LocalRun
    run_dir: Path
    thread: threading.Thread
    result: list[RunResult] = field(default_factory=list)

    def finished(self) -> RunResult:
        self.thread.join(240)
        assert self.result, "the run did not end in 240 s"
        assert self.result[0].reason == "finished", self.result[0]
        return self.result[0]


@pytest.fixture(scope="module")
def live_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveRun]:
    run_dir = tmp_path_factory.mktemp("trackers") / "qs"
    config = reduced_quickstart(
        run_dir,
        *(f"dataflow.auth.{role}={token}" for role, token in TOKENS.items()),
        "logging.tensorboard=true", "logging.wandb=true", "logging.mlflow=true",
        "logging.report_every_s=1", "policies.policy.warmup.steps=10",
        "eval.0.generator.size=20", "eval.0.every_s=2", "dataflow.dashboard.sample_s=0.5",
        steps=STEPS,
    )  # fmt: skip
    launcher = LocalRun(config)
    stop = threading.Event()
    live = LiveRun(launcher, run_dir, threading.Thread(target=lambda: None))
    live.thread = threading.Thread(target=lambda: live.result.append(launcher.run(stop)))
    live.thread.start()
    yield live
    stop.set()
    live.thread.join(120)


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _browser() -> Any:
    chromium = shutil.which("chromium")
    if chromium is None:
        pytest.skip("Debian's chromium is not installed (./scripts/test.sh installs it with "
                    "apt-get where it can): the dashboard's browser test needs it")  # fmt: skip
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright (dev extra)")
    return sync_api, chromium


def test_dashboard_in_headless_chromium(live_run: LiveRun) -> None:
    sync_api, chromium = _browser()
    link = live_run.launcher.dashboard_link()
    assert link is not None and link[1] == TOKENS["read"]
    url, token = link
    wait_for(lambda: _answers(url.removesuffix("/dashboard") + "/v1/health"), 120,
             "the run's dataflow service")  # fmt: skip
    artifacts = Path(os.environ.get("ASTRAFLOW_TEST_ARTIFACTS", ROOT / "test-artifacts"))
    artifacts.mkdir(parents=True, exist_ok=True)
    args = ["--no-sandbox"] if os.geteuid() == 0 else []  # chromium refuses root otherwise
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, args=args)
        page = browser.new_page(viewport={"width": 1400, "height": 1100})
        errors: list[str] = []
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        refused = page.goto(url)
        assert refused is not None and refused.status == 401
        assert page.locator("canvas").count() == 0 and page.locator("input[name=token]").count()
        opened = page.goto(f"{url}?token={token}")
        assert opened is not None and opened.status == 200
        assert page.url == url, "the token leaves the address bar"
        charts = "() => window.astraflowDashboard ? window.astraflowDashboard.charts() : {}"

        def state() -> dict[str, Any]:
            return dict(page.evaluate(charts))

        wait_for(lambda: "version" in state(), 120, "the first announced version on the page")
        first = state()
        wait_for(lambda: state()["version"]["last"] >= first["version"]["last"] + 3, 120,
                 "newer versions on the chart while the run goes on")  # fmt: skip
        later = state()
        for chart in ("version", "throughput", "buffers", "pools"):  # drawn from the start
            assert later[chart]["values"] > first[chart]["values"] > 0, (chart, first, later)
        wait_for(lambda: set(CHARTS) <= state().keys(), 120, "every chart drawn with data")
        final = state()
        assert all(final[chart]["values"] > 0 for chart in CHARTS), final
        assert final["version"]["values"] >= later["version"]["values"]
        assert page.evaluate("() => window.astraflowDashboard.staleness()") >= 1
        page.screenshot(path=str(artifacts / "dashboard.png"), full_page=True)
        browser.close()
    assert not errors, errors
    assert (artifacts / "dashboard.png").stat().st_size > 20_000


def _no_tokens_in(paths: list[Path]) -> None:
    for path in paths:
        data = path.read_bytes()
        assert not any(t.encode() in data for t in TOKENS.values()), path


def test_tensorboard_events_hold_every_figure(live_run: LiveRun) -> None:
    live_run.finished()
    log_dir = live_run.run_dir / "tensorboard" / "run"
    scalars = tensorboard_scalars(log_dir)
    assert scalars.keys() >= EXPECTED, sorted(EXPECTED - scalars.keys())
    assert any(t.startswith("dataflow/node/") and t.endswith("/refresh_s/policy") for t in scalars)
    # stepped by policy version, one point per trained version, in wall-time order
    loss = scalars["trainer/policy/loss"]
    assert [step for step, _, _ in loss] == list(range(1, STEPS + 1))
    walls = [wall for _, wall, _ in loss]
    assert walls == sorted(walls) and walls[-1] - walls[0] > 0
    assert max(step for step, _, _ in scalars["eval/policy/accuracy"]) == STEPS
    _no_tokens_in(list(log_dir.iterdir()))


def test_wandb_offline_run_holds_the_metrics(live_run: LiveRun) -> None:
    live_run.finished()
    rows, config = wandb_history(live_run.run_dir)
    logged = set().union(*(row.keys() for row in rows))
    assert logged >= EXPECTED, sorted(EXPECTED - logged)
    versions = [row["version"] for row in rows if "trainer/policy/loss" in row]
    assert versions == list(range(1, STEPS + 1))
    assert all("wall_time" in row for row in rows)
    assert config["resolved"]["seed"] == 0 and config["run"]["run_dir"] == str(live_run.run_dir)
    assert config["resolved"]["dataflow"]["auth"]["admin"] == "**********"
    _no_tokens_in(list((live_run.run_dir / "wandb").rglob("*.wandb")))


def test_mlflow_file_store_holds_the_metrics(live_run: LiveRun) -> None:
    live_run.finished()
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(live_run.run_dir / "mlruns").resolve().as_uri())
    experiment = client.get_experiment_by_name("astraflow")
    assert experiment is not None
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.status == "FINISHED"
    assert run.data.metrics.keys() >= EXPECTED, sorted(EXPECTED - run.data.metrics.keys())
    loss = client.get_metric_history(run.info.run_id, "trainer/policy/loss")
    assert sorted(m.step for m in loss) == list(range(1, STEPS + 1))
    assert run.data.params["seed"] == "0" and run.data.params["mode"] == "async"
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id, "config")}
    assert artifacts == {"config/run.json", "config/resolved.json"}
    _no_tokens_in([p for p in (live_run.run_dir / "mlruns").rglob("*") if p.is_file()])
