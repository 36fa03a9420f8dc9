#!/usr/bin/env bash
# GPU check of the learner on a CUDA host (the lent H200): Triton token_stats vs the PyTorch
# path (values, grads, timing) and the learner step's tokens/s and MFU. Prints one JSON line
# per benchmark (last lines of the output); logs go to $OUT (when set) or /tmp/gpu_check.
#
#   bash scripts/gpu_check.sh            # from the repository root
#
# Wheels in .whl/ (megatron-core, fetched on a host with pip: see docs/PERFORMANCE.md, "GPU")
# are installed to /tmp/site first; the host needs torch and triton already.
# Env: TS_TIMEOUT / LEARNER_TIMEOUT (seconds per benchmark), LEARNER_ARGS (extra arguments).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
LOG=${OUT:-/tmp/gpu_check}
mkdir -p "$LOG"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,memory.used --format=csv,noheader || true
"$PY" -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
timeout "${TS_TIMEOUT:-150}" "$PY" benchmarks/token_stats_gpu.py 2>"$LOG/token_stats.err" |
    tee "$LOG/token_stats.json"
echo "token_stats_gpu rc=${PIPESTATUS[0]}"
tail -n 5 "$LOG/token_stats.err"
# shellcheck disable=SC2086
timeout "${LEARNER_TIMEOUT:-300}" "$PY" benchmarks/learner.py ${LEARNER_ARGS:-} \
    2>"$LOG/learner.err" | tee "$LOG/learner.json"
echo "learner rc=${PIPESTATUS[0]}"
grep -v -i "warn" "$LOG/learner.err" | tail -n 8
echo "== JSON"
cat "$LOG/token_stats.json" "$LOG/learner.json"
