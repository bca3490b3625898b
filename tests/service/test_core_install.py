"""``pip install astraflow`` with no extras runs a dataflow service and a weight server: a
fresh virtual environment (no system packages, no torch) built from this source tree, both
servers started with its ``astraflow`` command and answering over real HTTP."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import torch

from fixtures.dataflow import make_config
from fixtures.net import free_port

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def core_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A plain venv with ``pip install <this tree>`` (no extras); its ``bin`` directory."""
    base = tmp_path_factory.mktemp("core-install")
    source = base / "source"  # a copy: building in the tree would leave build/ behind
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(ROOT / "src", source / "src", ignore=shutil.ignore_patterns("__pycache__"))
    venv = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    done = subprocess.run(
        [*pip, "--disable-pip-version-check", str(source)], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return venv / "bin"


@contextmanager
def _serving(cmd: list[str], health: str, log: Path) -> Iterator[subprocess.Popen[bytes]]:
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, f"{cmd[1:3]} exited: {log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"{cmd[1:3]} did not start: {log.read_text()}"
            try:
                if httpx.get(health, timeout=1.0).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        yield proc
    finally:
        proc.terminate()
        proc.wait(30)


def test_the_core_install_has_no_torch(core_venv: Path) -> None:
    python = str(core_venv / "python")
    done = subprocess.run([python, "-c", "import torch"], capture_output=True, text=True)
    assert done.returncode != 0 and "No module named 'torch'" in done.stderr
    imported = subprocess.run(
        [
            python,
            "-c",
            "import sys, astraflow.cli.main, astraflow.dataflow.server, astraflow.weights.server;"
            "print(sorted(m for m in ('torch', 'transformers', 'matplotlib') if m in sys.modules))",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert imported.stdout.strip() == "[]"


def test_the_core_install_serves_a_dataflow(core_venv: Path, tmp_path: Path) -> None:
    port = free_port()
    config = make_config(tmp_path / "dataflow").model_copy(update={"port": port})
    path = tmp_path / "dataflow.json"
    path.write_text(json.dumps(config.model_dump(mode="json")))
    url = f"http://127.0.0.1:{port}"
    cmd = [str(core_venv / "astraflow"), "dataflow", "serve", "--config", str(path)]
    with _serving(cmd, f"{url}/v1/health", tmp_path / "dataflow.log"):
        report = httpx.get(f"{url}/v1/report", timeout=10).json()
        lease = httpx.post(
            f"{url}/v1/lease",
            json={"node_id": "n1", "capacity": 2, "workflows": ["rlvr"], "versions": {}},
            timeout=10,
        )
        # the dashboard's page and charting library ship in the wheel (package data)
        page = httpx.get(f"{url}/dashboard", timeout=10)
        charts = httpx.get(f"{url}/dashboard/static/uPlot.iife.min.js", timeout=10)
    assert page.status_code == 200 and "dashboard.js" in page.text
    assert charts.status_code == 200 and len(charts.content) > 10_000
    assert "policies" in report
    assert lease.status_code == 200, lease.text
    assert len(lease.json()["tasks"]) == 2  # real tasks from the JSONL source


def test_the_core_install_serves_weights_and_merges_deltas(core_venv: Path, tmp_path: Path) -> None:
    from astraflow.weights import WeightStore, WeightStoreConfig, manifest_ref

    root = tmp_path / "store"
    store = WeightStore(root, WeightStoreConfig(full_every=10))
    weights = {"w": torch.zeros(64), "b": torch.ones(8)}
    for version in range(3):  # v0 full, then two deltas (made here, where torch is)
        weights["w"][version] = version + 1.0
        store.publish("p", version, weights).result(timeout=60)
    store.close()
    port = free_port()
    url = f"http://127.0.0.1:{port}/v1/weights"
    cmd = [str(core_venv / "astraflow"), "weights", "serve", "--root", str(root)]
    cmd += ["--port", str(port)]
    with _serving(cmd, f"{url}/health", tmp_path / "weights.log"):
        latest = httpx.get(f"{url}/p/latest", timeout=10).json()
        merged = httpx.get(f"{url}/p/merged/0/2", timeout=30)
        manifest = httpx.get(f"{url}/files/{manifest_ref('p', 2)}", timeout=10).json()
    assert latest == {"policy": "p", "version": 2}
    assert merged.status_code == 200, merged.text
    # composed without torch: the merged delta lands exactly on version 2
    assert merged.json()["checksum"] == manifest["checksum"]
    assert merged.json()["base"] == 0
