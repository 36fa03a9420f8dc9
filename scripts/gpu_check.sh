#!/usr/bin/env bash
# GPU check of the learner on a CUDA host (the lent H200): correctness on CUDA (device latent
# noise bit-identical to the CPU spec, truncated depth backprop, Triton token_stats), then the
# real Trainer's step (benchmarks/trainer_gpu.py) at the ~1B Huginn shape and the Huginn-0125
# shape, eager and compiled; optionally the older stand-ins (token_stats_gpu.py, learner.py).
# One JSON line per benchmark in $LOG/*.jsonl; a summary table last.
#
#   bash scripts/gpu_check.sh                       # from the repository root
#   PARTS="tests trainer" bash scripts/gpu_check.sh # choose parts: tests trainer ipc attn dp standin decode depth depth_big torch_depth torchgen digest e2e system placement chunk syncs learnerproc shm packed loop_credit loop_credit_gpu exit_pays_gpu depthlearn
#
# Wheels in .whl/ (megatron-core 0.16.1, omegaconf 2.4.0, antlr4-python3-runtime 4.9.3,
# zstandard, pyzmq: see docs/PERFORMANCE.md, "GPU") are installed to /tmp/site first; the host
# needs torch and triton. Env: PARTS, BENCHES (trainer labels to run; default all), TRAINER_STEPS (default 20), HUGINN_MICRO (default 1),
# T_TESTS, T_DP, T_TG (seconds), TG_VARIANTS, TG_ATTN (PARTS=torchgen), LEARNERPROC_ARGS (extra flags of benchmarks/learner_process.py, e.g.
# --compile), T_EXITG (default 580), EXITG_ARGS, EXITG_OUT (PARTS=exit_pays_gpu), LOG (default $OUT
# or /tmp/gpu_check), BALLAST_FREE_GIB (below).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
LOG=${LOG:-${OUT:-/tmp/gpu_check}}
PARTS=${PARTS:-tests trainer}
STEPS=${TRAINER_STEPS:-20}
mkdir -p "$LOG"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONHASHSEED=0
if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,memory.used --format=csv,noheader || true
"$PY" -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__,
"gpus", torch.cuda.device_count())'
has() { [[ " $PARTS " == *" $1 "* ]]; }
# BALLAST_FREE_GIB=G: a process holds the card's memory down to G GiB free (a bare H100 80GB
# HBM3 has ~79.1 GiB free) while the parts run: a fit on a smaller card, tested on a larger one
# (memory only: bandwidth and FLOP/s stay the larger card's). Stopped by its pid at exit.
if [ -n "${BALLAST_FREE_GIB:-}" ]; then
    "$PY" -c '
import sys, time, torch
free, total = torch.cuda.mem_get_info()
keep = int(float(sys.argv[1]) * 2**30)
held = torch.empty(max(0, free - keep), dtype=torch.uint8, device="cuda")
free, total = torch.cuda.mem_get_info()
print(f"ballast: {held.numel() / 2**30:.1f} GiB held; {free / 2**30:.2f} of {total / 2**30:.1f} GiB free", flush=True)
while True:
    time.sleep(60)
' "$BALLAST_FREE_GIB" &
    BALLAST_PID=$!
    trap 'kill "$BALLAST_PID" 2>/dev/null' EXIT
    sleep 15
    nvidia-smi --query-gpu=memory.used,memory.total --format=csv,noheader || true
fi

if has tests; then
    timeout "${T_TESTS:-240}" "$PY" -m pytest -q -p no:cacheprovider \
        tests/learner/test_device_noise.py tests/models/test_kernels_noise.py \
        tests/learner/test_backprop_depth.py tests/learner/test_kernels_token_stats.py \
        tests/models/test_sampling.py -rA 2>&1 | grep -E "PASSED|FAILED|ERROR|passed|failed|^E " |
        tail -n 40 | tee "$LOG/tests.txt"
fi

bench() {  # bench NAME TIMEOUT ARGS...: one benchmarks/trainer_gpu.py run (if in $BENCHES)
    local name=$1 t=$2
    shift 2
    [[ " ${BENCHES:-$name} " == *" $name "* ]] || return 0
    timeout "$t" "$PY" benchmarks/trainer_gpu.py --label "$name" "$@" \
        2>"$LOG/$name.err" | tee -a "$LOG/trainer.jsonl"
    echo "$name rc=${PIPESTATUS[0]}"
    grep -E "^step|Error|error:" "$LOG/$name.err" | tail -n 4
}
if has trainer; then
    bench 1b_eager 90 --shape huginn_1b --steps 10
    bench 1b_compiled 130 --shape huginn_1b --steps 10 --warmup 3 --compile
    bench 1b_compiled_m8 130 --shape huginn_1b --steps 10 --warmup 3 --compile --micro 8
    bench 0125_eager 200 --shape huginn_0125 --steps "$STEPS" --micro "${HUGINN_MICRO:-1}"
    bench 0125_compiled 260 --shape huginn_0125 --steps "$STEPS" --warmup 3 \
        --micro "${HUGINN_MICRO:-1}" --compile
    # the run config's small-model lr (3e-3, ~1000x a 3.5B rate): the health verdict's check
    bench 0125_compiled_lr3e3 260 --shape huginn_0125 --steps "$STEPS" --warmup 3 \
        --micro "${HUGINN_MICRO:-1}" --compile --lr 3e-3
    # per-loop credit (objective.loop_weighting): peak memory and step time vs last
    bench 0125_eager_uniform 260 --shape huginn_0125 --steps "$STEPS" --micro "${HUGINN_MICRO:-1}" \
        --loop-weighting uniform
fi
if has depthlearn; then  # the learner's depth batching (fea5725) on the card: a learned exit's
    # depths (uniform in 1..4 a response token) with and without it, and the full depth beside
    # them (issue 47: what an exit saves the learner); compiled, as looprl run on a CUDA host
    # (Ouro's own kv is full: each row runs its prompt's depth; the exit arm's is last_exited)
    LX="rollout.exit_policy={kind: ouro_gate, q: 0.8, kv: last_exited}"
    bench ouro_full 200 --shape ouro_1b --steps 6 --warmup 3 --compile --set "$LX"
    bench ouro_exits 200 --shape ouro_1b --steps 6 --warmup 3 --compile --exit-depths uniform \
        --set "$LX"
    bench ouro_exits_masked 200 --shape ouro_1b --steps 6 --warmup 3 --compile \
        --exit-depths uniform --no-compact --set "$LX"
    bench 1b_exits 160 --shape huginn_1b --steps 6 --warmup 3 --compile --exit-depths uniform
    bench 1b_exits_masked 160 --shape huginn_1b --steps 6 --warmup 3 --compile \
        --exit-depths uniform --no-compact
fi
if has dp; then  # two GPUs (NCCL): TP=2 / DP=2 equal one GPU, then throughput
    timeout "${T_DP_TESTS:-240}" "$PY" -m pytest -q -p no:cacheprovider -rA \
        tests/learner/test_trainer.py tests/learner/test_nonfinite.py \
        -k "tp2_and_dp2 or skipped_on_every_rank" 2>&1 | grep -E "^E |PASSED|FAILED|ERROR|passed|failed" |
        tail -n 30 | tee "$LOG/dp_tests.txt"
    dist() {  # dist NAME TIMEOUT ARGS...: benchmarks/trainer_gpu.py on 2 GPUs (torchrun)
        local name=$1 t=$2
        shift 2
        [[ " ${BENCHES:-$name} " == *" $name "* ]] || return 0
        timeout "$t" "$PY" -m torch.distributed.run --nproc-per-node 2 \
            benchmarks/trainer_gpu.py --label "$name" "$@" 2>"$LOG/$name.err" |
            tee -a "$LOG/trainer.jsonl"
        grep -E "^step|Error" "$LOG/$name.err" | tail -n 3
    }
    dist 0125_dp2_compiled 200 --shape huginn_0125 --steps 10 --warmup 3 --batch 8 \
        --micro "${HUGINN_MICRO:-1}" --compile
    bench ouro_eager 120 --shape ouro_1b --steps 8
    dist ouro_tp2_eager 150 --shape ouro_1b --steps 8 --tp 2
    bench ouro_compiled 150 --shape ouro_1b --steps 8 --warmup 3 --compile
    dist ouro_tp2_compiled 180 --shape ouro_1b --steps 8 --warmup 3 --tp 2 --compile
fi
if has packed; then  # packed rows: responses U(256, 4096) at Huginn-0125
    # CUDA correctness first: packed == padded log-probs / metrics / weights (fast: <= 1e-6;
    # the FlexAttention kernel here; the DP=2 test needs 2 GPUs: not here), then MFU on real
    # tokens, the same tokens per micro-batch (PACK_BUDGET, default 8192) in all three
    # layouts: full-length rows of 4096, today's padded rows of the spread (2 a micro-batch),
    # packed rows of the spread.
    [ "${PACK_TESTS:-1}" = 1 ] && timeout "${T_PACKED_TESTS:-300}" "$PY" -m pytest -q -p no:cacheprovider -rA \
        tests/learner/test_packed_rows.py -k "not data_parallel" ${PACK_TEST_ARGS:-} 2>&1 |
        tee "$LOG/packed_tests.log" | grep -E "PASSED|FAILED|ERROR|passed|failed|^E " |
        tail -n 20 | tee "$LOG/packed_tests.txt"  # the whole log comes back in packed_tests.log
    PB=${PACK_BUDGET:-8192}
    PS=${PACK_STEPS:-5}
    bench 0125_full4k "${T_PACKED:-420}" --shape huginn_0125 --compile --steps "$PS" --warmup 2 \
        --seq 4096 --micro $((PB / 4096)) --batch 8
    bench 0125_spread_padded "${T_PACKED:-420}" --shape huginn_0125 --compile --steps "$PS" \
        --warmup 2 --layout padded --micro 2 --batch 16
    bench 0125_spread_packed "${T_PACKED:-420}" --shape huginn_0125 --compile --steps "$PS" \
        --warmup 2 --layout packed --budget "$PB" --pack-multiple 512 --batch 16
    # every packed row exactly PB positions: one compiled shape (if dynamic shapes fail above)
    bench 0125_spread_packed_static "${T_PACKED:-420}" --shape huginn_0125 --compile \
        --steps "$PS" --warmup 2 --layout packed --budget "$PB" --pack-multiple "$PB" --batch 16
    # 64 rollouts a step: first-fit-decreasing bins (learner.step._pack) fill rows of PB
    # positions to ~97 % where 16 rollouts leave a last row's slack of up to 18 %
    bench 0125_spread_packed_static64 "${T_PACKED:-420}" --shape huginn_0125 --compile \
        --steps "$PS" --warmup 2 --layout packed --budget "$PB" --pack-multiple "$PB" --batch 64
    bench 0125_spread_packed_eager "${T_PACKED:-420}" --shape huginn_0125 --steps "$PS" \
        --warmup 2 --layout packed --budget "$PB" --pack-multiple 512 --batch 16
    # the same three layouts eager (no compile time: the comparison in ~3 minutes)
    bench 0125_full4k_eager "${T_PACKED:-420}" --shape huginn_0125 --steps "$PS" --warmup 2 \
        --seq 4096 --micro $((PB / 4096)) --batch 8
    bench 0125_spread_padded_eager "${T_PACKED:-420}" --shape huginn_0125 --steps "$PS" \
        --warmup 2 --layout padded --micro 2 --batch 16
    grep -h '"layout"' "$LOG/trainer.jsonl" | "$PY" -c 'import json, sys
for x in sys.stdin:
    r = json.loads(x)
    if r.get("layout") in ("full", "padded", "packed") and "0125_" in r["label"]:
        print(r["label"], r["layout"], "mfu_real", r["mfu_real_tokens"], "padding",
              r["padding_fraction"], "real tok/s", r["real_tokens_per_s"], "attention",
              r["packed_attention"], "peak GiB", r["peak_mem_gib"], r["health"]["verdict"])'
fi
if has decode; then  # the reference engine's decode step in a CUDA graph vs eager
    timeout 120 "$PY" -m pytest -q -p no:cacheprovider -rA tests/models/test_engine_graph.py \
        -k cuda 2>&1 | grep -E "PASSED|FAILED|ERROR|passed|failed|^E " | tail -n 10
    timeout "${T_DECODE:-200}" "$PY" benchmarks/decode_graph.py 2>"$LOG/decode.err" |
        tee "$LOG/decode.json"
fi
if has depth; then  # depth batching and the torch generator engine
    timeout 120 "$PY" -m pytest -q -p no:cacheprovider -rA tests/models/test_engine_graph.py \
        -k cuda 2>&1 | grep -E "PASSED|FAILED|ERROR|passed|failed|^E " | tail -n 10
    # CPU: the reference engine on this host's cores; GPU: Huginn-0125, bf16, batch 64, D 32
    timeout "${T_DEPTH_CPU:-200}" "$PY" benchmarks/depth_batching.py --device cpu \
        --shape cpu_mid --batch 256 --depth 16 --prompt 16 --tokens 4 --reps 2 \
        2>"$LOG/depth_cpu.err" | tee "$LOG/depth_cpu.jsonl" | tail -n 1
    timeout "${T_DEPTH_GPU:-150}" "$PY" benchmarks/depth_batching.py --shape huginn_1b \
        --dtype bfloat16 --batch 512 --depth 32 --prompt 16 --tokens 8 --reps 2 \
        2>>"$LOG/depth_gpu.err" | tee "$LOG/depth_gpu_b512.jsonl" | tail -n 1
    timeout "${T_DEPTH_GPU:-300}" "$PY" benchmarks/depth_batching.py --shape huginn_0125 \
        --dtype bfloat16 --batch 64 --depth 32 --prompt 64 --tokens 16 --reps 2 --graph \
        --engine 2>"$LOG/depth_gpu.err" | tee "$LOG/depth_gpu.jsonl"
    tail -n 5 "$LOG/depth_cpu.err" "$LOG/depth_gpu.err"
fi
if has depth_big; then  # depth batching where the core's matmuls are compute-bound:
    # Huginn-0125 / ~1B, bf16, D 32, large batches (DEPTH_BIG: "shape:batch ..."), eager compact
    # vs masked vs ticks (models.engine.ticks, K = readout_every; DEPTH_BIG_PATHS; DEPTH_BIG_ARGS
    # e.g. --balanced: no tail); batch 64 at 0125
    # is bound by weight reads (table in docs/PERFORMANCE.md)
    for sb in ${DEPTH_BIG:-huginn_0125:256 huginn_0125:512 huginn_1b:2048}; do
        timeout "${T_DEPTH_BIG:-150}" "$PY" benchmarks/depth_batching.py --shape "${sb%%:*}" \
            --dtype bfloat16 --batch "${sb##*:}" --depth 32 --prompt 16 --tokens "${DEPTH_BIG_TOKENS:-8}" \
            --reps 2 --paths "${DEPTH_BIG_PATHS:-compact,masked,ticks,ticks4,ticks8}" ${DEPTH_BIG_ARGS:-} \
            2>>"$LOG/depth_big.err" | tee -a "$LOG/depth_big.jsonl" | tail -n 1
    done
    tail -n 5 "$LOG/depth_big.err"
fi
if has torch_depth; then  # the torch engine end to end at adaptive depths: chunk
    # decode vs decode by ticks (generators.depth_ticks), Ouro-like random weights, bf16;
    # first the CUDA checks of the ticks in a CUDA graph and of the slot-indexed decode kernel
    timeout "${T_TD_TESTS:-150}" "$PY" -m pytest -q -p no:cacheprovider -rA \
        tests/models/test_engine_ticks.py tests/models/test_engine_attention.py \
        tests/generator/test_torch_ticks.py tests/models/test_engine_kv.py \
        tests/models/test_sampling.py -k "cuda or compiled or gpu" 2>&1 |
        grep -E "PASSED|FAILED|ERROR|passed|failed|^E " | tail -n 12 | tee "$LOG/torch_depth_tests.txt"
    # (defaults: the T = 64 / 128 call of docs/PERFORMANCE.md "The torch engine on the GPU"; the chunk decode: --ticks 0 rows
    # are dropped by --skip-chunk, TORCH_DEPTH_ARGS without it brings them back)
    for tt in ${TORCH_DEPTH_TOKENS:-64 128}; do  # one run per generation length (the batch's tail)
        timeout "${T_TORCH_DEPTH:-300}" "$PY" benchmarks/torch_depth.py --device cuda --tokens "$tt" \
            ${TORCH_DEPTH_ARGS:---batch 256 --depth 16 --ticks 2,4 --schedules gate_fixed,half,quarter --temperature 1 --reps 2 --skip-chunk --skip-eager} \
            2>"$LOG/torch_depth_$tt.err" | tee "$LOG/torch_depth_$tt.json"
        echo "torch_depth tokens $tt rc=${PIPESTATUS[0]}"
        tail -n 2 "$LOG/torch_depth_$tt.err"
    done
fi
if has torchgen; then  # the torch engine's decode vs the HBM bound
    # CUDA checks first: graph == eager step (fp32), compiled blocks vs eager (CPU and CUDA);
    # then Huginn-0125, bf16, batch 64, D 32: the graph step per variant (eager / compiled
    # blocks) x decode attention backend, a kernel profile, and TorchEngine.generate.
    timeout "${T_TG_TESTS:-150}" "$PY" -m pytest -q -p no:cacheprovider -rA \
        tests/models/test_engine_graph.py tests/models/test_engine_attention.py -k "cuda or compiled" 2>&1 |
        grep -E "PASSED|FAILED|ERROR|passed|failed|^E " | tail -n 12 | tee "$LOG/torchgen_tests.txt"
    timeout "${T_TG:-420}" "$PY" benchmarks/depth_batching.py --shape huginn_0125 \
        --dtype bfloat16 --batch 64 --depth 32 --prompt 64 --tokens 16 --reps 2 \
        --schedules fixed --paths compact --graph --engine \
        --graph-variants "${TG_VARIANTS:-eager,compiled}" --attn "${TG_ATTN:-triton,default,efficient}" \
        --profile 2>"$LOG/torchgen.err" | tee "$LOG/torchgen.jsonl"
    echo "torchgen rc=${PIPESTATUS[0]}"
    grep -E "Error|error" "$LOG/torchgen.err" | tail -n 8
fi
if has loop_credit; then  # loop credit on the host's CPU cores (GPU hidden): one warm start,
    # then the 15 (arm, seed) runs of benchmarks/loop_credit.py in 15 processes of one thread
    S='rollout.exit_policy={kind: sampled_gate};objective.exit_coef=1.0;objective.exit_entropy_coef=0.01'
    CUDA_VISIBLE_DEVICES= timeout "${T_LOOP:-590}" "$PY" benchmarks/loop_credit.py --jobs 15 \
        --task vars --gate-warm-steps "${LOOP_GATE_STEPS:-600}" --seeds "${LOOP_SEEDS:-5}" \
        --arms "last,exit_pdf,uniform,learned,sampled_cost05_adv:$S;objective.depth_cost=0.05;objective.depth_cost_in=advantage" \
        2>"$LOG/loop_credit.err" | tee "$LOG/loop_credit.jsonl"
    echo "loop_credit rc=${PIPESTATUS[0]}"
    grep -E "^#|Error" "$LOG/loop_credit.err" | tail -n 24
fi

if has loop_credit_gpu; then  # loop credit, the GPU mode: Ouro small (13M) on this GPU, a
    # longer warm start (SFT + the exit gate's stage II), then the arms x seeds with the megatron
    # learner, each (arm, seed) its own process on the one GPU. LOOPG_ARGS: flags appended
    # (a later flag wins), e.g. a short timing run.
    S='rollout.exit_policy={kind: sampled_gate};objective.exit_coef=1.0;objective.exit_entropy_coef=0.01'
    timeout "${T_LOOPG:-580}" "$PY" benchmarks/loop_credit.py --device cuda --size small \
        --task vars --chain 2 --train 20000 --test 500 --warm-steps 1500 --warm-batch 128 --warm-lr 1e-3 \
        --gate-warm-steps 400 --steps 30 --prompts 32 --n 8 --lr 3e-4 --seeds 3 --jobs 12 \
        --arms "last,exit_pdf,uniform,sampled_cost05_adv:$S;objective.depth_cost=0.05;objective.depth_cost_in=advantage" \
        ${LOOPG_ARGS:-} 2>"$LOG/loop_credit_gpu.err" | tee "$LOG/loop_credit_gpu.jsonl"
    echo "loop_credit_gpu rc=${PIPESTATUS[0]}"
    grep -E "^#|Error" "$LOG/loop_credit_gpu.err" | tail -n 40
fi

if has exit_pays_gpu; then  # does the learned exit pay, the GPU mode (issue 47): Ouro 400m (413 M,
    # weight-bound decode), ONE warm start on this GPU (SFT + Ouro's stage I), then per seed
    # `looprl run` at the fixed full depth and with the sampled exit + depth cost (megatron bf16
    # learner, torch engine bf16: graph decode / ticks in kv last_exited), `looprl eval` on the
    # GPU. --budget-s: no seed is started that would not end inside T_EXITG. The work directory
    # (runs/, ignored: kept while this machine stays warm) holds the warm start for a later
    # call: EXITG_ARGS="--warm runs/exit_pays_gpu/warm --first-seed 3 --seeds 2"; the calls'
    # outputs combine with `python benchmarks/exit_pays.py --merge A.jsonl B.jsonl` (no GPU); a
    # call cut off before its summary: pass its exit_pays_gpu.err (the seeds both arms finished).
    # EXITG_ARGS: flags appended (a later flag wins); EXITG_OUT: the work directory. The task
    # whose completion is most of a row (an exit can save most of a step): EXITG_ARGS="--task
    # pairs --engine-eager" (docs/PERFORMANCE.md "The ceiling a task leaves"; its warm start
    # trains 112-position rows: estimated, not measured, 5-7 min of T_EXITG before a seed).
    TX=${T_EXITG:-580}
    timeout "$TX" "$PY" benchmarks/exit_pays.py --device cuda --out "${EXITG_OUT:-runs/exit_pays_gpu}" \
        --budget-s $((TX - 30)) ${EXITG_ARGS:-} 2>"$LOG/exit_pays_gpu.err" | tee "$LOG/exit_pays_gpu.jsonl"
    rc=${PIPESTATUS[0]}
    echo "exit_pays_gpu rc=$rc"
    grep -E "^#|Error|error:" "$LOG/exit_pays_gpu.err" | cut -c1-600 | tail -n 30
    [ "$rc" = 0 ] || tail -n 5 "$LOG/exit_pays_gpu.err" | cut -c1-600
fi

if has digest; then  # the weight digest on the host's CPUs (target: 7 GB under 0.5 s)
    timeout "${T_DIGEST:-240}" "$PY" benchmarks/digest.py --sizes-gib 1,6.52,7 \
        --workers 1,4,8,16 2>"$LOG/digest.err" | tee "$LOG/digest.json"
fi
if has e2e; then  # the whole system on this GPU: looprl run, learner + torch-engine generator
    timeout "${T_E2E:-570}" "$PY" benchmarks/gpu_e2e.py --size "${E2E_SIZE:-1b}" \
        --steps "${E2E_STEPS:-40}" --sync-steps "${E2E_SYNC_STEPS:-15}" --out /tmp/gpu_e2e ${E2E_ARGS:-} \
        2>"$LOG/e2e.err" | tee "$LOG/e2e.json"
    tail -n 8 "$LOG/e2e.err"
    for f in /tmp/gpu_e2e/run_*.out; do [ -f "$f" ] && tail -n 3 "$f"; done
    # why a generator refused a version, memory, the adapters' path (learner and generator logs)
    grep -hE "refused weights|out of memory|OutOfMemory|adapter|base packed|gone|Traceback" \
        /tmp/gpu_e2e/run_*/logs/*.log 2>/dev/null | cut -c1-400 | tail -n 20
    for r in async sync; do  # the per-step rows (time/* timeline) come back with the JSON
        [ -f "/tmp/gpu_e2e/run_$r/metrics.jsonl" ] && cp "/tmp/gpu_e2e/run_$r/metrics.jsonl" "$LOG/e2e_$r.jsonl"
    done
fi
if has ipc; then  # same-host weights on the device (weights.cuda_ipc): the digest kernel, two processes
    timeout "${T_IPC:-240}" "$PY" -m pytest -q -p no:cacheprovider -rA tests/weights/test_cuda_ipc.py tests/weights/test_device_first.py tests/weights/test_device_adapters.py \
        tests/weights/test_transports.py 2>&1 | grep -E "PASSED|FAILED|ERROR|passed|failed|^E " |
        tail -n 30 | tee "$LOG/ipc_tests.txt"
fi
if has placement; then  # looprl run with its generator as a thread, then as a process: one card
    # (generators.placement; gpu_system.py --skip-parts; PLACEMENT_STEPS steps, the first 2 untimed)
    # PLACEMENTS (default "thread process"); PLACEMENT_PROFILE=A:B profiles steps A..B of each
    # run (metrics.profile_steps: its summary.json and kernel table come back); PLACEMENT_SET:
    # more KEY=VALUE for every run (e.g. "generators.decode_chunk=8")
    for pl in ${PLACEMENTS:-thread process}; do
        prof=(${PLACEMENT_SET:-})
        [ -n "${PLACEMENT_PROFILE:-}" ] && prof+=("metrics.profile_steps=[${PLACEMENT_PROFILE/:/,}]")
        timeout "${T_PLACEMENT:-270}" "$PY" benchmarks/gpu_system.py --size "${SYSTEM_SIZE:-1b}" \
            --prompts 32 --n 8 --tokens 512 --steps "${PLACEMENT_STEPS:-6}" --warmup 2 \
            --timeout 250 --skip-parts --out "/tmp/gpu_placement_$pl" \
            --set "generators.placement=$pl" "${prof[@]}" 2>"$LOG/placement_$pl.err" | tee -a "$LOG/placement.jsonl"
        echo "placement $pl rc=${PIPESTATUS[0]}"
        grep -hE "failed|Error|error:" "$LOG/placement_$pl.err" | grep -v "^\[W" | tail -n 3
        # did the engine keep its compiled blocks and draw (a fallback logs "eager")
        grep -hE "eager|Traceback|out of memory" /tmp/gpu_placement_$pl/run_*/logs/*.log 2>/dev/null |
            cut -c1-300 | tail -n 6
        f=$(ls /tmp/gpu_placement_$pl/run_*/metrics.jsonl 2>/dev/null | head -n 1)
        [ -n "$f" ] && cp "$f" "$LOG/placement_$pl.metrics.jsonl"
        for p in summary.json kernels.txt; do
            g=$(ls /tmp/gpu_placement_$pl/run_*/profile/$p 2>/dev/null | head -n 1)
            [ -n "$g" ] && cp "$g" "$LOG/placement_${pl}_profile_$p"
        done
        g=$(ls /tmp/gpu_placement_$pl/run_*/profile/trace.json.gz 2>/dev/null | head -n 1)
        [ -n "$g" ] && [ "$(stat -c %s "$g")" -lt 15000000 ] && cp "$g" "$LOG/placement_${pl}_trace.json.gz"
        g=$(ls /tmp/gpu_placement_$pl/run_*/profile/summary.json 2>/dev/null | head -n 1)
        [ -n "$g" ] && "$PY" -c 'import json, sys; s = json.load(open(sys.argv[1])); print("profile:", {k: round(v, 3) for k, v in s.items() if isinstance(v, float)}, {k: round(v["busy_s"], 3) for k, v in s["streams"].items()}, {k: {a: round(b, 3) for a, b in v.items()} for k, v in list(s.get("threads", {}).items())[:6]})' "$g"
    done
fi
if has syncs; then  # the learner's reads of the card (learner.batching "No device read"): the CUDA
    # test (none in a micro-batch), then a 1b compiled step's count and sites (trainer_gpu --syncs);
    # BASE=DIR: the same benchmark from another checkout first (git archive REV | tar -x -C DIR)
    timeout "${T_SYNC_TESTS:-150}" "$PY" -m pytest -q -p no:cacheprovider -rA \
        tests/learner/test_packed_rows.py -k reads_nothing 2>&1 |
        grep -E "PASSED|FAILED|ERROR|passed|failed|^E " | cut -c1-1500 | tail -n 12 | tee "$LOG/sync_tests.txt"
    for d in ${BASE:-} .; do
        l=head && [ "$d" != . ] && l=base
        (cd "$d" && PYTHONPATH="$PWD:/tmp/site" timeout "${T_SYNC:-200}" "$PY" benchmarks/trainer_gpu.py \
            --shape huginn_1b --steps 8 --warmup 3 --compile --syncs --label "syncs_$l" \
            2>"$LOG/syncs.err" | tee -a "$LOG/syncs.jsonl")
        tail -n 2 "$LOG/syncs.err"
    done
fi
if has chunk; then  # generators.decode_chunk: the CUDA tests (and the draw's microbenchmark),
    # then one step's generation alone at 1b 256 x 512 per chunk size (CHUNKS, default "1 8";
    # gpu_system.py --generation-only)
    # (150 s ran out on the H100 before the summary: 300; the draw and noise kernels' tests too)
    timeout "${T_CHUNK_TESTS:-300}" "$PY" -m pytest -q -p no:cacheprovider -rA \
        tests/generator/test_decode_chunk.py tests/models/test_engine_attention.py \
        tests/models/test_engine_kv.py tests/models/test_kernels_draw.py \
        tests/models/test_kernels_noise.py 2>&1 |
        grep -E "PASSED|FAILED|ERROR|passed|failed|^E " |
        tail -n 20 | tee "$LOG/chunk_tests.txt"
    timeout 120 "$PY" benchmarks/draw_gpu.py --sweep 2>"$LOG/draw.err" | tee "$LOG/draw.jsonl"
    tail -n 3 "$LOG/draw.err"
    for c in ${CHUNKS:-1 8}; do
        timeout "${T_CHUNK:-200}" "$PY" benchmarks/gpu_system.py --size "${SYSTEM_SIZE:-1b}" \
            --prompts 32 --n 8 --tokens 512 --generation-only --out "/tmp/gpu_chunk_$c" \
            --set "generators.decode_chunk=$c" 2>"$LOG/chunk_$c.err" | tee -a "$LOG/chunk.jsonl"
        echo "chunk $c rc=${PIPESTATUS[0]}"
        grep -hE "Error|error:|eager" "$LOG/chunk_$c.err" | grep -v "^\[W" | tail -n 3
    done
fi
if has attn; then  # the decode-attention kernel at the 1b run's shape, per launch configuration
    timeout "${T_ATTN:-240}" "$PY" benchmarks/decode_attention.py \
        ${ATTN_ARGS:---batch 256 --length 544 --heads 16 --dim 128 --reps 50} 2>"$LOG/attn.err" |
        tee -a "$LOG/attn.jsonl"
    tail -n 3 "$LOG/attn.err"
fi
if has system; then  # looprl run at a shape users run, against its parts alone (gpu_system.py)
    # SYSTEM_JOBS: "PROMPTSxNxTOKENS ..." (default the 1b 256 x 512 job); one JSON line each.
    # SYSTEM_SETS: variants separated by ";", each a run of KEY=VALUE overrides given to --set
    # (an empty variant, which must come first: none), e.g. ";generators.mps_percent=60
    # generators.learner_mps_percent=40" runs the defaults, then that split of the SMs
    IFS=';' read -r -a sets <<<"${SYSTEM_SETS:-}"
    [ ${#sets[@]} -gt 0 ] || sets=("")
    for job in ${SYSTEM_JOBS:-32x8x512}; do
      IFS=x read -r sp sn st <<<"$job"
      for v in "${!sets[@]}"; do
        set_args=()
        [ -n "${sets[$v]// /}" ] && set_args=(--set ${sets[$v]})
        tag=$job; [ ${#sets[@]} -gt 1 ] && tag="${job}_v$v"
        echo "system $tag: ${sets[$v]:-no variant keys}"
        timeout "${T_SYSTEM:-560}" "$PY" benchmarks/gpu_system.py --size "${SYSTEM_SIZE:-1b}" \
            --prompts "$sp" --n "$sn" --tokens "$st" --steps "${SYSTEM_STEPS:-10}" \
            --warmup "${SYSTEM_WARMUP:-3}" --timeout "${SYSTEM_TIMEOUT:-420}" ${SYSTEM_ARGS:-} \
            "${set_args[@]}" 2>"$LOG/system_$tag.err" | tee -a "$LOG/system.jsonl"
        echo "system $tag rc=${PIPESTATUS[0]}"
        tail -n 5 "$LOG/system_$tag.err"
        run=/tmp/gpu_system/run_${SYSTEM_SIZE:-1b}_${sp}x${sn}x${st}
        [ -f "$run/metrics.jsonl" ] && cp "$run/metrics.jsonl" "$LOG/system_$tag.metrics.jsonl"
        # metrics.profile_steps in SYSTEM_ARGS: each process's summary and kernel tables come back
        for g in "$run"/profile/*.json "$run"/profile/*.txt "$run"/profile/*/*.json "$run"/profile/*/*.txt; do
            [ -f "$g" ] && cp "$g" "$LOG/system_${tag}_$(basename "$(dirname "$g")")_$(basename "$g")"
        done
        tail -n 15 "$run.out" 2>/dev/null
      done
    done
fi
if has learnerproc; then  # the real `looprl learner` process at Huginn-0125
    # bf16, lr 1e-6, responses 256-4,096, one version per step; ~4-6 min with start-up. The JSON
    # line -> $LOG/learnerproc.json; metrics rows and the logs' tails -> $LOG/0125_process_*
    timeout "${T_LEARNERPROC:-550}" "$PY" benchmarks/learner_process.py --device cuda \
        --label 0125_process --logs "$LOG" --timeout "${LEARNERPROC_TIMEOUT:-500}" \
        ${LEARNERPROC_ARGS:-} 2>"$LOG/learnerproc.err" | tee "$LOG/learnerproc.json"
    echo "learnerproc rc=${PIPESTATUS[0]}"
    grep -E "Error|error" "$LOG/learnerproc.err" | tail -n 5
fi
if has shm; then  # same-host delivery through /dev/shm to a generator process
    # publish.transport shm (the torch engine's paths: staged on a GPU, overlapped on the CPU;
    # then check-first: the vLLM engine's order) vs shared_fs, Huginn-0125's 7.1 GB bf16
    for tl in ${SHM_RUNS:-shm:staged shm:overlapped shm:checked_first shared_fs:checked_first}; do
        t=${tl%%:*} l=${tl##*:}
        timeout "${T_SHM:-200}" "$PY" benchmarks/shm_delivery.py --gib 6.61 --device cuda \
            --transport "$t" --load "$l" 2>"$LOG/shm_${t}_$l.err" | tee -a "$LOG/shm.json"
        tail -n 3 "$LOG/shm_${t}_$l.err"
    done
fi
if has standin; then
    timeout "${TS_TIMEOUT:-150}" "$PY" benchmarks/token_stats_gpu.py 2>"$LOG/token_stats.err" |
        tee "$LOG/token_stats.json"
    timeout "${LEARNER_TIMEOUT:-300}" "$PY" benchmarks/learner.py 2>"$LOG/learner.err" |
        tee "$LOG/learner.json"
fi
echo "== summary"
"$PY" - "$LOG/trainer.jsonl" <<'EOF'
import json, sys
try:
    rows = [json.loads(x) for x in open(sys.argv[1]) if x.startswith("{")]
except FileNotFoundError:
    rows = []
for r in rows:
    print(f"{r['label']:16s} tok/s {r['tokens_per_s']:>10.0f}  MFU {r['mfu']:.3f}  step "
          f"{r['step_ms_median']:>8.1f} ms  peak {r['peak_mem_gib']:6.1f} GiB  finite "
          f"{r['loss_finite_every_step']}  health {r.get('health', {}).get('verdict')}  "
          f"lr {r.get('lr')}  skipped {r['skipped_nonfinite_total']}  "
          f"loss {r['losses'][0]:.4f}->{r['losses'][-1]:.4f}")
EOF
