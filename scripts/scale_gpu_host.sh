#!/usr/bin/env bash
# Weight delivery to many generators on a many-core host (a 2-GPU machine):
#   1. benchmarks/collective_bcast.py --backend nccl, N = 1 (GPU 0 -> GPU 1), 100 MB .. 7 GB, and
#      the product's publish round over NCCL (tests/pipeline/test_weight_collective.py -k nccl)
#   2. benchmarks/collective_bcast.py --backend gloo, N = 1, 4, 16, 100 MB and 1 GB, the tree
#      broadcast (--chunk-mb 0) against the pipelined chain (4 MiB pieces)
#   3. benchmarks/scale.py --weights (each simulated generator a process of its own), N = 1, 4,
#      16, 10 / 100 / 1000 MB, transports zmq, shared_fs, collective (pipelined, the default)
#   4. the same for collective with the tree broadcast (--collective-chunk-mb 0), N = 1, 16
# One JSON line per configuration in $LOG/*.jsonl (LOG defaults to $OUT), each part bounded by
# its own timeout. All parts take ~11 minutes on a 16-core host: one device call allows 10, so
# run it as two calls, PARTS="nccl bcast" (~4 min) and PARTS="scale tree" (~7 min).
#
#   bash scripts/scale_gpu_host.sh            # from the repository root
#   PARTS="bcast scale" bash scripts/scale_gpu_host.sh   # parts: nccl bcast scale tree
#   PARTS="bcast scale tree" GENS=1,2 SMALL_MB=5,10 BIG_MB=20 bash scripts/scale_gpu_host.sh  # smoke
#
# Wheels in .whl/ (pyzmq, zstandard, omegaconf, antlr4-python3-runtime) are installed to
# /tmp/site first; the host needs torch, numpy, psutil, msgpack and safetensors (the image has
# them). NVLink multicast stays off (NCCL_NVLS_ENABLE=0 and friends).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
LOG=${LOG:-${OUT:-/tmp/scale_gpu_host}}
PARTS=${PARTS:-nccl bcast scale tree}
GENS=${GENS:-1,4,16} TRANSPORTS=${TRANSPORTS:-zmq,shared_fs,collective} SMALL_MB=${SMALL_MB:-10,100} BIG_MB=${BIG_MB:-1000} NCCL_MB=${NCCL_MB:-100,1000,7000}
mkdir -p "$LOG"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONHASHSEED=0
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
echo "cpus $(nproc)"
"$PY" -c 'import torch; print("torch", torch.__version__, "gpus", torch.cuda.device_count())'
has() { [[ " $PARTS " == *" $1 "* ]]; }

part() {  # part NAME TIMEOUT SCRIPT ARGS...: one benchmark run, its JSON lines to $LOG/NAME.jsonl
    local name=$1 t=$2
    shift 2
    local t0=$SECONDS
    timeout "$t" "$PY" "$@" 2>"$LOG/$name.err" | grep '^{' | tee -a "$LOG/$name.jsonl"
    echo "$name rc=${PIPESTATUS[0]} $((SECONDS - t0))s"
    grep -E "Error|error:|Traceback" "$LOG/$name.err" | tail -n 4
}
if has nccl; then  # runs first: it also grows the machine's memory (tens of GB) for the rest
    # the product's round over NCCL: the learner (GPU 0) and a generator process (GPU 1)
    timeout 240 "$PY" -m pytest -q -p no:cacheprovider -rA tests/pipeline/test_weight_collective.py \
        -k nccl 2>&1 | grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed|skipped|^E " | tail -n 20
    part bcast_nccl 90 benchmarks/collective_bcast.py --backend nccl --gens 1 \
        --sizes-mb "$NCCL_MB" --port 29731
fi
if has bcast; then
    part bcast_gloo 150 benchmarks/collective_bcast.py --backend gloo --gens "$GENS" \
        --sizes-mb "${SMALL_MB##*,},$BIG_MB" --chunk-mb 0,4 --port 29831
fi
if has scale; then
    part scale_small 170 benchmarks/scale.py --weights --gens "$GENS" --sizes-mb "$SMALL_MB" \
        --transports "$TRANSPORTS"
    part scale_1gb 200 benchmarks/scale.py --weights --gens "$GENS" --sizes-mb "$BIG_MB" \
        --transports "$TRANSPORTS"
fi
if has tree; then
    part scale_tree 80 benchmarks/scale.py --weights --gens "${GENS%%,*},${GENS##*,}" \
        --sizes-mb "${SMALL_MB##*,},$BIG_MB" \
        --transports collective --collective-chunk-mb 0
fi
echo "--- summary (seconds to the last generator; ratio to N = 1)"
cat "$LOG"/*.jsonl 2>/dev/null | "$PY" -c '
import json, sys
for line in sys.stdin:
    r = json.loads(line)
    if r.get("bench") == "scale_weights":
        print("scale", r["transport"], "chunk", r.get("collective_chunk_mb", "-"), r["mb"], "MB N =",
              r["generators"], r["seconds"], "s x", r["ratio_to_first"], "learner", r["learner_s"])
    else:
        print("bcast", r["backend"], "chunk", r["chunk_mb"], r["mb"], "MB N =", r["generators"],
              r["second_bcast_s"], "s x", r["second_bcast_ratio"], "digest", r["to_last_digest_s"],
              "s x", r["to_last_digest_ratio"], "ok", r["digest_ok"])
'
