#!/usr/bin/env bash
# The test command: lint (ruff), format check, type check (mypy) and the pytest suite.
#   bash scripts/test.sh            # everything
#   bash scripts/test.sh -k codec   # extra arguments go to pytest
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$PWD/.venv/bin:$PATH"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 PYTHONHASHSEED=0
echo "== ruff"
ruff check .
ruff format --check .
echo "== mypy (proto, pipeline, models, weights)"
mypy proto pipeline models weights
echo "== pytest"
set +e
python -m pytest --durations=30 "$@"
rc=$?
set -e
# pytest exits 5 when nothing was collected: that is a failure for us too.
exit $rc
